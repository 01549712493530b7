"""DeepSeek-V3's sequence-wise balance loss (`balance.sequence_balance_loss`) against a loop over the paper's
eqs. 17-20 in float64, its gradient in the router scores, and its value under any sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe import balance
from maxtext_moe.moe.routing import RoutingConfig, route

ALPHA = 0.0001  # DeepSeek-V3's alpha


def numpy_top_k(scores: np.ndarray, top_k: int) -> np.ndarray:
    """Eq. 18's TopK({s_{j,t} | 1 <= j <= N_r}, K_r): the K largest affinities of each token, by sorting."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :top_k]


def numpy_sequence_balance_loss(scores: np.ndarray, indices: np.ndarray, alpha: float) -> float:
    """Eqs. 17-20 as written, one sequence, expert and token at a time, for the top-K sets `indices`; the mean
    over the sequences."""
    batch, seq, experts = scores.shape
    top_k = indices.shape[-1]
    losses = []
    for b in range(batch):
        total = 0.0
        for i in range(experts):
            chosen = sum(1 for t in range(seq) if i in indices[b, t])  # eq. 18: tokens whose top-K holds i
            f = experts / (top_k * seq) * chosen
            p = sum(scores[b, t, i] / scores[b, t].sum() for t in range(seq)) / seq  # eqs. 19-20
            total += f * p
        losses.append(alpha * total)  # eq. 17
    return float(np.mean(losses))


def _routed(cfg: RoutingConfig, batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """(sigmoid scores [B, S, E], the experts `route` sends each token to [B, S, K], the logits) for random
    logits and bias."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(batch * seq, cfg.num_experts)), jnp.float32)
    bias = jnp.asarray(0.3 * rng.normal(size=cfg.num_experts), jnp.float32)
    indices = np.asarray(route(logits, bias, cfg).indices).reshape(batch, seq, cfg.top_k)
    scores = np.asarray(jax.nn.sigmoid(logits)).reshape(batch, seq, -1)
    return scores, indices, logits


GROUPED = RoutingConfig(num_experts=32, top_k=8, n_groups=8, topk_groups=4)
CONFIGS = [RoutingConfig(num_experts=16, top_k=4), GROUPED, RoutingConfig(num_experts=64, top_k=6, n_groups=4)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_the_papers_equations(cfg: RoutingConfig, seed: int) -> None:
    """Several sequences; float32 against float64."""
    scores, _, _ = _routed(cfg, batch=3, seq=21, seed=seed)
    got = float(jax.jit(balance.sequence_balance_loss, static_argnums=(1, 2))(scores, cfg.top_k, ALPHA))
    s = scores.astype(np.float64)
    want = numpy_sequence_balance_loss(s, numpy_top_k(s, cfg.top_k), ALPHA)
    assert got == pytest.approx(want, rel=1e-6, abs=0)
    assert 0.5 * ALPHA < got < 3 * ALPHA  # about alpha for random routing: each sum_i f_i P_i is near 1


def test_counts_eq_18s_top_k_of_the_affinities_not_the_experts_a_token_is_sent_to() -> None:
    """With a selection bias and group limits the experts a token is sent to differ from the top-K of its
    affinities; eq. 18 counts the latter, per sequence."""
    scores, sent, _ = _routed(GROUPED, batch=2, seq=16, seed=3)
    plain = numpy_top_k(scores, GROUPED.top_k)
    assert (np.sort(plain, axis=-1) != np.sort(sent, axis=-1)).any()
    got = float(balance.sequence_balance_loss(scores, GROUPED.top_k, 1.0))
    assert got == pytest.approx(numpy_sequence_balance_loss(scores, plain, 1.0), rel=1e-6)
    assert got != pytest.approx(numpy_sequence_balance_loss(scores, sent, 1.0), rel=1e-6)
    # Per sequence, then averaged: one sequence's loss is not that of its tokens pooled with another's.
    pooled = numpy_sequence_balance_loss(scores.reshape(1, 32, -1), plain.reshape(1, 32, -1), 1.0)
    assert got != pytest.approx(pooled, rel=1e-6)


def test_gradient_in_the_scores_is_the_analytic_one_and_the_finite_difference() -> None:
    """dL/ds_{m,t} = alpha / (B S) * (f_m - sum_i f_i s'_{i,t}) / sum_j s_{j,t}; the indicator is constant."""
    scores, _, logits = _routed(GROUPED, batch=2, seq=12, seed=5)
    indices = numpy_top_k(scores, GROUPED.top_k)
    grad = np.asarray(jax.grad(balance.sequence_balance_loss)(jnp.asarray(scores), GROUPED.top_k, ALPHA))
    batch, seq, experts = scores.shape
    s = scores.astype(np.float64)
    z = s.sum(-1, keepdims=True)
    f = np.stack([np.bincount(indices[b].reshape(-1), minlength=experts) for b in range(batch)])
    f = f * experts / (GROUPED.top_k * seq)
    analytic = ALPHA / (batch * seq) * (f[:, None, :] - np.sum(f[:, None, :] * s / z, -1, keepdims=True)) / z
    np.testing.assert_allclose(grad, analytic, rtol=1e-4, atol=1e-12)
    assert np.abs(grad).max() > 0
    h = 1e-6
    for b, t, m in [(0, 0, 0), (1, 7, 13), (1, 11, 31)]:
        up, down = s.copy(), s.copy()
        up[b, t, m] += h
        down[b, t, m] -= h
        fd = (numpy_sequence_balance_loss(up, indices, ALPHA) - numpy_sequence_balance_loss(down, indices, ALPHA)) / (
            2 * h
        )
        assert grad[b, t, m] == pytest.approx(fd, rel=1e-3), (b, t, m)
    # Through the router: the gate logits get a gradient from it (the selection itself gets none).

    def through_router(lg: jax.Array) -> jax.Array:
        return balance.sequence_balance_loss(jax.nn.sigmoid(lg).reshape(batch, seq, -1), GROUPED.top_k, ALPHA)

    assert float(jnp.abs(jax.grad(through_router)(logits)).max()) > 0


def test_weight_zero_is_zero() -> None:
    scores, _, _ = _routed(CONFIGS[0], batch=2, seq=8, seed=0)
    assert float(balance.sequence_balance_loss(scores, CONFIGS[0].top_k, 0.0)) == 0.0


_FOUR_CPU_DEVICES = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from maxtext_moe.moe import balance

    rng = np.random.default_rng(0)
    scores = jnp.asarray(rng.uniform(0.01, 1.0, size=(4, 32, 16)), jnp.float32)
    loss = jax.jit(jax.value_and_grad(balance.sequence_balance_loss), static_argnums=(1, 2))
    one, one_grad = loss(scores, 4, 1e-4)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))
    worst = 0.0
    for spec in (P("data"), P(None, "seq"), P("data", "seq"), P(("data", "seq"))):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
        value, grad = loss(put(scores), 4, 1e-4)
        worst = max(worst, abs(float(value) - float(one)) / float(one),
                    float(jnp.max(jnp.abs(grad - one_grad)) / jnp.max(jnp.abs(one_grad))))
    print(json.dumps({"devices": len(jax.devices()), "worst": worst}))
""")


def test_same_value_and_gradient_whatever_the_sharding() -> None:
    """Batch-, sequence- and both-sharded over 4 CPU devices: the loss and its gradient are the one-device ones."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _FOUR_CPU_DEVICES], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and result["worst"] < 1e-6, result
