"""Load-balance statistics: on a routing chosen by hand, on the real layers, and their per-layer names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe import balance, expert_parallel
from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.routing import RoutingConfig, route
from maxtext_moe.run.progress import balance_note

CFG = MoEConfig(
    emb_dim=32,
    moe_mlp_dim=16,
    shared_mlp_dim=16,
    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
)


def test_load_statistics_of_a_known_routing() -> None:
    """Six tokens pick two of eight experts each; expert 0 is chosen by five of them."""
    chosen = [(0, 1), (0, 2), (0, 3), (0, 4), (5, 6), (0, 7)]
    logits = jnp.full((6, 8), -10.0).at[jnp.repeat(jnp.arange(6), 2), jnp.array(chosen).reshape(-1)].set(10.0)
    routing = route(logits, jnp.zeros(8), RoutingConfig(num_experts=8, top_k=2))
    np.testing.assert_array_equal(np.asarray(routing.counts), [5, 1, 1, 1, 1, 1, 1, 1])
    stats = {k: float(v) for k, v in balance.load_stats(routing.counts).items()}
    assert stats == {"tokens_max": 5.0, "tokens_mean": 1.5, "top_share": pytest.approx(5 / 12)}
    assert balance_note({f"moe/{k}/layer_003": v for k, v in stats.items()}) == " | imb 3.33x L3"


def test_balanced_routing_has_share_one_over_experts() -> None:
    counts = jnp.full((16,), 32, jnp.int32)
    stats = balance.load_stats(counts)
    assert float(stats["tokens_max"]) == float(stats["tokens_mean"]) == 32.0
    assert float(stats["top_share"]) == 1 / 16


def test_bias_statistics() -> None:
    bias = np.array([-0.003, 0.001, 0.0, 0.002], np.float32)
    stats = {k: float(v) for k, v in balance.bias_stats(jnp.asarray(bias, jnp.bfloat16)).items()}
    assert stats["bias_min"] == pytest.approx(-0.003, rel=1e-2) and stats["bias_max"] == pytest.approx(0.002, rel=1e-2)
    assert stats["bias_mean_abs"] == pytest.approx(0.0015, rel=1e-2)


@pytest.mark.parametrize("ranks", [1, 4])
def test_the_layer_reports_no_dropped_copies_and_its_real_counts(ranks: int) -> None:
    """One device and emulated EP: every (token, expert) copy reached an expert, and the counts are the
    routing's (each token once per chosen expert)."""
    params = init_params(jax.random.key(3), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(4), (2, 32, CFG.emb_dim))
    if ranks == 1:
        _, routing = jax.jit(moe_forward, static_argnums=2)(params, x, CFG)
    else:
        _, routing = jax.jit(expert_parallel.ep_moe_forward_emulated, static_argnums=(2, 3))(params, x, CFG, ranks)
    assert float(routing.dropped) == 0.0
    expected = np.bincount(np.asarray(routing.indices).reshape(-1), minlength=16)
    np.testing.assert_array_equal(np.asarray(routing.counts), expected)
    assert float(balance.load_stats(routing.counts)["tokens_mean"]) == 64 * 4 / 16


def test_layer_scalars_name_scanned_and_unrolled_layers_alike() -> None:
    from maxtext_moe.upstream.balance_metrics import layer_scalars

    # The shapes MaxText's NNX decoder gives sown values: a scanned stack one entry per layer, an unrolled
    # layer and the MTP layer a tuple holding a scalar.
    scanned = {
        "decoder": {"moe_layers": {"moe_balance_tokens_max": (jnp.array([7.0, 8.0, 9.0]),)}},
        "mtp_block": {"mtp_layer_1": {"mtp_1_transformer_layer": {"moe_balance_tokens_max": (jnp.array(6.0),)}}},
    }
    unrolled = {
        "decoder": {f"moe_layers_{i}": {"moe_balance_tokens_max": (jnp.array(7.0 + i),)} for i in range(3)},
        "mtp_block": scanned["mtp_block"],
    }
    want = {"moe/tokens_max/layer_001": 7.0, "moe/tokens_max/layer_002": 8.0, "moe/tokens_max/layer_003": 9.0}
    want["moe/tokens_max/mtp_1"] = 6.0
    for tree in (scanned, unrolled):
        assert {k: float(v) for k, v in layer_scalars(tree, first_dense=1).items()} == want
    # Gradient accumulation: MaxText sums the micro-batches' intermediates; the scalars are their mean.
    halved = {k: float(v) for k, v in layer_scalars(scanned, first_dense=1, microbatches=2).items()}
    assert halved == {k: v / 2 for k, v in want.items()}
    elsewhere = {"decoder": {"moe_layers_outside_pipeline": {"moe_balance_tokens_max": (jnp.array([1.0, 2.0]),)}}}
    assert {k: float(v) for k, v in layer_scalars(elsewhere, first_dense=1).items()} == {
        "moe/tokens_max/decoder-moe_layers_outside_pipeline_0": 1.0,
        "moe/tokens_max/decoder-moe_layers_outside_pipeline_1": 2.0,
    }


def test_progress_note_names_the_worst_layer_and_any_drop() -> None:
    m = {"moe/tokens_max/layer_001": 150.0, "moe/tokens_mean/layer_001": 128.0}
    m |= {"moe/tokens_max/mtp_1": 204.0, "moe/tokens_mean/mtp_1": 128.0, "moe/dropped/layer_001": 0.0}
    assert balance_note(m) == " | imb 1.59x MTP1"
    assert balance_note(m | {"moe/dropped/mtp_1": 12.0}) == " | imb 1.59x MTP1 | dropped 12"
    assert balance_note({"learning/loss": 2.0}) == ""
    label = "decoder-moe_layers_outside_pipeline_1"  # a layer outside the usual stacks keeps its path
    elsewhere = {f"moe/tokens_max/{label}": 3.0, f"moe/tokens_mean/{label}": 2.0}
    assert balance_note(elsewhere) == f" | imb 1.50x {label}"
