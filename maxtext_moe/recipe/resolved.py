"""The resolved recipe: the single object every command consumes.

Data flows one way: recipe files -> `recipe.compose` -> `validate.resolve` -> this object ->
`show` / `plan` / `doctor` / `train`. It holds plain data only (no jax), so it can be printed,
hashed into a run's identity, and passed to a subprocess.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from maxtext_moe.moe.settings import MoeSettings
from maxtext_moe.recipe import maxtext_keys
from maxtext_moe.recipe.guard import GuardSettings
from maxtext_moe.recipe.hardware import Hardware, profile
from maxtext_moe.recipe.job import JobSettings
from maxtext_moe.recipe.training import TrainingSettings

# Keys that change the shape or layout of saved parameters, besides those a MaxText model file sets.
_CHECKPOINT_SHAPE_KEYS = (
    "model_name",
    "vocab_size",
    "weight_dtype",
    "scan_layers",
    "mtp_num_layers",
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "base_mlp_dim",
    "base_moe_mlp_dim",
    "base_num_decoder_layers",
    "head_dim",
    "num_experts",
    "first_num_dense_layers",
    "shared_experts",
    "q_lora_rank",
    "kv_lora_rank",
)
# Keys that change the parameter tree only when set (MaxText's fused expert up-projection, one `wi` for wi_0 and
# wi_1): they join the identity only then, so that run folders written before they were known keep theirs.
_CHECKPOINT_TREE_SWITCHES = ("prefuse_moe_weights",)

# Keys that change the optimizer state's tree in MaxText's `optimizers.get_optimizer`: its optax chain
# (opt_type), the spike-skipping wrapper's extra state (its buffers hold skip_step_interval steps), and the
# masks that drop state for some parameters. A checkpoint restores only into the same tree; dtypes (mu_dtype)
# are cast on restore and are not listed.
_OPTIMIZER_STATE_KEYS = (
    "opt_type",
    "skip_step_on_spikes",
    "skip_step_interval",
    "trainable_parameters_mask",
    "adamw_mask",
)


@dataclass(frozen=True)
class Topology:
    hardware: str
    nodes: int
    gpus_per_node: int

    @property
    def num_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def profile(self) -> Hardware:
        return profile(self.hardware)


@dataclass(frozen=True)
class ResolvedRecipe:
    name: str
    description: str
    maxtext: dict[str, Any]
    env: dict[str, str]
    topology: Topology
    corpus: dict[str, Any] | None
    moe: dict[str, Any] = field(default_factory=lambda: {"impl": "maxtext"})  # MoeSettings.to_dict()
    attention: dict[str, Any] = field(
        default_factory=lambda: {"residuals": "recompute", "kernel": "cudnn", "bf16_projections": []}
    )  # validate._attention
    guard: dict[str, Any] = field(default_factory=lambda: GuardSettings().to_dict())  # GuardSettings.to_dict()
    job: dict[str, Any] = field(default_factory=lambda: JobSettings().to_dict())  # JobSettings.to_dict()
    training: dict[str, Any] | None = None  # TrainingSettings.to_dict(), or None: MaxText's own schedule
    sources: dict[str, str] = field(default_factory=dict)  # "maxtext.steps" -> file or "command line"
    files: list[str] = field(default_factory=list)

    @property
    def moe_settings(self) -> MoeSettings:
        """The `moe` section as code reads it: typed, with every default filled in."""
        return MoeSettings.from_dict(self.moe)

    @property
    def guard_settings(self) -> GuardSettings:
        """The `guard` section as code reads it: what a diverging run does."""
        return GuardSettings.from_dict(self.guard)

    @property
    def job_settings(self) -> JobSettings:
        """The `job` section as code reads it: restarts, the hang watchdog and the compilation cache."""
        return JobSettings.from_dict(self.job)

    @property
    def training_settings(self) -> TrainingSettings | None:
        """The `training` section as code reads it, or None when the recipe leaves the schedule to MaxText."""
        return None if self.training is None else TrainingSettings.from_dict(self.training)

    @property
    def slice_fusion(self) -> bool:
        """Whether XLA's dynamic-slice fusion is on (XLA's default): in a scanned loop it runs twice every
        custom-call GEMM whose output the remat policy saves (scripts/repro/, dynamic_slice_fusion_*)."""
        return "--xla_gpu_enable_dynamic_slice_fusion=false" not in str(self.env.get("XLA_FLAGS", "")).split()

    def effective(self, key: str) -> Any:
        """A MaxText key's value as MaxText will see it: recipe, else model file, else base.yml."""
        if key in self.maxtext:
            return self.maxtext[key]
        model = maxtext_keys.model_defaults(str(self.maxtext.get("model_name", "default")))
        if key in model:
            return model[key]
        return maxtext_keys.defaults().get(key)

    def checkpoint_identity(self) -> dict[str, Any]:
        """What a checkpoint written by this recipe must match to be resumed by it."""
        keys = set(_CHECKPOINT_SHAPE_KEYS) | set(
            maxtext_keys.model_defaults(str(self.maxtext.get("model_name", "default")))
        )
        shape = {k: self.effective(k) for k in sorted(keys)}
        shape |= {k: True for k in _CHECKPOINT_TREE_SWITCHES if self.effective(k) is True}
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
        optimizer = {k: self.effective(k) for k in _OPTIMIZER_STATE_KEYS}
        return {"recipe": self.name, "model_digest": digest, "model": shape, "optimizer": optimizer} | self.schedule()

    def schedule(self) -> dict[str, Any]:
        """The learning-rate schedule's length, and whether the recipe set it or it follows `steps` (MaxText's
        -1): a resumed run whose schedule follows a changed `steps` would restart its cosine for the new total."""
        explicit = int(self.effective("learning_rate_schedule_steps")) > 0
        length = int(self.effective("learning_rate_schedule_steps" if explicit else "steps"))
        return {"schedule_steps": length, "schedule_set": explicit}

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.name,
            "description": self.description,
            "maxtext": self.maxtext,
            "env": self.env,
            "topology": asdict(self.topology) | {"num_devices": self.topology.num_devices},
            "corpus": self.corpus,
            "moe": self.moe,
            "attention": self.attention,
            "guard": self.guard,
            "job": self.job,
            "training": self.training,
            "sources": self.sources,
            "files": self.files,
        }
