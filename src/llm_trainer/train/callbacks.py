"""Hooks into the training loop: subclass `Callback` and override what you need."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .trainer import Trainer


class Callback:
    """`trainer` gives access to state, model, optimizer; `row`/`metrics` are what the backends get."""

    def on_train_begin(self, trainer: Trainer) -> None: ...
    def on_step_end(self, trainer: Trainer, row: dict) -> None: ...
    def on_evaluate(self, trainer: Trainer, metrics: dict) -> None: ...
    def on_save(self, trainer: Trainer, path: Path) -> None: ...
    def on_train_end(self, trainer: Trainer, metrics: dict) -> None: ...
