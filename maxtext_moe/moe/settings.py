"""The recipe's `moe:` section as one typed object: fields, choices, defaults and the checks that need only
these settings and the hardware kind.

Why one home: the recipe checks, the planner, bench, doctor and the training process all read these
settings; each keeping its own defaults let them disagree (FP8 experts planned as BF16 while bench counted
them as FP8). This module imports no jax, so recipe checks and `plan` stay free of it; the JAX code takes
its types (`Backend`, `Fp8`, `Impl`) from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Protocol, get_args

from maxtext_moe.errors import UserError

Block = Literal["maxtext", "ours"]
Backend = Literal["ragged_dot", "tokamax", "te"]
TeGemmPath = Literal["auto", "v1", "v2"]  # requested; gemm.TePath is the one chosen
Fp8 = Literal["none", "current_scaling", "mxfp8"]
# Who casts the expert operands to FP8 under current scaling: TE's grouped quantize or XLA (`te_group_scales`).
Fp8Cast = Literal["te", "xla"]
Exchange = Literal["auto", "all_to_all", "ragged_all_to_all", "nccl_ep"]
# How one EP exchange is computed: the recipe's `exchange` resolved ("auto" is "all_to_all"), or the
# all_gather emulation that the CPU reference runs under `vmap`. "nccl_ep" is TE's NCCL EP dispatch and
# combine around our routing and grouped GEMMs (`nccl_ep.py`), in place of the whole dedup exchange.
Impl = Literal["all_to_all", "ragged_all_to_all", "emulated", "nccl_ep"]
# Exchanges only NVIDIA GPUs run: XLA:CPU has no ragged all-to-all, and NCCL EP is NCCL's.
GPU_EXCHANGES: tuple[Impl, ...] = ("ragged_all_to_all", "nccl_ep")

EP_AXIS = "expert"  # MaxText's name for the expert-parallel mesh axis

BACKENDS: tuple[Backend, ...] = ("ragged_dot", "tokamax", "te")
FP8_MODES: tuple[Fp8, ...] = get_args(Fp8)
IMPLS: tuple[Impl, ...] = get_args(Impl)
# Field -> its choices, in the order messages list them.
CHOICES: dict[str, tuple[Any, ...]] = {
    "impl": get_args(Block),
    "gemm": ("te", "tokamax", "ragged_dot"),
    "te_gemm_path": get_args(TeGemmPath),
    "fp8": FP8_MODES,
    "fp8_cast": get_args(Fp8Cast),
    "exchange": get_args(Exchange),
    "dispatch_chunks": (1, 2, 4),
}
SEQ_BALANCE = "seq_balance_loss_weight"  # the one field that is a number, not a choice


class HardwareKind(Protocol):
    """What the checks read of a hardware profile (`recipe.hardware.Hardware`)."""

    name: str
    maxtext_hardware: str
    mxfp8: bool

    @property
    def fp8(self) -> bool: ...


class Sourced(Protocol):
    """A recipe value and the file (or command-line override) that set it (`recipe.composition.Value`)."""

    value: Any
    source: str


@dataclass(frozen=True)
class MoeSettings:
    """Which routed-MoE block runs and how: `impl` maxtext (MaxText's own block, tuned with MaxText keys;
    the other fields then do not apply) or ours, with its grouped-GEMM `gemm` backend, TE's grouped-GEMM
    path, FP8 expert GEMMs (TE's per-tensor current scaling on Hopper and later, or MXFP8 on Blackwell) and
    the EP `exchange`, and how many chunks each rank's tokens are dispatched in (`dispatch_chunks`: one
    chunk's exchange can run beside another's expert GEMMs). `seq_balance_loss_weight` is DeepSeek-V3's alpha
    for its sequence-wise balance loss (`balance.sequence_balance_loss`), 0 for none: MaxText's own
    `load_balance_loss_weight` weighs a different loss, on its own router."""

    impl: Block = "maxtext"
    gemm: Backend = "ragged_dot"
    te_gemm_path: TeGemmPath = "auto"
    fp8: Fp8 = "none"
    fp8_cast: Fp8Cast = "te"
    exchange: Exchange = "auto"
    dispatch_chunks: int = 1
    seq_balance_loss_weight: float = 0.0

    @property
    def ours(self) -> bool:
        return self.impl == "ours"

    @property
    def expert_fp8(self) -> bool:
        """Whether our block's expert GEMMs run in FP8."""
        return self.ours and self.fp8 != "none"

    @property
    def exchange_impl(self) -> Impl:
        """The exchange the EP layer runs: "auto" is XLA's dense all-to-all, which every backend implements."""
        return "all_to_all" if self.exchange == "auto" else self.exchange

    @staticmethod
    def default_gemm(hw: HardwareKind) -> Backend:
        """TE's grouped GEMM on NVIDIA GPUs (the fastest kernel there), `ragged_dot` elsewhere."""
        return "te" if hw.maxtext_hardware == "gpu" else "ragged_dot"

    def to_dict(self) -> dict[str, Any]:
        """The section as `show` prints it: MaxText's block has no settings of ours besides `impl` and the
        model's sequence-wise balance loss, which it computes itself (`recipe.moe_checks.maxtext_keys`)."""
        if self.ours:
            return asdict(self)
        weight = self.seq_balance_loss_weight
        return {"impl": self.impl} | ({SEQ_BALANCE: weight} if weight > 0 else {})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MoeSettings:
        """Back from `to_dict` (a resolved recipe passed as plain data)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    @classmethod
    def from_section(cls, section: Mapping[str, Sourced], hw: HardwareKind) -> MoeSettings:
        """The checked settings of a recipe's `moe:` section on hardware `hw`; a `UserError` names the key,
        the file that set it and the fix."""
        for key, v in section.items():
            if key in CHOICES and v.value not in CHOICES[key]:
                raise UserError(
                    f"must be one of {', '.join(map(str, CHOICES[key]))}, got {v.value!r}.",
                    key=f"moe.{key}",
                    source=v.source,
                )
        weight = _loss_weight(section[SEQ_BALANCE]) if SEQ_BALANCE in section else cls.seq_balance_loss_weight
        impl = section["impl"].value if "impl" in section else "maxtext"
        if impl == "maxtext":
            # An explicit `impl: maxtext` (say, a command-line override of a recipe using ours) drops our
            # block's settings; setting them with no impl at all is a mistake worth a message. The balance
            # loss weight is the model's (a model fragment pins DeepSeek-V3's): MaxText's block computes the
            # same loss with it (`recipe.moe_checks.maxtext_keys`).
            extra = next((k for k in section if k not in ("impl", SEQ_BALANCE)), None)
            exchange = section.get("exchange")
            if "impl" not in section and exchange is not None and exchange.value == "nccl_ep":
                raise UserError(
                    "is nccl_ep, which runs our block's routing around TE's NCCL EP; MaxText's own block "
                    "reaches NCCL EP only as TE's fused MoE (te_moe_block).",
                    key="moe.exchange",
                    source=exchange.source,
                    fix="set moe.impl: ours, or remove moe.exchange and set te_moe_block: true.",
                )
            if extra and "impl" not in section:
                raise UserError(
                    "applies only to moe.impl: ours; MaxText's own block is tuned with MaxText keys "
                    "(use_tokamax_gmm, te_moe_block).",
                    key=f"moe.{extra}",
                    source=section[extra].source,
                    fix="set moe.impl: ours, or remove it.",
                )
            return cls(impl="maxtext", seq_balance_loss_weight=weight)
        value = {k: v.value for k, v in section.items()} | {SEQ_BALANCE: weight}
        settings = cls(**(value | {"gemm": value.get("gemm", cls.default_gemm(hw))}))
        settings.check(hw, {k: v.source for k, v in section.items()})
        return settings

    def check(self, hw: HardwareKind, sources: Mapping[str, str]) -> None:
        """Refuse what cannot run on `hw`: TE, `ragged_all_to_all` and `nccl_ep` need NVIDIA GPUs, FP8 experts
        need FP8 matrix units and TE's grouped GEMM, and NCCL EP moves BF16 tokens only. `sources` maps a field
        to where it was set."""
        where = sources.get("impl")
        if self.gemm == "te" and hw.maxtext_hardware != "gpu":
            raise UserError(
                f"is te, but Transformer Engine's grouped GEMM needs an NVIDIA GPU and this recipe runs on {hw.name}.",
                key="moe.gemm",
                source=sources.get("gemm", where),
                fix="use moe.gemm: ragged_dot (or tokamax) on the CPU.",
            )
        if self.fp8 != "none":
            # MaxText's TE block has FP8 experts only as MXFP8 (Blackwell); ours adds TE's current scaling,
            # which Hopper runs too.
            if not hw.fp8:
                raise UserError(
                    f"is {self.fp8}, but {hw.name} has no FP8 matrix units.",
                    key="moe.fp8",
                    source=sources.get("fp8"),
                    fix="set moe.fp8: none, or run on an FP8 GPU (topology.hardware: h100, h200, gb200, gb300).",
                )
            if self.gemm != "te":
                raise UserError(
                    f"is {self.fp8}, but FP8 expert GEMMs run on Transformer Engine's grouped GEMM only, and "
                    f"moe.gemm is {self.gemm}.",
                    key="moe.fp8",
                    source=sources.get("fp8"),
                    fix="set moe.gemm: te, or moe.fp8: none.",
                )
            if self.fp8 == "mxfp8" and not hw.mxfp8:
                raise UserError(
                    f"is mxfp8, but MXFP8 (block-scaled FP8) needs Blackwell (SM100) and {hw.name} has none.",
                    key="moe.fp8",
                    source=sources.get("fp8"),
                    fix="use moe.fp8: current_scaling on Hopper (per-tensor FP8, which it runs).",
                )
        if self.fp8_cast != "te" and self.fp8 != "current_scaling":
            raise UserError(
                f"is {self.fp8_cast}, which casts the expert operands of TE's per-tensor current scaling, and "
                f"moe.fp8 is {self.fp8}.",
                key="moe.fp8_cast",
                source=sources.get("fp8_cast"),
                fix="set moe.fp8: current_scaling, or remove moe.fp8_cast.",
            )
        if self.exchange in GPU_EXCHANGES and hw.maxtext_hardware != "gpu":
            runs = "XLA implements" if self.exchange == "ragged_all_to_all" else "NCCL (through TE) runs"
            raise UserError(
                f"is {self.exchange}, which {runs} on GPUs only, and this recipe runs on {hw.name}.",
                key="moe.exchange",
                source=sources.get("exchange"),
                fix="use moe.exchange: auto (or all_to_all).",
            )
        if self.exchange == "nccl_ep" and self.dispatch_chunks > 1:
            raise UserError(
                f"is {self.dispatch_chunks} with moe.exchange: nccl_ep, but TE's NCCL EP dispatches a layer's "
                "tokens in one call; chunks apply to our exchanges.",
                key="moe.dispatch_chunks",
                source=sources.get("dispatch_chunks"),
                fix="set moe.dispatch_chunks: 1, or moe.exchange: auto.",
            )
        if self.exchange == "nccl_ep" and self.fp8 != "none":
            raise UserError(
                f"is {self.fp8} with moe.exchange: nccl_ep, but TE 2.20.2's NCCL EP dispatches BF16 tokens "
                "only (ep_bootstrap's max_token_dtype), and our FP8 expert GEMMs are verified with the other "
                "exchanges only.",
                key="moe.fp8",
                source=sources.get("fp8"),
                fix="set moe.fp8: none, or moe.exchange: auto.",
            )


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MoeSettings))  # the `moe:` section's keys


def _loss_weight(v: Sourced) -> float:
    """`moe.seq_balance_loss_weight` as a float >= 0; text such as `1e-4` (which YAML 1.1 and the command line
    leave a string) is read as the number it writes."""
    value = v.value
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UserError(
            f"must be a number >= 0 (DeepSeek-V3's alpha, 0 for no sequence-wise balance loss), got {v.value!r}.",
            key=f"moe.{SEQ_BALANCE}",
            source=v.source,
            fix="write a weight such as 0.0001 (DeepSeek-V3's), or 0 to leave the loss out.",
        )
    return float(value)


@dataclass(frozen=True)
class ExpertPath:
    """How the routed experts compute, passed down whole from the layer to the grouped GEMMs and the EP
    exchange instead of a list of loose flags.

    backend        grouped-GEMM kernel (`gemm.grouped_matmul`)
    fp8            FP8 expert GEMMs ("current_scaling", "mxfp8": backend te only)
    fp8_cast       who casts the operands under current scaling: TE's grouped quantize or XLA
    exchange       how an EP exchange runs (`exchange.exchange`), or "nccl_ep" (`nccl_ep.routed`)
    buffer_factor  EP receive buffer, MaxText's `ragged_buffer_factor` (<= 0: the dropless worst case)
    dedup          send a token once per destination rank (ours), not once per chosen expert (MaxText's)
    dispatch_chunks  split each rank's tokens into this many chunks, each planned, exchanged and computed on
                   its own (`expert_parallel._rank_routed`), so that XLA can run one chunk's exchange beside
                   another chunk's expert GEMMs
    axis_name      the mesh (or vmap) axis the experts are split over
    own_adjoint    the exchange's own adjoint (False under `vmap`, where a custom VJP loses the axis name)
    """

    backend: Backend = "ragged_dot"
    fp8: Fp8 = "none"
    exchange: Impl = "all_to_all"
    buffer_factor: float = -1.0
    dedup: bool = True
    dispatch_chunks: int = 1
    axis_name: str = EP_AXIS
    own_adjoint: bool = True
    fp8_cast: Fp8Cast = "te"

    @classmethod
    def of(cls, settings: MoeSettings, buffer_factor: float = -1.0) -> ExpertPath:
        """The path a recipe's settings ask for, with MaxText's `ragged_buffer_factor`."""
        return cls(
            settings.gemm,
            settings.fp8,
            settings.exchange_impl,
            buffer_factor,
            dispatch_chunks=settings.dispatch_chunks,
            fp8_cast=settings.fp8_cast,
        )


DEFAULT_PATH = ExpertPath()  # ragged_dot in the compute dtype: runs on every backend
