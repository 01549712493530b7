"""`maxtext-moe plan`: memory, FLOPs, communication and step time of a resolved recipe, before launch.

MaxText reports memory only after XLA has compiled for the real devices, and FLOPs only once training
runs; neither tells whether a 671B layout fits a cluster one does not have yet. This package answers
that from arithmetic over the resolved configuration alone (no jax): `model` (shapes and parameter
counts), `layout` (mesh, batch, dtypes, remat policy), `flops`, `memory`, `communication`, `estimate`
(step time, fit verdict, rendering), `search` (rank layouts that fit), `fit` (the verdict before a GPU
run, the nearest layouts that fit after XLA ran out of memory) and `budget` (the days and GPU-hours of the
recipe's `training:` token budget).
"""

from maxtext_moe.plan import budget, search
from maxtext_moe.plan.estimate import Plan, estimate
from maxtext_moe.plan.layout import Layout
from maxtext_moe.plan.model import Model

__all__ = ["Layout", "Model", "Plan", "budget", "estimate", "search"]
