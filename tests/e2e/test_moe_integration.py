"""`moe.impl: ours` inside MaxText's real DeepSeek decoder on the CPU: it trains, computes the same model as
MaxText's block, reads and writes the same checkpoints, and keeps the aux-loss-free bias update.

Three MaxText processes (about 20 s each here): a straight run with MaxText's block, the same run with
ours, and ours resuming MaxText's checkpoint. All use the float32 tiny recipe with the same seed and
the same Grain data, and DeepSeek-V3's sequence-wise balance loss, which each block computes its own way, so
that it is part of the compared loss.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import read_metrics, run_cli, tensorboard_scalars

from maxtext_moe.cli import resolve
from maxtext_moe.moe import balance
from maxtext_moe.run import run_dir
from maxtext_moe.tools import doctor

pytestmark = pytest.mark.slow
RUN = "deepseek3-tiny-cpu"
STEPS = 6
ALPHA = 0.01
COMMON = [
    "steps=6",
    "per_device_batch_size=2",
    "max_target_length=128",
    "corpus.max_mib=1",
    "checkpoint_period=3",
    # DeepSeek-V3's sequence-wise balance loss, at 100x its alpha so that it moves the loss: our layer computes
    # it itself, MaxText's block as its Megatron-style sequence loss (`load_balance_loss_weight`).
    f"moe.seq_balance_loss_weight={ALPHA}",
]
RATE = 0.001  # routed_bias_update_rate of configs/model/deepseek3-tiny.yml
# float32 on XLA:CPU: both blocks do the same arithmetic up to the order of a few sums (measured: step 0
# bit-identical, later steps within 2e-7). A semantic slip (bias in the weights, a missed scaling factor,
# one token routed differently) moves the loss by far more than 1e-5.
RTOL = 1e-5


# The tiny model's MoE layers, as the balance scalars name them: decoder layers 1-3 (layer 0 is dense), the MTP layer.
LAYERS = ("layer_001", "layer_002", "layer_003", "mtp_1")


def _train(out: Path, *overrides: str) -> None:
    r = run_cli("train", RUN, *COMMON, f"base_output_directory={out}", *overrides, cwd=out.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (out / "terminal.txt").write_text(r.stdout)


def _losses(out: Path, key: str = "learning/loss") -> dict[int, float]:
    return {step: m[key] for step, m in read_metrics(out / RUN).items()}


def _gate_biases(step_dir: Path) -> dict[str, np.ndarray]:
    """Every MoE gate bias (decoder stack and MTP layer) in an Orbax checkpoint of the run."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as c:
        tree = c.restore(str(step_dir / "items"))
    found: dict[str, np.ndarray] = {}

    def walk(node, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif path[-2:] == ("gate", "bias"):
            found["/".join(path)] = np.asarray(node)

    walk(tree, ())
    assert len(found) == 2, found.keys()
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("moe-integration")
    outs = {name: base / name for name in ("maxtext", "ours", "resumed")}
    _train(outs["maxtext"])
    _train(outs["ours"], "moe.impl=ours")
    # Resume MaxText's run at its step-3 checkpoint with our block (the run-folder identity is the model
    # shape only); steps 4 and 5 then repeat the straight run's data.
    shutil.copytree(outs["maxtext"], outs["resumed"])
    shutil.rmtree(outs["resumed"] / RUN / "checkpoints" / str(STEPS - 1))
    (outs["resumed"] / RUN / "metrics.jsonl").unlink()
    _train(outs["resumed"], "moe.impl=ours")
    return outs


def test_ours_trains_and_writes_checkpoints(runs):
    run = runs["ours"] / RUN
    loss = _losses(runs["ours"])
    assert sorted(loss) == list(range(STEPS)) and all(np.isfinite(v) for v in loss.values())
    assert np.mean([loss[4], loss[5]]) < np.mean([loss[0], loss[1]]) - 0.2, loss
    assert run_dir.scan(run / "checkpoints").complete == [0, 3, STEPS - 1]
    assert (
        "moe.impl=ours: maxtext.models.deepseek.DeepSeekMoELayer -> OurDeepSeekMoELayer (grouped GEMM ragged_dot)"
        in (run / "maxtext.log").read_text()
    )


def test_same_model_as_maxtext_block(runs):
    """Same seed, same data: ours gives MaxText's loss and sequence-wise balance loss at step 0 and stays with
    it."""
    mt, ours = _losses(runs["maxtext"]), _losses(runs["ours"])
    mt_lb, ours_lb = _losses(runs["maxtext"], "learning/moe_lb_loss"), _losses(runs["ours"], "learning/moe_lb_loss")
    assert abs(ours[0] - mt[0]) <= 1e-6 * mt[0], (ours[0], mt[0])
    assert mt_lb[0] > 0 and abs(ours_lb[0] - mt_lb[0]) <= 1e-6 * mt_lb[0], (ours_lb[0], mt_lb[0])
    for step in range(1, STEPS):
        assert abs(ours[step] - mt[step]) <= RTOL * mt[step], (step, ours[step], mt[step])
    assert abs(mt[0] - mt[STEPS - 1]) > 0.1  # the loss did move, so "close" compares trained models


def test_ours_resumes_maxtext_checkpoint(runs):
    """MaxText's checkpoint restored into our block continues exactly where MaxText's block goes."""
    resumed, straight = _losses(runs["resumed"]), _losses(runs["maxtext"])
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert abs(resumed[step] - straight[step]) <= RTOL * straight[step], (step, resumed[step], straight[step])


def test_gate_bias_moves_as_with_maxtext(runs):
    """routed_bias_update_rate > 0: each step adds rate * sign(mean load - load) to every gate bias (the
    bias starts at 0); with ours the biases after 6 steps equal MaxText's, entry for entry."""
    last = STEPS - 1
    ours = _gate_biases(runs["ours"] / RUN / "checkpoints" / str(last))
    mt = _gate_biases(runs["maxtext"] / RUN / "checkpoints" / str(last))
    first = _gate_biases(runs["ours"] / RUN / "checkpoints" / "0")
    for name, bias in ours.items():
        np.testing.assert_array_equal(bias, mt[name], err_msg=name)
        steps_taken = np.round(bias / RATE)
        np.testing.assert_allclose(bias, steps_taken * RATE, atol=1e-7, err_msg=name)  # whole steps of size rate
        assert np.all(np.abs(steps_taken) <= STEPS) and np.any(steps_taken), name
        assert not np.array_equal(bias, first[name]), name  # it kept moving after the first step


def test_both_blocks_report_the_same_load_balance(runs):
    """Same seed, same data: the per-layer expert loads and biases MaxText's block reports (its own gate and
    top-k, re-run) equal what our layer measures, at every step; ours says it dropped nothing; the terminal
    names the worst layer of the last step."""
    mt, ours = read_metrics(runs["maxtext"] / RUN), read_metrics(runs["ours"] / RUN)
    for step in range(STEPS):
        for stat in (*balance.LOAD_STATS, *balance.BIAS_STATS):
            for layer in LAYERS:
                key = f"moe/{stat}/{layer}"
                assert ours[step][key] == mt[step][key], (step, key, ours[step][key], mt[step][key])
        assert [ours[step][f"moe/dropped/{layer}"] for layer in LAYERS] == [0.0] * len(LAYERS)
        assert not any(k.startswith("moe/dropped/") for k in mt[step])  # MaxText's block does not say
        assert not any(k.startswith("moe/seq_balance_loss/") for k in mt[step])  # ours alone reports it
    last = ours[STEPS - 1]
    ratio, worst = max((last[f"moe/tokens_max/{x}"] / last[f"moe/tokens_mean/{x}"], x) for x in LAYERS)
    name = "MTP1" if worst == "mtp_1" else f"L{int(worst[-3:])}"
    assert 1.0 < ratio <= 2.0  # 16 experts, top-8: at 2x every token chose the busiest expert
    assert (
        f"step     {STEPS}/{STEPS} | loss {last['learning/loss']:.4f} | imb {ratio:.2f}x {name} | "
        in (runs["ours"] / "terminal.txt").read_text()
    )


def test_sequence_balance_loss_is_reported_per_layer_and_added_to_the_loss(runs):
    """`moe.seq_balance_loss_weight`: every MoE layer (decoder and MTP) reports its weighted loss, about alpha
    (each sequence's sum_i f_i P_i is near 1); MaxText's `learning/moe_lb_loss` is their sum, and it is part
    of the loss the step differentiates (test_same_model_as_maxtext_block: the same sum as MaxText's block's
    own sequence loss)."""
    out = runs["ours"]
    metrics = read_metrics(out / RUN)
    for step, m in metrics.items():
        layers = [m[f"moe/seq_balance_loss/{x}"] for x in LAYERS]
        assert all(0.5 * ALPHA < v < 2 * ALPHA for v in layers), (step, layers)
        assert m["learning/moe_lb_loss"] == pytest.approx(sum(layers), rel=1e-6), (step, m)
        parts = m["learning/lm_loss"] + m["learning/mtp_loss"] + m["learning/moe_lb_loss"]
        assert m["learning/loss"] == pytest.approx(parts, rel=1e-6, abs=0), (step, m)
    assert len({metrics[0][f"moe/seq_balance_loss/{x}"] for x in LAYERS}) == len(LAYERS)  # per layer
    events = list((out / RUN / "tensorboard").rglob("events.out.tfevents.*"))
    board = tensorboard_scalars(events[0])
    for x in LAYERS:
        key = f"moe/seq_balance_loss/{x}"
        assert board[key] == pytest.approx({step: m[key] for step, m in metrics.items()}, rel=1e-6), key


def test_bias_statistics_are_the_bias_each_step_routed_with(runs):
    """The bias a step routes with is the one the previous step saved: step 4's statistics are those of the
    step-3 checkpoint's gate biases, layer by layer; step 0 routes with the initial bias, 0."""
    m = read_metrics(runs["ours"] / RUN)
    biases = _gate_biases(runs["ours"] / RUN / "checkpoints" / "3")
    stacked = next(b for name, b in biases.items() if "moe_layers" in name)  # [3 MoE layers, 16 experts]
    per_layer = dict(zip(LAYERS, [*stacked, next(b for name, b in biases.items() if "mtp" in name)], strict=True))
    for layer, bias in per_layer.items():
        got = [m[4][f"moe/{s}/{layer}"] for s in balance.BIAS_STATS]
        np.testing.assert_allclose(got, [bias.min(), bias.max(), np.abs(bias).mean()], rtol=1e-6, err_msg=layer)
        assert [m[0][f"moe/{s}/{layer}"] for s in balance.BIAS_STATS] == [0.0, 0.0, 0.0]
    assert len({m[4][f"moe/bias_mean_abs/{x}"] for x in LAYERS}) > 1  # the layers' biases differ: not one figure


def test_install_rebinds_the_deepseek_layer_the_decoder_builds(monkeypatch):
    from types import SimpleNamespace

    from maxtext.layers.nnx_decoders import NNXDecoder
    from maxtext.models import deepseek

    from maxtext_moe.moe.settings import MoeSettings
    from maxtext_moe.upstream import deepseek_layer

    monkeypatch.setattr(deepseek, "DeepSeekMoELayer", deepseek.DeepSeekMoELayer)  # restored after the test
    installed = deepseek_layer.install(MoeSettings(impl="ours", gemm="tokamax"))
    config = SimpleNamespace(decoder_block=deepseek.DecoderBlockType.DEEPSEEK, scan_layers=True)
    layers = NNXDecoder.get_decoder_layers(SimpleNamespace(config=config))
    assert layers == [deepseek.DeepSeekDenseLayer, installed]
    assert issubclass(installed, deepseek_layer.OurDeepSeekMoELayer) and installed.settings.gemm == "tokamax"


def test_nccl_ep_install_bootstraps_from_maxtexts_start_up(monkeypatch):
    """With moe.exchange nccl_ep, `install` makes the function MaxText's `setup_train_loop` calls before it
    builds the model bootstrap NCCL EP for our layers; here, without TE, it stops with the package to install."""
    import inspect
    from types import SimpleNamespace

    import jax
    import numpy as np
    from jax.sharding import Mesh
    from maxtext.models import deepseek
    from maxtext.utils import max_utils, train_utils

    from maxtext_moe.errors import UserError
    from maxtext_moe.moe.settings import MoeSettings
    from maxtext_moe.upstream import deepseek_layer

    assert "max_utils.maybe_bootstrap_te_moe(config, mesh, shaped_batch)" in inspect.getsource(
        train_utils.setup_train_loop
    )
    monkeypatch.setattr(deepseek, "DeepSeekMoELayer", deepseek.DeepSeekMoELayer)  # both restored after the test
    monkeypatch.setattr(max_utils, "maybe_bootstrap_te_moe", max_utils.maybe_bootstrap_te_moe)
    deepseek_layer.install(MoeSettings(impl="ours", gemm="ragged_dot", exchange="nccl_ep"))
    assert max_utils.maybe_bootstrap_te_moe.bootstraps_ours
    config = SimpleNamespace(te_moe_block=False, num_experts=16, num_experts_per_tok=4, emb_dim=32)
    config.__dict__.update(gradient_accumulation_steps=1, micro_batch_size_to_train_on=2, eval_interval=-1)
    config.ragged_buffer_factor = -1.0
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    with pytest.raises(UserError, match=r"nccl_ep needs Transformer Engine's JAX EP.*transformer-engine\[jax\]"):
        max_utils.maybe_bootstrap_te_moe(config, mesh, {"inputs": jax.ShapeDtypeStruct((2, 8), np.int32)})


def test_doctor_requires_te_for_our_te_gemm():
    machine = doctor.Machine(
        jax_version="0.11.2",
        backend="gpu",
        device_kind="NVIDIA H200",
        local_devices=1,
        compute_capability=(9, 0),
        te_version=None,
        te_error=None,
        te_compiled_v2=None,
        cublaslt=130100,
        nccl=(2, 28, 9),
        host_mem_gib=2000.0,
    )
    recipe = resolve("deepseek3-proxy-h200-1gpu", ["moe.impl=ours"])
    assert recipe.moe["gemm"] == "te"
    te = next(x for x in doctor.compare(machine, recipe) if x.item == "transformer-engine")
    assert te.status == "gap" and "moe.gemm=te" in te.have
    with_te = doctor.Machine(**{**machine.__dict__, "te_version": "2.20.2", "te_compiled_v2": True})
    v2 = resolve("deepseek3-proxy-h200-1gpu", ["moe.impl=ours", "moe.te_gemm_path=v2"])
    line = next(x for x in doctor.compare(with_te, v2) if x.item == "te grouped gemm")
    assert line.status == "gap" and "moe.te_gemm_path=v2 cannot run here" in line.have
