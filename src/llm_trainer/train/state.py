"""The counters of a run that a checkpoint saves and a resume restores (in train_state.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (including skipped ones)
    tokens_seen: int = 0  # input tokens consumed
    best_val_loss: float | None = None  # the lowest evaluation so far: best_model holds its weights
    best_step: int | None = None
    patience_reference: float | None = None  # early stopping: the last val_loss that improved by more than min_delta
    evals_without_improvement: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient was not finite
    consecutive_bad_steps: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, saved: dict) -> None:
        """Restore in place; keys of other parts of train_state.json (epoch, data, rng, ...) are ignored."""
        fresh = TrainState()
        for field in dataclasses.fields(self):
            setattr(self, field.name, saved.get(field.name, getattr(fresh, field.name)))
