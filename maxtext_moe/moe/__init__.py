"""Our own DeepSeek-V3 routed-MoE block, one small module per job. Pure JAX: no MaxText imports.

- `settings`: the recipe's `moe:` section (`MoeSettings`) and how the experts compute (`ExpertPath`); no jax.
- `routing`: sigmoid scores, bias for selection only, group-limited top-k, renormalised and scaled
  weights, and the aux-loss-free bias update.
- `gemm`: one grouped-GEMM interface over `jax.lax.ragged_dot`, tokamax and Transformer Engine.
- `align`: the one row gather with a gather as its gradient (`take_rows`), and padding each expert's rows
  to a multiple of 16, as TE's FP8 grouped GEMM needs on Hopper.
- `remat_names`: the remat names of the expert GEMM outputs, which the layer tags and the planner reads.
- `layer`: the dropless single-device forward (route, sort, grouped GEMMs, unsort, combine, shared expert)
  and the one dropless check.
- Expert parallelism with per-destination-rank deduplication, in four steps:
  `send_plan` (what each rank sends), `exchange` (the ragged all-to-all: dense blocks, XLA's ragged
  collective or an emulation, and its adjoint), `receive` (expand to local experts, grouped GEMMs, reduce;
  receive-buffer sizes and their guard) and `expert_parallel` (one EP step and its vmap/shard_map drivers).
- `nccl_ep`: the routed experts with TE's NCCL EP dispatch and combine in place of our exchange
  (`moe.exchange: nccl_ep`), and its once-per-process bootstrap.
- `balance`: a layer's load-balance statistics (tokens per expert, dropped copies, selection bias).
- `reference`: a dense per-expert float32 reference, for tests and benchmarks only.

The layer inside MaxText's DeepSeek decoder (`moe.impl: ours`) is `upstream/deepseek_layer.py`; MaxText's
own block on our parameters, the yardstick, is `upstream/maxtext_block.py`. Parameters use the tree and
shapes of MaxText's `RoutedAndSharedMoE`, so weights move between the two.
"""
