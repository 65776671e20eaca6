"""The rows every metric backend receives and metrics.jsonl holds: one type per kind of row.

    TrainRow    every `logging_steps` optimizer steps: loss, lr, grad_norm, tokens, speed
    EvalRow     every evaluation: val_loss, perplexity, how many tokens it covered, and with several
                data sources each one's loss (`eval/<source>/loss`)
    SummaryRow  once, at the end of `train()`
    "downstream" benchmark scores of `training.eval_tasks`: `downstream/<task>/<metric>` (`downstream_row`)
    AlertRow    each alert raised (`training.alerts`, train/alerts.py): event, message, wall-clock time
    "custom"    a user's own values (`Trainer.metrics_tracker.update`): `custom_row`, no fixed schema

Each row is a flat JSON object with `kind` ("train", "eval", "summary") and `step`; optional fields
that have no value (MFU on a CPU, val_loss of a run without validation data) are left out. Readers
call `row_kind(row)`, which also reads files written before rows had a `kind`, and read metrics.jsonl
with `read_rows`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from ..errors import UsageError
from ..limits import parse_json

Kind = Literal["train", "eval", "summary"]


class _Row:
    kind: ClassVar[str]

    def as_dict(self) -> dict:
        """The row as the backends get it: `kind` first; optional fields (default None) only when set."""
        out: dict = {"kind": self.kind}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value is None and field.default is None:
                continue
            out[field.name] = value
        return out


@dataclass(kw_only=True)
class TrainRow(_Row):
    kind: ClassVar[str] = "train"
    step: int
    epoch: int
    loss: float  # mean over the step's target tokens, all ranks
    lr: float
    grad_norm: float  # before clipping
    tokens_seen: int
    skipped_steps: int  # non-finite steps skipped so far
    loss_spikes: int | None = None  # with training.on_loss_spike: spikes so far (train/spikes.py)
    rewinds: int | None = None  # ... and rewinds to a checkpoint
    tokens_per_s: float | None = None  # the speed monitor's window (see train/speed.py)
    samples_per_s: float | None = None
    step_time_s: float | None = None
    data_wait_fraction: float | None = None
    peak_memory_mb: float | None = None
    flops_per_token: float | None = None
    mfu: float | None = None


@dataclass(kw_only=True)
class EvalRow(_Row):
    kind: ClassVar[str] = "eval"
    step: int
    val_loss: float
    perplexity: float
    tokens: int  # target tokens evaluated
    batches: int | None = None  # batches evaluated (training.eval_max_batches caps them)
    batches_total: int | None = None  # batches the validation data holds
    source_losses: dict[str, float] | None = None  # each source's val_loss (data.sources): `eval/<source>/loss`

    def as_dict(self) -> dict:
        out = super().as_dict()
        for name, loss in (out.pop("source_losses", None) or {}).items():
            out[f"eval/{name}/loss"] = loss
        return out


@dataclass(kw_only=True)
class SummaryRow(_Row):
    kind: ClassVar[str] = "summary"
    step: int
    train_runtime_s: float
    tokens_per_s: float  # over this train() call
    tokens_seen: int
    skipped_steps: int
    stopped_early: str | None  # why the run ended before max_steps, or null
    best_val_loss: float | None
    checkpoint: str | None  # the last checkpoint written
    evaluation_s: float  # of train_runtime_s: evaluating (and writing best_model)
    checkpoint_s: float  # of train_runtime_s: the loop waiting for checkpoint saves
    val_loss: float | None = None  # the final evaluation
    perplexity: float | None = None
    time_to_target_s: float | None = None  # seconds from the start of train() to target_val_loss
    stopped_by_signal: str | None = None  # the signal the run stopped for: its name (SIGTERM), or another rank's
    loss_spikes: int | None = None  # with training.on_loss_spike
    rewinds: int | None = None


@dataclass(kw_only=True)
class AlertRow(_Row):
    kind: ClassVar[str] = "alert"
    step: int
    event: str  # loss_spike, rewind, max_rewinds, non_finite, stall, throughput, data_wait, eval_worse,
    # early_stop, checkpoint_failed, bucket_full, disk_full, finished, stopped, crashed
    message: str  # one line, for people
    time: float  # Unix time it was raised


def custom_row(step: int, values: dict) -> dict:
    """A row of a user's own numbers (`{"custom/accuracy": 0.5}`) at `step`."""
    row: dict = {"kind": "custom", "step": int(step)}
    for key, value in values.items():
        if key in row:
            raise ValueError(f"custom metric names must not be {', '.join(row)}; got {key!r}")
        try:
            row[str(key)] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"custom metric {key!r} must be a number, got {value!r}") from None
    return row


def downstream_row(step: int, scores: dict[str, dict[str, float]]) -> dict:
    """Scores {task: {metric: value}} as one row, each under `downstream/<task>/<metric>`, the name the
    backends (TensorBoard, W&B, MLflow) show it by."""
    row: dict = {"kind": "downstream", "step": int(step)}
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            row[f"downstream/{task}/{metric}"] = float(value)
    return row


def row_kind(row: dict) -> Kind | None:
    """ "train", "eval" or "summary"; None for a row of none of them (e.g. a custom one)."""
    kind = row.get("kind")
    if kind in ("train", "eval", "summary"):
        return kind
    if "kind" in row:
        return None
    if row.get("event") == "train_end":  # files written before rows had a kind
        return "summary"
    if "val_loss" in row:
        return "eval"
    if "loss" in row:
        return "train"
    return None


def read_rows(text: str) -> list[dict]:
    """metrics.jsonl's rows, in order: each line one JSON object (parsed within `limits`' bounds); a line
    that is not one (cut short by a kill, being written) is passed over."""
    rows = []
    for line in text.splitlines():
        try:
            row = parse_json(line, "metrics.jsonl")
        except (ValueError, UsageError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_rows_of(path: Path) -> list[dict]:
    """`read_rows` of the metrics.jsonl at `path` ([] when there is none); bytes that are not UTF-8 (a
    line some other writer damaged) read as replacement characters, and their line is passed over."""
    if not path.is_file():
        return []
    return read_rows(path.read_bytes().decode("utf-8", errors="replace"))
