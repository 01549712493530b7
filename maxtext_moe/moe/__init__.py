"""Our own DeepSeek-V3 routed-MoE block (issue 5), one small module per job.

- `routing`: sigmoid scores, bias for selection only, group-limited top-k, renormalised and scaled
  weights, and the aux-loss-free bias update.
- `gemm`: one grouped-GEMM interface over `jax.lax.ragged_dot`, tokamax and Transformer Engine.
- `align`: padding each expert's rows to a multiple of 16, as TE's FP8 grouped GEMM needs on Hopper.
- `layer`: the dropless single-device forward (route, sort, grouped GEMMs, unsort, combine, shared expert).
- `dispatch`: expert parallelism with per-destination-rank deduplication (ragged_all_to_all or its emulation).
- `integration`: the block inside MaxText's DeepSeek decoder (`moe.impl: ours` in a recipe).
- `maxtext_block`: MaxText's own block on our parameters, the yardstick for tests and benchmarks.
- `reference`: a dense per-expert float32 reference, for tests and benchmarks only.

Parameters use the tree and shapes of MaxText's `RoutedAndSharedMoE`, so weights move between the two.
"""
