"""Check a composed recipe and turn it into a `ResolvedRecipe`.

MaxText's own pydantic model checks types and some values, but only once jax has started, and its messages
name neither the file a value came from nor the hardware it will run on; many mistakes that matter for
DeepSeek-V3 on GPUs (the TPU-only `megablox` kernel left on, MXFP8 experts on a Hopper, an expert-parallel
size that does not divide the experts, a mesh that does not match the cluster) it accepts and fails on
later, or never. These checks run first, without jax, and each error names the key, the file and the fix;
`upstream.maxtext_config` then runs MaxText's model. The `moe:` section's own checks are in `moe/settings.py`,
its checks against MaxText keys in `moe_checks.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from maxtext_moe.data import corpus as corpus_files
from maxtext_moe.data import prepared
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import guard as guard_section
from maxtext_moe.recipe import job as job_section
from maxtext_moe.recipe import maxtext_keys, mesh_check, moe_checks
from maxtext_moe.recipe import training as training_section
from maxtext_moe.recipe.composition import Composition, Value, suggest
from maxtext_moe.recipe.hardware import PROFILES, Hardware
from maxtext_moe.recipe.resolved import ResolvedRecipe, Topology
from maxtext_moe.upstream import bf16_projections

BASE_DEFAULT = "MaxText's base.yml default"
FP8_QUANTIZATIONS = frozenset(
    "fp8 fp8_e4m3 fp8_e5m2 nanoo_fp8 fp8_nanoo fp8_gpu fp8_full te_fp8_delayedscaling te_fp8_currentscaling".split()
)
MXFP8 = "te_mxfp8"

RESIDUALS = ("recompute", "save")  # attention.residuals
ATTENTION_KERNELS = ("cudnn", "fa3")  # attention.kernel
# Attention kernels whose forward outputs `attention.residuals: save` keeps (remat.ATTENTION_FORWARD_PRIMITIVES)
FLASH_ATTENTION = ("cudnn_flash_jax", "cudnn_flash_te")

# key -> (predicate, what the value must be)
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "steps": (lambda v: v >= 1 or v == -1, "at least 1 (or -1 to follow learning_rate_schedule_steps)"),
    "per_device_batch_size": (lambda v: v > 0, "greater than 0"),
    "max_target_length": (lambda v: v >= 1, "at least 1"),
    "learning_rate": (lambda v: v > 0, "greater than 0"),
    "checkpoint_period": (lambda v: v >= 1, "at least 1"),
    "num_experts": (lambda v: v >= 1, "at least 1"),
    "num_experts_per_tok": (lambda v: v >= 1, "at least 1"),
    "base_num_decoder_layers": (lambda v: v >= 1, "at least 1"),
    "first_num_dense_layers": (lambda v: v >= 0, "0 or more"),
    "mtp_num_layers": (lambda v: v >= 0, "0 or more"),
    "routed_bias_update_rate": (lambda v: v >= 0, "0 or more"),
    "warmup_steps_fraction": (lambda v: 0 <= v <= 1, "between 0 and 1"),
    "ragged_buffer_factor": (lambda v: v > 0 or v == -1, "greater than 0 (or -1 for worst-case capacity)"),
}


def _type_ok(value: Any, default: Any) -> tuple[bool, str]:
    """Whether `value` has the kind of type MaxText's default for the key has."""
    if isinstance(default, bool):
        return isinstance(value, bool), "true or false"
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool), "an integer"
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    if isinstance(default, list):
        return isinstance(value, list), "a list"
    if isinstance(default, dict):
        return isinstance(value, dict), "a mapping"
    if isinstance(default, str) and default not in ("", "None"):
        return not isinstance(value, (list, dict, bool)), "a string"
    return True, ""


class _Checker:
    """Runs the checks over one composition; `where(key)` names the file a key came from."""

    def __init__(self, comp: Composition):
        self.comp = comp
        self.maxtext = {k: v.value for k, v in comp.sections["maxtext"].items()}
        self.model = maxtext_keys.model_defaults(str(self.maxtext.get("model_name", "default")))

    def value(self, key: str) -> Any:
        if key in self.maxtext:
            return self.maxtext[key]
        if key in self.model:
            return self.model[key]
        return maxtext_keys.defaults().get(key)

    def where(self, key: str) -> str:
        src = self.comp.source("maxtext", key)
        if src:
            return src
        if key in self.model:
            return f"MaxText's models/{self.maxtext.get('model_name')}.yml"
        return BASE_DEFAULT

    def fail(self, key: str, message: str, fix: str) -> None:
        raise UserError(message, key=key, source=self.where(key), fix=fix)

    def types_and_ranges(self) -> None:
        defaults = maxtext_keys.defaults()
        for key, value in self.maxtext.items():
            ok, expected = _type_ok(value, defaults.get(key))
            if not ok:
                self.fail(
                    key,
                    f"must be {expected}, got {value!r} ({type(value).__name__}).",
                    f"set {key} to {expected}, e.g. {key}: {defaults.get(key)!r}.",
                )
        for key, (pred, text) in RANGES.items():
            value = self.value(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not pred(value):
                self.fail(key, f"must be {text}, got {value!r}.", f"choose a value {text}.")
        if self.value("num_experts_per_tok") > self.value("num_experts"):
            self.fail(
                "num_experts_per_tok",
                f"routes each token to {self.value('num_experts_per_tok')} experts but the model has only "
                f"{self.value('num_experts')}.",
                "lower num_experts_per_tok or raise num_experts.",
            )
        if self.value("first_num_dense_layers") > self.value("base_num_decoder_layers"):
            self.fail(
                "first_num_dense_layers",
                f"is {self.value('first_num_dense_layers')} but the model has only "
                f"{self.value('base_num_decoder_layers')} decoder layers.",
                "lower first_num_dense_layers or raise base_num_decoder_layers.",
            )

    def topology(self) -> Topology:
        sec = self.comp.sections["topology"]

        def field(name: str, default: Any) -> Any:
            return sec[name].value if name in sec else default

        hw = field("hardware", None)
        where = self.comp.source("topology", "hardware") or self.comp.name
        if hw is None:
            raise UserError(
                "the recipe names no hardware.",
                key="topology.hardware",
                source=self.comp.name,
                fix="include a configs/hardware/ fragment, e.g. 'hardware/h200'.",
            )
        if hw not in PROFILES:
            raise UserError(
                f"unknown hardware '{hw}'.{suggest(str(hw), tuple(PROFILES))}",
                key="topology.hardware",
                source=where,
                fix=f"use one of: {', '.join(PROFILES)}.",
            )
        nodes, per_node = field("nodes", 1), field("gpus_per_node", PROFILES[hw].gpus_per_node)
        for name, v in (("nodes", nodes), ("gpus_per_node", per_node)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(
                    f"must be a whole number of at least 1, got {v!r}.",
                    key=f"topology.{name}",
                    source=self.comp.source("topology", name) or where,
                )
        return Topology(hardware=hw, nodes=nodes, gpus_per_node=per_node)

    def hardware_contradictions(self, hw: Hardware) -> None:
        moe = self.value("num_experts") > 1
        if moe and self.value("sparse_matmul") and self.value("megablox") and hw.maxtext_hardware in ("gpu", "cpu"):
            self.fail(
                "megablox",
                f"is true, but megablox is a TPU kernel and this recipe runs on {hw.name}.",
                "set megablox: false (dropless grouped GEMM then runs through ragged_dot, tokamax or TE).",
            )
        quant = str(self.value("quantization") or "")
        if quant in FP8_QUANTIZATIONS | {MXFP8} and not hw.fp8:
            self.fail(
                "quantization",
                f"asks for FP8 ({quant}) but {hw.name} has no FP8 matrix units.",
                "remove the quantization fragment, or run on an FP8-capable GPU (Hopper or Blackwell).",
            )
        for key in ("quantization", "te_gmm_quantization"):
            if str(self.value(key) or "") == MXFP8 and not hw.mxfp8:
                self.fail(
                    key,
                    f"is te_mxfp8, but MXFP8 needs Blackwell (SM100) and {hw.name} is "
                    f"SM{''.join(map(str, hw.compute_capability or ()))}.",
                    "on Hopper use te_no_quant (BF16) experts with quantization: te_fp8_currentscaling "
                    "for the dense GEMMs.",
                )
        if self.value("te_moe_block"):
            if self.value("routed_bias_update_rate") > 0:
                self.fail(
                    "routed_bias_update_rate",
                    "is above 0 (DeepSeek-V3's aux-loss-free balancing), but TE's MoE block (te_moe_block) "
                    "does not implement the bias update and would drop it.",
                    "set routed_bias_update_rate: 0 and say so in the recipe (with a training section, also "
                    "training.bias_update_rate: {0: 0}), or turn te_moe_block off.",
                )
            if self.value("norm_topk_prob"):
                self.fail(
                    "norm_topk_prob",
                    "is true, but TE's MoE block (te_moe_block) does not support it.",
                    "set norm_topk_prob: false, or turn te_moe_block off.",
                )
            if not self.value("te_gmm_quantization"):
                self.fail(
                    "te_gmm_quantization",
                    "must be set when te_moe_block is true.",
                    "set te_gmm_quantization: te_no_quant (BF16) or te_mxfp8 (Blackwell).",
                )


def _attention(comp: Composition, check: _Checker, hw: Hardware) -> dict[str, Any]:
    """The `attention` section with defaults: `residuals: save` keeps flash attention's forward outputs;
    `kernel: fa3` runs FlashAttention-3 where MaxText's `cudnn_flash_jax` would run cuDNN's;
    `bf16_projections` keeps MLA projections out of TE's FP8."""
    sec = comp.sections["attention"]

    def field(name: str, default: str, allowed: tuple[str, ...]) -> tuple[str, str | None]:
        value, where = (sec[name].value, sec[name].source) if name in sec else (default, None)
        if value not in allowed:
            raise UserError(
                f"must be one of {', '.join(allowed)}, got {value!r}.", key=f"attention.{name}", source=where
            )
        return value, where

    residuals, where = field("residuals", "recompute", RESIDUALS)
    if residuals == "save" and check.value("attention") not in FLASH_ATTENTION:
        raise UserError(
            f"is save, but attention is {check.value('attention')!r}; only cuDNN flash attention's forward "
            "outputs are kept this way.",
            key="attention.residuals",
            source=where,
            fix=f"set attention to one of {', '.join(FLASH_ATTENTION)}, or attention.residuals: recompute.",
        )
    kernel, where = field("kernel", "cudnn", ATTENTION_KERNELS)
    if kernel == "fa3" and check.value("attention") != "cudnn_flash_jax":
        raise UserError(
            f"is fa3, but attention is {check.value('attention')!r}; FlashAttention-3 takes the place of the "
            "cuDNN kernel MaxText's cudnn_flash_jax runs.",
            key="attention.kernel",
            source=where,
            fix="set attention: cudnn_flash_jax, or attention.kernel: cudnn.",
        )
    if kernel == "fa3" and (hw.compute_capability or (0, 0))[0] != 9:
        raise UserError(
            f"is fa3, which is built for Hopper (sm_90a); topology.hardware is {hw.name}.",
            key="attention.kernel",
            source=where,
            fix="use attention.kernel: cudnn on this hardware.",
        )
    return {"residuals": residuals, "kernel": kernel, "bf16_projections": _bf16_projections(sec, check)}


def _bf16_projections(sec: dict[str, Value], check: _Checker) -> list[str]:
    """`attention.bf16_projections`: MLA projections computed in BF16 where TE's FP8 quantizes the rest."""
    if "bf16_projections" not in sec:
        return []
    value, where = sec["bf16_projections"].value, sec["bf16_projections"].source
    names = value if isinstance(value, list) else [value]
    known = tuple(bf16_projections.PROJECTIONS)
    for name in names:
        if name not in known:
            raise UserError(
                f"names {name!r}, which is not an MLA projection.",
                key="attention.bf16_projections",
                source=where,
                fix=f"list some of {', '.join(known)}.",
            )
    quant = str(check.value("quantization") or "")
    if names and not quant.startswith("te_fp8"):
        raise UserError(
            f"keeps {', '.join(names)} in BF16, but quantization is {quant or 'off'!r}: only TE's FP8 recipes "
            "(te_fp8_currentscaling, te_fp8_delayedscaling) quantize them.",
            key="attention.bf16_projections",
            source=where,
            fix="include quantization/fp8-hopper, or remove attention.bf16_projections.",
        )
    return sorted(set(names), key=known.index)


def _env(comp: Composition) -> dict[str, str]:
    env = {k: _env_str(v.value) for k, v in comp.sections["env"].items()}
    flags = comp.sections["xla_flags"]
    if flags:
        if "XLA_FLAGS" in env:
            raise UserError(
                "is set directly and through xla_flags; use one.",
                key="env.XLA_FLAGS",
                source=comp.source("env", "XLA_FLAGS"),
                fix="move the flags into the xla_flags section.",
            )
        env["XLA_FLAGS"] = " ".join(f"--{k}={_env_str(v.value)}" for k, v in flags.items())
    return env


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def resolve(comp: Composition) -> ResolvedRecipe:
    """Validate `comp` and derive what it implies (MaxText's `hardware`, the environment)."""
    check = _Checker(comp)
    check.types_and_ranges()
    topo = check.topology()
    hw = topo.profile
    if "hardware" in check.maxtext and check.maxtext["hardware"] != hw.maxtext_hardware:
        check.fail(
            "hardware",
            f"is '{check.maxtext['hardware']}' but topology.hardware is {hw.name}, "
            f"which MaxText calls '{hw.maxtext_hardware}'.",
            "leave MaxText's hardware key unset; it is derived from topology.hardware.",
        )
    check.hardware_contradictions(hw)
    mesh_check.check(check.value, check.fail, topo)
    maxtext = dict(check.maxtext, hardware=hw.maxtext_hardware)
    sources = {f"{section}.{k}": v.source for section, values in comp.sections.items() for k, v in values.items()}
    sources["maxtext.hardware"] = f"derived from topology.hardware ({sources.get('topology.hardware')})"
    corpus = {k: v.value for k, v in comp.sections["corpus"].items()} or None
    if corpus is not None and not maxtext.get("grain_train_files"):
        out = Path(str(maxtext.get("base_output_directory") or "runs"))
        maxtext["grain_train_files"] = corpus_files.file_pattern(corpus_files.default_dir(out))
        sources["maxtext.grain_train_files"] = f"derived from the corpus section ({sources.get('corpus.source')})"
    prepared.resolve_train_files(maxtext, sources)
    moe_settings = moe_checks.settings(comp.sections["moe"], check, topo)
    moe = moe_settings.to_dict()
    for key in moe:
        sources.setdefault(f"moe.{key}", f"default for {hw.name}" if key == "gemm" else "default")
    for key, value in moe_checks.maxtext_keys(moe_settings).items():
        maxtext[key] = value
        sources[f"maxtext.{key}"] = (
            f"derived from moe.seq_balance_loss_weight ({sources['moe.seq_balance_loss_weight']})"
        )
    attention = _attention(comp, check, hw)
    for key in attention:
        sources.setdefault(f"attention.{key}", "default")
    guard = guard_section.resolve(comp.sections["guard"], check.value, lambda k: comp.source("maxtext", k))
    maxtext |= guard.maxtext_keys()
    sources |= guard.sources(sources)
    training = None
    if comp.sections["training"]:
        settings = training_section.resolve(
            comp.sections["training"],
            check.value,
            lambda k: comp.source("maxtext", k),
            topo.num_devices,
            comp.files[-1],
        )
        steps_set = int(check.value("steps")) if comp.source("maxtext", "steps") else None
        derived = training_section.maxtext_keys(settings, steps_set)
        maxtext |= derived
        for key in derived:
            if key != "steps" or steps_set is None:
                sources[f"maxtext.{key}"] = "derived from the training section"
        training = settings.to_dict()
    job = job_section.resolve(comp.sections["job"])
    for key in job.to_dict():
        sources.setdefault(f"job.{key}", "default")
    return ResolvedRecipe(
        name=comp.name,
        description=comp.description,
        maxtext=maxtext,
        env=_env(comp),
        topology=topo,
        corpus=corpus,
        moe=moe,
        attention=attention,
        guard=guard.to_dict(),
        job=job.to_dict(),
        training=training,
        sources=sources,
        files=list(comp.files),
    )
