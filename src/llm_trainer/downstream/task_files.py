"""What a task YAML the user names may make lm-eval do, read before lm-eval reads it.

lm-eval imports the Python a task YAML names with `!function module.name` (a `module.py` next to the
YAML, else any importable module) while it loads the task, and it loads a metric it does not know
through Hugging Face `evaluate`, which runs that metric's script (from the Hub or a local path). A
task folder someone shares is as untrusted as a checkpoint folder: neither runs unless the user says
so with `--trust_task_code` (`training.trust_task_code: true`). The tasks shipped with this package
and lm-eval's own task YAMLs are ours and lm-eval's code, and run as they are.

Every YAML of a task file or folder (and each file its `include:` chain reaches) is parsed here with
a safe loader that records `!function` tags instead of importing them; a file that does not parse,
is not a mapping, or includes a file that is not there is one line naming it, where lm-eval would
skip it in a folder without a word.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config_loader import yaml_problem
from ..errors import UsageError, first_line
from ..limits import MAX_NESTING, MAX_TASK_FILE_BYTES, check_structure

BUILTIN_DIR = Path(__file__).parent / "tasks"  # the task YAMLs shipped with the package
TRUST_FLAG = "--trust_task_code (training.trust_task_code: true)"


@dataclass(frozen=True)
class FunctionTag:
    """One `!function module.name` of a task YAML: what lm-eval would import, and from which file."""

    spec: str
    yaml_path: Path

    def module_file(self) -> Path | None:
        """The `module.py` next to the YAML lm-eval imports first, or None (it would import `module`
        from the installed packages instead)."""
        module, _, _ = self.spec.rpartition(".")
        path = (self.yaml_path.parent / f"{module.replace('.', '/')}.py").resolve()
        return path if module and path.is_file() else None

    def describe(self) -> str:
        file = self.module_file()
        return f"`!function {self.spec}` runs {file if file else 'the installed module it names'}"


def _loader(yaml_path: Path, tags: list[FunctionTag]) -> type[yaml.SafeLoader]:
    """A safe YAML loader for one file that records its `!function` tags (as their text) in `tags`."""

    class Loader(yaml.SafeLoader):
        pass

    def record(loader: yaml.SafeLoader, node: yaml.Node) -> str:
        spec = str(loader.construct_scalar(node))  # type: ignore[arg-type]
        tags.append(FunctionTag(spec, yaml_path))
        return spec

    Loader.add_constructor("!function", record)
    return Loader


@functools.cache
def trusted_dirs() -> tuple[Path, ...]:
    """Where task YAMLs are ours or lm-eval's own: the tasks shipped here and lm-eval's task folder."""
    import lm_eval.tasks

    return (BUILTIN_DIR.resolve(), Path(lm_eval.tasks.__file__).parent.resolve())


def _is_trusted(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in trusted_dirs())


def _parse(path: Path, tags: list[FunctionTag]) -> dict[str, Any]:
    """One task YAML as a mapping (its `!function` tags recorded), or a UsageError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_TASK_FILE_BYTES:
            raise UsageError(
                f"task file {path} is {size:,} bytes, over the limit of {MAX_TASK_FILE_BYTES:,} for a task YAML"
            )
        text = path.read_text(encoding="utf-8")
        config = yaml.load(text, Loader=_loader(path, tags))  # noqa: S506 (a SafeLoader subclass)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"task file {path} cannot be read ({first_line(exc)})") from None
    except RecursionError:
        raise UsageError(
            f"task file {path} is nested more than {MAX_NESTING} levels deep (the nesting limit)"
        ) from None
    except yaml.YAMLError as exc:
        raise UsageError(f"task file {path} is not valid YAML ({yaml_problem(exc)})") from None
    check_structure(config, f"task file {path}")
    if not isinstance(config, dict):
        raise UsageError(f"task file {path} is not an lm-eval task (a YAML mapping with a `task:` key)")
    return config


def _chain(path: Path, tags: list[FunctionTag], seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """`path` and every file its `include:` chain reaches (resolved as lm-eval resolves them: relative
    to the including file), each with its own parsed mapping."""
    path = path.expanduser().resolve()
    if path in seen:
        raise UsageError(f"task file {seen[-1]} includes {path}, which includes it again (an include cycle)")
    if len(seen) >= MAX_NESTING:
        raise UsageError(f"task file {seen[0]} has includes nested more than {MAX_NESTING} levels deep")
    if not path.is_file():
        where = f"task file {seen[-1]} includes {path}" if seen else f"task file {path}"
        raise UsageError(f"{where}, which is {'not a file' if path.exists() else 'not there'}")
    config = _parse(path, tags)
    files = [(path, config)]
    includes = config.get("include")
    for include in includes if isinstance(includes, list) else [] if includes is None else [includes]:
        if not isinstance(include, str):
            raise UsageError(f"task file {path}: `include:` must name YAML files, got {include!r}")
        target = Path(include) if Path(include).is_absolute() else path.parent / include
        files += _chain(target, tags, (*seen, path))
    return files


def _unknown_metrics(config: dict[str, Any]) -> list[str]:
    """The metrics a task mapping names that lm-eval would load through Hugging Face `evaluate` (a
    metric script: Python from the Hub or a local path), anywhere in it (a group's inline tasks too)."""
    import lm_eval.api.metrics  # noqa: F401  (registers lm-eval's metrics)
    from lm_eval.api.registry import metric_registry

    found: list[str] = []
    stack: list[Any] = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            metrics = item.get("metric_list")
            for entry in metrics if isinstance(metrics, list) else []:
                if not isinstance(entry, dict):
                    continue
                name = entry.get("metric")
                if isinstance(name, str) and (entry.get("hf_evaluate") is True or name not in metric_registry):
                    found.append(name)
            stack.extend(item.values())
    return found


def task_yamls(path: Path) -> list[Path]:
    """The task YAMLs lm-eval reads from a task folder (its own walk, so both see the same files)."""
    from lm_eval.tasks._index import TaskIndex

    return list(TaskIndex._iter_yaml_files(path))


def check_task_files(spec: str, paths: list[Path], trust_code: bool) -> None:
    """Refuse, before lm-eval reads them, task YAMLs (of the file or folder `spec`) that do not parse,
    or that run code from outside this package and lm-eval unless `trust_code`: `!function` tags and
    metrics loaded through Hugging Face `evaluate`. Then lm-eval's own reading of each (its includes
    merged, no function imported) must succeed too: a folder's broken file is named, not skipped."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in paths:
        tags: list[FunctionTag] = []
        files = _chain(path, tags)
        if not trust_code:
            _refuse_code(spec, [tag for tag in tags if not _is_trusted(tag.yaml_path)], files)
        try:
            load_yaml(path, resolve_func=False, recursive=True)
        except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError) as exc:
            raise UsageError(f"task file {path} is not a valid lm-eval task ({first_line(exc)})") from None


def _refuse_code(spec: str, tags: list[FunctionTag], files: list[tuple[Path, dict[str, Any]]]) -> None:
    if tags:
        tag = tags[0]
        raise UsageError(
            f"task {spec}: {tag.yaml_path} would run Python code ({tag.describe()}) when lm-eval loads it; "
            f"task code that is not llm-trainer's or lm-eval's runs only with {TRUST_FLAG}, "
            "if you trust where the task came from"
        )
    for path, config in files:
        if _is_trusted(path):
            continue
        for name in _unknown_metrics(config):
            raise UsageError(
                f"task {spec}: {path} names metric {name!r}, which lm-eval does not have: it would load it "
                f"through Hugging Face evaluate, which runs the metric's script; use one of lm-eval's metrics, "
                f"or pass {TRUST_FLAG} if you trust that script"
            )
