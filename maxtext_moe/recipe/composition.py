"""Compose a recipe from YAML fragments and command-line overrides into one resolved recipe.

MaxText takes one flat dictionary of a thousand keys and reports a mistake, if at all, after the
devices are initialised. A recipe instead names small fragments (model, hardware, parallelism, ...)
that many recipes share; this module merges them in order, remembers which file every value came
from, and hands the result to `validate` so that an error can name the key, the file and the fix
before any compute is spent. It never imports jax or MaxText.

File format (recipes and fragments alike; every section optional):

    description: one line shown by `maxtext-moe list`
    include: [model/deepseek3-tiny, hardware/cpu]   # fragments under configs/, merged first, in order
    maxtext: {key: value}                            # MaxText configuration keys
    env: {NAME: value}                               # process environment, set before jax is imported
    xla_flags: {xla_flag_name: value}                # joined into XLA_FLAGS
    topology: {hardware: h200, nodes: 1, gpus_per_node: 8}
    corpus: {source: python-stdlib, max_mib: 8}      # text prepared locally for the Grain loader
    moe: {impl: ours, gemm: te}                      # which routed-MoE block and grouped GEMM run
    attention: {residuals: save}                     # keep flash attention's forward outputs for the backward
    guard: {action: stop, loss_spike: off}           # what a diverging run does (recipe/guard.py)
    job: {max_restarts: 3, watchdog: auto}           # restarts and hang detection of a job (recipe/job.py)
    training: {tokens: 14.8T, lr_peak: 2.2e-4}      # the run's length and schedules, in tokens (recipe/training.py)

Later values replace earlier ones key by key; command-line `key=value` overrides come last.
A command-line `KIND=NAME` for a kind in `SWAPPABLE` (`data=prepared`) merges configs/KIND/NAME.yml in place
of the recipe's fragment of that kind (or after its includes when it has none), so that a recipe trains on
other data or another remat policy without a file of one's own.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from maxtext_moe import paths
from maxtext_moe.errors import UserError
from maxtext_moe.moe import settings
from maxtext_moe.recipe import guard, job, maxtext_keys, training

SECTIONS = (
    "description",
    "include",
    "maxtext",
    "env",
    "xla_flags",
    "topology",
    "corpus",
    "moe",
    "attention",
    "guard",
    "job",
    "training",
)
TOPOLOGY_FIELDS = ("hardware", "nodes", "gpus_per_node")
CORPUS_FIELDS = ("source", "max_mib", "shards")
MOE_FIELDS = settings.FIELDS
ATTENTION_FIELDS = ("residuals", "kernel", "bf16_projections")
# sections with fixed fields
FIELDS = {
    "topology": TOPOLOGY_FIELDS,
    "corpus": CORPUS_FIELDS,
    "moe": MOE_FIELDS,
    "attention": ATTENTION_FIELDS,
    "guard": guard.FIELDS,
    "job": job.FIELDS,
    "training": training.FIELDS,
}
# Fields that moved to another section: old "section.field" -> new "section.field".
MOVED = {"moe.attention_residuals": "attention.residuals"}
# Command-line prefixes that address a section other than `maxtext`.
PREFIXES = {
    "env": "env",
    "xla": "xla_flags",
    "xla_flags": "xla_flags",
    "topology": "topology",
    "corpus": "corpus",
    "moe": "moe",
    "attention": "attention",
    "guard": "guard",
    "job": "job",
    "training": "training",
}
COMMAND_LINE = "command line"
# Fragment kinds a bare `KIND=NAME` swaps from the command line: each kind's fragments are alternatives for
# one another (where the data comes from; which activations are kept), and no MaxText key has the kind's name.
SWAPPABLE = ("data", "memory")
_SWAP_NOTE = f"on the {COMMAND_LINE}"
_SWAPPED = re.compile(rf"\((\w+=[\w.-]+) {_SWAP_NOTE}\)$")
# MaxText keys that `run/train.py` sets itself: a value given for them would be ignored without a word.
RESERVED = {
    "metrics_file": "maxtext-moe writes each step's metrics to <run folder>/metrics.jsonl itself and follows "
    "that file for its progress lines. Fix: read metrics.jsonl in the run folder; set base_output_directory "
    "and run_name to choose the folder.",
}
# YAML 1.1 (PyYAML) reads a float only with a dot and a signed exponent: `3e-4` and `3e-05` stay strings.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


@dataclass(frozen=True)
class Value:
    value: Any
    source: str


@dataclass
class Composition:
    """Values per section, each remembering the file (or override) that set it last."""

    name: str
    description: str = ""
    sections: dict[str, dict[str, Value]] = field(
        default_factory=lambda: {s: {} for s in SECTIONS if s not in ("description", "include")}
    )
    files: list[str] = field(default_factory=list)
    swapped: set[str] = field(default_factory=set)  # fragment kinds replaced from the command line

    def get(self, section: str, key: str, default: Any = None) -> Any:
        v = self.sections[section].get(key)
        return default if v is None else v.value

    def source(self, section: str, key: str) -> str | None:
        v = self.sections[section].get(key)
        return None if v is None else v.source


def suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """' Did you mean X?' or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def recipe_names() -> list[str]:
    return sorted(p.stem for p in paths.recipes_dir().glob("*.yml"))


def fragment_names() -> list[str]:
    root = paths.configs_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yml"))


def find_recipe(ref: str) -> Path:
    """A recipe by name (`recipes/NAME.yml`) or by path to a YAML file."""
    as_path = Path(ref)
    if as_path.suffix in (".yml", ".yaml"):
        if not as_path.is_file():
            raise UserError(f"recipe file {ref} does not exist.", fix="check the path, or run `maxtext-moe list`.")
        return as_path
    path = paths.recipes_dir() / f"{ref}.yml"
    if not path.is_file():
        raise UserError(
            f"no recipe named '{ref}'.{suggest(ref, recipe_names())}",
            fix="run `maxtext-moe list` to see the recipes, or give a path to a .yml file.",
        )
    return path


def load_yaml(path: Path) -> dict[str, Any]:
    """One YAML mapping; syntax errors and non-mappings become user errors naming the file."""
    where = paths.display(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise UserError(f"is not valid YAML: {e}".replace("\n", " "), source=where) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"must be a YAML mapping of sections, not {type(data).__name__}.", source=where)
    for section in data:
        if section not in SECTIONS:
            raise UserError(
                f"unknown section '{section}'.{suggest(str(section), SECTIONS)}",
                source=where,
                fix=f"use only: {', '.join(SECTIONS)}.",
            )
    return data


def _check_key(section: str, key: str, where: str) -> None:
    if section == "maxtext" and key in RESERVED:
        message, fix = RESERVED[key].split(" Fix: ")
        raise UserError(f"is set by maxtext-moe, not by recipes: {message}", key=key, source=where, fix=fix)
    if section == "maxtext":
        known = maxtext_keys.defaults()
        if key not in known:
            raise UserError(
                f"unknown MaxText key.{suggest(key, tuple(known))}",
                key=key,
                source=where,
                fix="see MaxText's configs/base.yml for the keys it accepts.",
            )
    elif f"{section}.{key}" in MOVED:
        new = MOVED[f"{section}.{key}"]
        raise UserError(f"has moved to {new}.", key=f"{section}.{key}", source=where, fix=f"write {new} instead.")
    elif section in FIELDS and key not in FIELDS[section]:
        raise UserError(
            f"unknown {section} field.{suggest(key, FIELDS[section])}",
            key=f"{section}.{key}",
            source=where,
            fix=f"use one of: {', '.join(FIELDS[section])}.",
        )
    elif section == "xla_flags" and not key.startswith("xla_"):
        raise UserError(
            "XLA flag names start with 'xla_' (write them without the leading dashes).",
            key=f"xla_flags.{key}",
            source=where,
        )
    elif section == "env" and (not key or not key.replace("_", "A").isalnum() or key[0].isdigit()):
        raise UserError("is not a valid environment variable name.", key=f"env.{key}", source=where)


def _as_number(key: str, value: Any) -> Any:
    """`value` as YAML 1.2 reads it where MaxText's default for `key` is a number (`3e-4` -> 0.0003).

    A float that is a whole number becomes an int for an integer key (`steps=1e3`); any other text is
    left for `validate` to reject with the key's expected type.
    """
    default = maxtext_keys.defaults().get(key)
    if not isinstance(value, str) or isinstance(default, bool) or not isinstance(default, (int, float)):
        return value
    if not _NUMBER.fullmatch(value.strip()):
        return value
    number = float(value)
    if isinstance(default, int):
        return int(number) if number.is_integer() else value
    return number


def _merge_file(
    comp: Composition, path: Path, stack: tuple[Path, ...], swaps: dict[str, str], label: str = ""
) -> dict[str, Any]:
    """Merge one file (its includes first) into `comp`; returns the file's own mapping.

    `swaps` (kind -> fragment name, from `KIND=NAME` on the command line) replaces each include of that kind;
    the fragment put in its place merges its own includes as written. `label` follows the file's name in the
    sources of its values.
    """
    where = paths.display(path) + label
    if path.resolve() in stack:
        chain = " -> ".join(paths.display(p) for p in (*stack, path))
        raise UserError(f"includes itself: {chain}.", source=where, fix="remove one of the includes.")
    data = load_yaml(path)
    includes = data.get("include") or []
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise UserError("must be a list of fragment names like 'model/deepseek3-tiny'.", key="include", source=where)
    for ref in includes:
        _merge_include(comp, ref, where, (*stack, path.resolve()), swaps)
    for kind in [] if stack else [k for k in swaps if k not in comp.swapped]:  # the recipe has none of that kind
        _merge_include(comp, kind, where, (path.resolve(),), swaps)
    comp.files.append(paths.display(path))
    for section in comp.sections:
        body = data.get(section)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise UserError(
                f"section must be a mapping of key: value, not {type(body).__name__}.", key=section, source=where
            )
        for key, value in body.items():
            key = str(key)
            _check_key(section, key, where)
            comp.sections[section][key] = Value(_as_number(key, value) if section == "maxtext" else value, where)
    return data


def swap_in(source: str | None) -> str:
    """The `KIND=NAME` swap that put a value's fragment in the recipe (`data=prepared`), from the value's
    source; '' for a value of the recipe's own fragments."""
    found = _SWAPPED.search(source or "")
    return found.group(1) if found else ""


def _merge_include(comp: Composition, ref: str, where: str, stack: tuple[Path, ...], swaps: dict[str, str]) -> None:
    """Merge the fragment `ref` that the file `where` includes, or the one a swap of its kind puts in its place."""
    kind = ref.split("/", 1)[0]
    label = ""
    if kind in swaps:
        ref, label = f"{kind}/{swaps[kind]}", f" ({kind}={swaps[kind]} {_SWAP_NOTE})"
        swaps = {k: v for k, v in swaps.items() if k != kind}  # its own includes merge as written
        comp.swapped.add(kind)
    frag = paths.configs_dir() / f"{ref}.yml"
    if not frag.is_file():
        raise UserError(
            f"no fragment '{ref}'.{suggest(ref, fragment_names())}",
            key="include",
            source=where,
            fix="fragments are configs/<kind>/<name>.yml, named without '.yml'.",
        )
    _merge_file(comp, frag, stack, swaps, label)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`key=value` from the command line -> (section, key, value); the value is parsed as YAML."""
    if "=" not in text:
        raise UserError(
            f"override '{text}' has no '='.",
            source=COMMAND_LINE,
            fix="write overrides as key=value, e.g. steps=20 or env.NCCL_DEBUG=INFO.",
        )
    dotted, raw = text.split("=", 1)
    section, key = "maxtext", dotted
    if "." in dotted:
        prefix, rest = dotted.split(".", 1)
        if prefix not in PREFIXES:
            raise UserError(
                f"unknown prefix '{prefix}' in '{dotted}'.{suggest(prefix, tuple(PREFIXES))}",
                source=COMMAND_LINE,
                fix="use a MaxText key, or env.NAME, xla.FLAG, topology.FIELD, corpus.FIELD, moe.FIELD, "
                "attention.FIELD, guard.FIELD, job.FIELD, training.FIELD.",
            )
        section, key = PREFIXES[prefix], rest
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return section, key, value


def fragment_swaps(overrides: list[str] | tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Split `KIND=NAME` fragment swaps (`data=prepared`) from the other overrides; an unknown NAME is refused
    with the kind's fragments."""
    swaps, rest = {}, []
    for text in overrides:
        kind, _, name = text.partition("=")
        if kind not in SWAPPABLE:
            rest.append(text)
            continue
        choices = sorted(p.stem for p in (paths.configs_dir() / kind).glob("*.yml"))
        if name not in choices:
            raise UserError(
                f"no {kind} fragment '{name}'.{suggest(name, choices)}",
                key=kind,
                source=COMMAND_LINE,
                fix=f"use one of: {', '.join(choices)} (configs/{kind}/NAME.yml).",
            )
        swaps[kind] = name
    return swaps, rest


def compose(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> Composition:
    """Merge a recipe's fragments (swapped ones replaced), the recipe itself, then command-line overrides."""
    path = find_recipe(ref)
    swaps, overrides = fragment_swaps(overrides)
    comp = Composition(name=path.stem)
    comp.description = str(_merge_file(comp, path, (), swaps).get("description", "")).strip()
    for text in overrides:
        section, key, value = parse_override(text)
        _check_key(section, key, COMMAND_LINE)
        comp.sections[section][key] = Value(_as_number(key, value) if section == "maxtext" else value, COMMAND_LINE)
    _check_data_source(comp, ref)
    return comp


def _check_data_source(comp: Composition, ref: str) -> None:
    """`grain_train_files` where the recipe's data fragment would not read it (a corpus section that writes its own
    corpus, synthetic data) names the fragment that does."""
    files = comp.sections["maxtext"].get("grain_train_files")
    if files is None:
        return
    dataset = comp.get("maxtext", "dataset_type", maxtext_keys.defaults().get("dataset_type"))
    if comp.sections["corpus"]:
        why = "the recipe's corpus section makes maxtext-moe prepare its own corpus and point MaxText at it"
    elif dataset != "grain":
        why = f"the recipe reads dataset_type {dataset} ({comp.source('maxtext', 'dataset_type') or 'default'})"
    else:
        return
    raise UserError(
        f"is set, but {why}.",
        key="grain_train_files",
        source=files.source,
        fix=f"add data=prepared to read a corpus from `maxtext-moe data prepare` (`maxtext-moe train {ref} "
        "data=prepared grain_train_files=/data/corpus`), or data=parquet for raw-text .parquet files; or drop "
        "grain_train_files.",
    )
