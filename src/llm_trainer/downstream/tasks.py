"""Which lm-evaluation-harness tasks `--tasks` / `training.eval_tasks` name, loaded before any model runs.

A task is named three ways: one of the tasks shipped with this package (`BUILTIN`, data in the package,
read offline), an lm-eval task name (`arc_easy`; its data comes from the Hugging Face Hub or its cache),
or a path to a task YAML file or a folder of them (the user's own tasks; lm-eval reads `data_files`
relative to the working directory). A spec is a path only when written as one (`./x`, `/x`, `x.yaml`),
never because a folder of that name exists. A task file or folder is read first by `task_files.py`:
the Python it names runs only when the user trusts it. Each is loaded here, one by one, and checked
(`check_task`), so a mistake is one line naming the task: an unknown name with the closest known ones,
a Hub dataset that cannot be reached with how to point the task at local files instead, a setting
lm-eval would only trip over mid-evaluation.

lm-eval indexes its ~15,000 task names in seconds, so the index is built only when a name is not ours.
"""

from __future__ import annotations

import collections
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

from ..errors import UsageError, first_line
from ..hf.hub import cache_only_while_hub_unreachable
from ..limits import MAX_GEN_TOKS, MAX_TASK_REPEATS, check_count
from .task_files import BUILTIN_DIR, check_task_files, task_yamls

BUILTIN = ("llmt_choice", "llmt_cloze", "llmt_rolling", "llmt_exact")
MAX_FEWSHOT = 10_000  # few-shot examples in one prompt (each task's data bounds it further)
MAX_TASK_SPECS = 1_000  # names and paths in one --tasks (a group or a folder stands for many tasks)
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
    repository" outside one). Its record of the environment (torch's report: `pip list`, `lscpu` and more,
    a second or two on every rank) is asked for once per process, not at every evaluation of a run.
    Its warnings and errors still show."""
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.evaluator
    import torch.utils.collect_env

    swaps = [
        (lm_eval.api.task, "tqdm", _no_bar),
        (lm_eval.api.model, "tqdm", _no_bar),
        (lm_eval.evaluator, "get_git_commit_hash", _git_commit),
        (torch.utils.collect_env, "get_pretty_env_info", _once(torch.utils.collect_env.get_pretty_env_info)),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, value in swaps:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def sandboxed_templates() -> Iterator[None]:
    """While tasks load and evaluate: their prompt templates (`doc_to_text: "{{ ... }}"` and the other
    `doc_to_*` fields) rendered in Jinja's sandbox. lm-eval renders them with a plain Jinja environment,
    where a template reaches Python itself (`{{ cycler.__init__.__globals__.os.popen(...) }}`): a task
    YAML would run code without any `!function`. In the sandbox such an access is a template error."""
    import lm_eval.utils

    saved = lm_eval.utils.env
    lm_eval.utils.env = _sandbox(saved)
    try:
        yield
    finally:
        lm_eval.utils.env = saved


@functools.cache
def _sandbox(plain):
    """A sandboxed Jinja environment with the settings and filters of lm-eval's environment `plain`."""
    from jinja2.sandbox import SandboxedEnvironment

    if isinstance(plain, SandboxedEnvironment):
        return plain
    env = SandboxedEnvironment(
        loader=plain.loader, undefined=plain.undefined, keep_trailing_newline=plain.keep_trailing_newline
    )
    env.filters.update(plain.filters)
    return env


def _no_bar(*args, **kwargs):
    """tqdm, hidden whatever the caller asks (lm-eval passes `disable=False` where it passes anything)."""
    from tqdm import tqdm

    return tqdm(*args, **{**kwargs, "disable": True})


_ENVIRONMENT: dict[str, str] = {}  # torch's report of this process's environment, once asked


def _once(report):
    """`report()` (torch's `get_pretty_env_info`) asked the first time only; its text kept for the process."""

    def kept() -> str:
        if "report" not in _ENVIRONMENT:
            _ENVIRONMENT["report"] = report()
        return _ENVIRONMENT["report"]

    return kept


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
    if len(names) > MAX_TASK_SPECS:
        raise UsageError(
            f"--tasks names {len(names):,} tasks, over the limit of {MAX_TASK_SPECS:,}; "
            "name a group or a folder of task YAMLs instead"
        )
    twice = sorted(name for name, count in collections.Counter(names).items() if count > 1)
    if twice:
        raise UsageError(f"--tasks names {', '.join(twice[:5])} more than once; name each task once")
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
    """A path is written as one (`./x`, `/x`, `dir/x`, or a `.yaml`/`.yml` file); any other spec is a
    task name, even where a folder of that name is in the working directory."""
    return spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec


def load_tasks(specs: list[str], *, trust_code: bool = False, num_fewshot: int | None = None) -> list:
    """lm-eval Task (and Group) objects for each spec, in order; a UsageError naming the first one that
    cannot be loaded or would not evaluate (see `check_task`), with `num_fewshot` examples if given.
    A task file or folder's YAMLs are read first (`task_files`): their code runs only if `trust_code`."""
    require_lm_eval()
    if num_fewshot is not None:
        check_count(num_fewshot, "--num_fewshot", MAX_FEWSHOT, minimum=0)
    loaded = []
    with sandboxed_templates():
        for spec in specs:
            if spec in BUILTIN:
                found = _load(_manager(False), builtin_config(spec), spec)
            elif _is_path(spec):
                found = _load_path(spec, trust_code)
            else:
                found = _load_name(spec)
            for item in found:
                for task in item.get_all_tasks() if hasattr(item, "get_all_tasks") else [item]:
                    check_task(task, spec, num_fewshot)
            loaded += found
    return loaded


def _load_path(spec: str, trust_code: bool) -> list:
    """The tasks of a task YAML file, or of every task YAML in a folder."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise UsageError(f"task file or folder {spec} not found")
    if not path.is_dir():
        check_task_files(spec, [path], trust_code)
        return _load(_manager(False), str(path.resolve()), spec)
    check_task_files(spec, task_yamls(path.resolve()), trust_code)
    manager = _manager(False, str(path.resolve()))
    names = manager.all_subtasks
    if not names:
        raise UsageError(f"{spec} holds no lm-eval task YAML (a file with a `task:` key)")
    loaded = []
    for name in names:
        loaded += _load(manager, name, name)
    return loaded


def _load_name(spec: str) -> list:
    """One of lm-eval's own tasks (or groups) by name."""
    manager = _manager(True)
    if spec not in manager.all_tasks:
        close = difflib.get_close_matches(spec[:200], [*BUILTIN, *manager.all_tasks], n=3, cutoff=0.6)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise UsageError(
            f"unknown task {spec[:200]!r}{hint} (lm-eval task names, one of {', '.join(BUILTIN)}, "
            "or a task YAML file or folder: ./NAME for a folder in the working directory)"
        )
    return _load(manager, spec, spec)


def _load(manager, spec, name: str) -> list:
    import jinja2
    from datasets.exceptions import DatasetsError

    hub = contextlib.nullcontext() if name in BUILTIN else cache_only_while_hub_unreachable()
    unreachable = None
    try:
        with hub as unreachable:  # a Hub that cannot be reached: the cache only, not tens of seconds of retries
            found = manager.load([spec])
    except (ConnectionError, TimeoutError) as exc:
        why = f"the Hub: {unreachable}; not in the cache either" if unreachable else first_line(exc)
        raise UsageError(f"task {name}: its dataset cannot be reached ({why}); {OFFLINE_HINT}") from None
    except OSError as exc:  # datasets: "not cached", "not found on the Hub" ...
        raise UsageError(f"task {name}: its dataset cannot be read ({first_line(exc)}); {OFFLINE_HINT}") from None
    except (StopIteration, DatasetsError) as exc:  # datasets: an empty data file, a line that is not JSON
        reason = "no records" if isinstance(exc, StopIteration) else first_line(exc.__cause__ or exc)
        raise UsageError(
            f"task {name}: its data cannot be read ({reason}); check the files its dataset_kwargs.data_files name"
        ) from None
    except (ImportError, AttributeError) as exc:  # a trusted `!function` naming a module or function not there
        raise UsageError(f"task {name}: a `!function` of it cannot be imported ({first_line(exc)})") from None
    except jinja2.TemplateError as exc:  # lm-eval renders the first document's prompt as it builds a task
        raise UsageError(f"task {name}: a prompt template fails on its first document ({first_line(exc)})") from None
    except (KeyError, ValueError, TypeError, IndexError, SyntaxError, yaml.YAMLError) as exc:
        # SyntaxError: choices rendered as text that is not a Python list (lm-eval reads them with literal_eval)
        raise UsageError(f"task {name} is not a valid lm-eval task ({type(exc).__name__}: {first_line(exc)})") from None
    groups = list(found["groups"].values())
    in_groups = {task.task_name for group in groups for task in group.get_all_tasks()}
    return [*groups, *(task for key, task in found["tasks"].items() if key not in in_groups)]


def check_task(task, spec: str, num_fewshot: int | None) -> None:
    """Refuse, before any model runs, a loaded task lm-eval would fail on (or build without bound for)
    only once it evaluates: `repeats` and `generation_kwargs` of the wrong type or past their limits,
    multiple choice without `doc_to_choice`, more few-shot examples than its data holds. (lm-eval
    renders the first document's prompt, target and choices as it builds the task: see `_load`.)"""
    config = task.config
    where = f"task {task.task_name}" + (f" ({spec})" if spec != task.task_name else "")
    check_count(getattr(config, "repeats", 1), f"{where}: repeats", MAX_TASK_REPEATS)
    if getattr(config, "output_type", None) == "generate_until":
        _check_generation(getattr(config, "generation_kwargs", None), where)
    if getattr(config, "output_type", None) == "multiple_choice" and getattr(config, "doc_to_choice", None) is None:
        raise UsageError(f"{where}: output_type multiple_choice needs doc_to_choice (the choices of each document)")
    shots = num_fewshot if num_fewshot is not None else getattr(config, "num_fewshot", None)
    if shots:
        check_count(shots, f"{where}: num_fewshot", MAX_FEWSHOT, minimum=0)
        _check_fewshot(task, shots, where)


def _check_generation(kwargs: Any, where: str) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise UsageError(f"{where}: generation_kwargs must be a mapping, got {kwargs!r}")
    until = kwargs.get("until", [])
    if not (isinstance(until, str) or (isinstance(until, list) and all(isinstance(s, str) for s in until))):
        raise UsageError(f"{where}: generation_kwargs.until must be a string or a list of strings, got {until!r}")
    if "max_gen_toks" in kwargs:
        check_count(kwargs["max_gen_toks"], f"{where}: generation_kwargs.max_gen_toks", MAX_GEN_TOKS)


def _check_fewshot(task, shots: int, where: str) -> None:
    """lm-eval samples few-shot examples without replacement (one more, then drops the document asked
    about, where they come from the split it evaluates)."""
    docs = task.fewshot_docs()
    if docs is None:
        return
    fewshot_split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
    needed = shots + (
        1 if fewshot_split is not None and fewshot_split == getattr(task.config, "test_split", None) else 0
    )
    if needed > len(docs):
        raise UsageError(
            f"{where}: {shots} few-shot examples asked for, but its few-shot split holds {len(docs)} documents "
            f"(at most {len(docs) - needed + shots} can be drawn); lower --num_fewshot or the task's num_fewshot"
        )
