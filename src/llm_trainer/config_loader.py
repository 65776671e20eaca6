"""Experiment files and command-line overrides into an `ExperimentConfig`: YAML or JSON read within
`limits`' bounds, dotted overrides (`training.learning_rate=3e-4`) applied, other frameworks' names
taken through `config_aliases`, and every problem said in one line (`UsageError`) naming the file or
the command line, with the closest valid key for a typo. The dataclasses themselves are `config`'s.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from . import config_aliases
from .config import ExperimentConfig
from .errors import UsageError, first_line
from .limits import MAX_NESTING, check_structure, parse_json


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-4` as a string; ML configs mean a number. Accept exponents without a dot.

    A key written twice in one mapping is refused: YAML would keep the last silently, and a second
    `model:` section would drop the first whole. (Keys a merge key `<<` brings in may be set again: that
    is what merging is for.) Merge keys copy entries while the document is built, so a few lines of
    nested merges could copy billions: a mapping that merges more than `MAX_MERGED_ENTRIES` is refused."""

    MAX_MERGED_ENTRIES = 10_000

    def flatten_mapping(self, node):
        checked = self.__dict__.setdefault("_checked", set())  # nodes flattened before: merges are in them
        if id(node) not in checked:
            checked.add(id(node))
            self._refuse_keys_twice(node)
        super().flatten_mapping(node)
        if len(node.value) > self.MAX_MERGED_ENTRIES:
            raise UsageError(
                f"a mapping merges more than {self.MAX_MERGED_ENTRIES:,} entries through YAML merge keys "
                f"(line {node.start_mark.line + 1}; the alias expansion limit)"
            )

    @staticmethod
    def _refuse_keys_twice(node) -> None:
        """A key written twice in the mapping as written (before merges add their entries)."""
        seen: dict[str, int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if key.value in seen:
                raise UsageError(
                    f"the key {key.value!r} is written twice in one mapping (lines {seen[key.value]} and {line}); "
                    "YAML would keep only the second: keep one"
                )
            seen[key.value] = line


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def yaml_load(text: str, where: str = "a YAML document"):
    """A YAML document as plain data, its nesting and alias expansion within `limits`' bounds."""
    try:
        value = yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise UsageError(f"{where} is nested more than {MAX_NESTING} levels deep (the nesting limit)") from None
    except UsageError as exc:  # the loader's own refusals (a key twice, merges past the limit)
        raise UsageError(f"{where}: {exc}") from None
    return check_structure(value, where)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and where it is, in one line: `line 3, column 1: found character '\t' that cannot
    start any token`, rather than its first line, `while scanning for the next token`."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or first_line(exc)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.learning_rate=3e-4` -> (["training", "learning_rate"], 0.0003); values are YAML scalars. A
    key nested deeper (`distributed.fsdp_config.sharding_strategy=...`, as a file may nest it) sets that
    one entry of the mapping: (["distributed", "fsdp_config"], {"sharding_strategy": ...})."""
    if "=" not in text:
        raise UsageError(f"override {text!r} must look like section.key=value (e.g. training.max_steps=100)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise UsageError(f"override key {key!r} must be section.key (e.g. training.learning_rate)")
    try:
        value = yaml_load(raw, f"override {key.strip()}") if raw.strip() else None
    except yaml.YAMLError as exc:
        if raw.lstrip().startswith(("[", "{")):  # meant as a list or mapping: never taken as one string
            items = raw.strip().removeprefix("[").removesuffix("]").split(",")
            quoted = "[" + ", ".join(json.dumps(item.strip()) for item in items if item.strip()) + "]"
            raise UsageError(
                f"override {key.strip()}={raw} is not a YAML list or mapping ({yaml_problem(exc)}); quote the "
                f"items that hold *, &, ! or : (YAML reads *x as an alias): '{key.strip()}={quoted}'"
            ) from None
        value = raw
    for name in reversed(parts[2:]):
        value = _Nested({name: value})
    return parts[:2], value


class _Nested(dict):
    """The value of an override nested past section.key: laid over the file's mapping, not replacing it."""


def _merged(current: Any, value: Any) -> Any:
    """A nested override's mapping laid over what the file gives there (its other entries kept)."""
    if not (isinstance(current, dict) and isinstance(value, dict)):
        return value
    out = dict(current)
    for key, item in value.items():
        out[key] = _merged(current.get(key), item) if isinstance(item, _Nested) else item
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "not found"
        raise UsageError(f"config file {path} {what}; pass --config with the path of a YAML or JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not UTF-8 text") from None
    where = f"config file {path}"
    try:
        data = parse_json(text, where) if path.suffix == ".json" else yaml_load(text, where)
    except json.JSONDecodeError as exc:
        raise UsageError(f"config file {path} could not be parsed: {first_line(exc, None)}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"config file {path} could not be parsed: {yaml_problem(exc)}") from None
    if data is None:
        raise UsageError(f"config file {path} is empty; it needs sections model:, training:, data:")
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping with sections model:, training:, data:")
    return data


# The settings that name where the data comes from: a source named on the command line replaces the
# config file's (a preset's built-in corpus must not win over `data.data_files=my.txt`).
DATA_SOURCE_KEYS = ("data_files", "dataset_name", "sources")


# Keys at the top of a DeepSpeed JSON config: what tells one given as the experiment config
DEEPSPEED_KEYS = frozenset({"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu"})


def load_experiment(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read an experiment file and apply dotted overrides; every error is a one-line `UsageError`. A data
    source named in an override (`DATA_SOURCE_KEYS`) replaces the ones the file names."""
    data = read_config_file(path) if path is not None else {}
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    deepspeed = sorted(DEEPSPEED_KEYS & set(data))
    if deepspeed and not {"model", "training", "data"} & set(data):
        raise UsageError(
            f"{path} is a DeepSpeed config ({', '.join(deepspeed)}), not an experiment: pass it as "
            f"training.deepspeed_config={path} with training.distributed_strategy=deepspeed, beside an experiment "
            "config (--config) that has model:, training: and data:"
        )
    parsed = [parse_override(text) for text in overrides]
    as_written = copy.deepcopy(data)  # the file alone: whether it, or the overrides, made an error
    given: dict[str, dict[str, Any]] = {}
    for (section, key), value in parsed:
        given.setdefault(section, {})[key] = value
    named_sources = {
        config_aliases.spellings_of(section, key)[1]
        for (section, key), _ in parsed
        if config_aliases.spellings_of(section, key)[0] == "data"
    } & set(DATA_SOURCE_KEYS)
    if named_sources and isinstance(data.get("data"), dict):
        for key in list(data["data"]):
            if config_aliases.spellings_of("data", key)[1] in set(DATA_SOURCE_KEYS) - named_sources:
                del data["data"][key]
    for (section, key), value in parsed:
        if isinstance(value, _Nested) and isinstance(data.get(section), dict):  # the file's other entries stay
            value = _merged(data[section].get(key), value)
        try:
            config_aliases.set_override(data, section, key, value)
        except ValueError:
            raise UsageError(f"section {section!r} in {path} must be a mapping") from None
    ours, problems = config_aliases.canonical_experiment(given, ExperimentConfig.known_fields())
    # keys no config knows, and two spellings of one field given different values (the file's own
    # spelling of a field an override sets is replaced by it: `set_override`)
    typos = [problem for problem in problems if problem.startswith("unknown") or problem.endswith("; keep one")]
    if typos:
        raise UsageError(f"command line: {config_aliases.one_message(typos)}")
    try:
        return ExperimentConfig.from_dict(data)
    except ValueError as exc:
        named = _names_an_override(str(exc), given) or _names_an_override(str(exc), ours)  # (ours: `distributed.*`)
        if not named and given:  # a combination (d_model and n_heads): the overrides' if the file alone is valid
            named = _valid(as_written)
        where = "command line: " if named else f"{path}: " if path is not None else ""
        raise UsageError(f"{where}{exc}") from None


def saved_batch_size(saved: Any) -> int | None:
    """`training.batch_size` of an experiment config saved in a folder (meta.json's `config`), or None
    when it records none. The folder may come from elsewhere and hold anything: a value that is not a
    positive integer is a one-line error."""
    training = saved.get("training") if isinstance(saved, dict) else None
    if training is None:
        return None
    if not isinstance(training, dict):
        raise UsageError("the folder's saved config.training is not a mapping; pass --batch-size")
    value = training.get("batch_size")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise UsageError(
            f"the folder's saved training.batch_size is {value!r}, not a positive integer; pass --batch-size"
        )
    return value


def _valid(data: dict) -> bool:
    """Whether `data` (a config file's mapping) makes a valid experiment."""
    try:
        ExperimentConfig.from_dict(data)
    except (ValueError, TypeError):
        return False
    return True


_CLASS_OF_SECTION = {"model": "ModelConfig", "training": "TrainingConfig", "data": "DataConfig"}


def _names_an_override(message: str, given: dict[str, dict[str, Any]]) -> bool:
    """Whether an error names a key the command line set (`data.sources`, `DataConfig.sources`)."""
    for section, keys in given.items():
        for key in keys:
            target, field = config_aliases.spellings_of(section, key)
            names = (f"{section}.{key}", f"{target}.{field}", f"{_CLASS_OF_SECTION.get(target)}.{field}")
            if any(re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message) for name in names):
                return True
    return False
