"""Which lm-evaluation-harness tasks `--tasks` / `training.eval_tasks` name, loaded before any model runs.

A task is named three ways: one of the tasks shipped with this package (`BUILTIN`, data in the package,
read offline), an lm-eval task name (`arc_easy`; its data comes from the Hugging Face Hub or its cache),
or a path to a task YAML file or a folder of them (the user's own tasks; lm-eval reads `data_files`
relative to the working directory). Each is loaded here, one by one, so a mistake is one line naming the
task: an unknown name with the closest known ones, a Hub dataset that cannot be reached with how to
point the task at local files instead.

lm-eval indexes its ~15,000 task names in seconds, so the index is built only when a name is not ours.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError
from ..hf.hub import cache_only_while_hub_unreachable

BUILTIN_DIR = Path(__file__).parent / "tasks"
BUILTIN = ("llmt_choice", "llmt_cloze", "llmt_rolling", "llmt_exact")
OFFLINE_HINT = (
    "to run it offline, save its data as JSONL and point a task YAML at it "
    "(dataset_path: json, dataset_kwargs: {data_files: {test: FILE.jsonl}}), then pass that YAML to --tasks"
)


def require_lm_eval():
    """The lm_eval module, or a one-line UsageError saying how to install it."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401  (the adapter's base class; fails where lm_eval is half-installed)
    except ImportError:
        raise UsageError("downstream evaluation needs lm-eval: pip install 'llm-trainer[eval]'") from None
    import datasets

    datasets.disable_progress_bars()  # "Generating test split" for every small task file
    for name in ("lm_eval", "lm-eval", "lm_eval.api.task", "lm_eval.evaluator"):  # its per-task INFO lines
        logging.getLogger(name).setLevel(logging.WARNING)
    return lm_eval


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """While lm-eval evaluates: no progress bars from its loops over documents and requests (one bar per
    task and request type at every evaluation, between the training log's lines), and its record of the
    working directory's git commit asked of git quietly (lm-eval lets git print "fatal: not a git
    repository" outside one). Its warnings and errors still show."""
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.evaluator

    swaps = [
        (lm_eval.api.task, "tqdm", _no_bar),
        (lm_eval.api.model, "tqdm", _no_bar),
        (lm_eval.evaluator, "get_git_commit_hash", _git_commit),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, value in swaps:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _no_bar(*args, **kwargs):
    """tqdm, hidden whatever the caller asks (lm-eval passes `disable=False` where it passes anything)."""
    from tqdm import tqdm

    return tqdm(*args, **{**kwargs, "disable": True})


def _git_commit() -> str | None:
    """What lm-eval records as `git_hash`: the working directory's commit, or None outside a repository."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0:
        return done.stdout.strip()
    return get_commit_from_path(os.getcwd())


def task_manager():
    """lm-eval's task manager for tasks loaded already (no index of lm-eval's own tasks)."""
    return _manager(False)


def split_tasks(tasks: str | list[str] | tuple[str, ...]) -> list[str]:
    """`"a,b"` or `["a", "b"]` -> `["a", "b"]` (a comma-separated string, as the CLI takes it)."""
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [item.strip() for item in items if item and item.strip()]
    if not names:
        raise UsageError("--tasks names no task; give lm-eval task names or task YAML paths, comma-separated")
    return names


def builtin_config(name: str) -> dict[str, Any]:
    """A shipped task's YAML as a config dict, its data files made absolute (inside the package)."""
    config = yaml.safe_load((BUILTIN_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(BUILTIN_DIR / file) for split, file in files.items()}
    return config


@functools.cache
def _manager(include_defaults: bool, include_path: str | None = None):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def _is_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or "/" in spec or Path(spec).is_dir()


def load_tasks(specs: list[str]) -> list:
    """lm-eval Task (and Group) objects for each spec, in order; a UsageError naming the first one that
    cannot be loaded."""
    require_lm_eval()
    loaded = []
    for spec in specs:
        if spec in BUILTIN:
            loaded += _load(_manager(False), builtin_config(spec), spec)
        elif _is_path(spec):
            path = Path(spec)
            if not path.exists():
                raise UsageError(f"task file or folder {spec} not found")
            if path.is_dir():
                manager = _manager(False, str(path.resolve()))
                names = manager.all_subtasks
                if not names:
                    raise UsageError(f"{spec} holds no lm-eval task YAML (a file with a `task:` key)")
                for name in names:
                    loaded += _load(manager, name, name)
            else:
                loaded += _load(_manager(False), str(path.resolve()), spec)
        else:
            manager = _manager(True)
            if spec not in manager.all_tasks:
                close = difflib.get_close_matches(spec, [*BUILTIN, *manager.all_tasks], n=3, cutoff=0.6)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise UsageError(
                    f"unknown task {spec!r}{hint} (lm-eval task names, one of {', '.join(BUILTIN)}, "
                    "or a task YAML file or folder)"
                )
            loaded += _load(manager, spec, spec)
    return loaded


def _load(manager, spec, name: str) -> list:
    hub = contextlib.nullcontext() if name in BUILTIN else cache_only_while_hub_unreachable()
    unreachable = None
    try:
        with hub as unreachable:  # a Hub that cannot be reached: the cache only, not tens of seconds of retries
            found = manager.load([spec])
    except (ConnectionError, TimeoutError) as exc:
        why = f"the Hub: {unreachable}; not in the cache either" if unreachable else _first_line(exc)
        raise UsageError(f"task {name}: its dataset cannot be reached ({why}); {OFFLINE_HINT}") from None
    except OSError as exc:  # datasets: "not cached", "not found on the Hub" ...
        raise UsageError(f"task {name}: its dataset cannot be read ({_first_line(exc)}); {OFFLINE_HINT}") from None
    except (KeyError, ValueError, TypeError, yaml.YAMLError) as exc:
        raise UsageError(f"task {name} is not a valid lm-eval task ({_first_line(exc)})") from None
    groups = list(found["groups"].values())
    in_groups = {task.task_name for group in groups for task in group.get_all_tasks()}
    return [*groups, *(task for key, task in found["tasks"].items() if key not in in_groups)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
