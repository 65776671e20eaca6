"""Downstream evaluation inside a training run (`training.eval_tasks`): which evaluations run the tasks,
the scores every rank agrees on, and which metric `best_model/` follows (`metric_for_best_model`)."""

from __future__ import annotations

import torch

from ..config import LOSS_NAMES, SOURCE_LOSS, is_loss_metric
from ..errors import UsageError
from ..logs import log
from .run import evaluate_tasks, scores


def follows_loss(config) -> bool:
    """Whether best_model/ follows the (mixed) validation loss (else a source's loss or a downstream metric)."""
    return config.metric_for_best_model in LOSS_NAMES


def greater_is_better(config) -> bool:
    """HF's rule: as `greater_is_better` says, else False for a loss and True for any other metric."""
    if config.greater_is_better is not None:
        return config.greater_is_better
    return not is_loss_metric(config.metric_for_best_model)


def is_due(config, step: int, at_end: bool) -> bool:
    if not config.eval_tasks:
        return False
    return at_end or config.eval_tasks_steps is None or step % config.eval_tasks_steps == 0


def check_supported(trainer) -> None:
    """Before training: refuse what downstream evaluation cannot do in this run (a one-line error now,
    not at the first evaluation)."""
    if not trainer.config.eval_tasks:
        return
    if _tokenizer(trainer) is None:
        raise UsageError("training.eval_tasks needs the run's tokenizer: pass tokenizer= to the Trainer")
    from .tasks import load_tasks, split_tasks

    config = trainer.config
    # a wrong name, task code not trusted, a task that cannot run: said now, not at the first evaluation
    load_tasks(split_tasks(config.eval_tasks), trust_code=config.trust_task_code)


def _tokenizer(trainer):
    """The run's tokenizer as ours (the Trainer also takes a tokenizers.Tokenizer or a transformers
    fast tokenizer), or None."""
    from ..tokenizer import Tokenizer

    if isinstance(trainer.tokenizer, Tokenizer):
        return trainer.tokenizer
    text = trainer._tokenizer_json()
    if text is None:
        return None
    from tokenizers import Tokenizer as HFTokenizer

    return Tokenizer(HFTokenizer.from_str(text))


def run_during_training(trainer, step: int) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} on every rank (each rank scores its share of the requests; rank 0's
    results are broadcast), and the one-line summary on the console."""
    tokenizer = _tokenizer(trainer)
    config = trainer.config
    results = evaluate_tasks(
        trainer.parallel.scoring_model(),
        tokenizer,
        config.eval_tasks,
        limit=config.eval_tasks_limit,
        batch_size=config.eval_batch_size or config.batch_size,
        autocast=lambda: trainer.autocast,
        trust_task_code=config.trust_task_code,
    )
    found = [scores(results) if results is not None else None]
    if trainer.dist.world_size > 1:
        torch.distributed.broadcast_object_list(found, src=0)
    values = found[0] or {}
    shown = "  ".join(f"{task}/{metric} {value:.4g}" for task, row in values.items() for metric, value in row.items())
    log(f"step {step} downstream: {shown}")
    return values


def metric_value(config, values: dict[str, dict[str, float]], metrics: dict, sources: list[str] | None) -> float | None:
    """metric_for_best_model's value (None: not measured at this evaluation): a downstream score from
    `values`, or a source's validation loss from the evaluation's `metrics` (`sources`: the names the
    validation split has). A metric that is not reported is a one-line error naming those that are."""
    if source := SOURCE_LOSS.fullmatch(config.metric_for_best_model):
        if source.group(1) not in (sources or []):
            known = ", ".join(f"eval/{name}/loss" for name in sources or []) or "none: the data has one source"
            raise UsageError(
                f"training.metric_for_best_model {config.metric_for_best_model} names no source of the "
                f"validation data (data.sources); known: {known}"
            )
        return metrics.get("source_losses", {}).get(source.group(1))  # None: no tokens of it this time
    _, task, metric = config.metric_for_best_model.split("/", 2)
    if not values:
        return None
    if metric not in values.get(task, {}):
        known = ", ".join(f"downstream/{t}/{m}" for t, row in values.items() for m in row)
        raise UsageError(
            f"training.metric_for_best_model {config.metric_for_best_model} is not measured; known: {known}"
        )
    return values[task][metric]
