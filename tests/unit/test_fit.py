"""An out-of-memory run says how to fit: the plan's verdict before compiling, XLA's error as the plan's figure and
the nearest layouts that fit (plan/fit.py). Real planner estimates of GPU recipes; no GPU, nothing compiled."""

from __future__ import annotations

import re

import pytest

from maxtext_moe.cli import resolve
from maxtext_moe.commands.runs import fit_checked
from maxtext_moe.errors import UserError
from maxtext_moe.plan import estimate, fit
from maxtext_moe.upstream import maxtext_errors

PROXY = "deepseek3-proxy-h200-1gpu"
LONG = ["max_target_length=8192", "per_device_batch_size=5"]  # 132.2 GiB planned, 123.0 usable
XLA_OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.95GiB."


def _as_maxtext_raises_it() -> RuntimeError:
    """XLA's error as MaxText's TE context hands it on: contextlib's re-yield error, XLA's as its context."""
    try:
        try:
            raise RuntimeError(XLA_OOM)  # jax's XlaRuntimeError is a RuntimeError
        except RuntimeError:
            raise RuntimeError(maxtext_errors.REYIELDED)  # noqa: B904 - contextlib raises it with the context kept
    except RuntimeError as e:
        return e


def _explained(recipe: str, overrides: list[str]) -> UserError:
    with pytest.raises(UserError) as caught, fit_checked(recipe, overrides, resolve(recipe, overrides), leader=False):
        raise _as_maxtext_raises_it()
    return caught.value


def test_xla_out_of_memory_is_found_under_maxtexts_wrapper() -> None:
    assert maxtext_errors.out_of_memory(_as_maxtext_raises_it()) == "Out of memory while trying to allocate 80.95GiB"
    at_run_time = RuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB (2147483648B) on device")
    assert maxtext_errors.out_of_memory(at_run_time) == "RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB"
    assert maxtext_errors.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: message larger than max")) is None


def test_out_of_memory_becomes_the_plans_figure_and_layouts_that_fit() -> None:
    e = _explained(PROXY, LONG)
    text = str(e)
    assert "\n" not in text
    assert text.startswith(
        "the GPU ran out of memory (XLA: Out of memory while trying to allocate 80.95GiB); the planner puts "
        f"{PROXY} (1 device on 1 h200, batch 5/device x seq 8192, remat minimal) at 132.2 GiB per GPU of 123.0 "
        "GiB usable on h200: it does not fit. Fix: nearest layouts that fit, as overrides to add: "
    )
    assert isinstance(e.__cause__, RuntimeError)  # --traceback still shows XLA's error
    suggested = re.findall(r"`([^`]+)` \(([\d.]+) GiB", text.split("Fix: ")[1])
    assert len(suggested) == fit.SUGGESTIONS
    assert "per_device_batch_size=2" in {overrides for overrides, _ in suggested}
    assert any("memory=full-remat" in overrides for overrides, _ in suggested)
    for overrides, gib in suggested:  # each, pasted as it is, fits in `plan` at the figure the line gave
        planned = estimate(resolve(PROXY, [*LONG, *overrides.split()]))
        assert planned.fits and f"{planned.memory.device_total / 2**30:.1f}" == gib
        assert float(gib) <= 132.2 * fit.HEADROOM


def test_a_layout_the_plan_fits_gets_layouts_with_room_below_it() -> None:
    """The recipe as shipped plans 100.3 of 123 GiB; had it run out, suggestions keep 10% below its figure."""
    text = str(_explained(PROXY, []))
    assert "at 100.3 GiB per GPU of 123.0 GiB usable on h200: it fits by the plan, which is an estimate" in text
    for a in fit.nearest(PROXY, [], resolve(PROXY, []), 100.3 * fit.HEADROOM):
        assert a.plan.memory.device_total / 2**30 <= 100.3 * fit.HEADROOM


def test_other_errors_and_cpu_recipes_keep_their_own_error() -> None:
    with pytest.raises(ValueError), fit_checked(PROXY, [], resolve(PROXY, []), leader=False):
        raise ValueError("not memory")
    cpu = "deepseek3-tiny-cpu"
    with pytest.raises(RuntimeError, match="generator"), fit_checked(cpu, [], resolve(cpu, []), leader=False):
        raise _as_maxtext_raises_it()  # the planner models GPU memory only


def test_the_warning_before_compiling(capsys: pytest.CaptureFixture[str]) -> None:
    """What train and bench print before MaxText compiles: one line when the plan does not fit, else nothing."""
    line = fit.warning(PROXY, LONG, resolve(PROXY, LONG))
    assert line is not None and "\n" not in line
    assert line.startswith(
        f"warning: the planner puts {PROXY} (1 device on 1 h200, batch 5/device x seq 8192, remat minimal) at "
        "132.2 GiB per GPU of 123.0 GiB usable on h200: XLA will likely run out of memory once it has compiled; "
        "nearest layouts that fit, as overrides to add: `per_device_batch_size=4` (116.3 GiB"
    )
    assert fit.warning(PROXY, [], resolve(PROXY, [])) is None  # fits
    assert fit.warning("deepseek3-tiny-cpu", [], resolve("deepseek3-tiny-cpu", [])) is None  # CPU: no GPU memory
    with fit_checked(PROXY, LONG, resolve(PROXY, LONG), leader=True):
        pass
    assert capsys.readouterr().err == f"maxtext-moe: {line}\n"
