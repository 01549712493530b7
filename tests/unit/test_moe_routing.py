"""DeepSeek-V3 routing against a plain NumPy reference, and the bias-update sign rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.errors import UserError
from maxtext_moe.moe.layer import gate_logits
from maxtext_moe.moe.routing import RoutingConfig, route, update_bias


def numpy_route(logits: np.ndarray, bias: np.ndarray, cfg: RoutingConfig) -> tuple[np.ndarray, np.ndarray]:
    """Token by token, as DeepSeek-V3's reference describes it; returns sorted expert ids and their weights."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    ids, weights = [], []
    for s in scores:
        choice = s + bias
        allowed = np.ones_like(choice, bool)
        if cfg.n_groups > 1:
            groups = choice.reshape(cfg.n_groups, -1)
            group_score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
            kept = np.argsort(-group_score, kind="stable")[: cfg.topk_groups]
            allowed = np.zeros((cfg.n_groups, groups.shape[1]), bool)
            allowed[kept] = True
            allowed = allowed.reshape(-1)
        top = np.argsort(-np.where(allowed, choice, -np.inf), kind="stable")[: cfg.top_k]
        w = s[top] / s[top].sum() * cfg.routed_scaling_factor
        order = np.argsort(top)
        ids.append(top[order])
        weights.append(w[order])
    return np.array(ids), np.array(weights)


def _sorted(r) -> tuple[np.ndarray, np.ndarray]:
    idx, w = np.asarray(r.indices), np.asarray(r.weights)
    order = np.argsort(idx, axis=1)
    return np.take_along_axis(idx, order, 1), np.take_along_axis(w, order, 1)


@pytest.mark.parametrize(
    "cfg",
    [
        RoutingConfig(num_experts=16, top_k=4),
        RoutingConfig(num_experts=32, top_k=8, n_groups=8, topk_groups=4, routed_scaling_factor=2.5),
        RoutingConfig(num_experts=64, top_k=6, n_groups=4, topk_groups=2, routed_scaling_factor=1.0),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_route_matches_numpy(cfg: RoutingConfig, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(97, cfg.num_experts)).astype(np.float32)
    bias = (0.3 * rng.normal(size=cfg.num_experts)).astype(np.float32)
    r = jax.jit(route, static_argnums=2)(logits, bias, cfg)
    ids, w = _sorted(r)
    ref_ids, ref_w = numpy_route(logits, bias, cfg)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5)
    np.testing.assert_allclose(w.sum(axis=1), cfg.routed_scaling_factor, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.counts), np.bincount(ref_ids.reshape(-1), minlength=cfg.num_experts))


def test_group_limit_keeps_choices_inside_kept_groups() -> None:
    cfg = RoutingConfig(num_experts=32, top_k=8, n_groups=8, topk_groups=4)
    logits = np.random.default_rng(2).normal(size=(256, 32)).astype(np.float32)
    groups = np.asarray(route(logits, np.zeros(32, np.float32), cfg).indices) // 4
    assert max(len(set(g)) for g in groups) <= 4


def test_bias_steers_selection_not_weights() -> None:
    cfg = RoutingConfig(num_experts=16, top_k=2, routed_scaling_factor=2.5)
    logits = np.random.default_rng(3).normal(size=(64, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[5] = 10.0  # expert 5 is chosen by every token
    r = route(logits, bias, cfg)
    assert np.all(np.any(np.asarray(r.indices) == 5, axis=1))
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    chosen = np.take_along_axis(scores, np.asarray(r.indices), 1)
    np.testing.assert_allclose(np.asarray(r.weights), chosen / chosen.sum(1, keepdims=True) * 2.5, rtol=1e-5)
    assert np.all(np.asarray(jax.grad(lambda b: route(logits, b, cfg).weights.sum())(bias)) == 0)


def test_weights_are_differentiable_in_logits() -> None:
    cfg = RoutingConfig(num_experts=8, top_k=2)
    logits = jax.random.normal(jax.random.key(4), (16, 8))
    g = jax.grad(lambda lg: (route(lg, jnp.zeros(8), cfg).weights * jnp.arange(2.0)).sum())(logits)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def test_gate_logits_are_exact_products_on_bf16_and_keep_the_split_dot_in_the_backward() -> None:
    """The router's dot on BF16 activations and weights, as the recipes store them: its logits match a float64
    product to float32 summation (a BF16 dot would be off by about 2e-3), and the forward dot and both of its
    gradients' dots carry the split-BF16 algorithm, so that none falls back to a float32 dot on CUDA cores."""
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (512, 256), jnp.bfloat16)
    w = (jax.random.normal(kw, (256, 16)) * 0.06).astype(jnp.bfloat16)
    logits = np.asarray(gate_logits(x, w), np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.linalg.norm(logits - exact) / np.linalg.norm(exact) < 1e-6

    def loss(x: jax.Array, w: jax.Array, cot: jax.Array) -> jax.Array:
        return jnp.sum(jax.nn.sigmoid(gate_logits(x, w)) * cot)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, jax.random.normal(kc, (512, 16))).as_text()
    assert hlo.count("stablehlo.dot_general") == 3
    assert hlo.count("num_primitive_operations = 3") == 3


def test_update_bias_sign_rule() -> None:
    counts = jnp.array([10, 30, 20, 20], jnp.int32)  # mean 20
    new = update_bias(jnp.zeros(4, jnp.float32), counts, rate=1e-3)
    np.testing.assert_allclose(np.asarray(new), [1e-3, -1e-3, 0.0, 0.0])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_experts=10, top_k=2, n_groups=4),
        dict(num_experts=8, top_k=2, n_groups=8, topk_groups=2),
        dict(num_experts=32, top_k=8, n_groups=8, topk_groups=1),
    ],
)
def test_bad_routing_config_is_a_user_error(kwargs: dict) -> None:
    with pytest.raises(UserError):
        RoutingConfig(**kwargs)
