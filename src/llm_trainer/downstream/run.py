"""One downstream evaluation: tasks loaded (`tasks.py`), our model behind lm-eval's evaluator
(`adapter.py`), lm-eval's own results back, and the few numbers a run logs (`scores`)."""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError
from ..files.disk import check_output_file
from ..logs import warn
from ..tokenizer import say_unseen
from .tasks import load_tasks, quiet_lm_eval, require_lm_eval, sandboxed_templates, split_tasks, task_manager


def check_limit(limit: int | float | None) -> None:
    """None (every item), a count >= 1, or a fraction in (0, 1) of each task's items, as lm-eval takes it."""
    if limit is None:
        return
    if isinstance(limit, bool) or not math.isfinite(limit) or limit <= 0 or (limit >= 1 and limit != int(limit)):
        raise UsageError(f"--limit must be a number of items >= 1 (or a fraction in (0, 1)), got {limit}")


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """lm-eval seeds Python's, numpy's and torch's generators (its reproducible defaults); the training
    around an evaluation must go on drawing as if none had run (dropout, data order, an exact resume)."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def evaluate_tasks(
    model,
    tokenizer,
    tasks,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = 16,
    autocast=None,
    trust_task_code: bool = False,
) -> dict | None:
    """lm-eval's results dict for `tasks` (names, YAML paths, comma-separated or a list) on `model`; every
    rank calls it and each scores its share of the requests (the same requests as one process, few-shot
    examples included); the results on rank 0, None elsewhere. Python named by the task files the user
    gave (`!function`) runs only with `trust_task_code`."""
    require_lm_eval()
    check_limit(limit)
    from lm_eval.evaluator import simple_evaluate

    from .adapter import LLMTrainerLM

    was_training = model.training
    model.eval()
    try:
        with quiet_lm_eval(), sandboxed_templates(), _random_state_kept():  # loading tasks draws too
            loaded = load_tasks(split_tasks(tasks), trust_code=trust_task_code, num_fewshot=num_fewshot)
            lm = LLMTrainerLM(model, tokenizer, batch_size=batch_size, autocast=autocast)
            results = simple_evaluate(
                model=lm,
                tasks=loaded,
                task_manager=task_manager(),  # the tasks are loaded: no index of lm-eval's own tasks (seconds)
                num_fewshot=num_fewshot,
                limit=int(limit) if limit is not None and limit >= 1 else limit,
                bootstrap_iters=0,  # no standard errors: lm-eval's bootstrap takes longer than the evaluation
                log_samples=False,
            )
    finally:
        model.train(was_training)
    if lm.model.rank != 0:  # lm-eval saw one process (it returns the results where LOCAL_RANK is 0)
        return None
    cut = lm.cut_summary()
    if cut is not None:
        warn(f"downstream evaluation: {cut}")
    say_unseen(tokenizer, lm.unseen, "downstream evaluation: the tasks' text")  # their scores mean little
    if lm.no_room:
        warn(
            f"downstream evaluation: {lm.no_room} generate_until request(s) allow as many new tokens as the "
            f"model's context ({lm.max_length}) or more, so only the last token of each prompt was kept (lm-eval's "
            "hf backend refuses them); lower the task's max_gen_toks for a comparable score"
        )
    config = results.setdefault("config", {})  # in the results JSON beside lm-eval's record of the model
    config["max_length"] = lm.max_length
    config["truncated_requests"] = {kind: lm.truncated[kind] for kind in sorted(lm.requests)}
    for kind, count in sorted((+lm.empty).items()):
        warn(
            f"downstream evaluation: {count} {kind} request(s) have a continuation the tokenizer merges into "
            "the context's last token (no tokens of its own); each is scored as log-likelihood 0"
        )
    return results


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-eval's results: `acc`, `acc_norm`, `exact_match`, ... (a metric
    under a filter other than lm-eval's default `none` is `metric/filter`); standard errors left out."""
    out: dict[str, dict[str, float]] = {}
    for task, values in (results or {}).get("results", {}).items():
        row = {}
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if (
                metric.endswith("_stderr")
                or metric == "sample_len"
                or not isinstance(value, (int, float))
                or isinstance(value, bool)
            ):
                continue
            row[metric if filter_name in ("", "none") else f"{metric}/{filter_name}"] = float(value)
        out[task] = row
    return out


def table(results: dict) -> str:
    """lm-eval's own markdown table of the results (task, version, filter, n-shot, metric, value)."""
    from lm_eval.utils import make_table

    return make_table(results)


def check_output(path: str | Path, overwrite: bool) -> Path:
    """Where `--output` will go, refused before any evaluation runs (`files.disk.check_output_file`)."""
    return check_output_file(path, overwrite, example="results.json")


def write_results(results: dict, path: str | Path, overwrite: bool) -> Path:
    """lm-eval's results JSON, as its own CLI writes it, replacing the file at `path` in one step (a
    failed write leaves what was there)."""
    from lm_eval.utils import handle_non_serializable

    from ..files.atomic import write_text

    path = check_output(path, overwrite)
    write_text(path, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return path
