"""Hooks into the training loop: subclass `Callback` and override what you need.

This module sits below the Trainer (which calls the hooks) and below the callbacks the pipeline adds
(`output_folder.RunFilesAtStart`, `plots.PlotsAtEnd`), so it names the Trainer in words only: each hook's
`trainer` is the `train.trainer.Trainer` running the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Callback:
    """`trainer` (the running `Trainer`) gives access to state, model, optimizer; `row`/`metrics` are
    what the backends get. `on_step_end` comes after each logging step (`training.logging_steps`) with
    that step's row, not after every step as in the Hugging Face Trainer: the loop reads values off
    the device only on logging steps, and a row needs them."""

    def on_train_begin(self, trainer: Any) -> None: ...
    def on_step_end(self, trainer: Any, row: dict) -> None: ...
    def on_evaluate(self, trainer: Any, metrics: dict) -> None: ...
    def on_save(self, trainer: Any, path: Path) -> None: ...
    def on_train_end(self, trainer: Any, metrics: dict) -> None: ...
