"""Our own DeepSeek-V3 routed-MoE block (issue 5), one small module per job.

- `routing`: sigmoid scores, bias for selection only, group-limited top-k, renormalised and scaled
  weights, and the aux-loss-free bias update.
- `gemm`: one grouped-GEMM interface over `jax.lax.ragged_dot`, tokamax and Transformer Engine.
- `layer`: the dropless single-device forward (route, sort, grouped GEMMs, unsort, combine, shared expert).
- `reference`: a dense per-expert float32 reference, for tests and benchmarks only.

Parameters use the tree and shapes of MaxText's `RoutedAndSharedMoE`, so weights move between the two.
"""
