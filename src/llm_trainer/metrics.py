"""Metric backends behind one small interface: `log(row)` and `close()`.

Rows are flat dicts with a `step`; training rows carry loss/lr/grad_norm/tokens, evaluation rows
val_loss/perplexity. Only rank 0 builds loggers; other ranks get none.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

from .errors import UsageError
from .logs import is_main_process, log


class MetricLogger(Protocol):
    def log(self, row: dict) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """metrics.jsonl: one JSON object per line, flushed each row so a crash loses nothing logged."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.handle = open(directory / "metrics.jsonl", "a", encoding="utf-8")

    def log(self, row: dict) -> None:
        self.handle.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class ConsoleLogger:
    """Evaluation results and (without a progress bar) training rows as plain lines."""

    def __init__(self, show_train_rows: bool):
        self.show_train_rows = show_train_rows

    def log(self, row: dict) -> None:
        if "event" in row:  # the end-of-run summary is printed by the trainer itself
            return
        if "val_loss" in row:
            log(f"eval  step {row['step']:>7}  val_loss {row['val_loss']:.4f}  perplexity {row['perplexity']:.2f}")
        elif "loss" in row and self.show_train_rows:
            log(
                f"train step {row['step']:>7}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                f"grad_norm {row.get('grad_norm', float('nan')):.3f}  {row.get('tokens_per_s', 0):,.0f} tok/s"
            )

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, directory: Path, config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("report_to tensorboard needs tensorboard: pip install 'llm-trainer[tracking]'") from None
        self.writer = SummaryWriter(str(directory / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, row: dict) -> None:
        prefix = "eval" if "val_loss" in row else "train"
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                name = {"val_loss": "loss"}.get(key, key)
                self.writer.add_scalar(f"{prefix}/{name}", value, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases; honours WANDB_MODE=offline, so no network is needed unless the user wants it."""

    def __init__(self, directory: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise UsageError("report_to wandb needs wandb: pip install 'llm-trainer[tracking]'") from None
        self.run = wandb.init(dir=str(directory), config=config, project="llm-trainer")

    def log(self, row: dict) -> None:
        prefix = "eval" if "val_loss" in row else "train"
        self.run.log({f"{prefix}/{k}": v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


def build_loggers(report_to: list[str], output_dir: Path, config: dict, progress_bar: bool) -> list[MetricLogger]:
    if not is_main_process():
        return []
    loggers: list[MetricLogger] = []
    for name in report_to:
        if name == "console":
            loggers.append(ConsoleLogger(show_train_rows=not progress_bar))
        elif name == "jsonl":
            loggers.append(JsonlLogger(output_dir))
        elif name == "tensorboard":
            loggers.append(TensorBoardLogger(output_dir, config))
        elif name == "wandb":
            loggers.append(WandbLogger(output_dir, config))
    return loggers


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
