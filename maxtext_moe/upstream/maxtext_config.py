"""MaxText's own configuration model, run on the resolved keys before training.

Our checks (`validate`) know recipes and hardware; MaxText's pydantic model knows its thousand keys'
exact types and derived values. Both must pass. The keys reach MaxText as `key=value` command-line
arguments, serialised here once, so that what is checked is byte for byte what trains.
"""

from __future__ import annotations

import json
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import maxtext_keys

# The kernels `AttentionOp.apply_attention` dispatches on (maxtext==0.2.5, layers/attention_op.py); any other
# value passes the config model and fails with a bare ValueError once the model is traced.
ATTENTION_KERNELS = (
    "autoselected",
    "dot_product",
    "flash",
    "cudnn_flash_te",
    "cudnn_flash_jax",
    "paged",
    "vllm_rpa",
    "vllm_batched_rpa",
)


def argv(maxtext: dict[str, Any]) -> list[str]:
    """MaxText's argv: program, base config, then one `key=value` per key (JSON is valid YAML flow)."""
    return ["maxtext-moe", str(maxtext_keys.base_yml())] + [f"{k}={json.dumps(v)}" for k, v in maxtext.items()]


def check(maxtext: dict[str, Any], sources: dict[str, str]) -> Any:
    """Run MaxText's pydantic model on `maxtext`; returns MaxText's config or raises a UserError.

    Uses `pyconfig._initialize_pydantic` (maxtext==0.2.5): the public wrapper logs the error and
    calls sys.exit(2) outside pytest, which would hide the key and the file from the user.
    """
    import pydantic
    from maxtext.configs import pyconfig

    if maxtext.get("attention", "autoselected") not in ATTENTION_KERNELS:  # a free string to MaxText's model
        raise UserError(
            f"MaxText has no attention kernel {maxtext['attention']!r}.",
            key="attention",
            source=sources.get("maxtext.attention", "MaxText's defaults"),
            fix=f"use one of: {', '.join(ATTENTION_KERNELS)}.",
        )

    try:
        return pyconfig._initialize_pydantic(argv(dict(maxtext, log_config=False)))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        if not err.get("loc"):  # a whole-model rule: MaxText's message names the keys
            raise UserError(
                f"MaxText rejects the configuration: {err['msg']}",
                fix="adjust the keys it names; `maxtext-moe show RECIPE` tells where each comes from.",
            ) from None
        key = str(err["loc"][0])
        raise UserError(
            f"MaxText rejects it: {err['msg']} (got {err.get('input')!r}).",
            key=key,
            source=sources.get(f"maxtext.{key}", "MaxText's defaults"),
            fix="see the key's description in MaxText's configs/types.py.",
        ) from None
    except (ValueError, AssertionError, TypeError, KeyError) as e:
        raise UserError(
            f"MaxText rejects the configuration: {e}",
            fix="adjust the keys it names; `maxtext-moe show RECIPE` tells where each comes from.",
        ) from None
