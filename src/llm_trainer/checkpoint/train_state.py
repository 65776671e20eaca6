"""The counters of a run that a checkpoint saves and a resume restores, and the schema of
train_state.json around them: one definition that the Checkpointer writes from and checks a saved
file against (the file may come from a folder we did not write)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (including skipped ones)
    tokens_seen: int = 0  # input tokens consumed, by all ranks together
    best_val_loss: float | None = None  # the lowest evaluation so far: best_model holds its weights
    best_step: int | None = None
    best_metric: float | None = None  # metric_for_best_model's best value, when that is not the mixed val_loss
    patience_reference: float | None = None  # early stopping: the last val_loss that improved by more than min_delta
    evals_without_improvement: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient was not finite
    consecutive_bad_steps: int = 0
    loss_spikes: int = 0  # steps the spike monitor called spikes (train/spikes.py)
    rewinds: int = 0  # times on_loss_spike=rewind went back to a checkpoint
    spike_history: dict | None = None  # the spike monitor's window: {"loss": [...], "grad_norm": [...]}

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, saved: dict) -> None:
        """Restore in place; keys of other parts of train_state.json (epoch, data, rng, ...) are ignored."""
        fresh = TrainState()
        for field in dataclasses.fields(self):
            setattr(self, field.name, saved.get(field.name, getattr(fresh, field.name)))

    def to_file(self, *, epoch: int, data: dict, schedule: dict, scaler: dict | None, rng: dict) -> dict:
        """train_state.json's content: these counters and the parts of the run around them (the
        loader's position, the schedule {"name", "total_steps"}, the fp16 scaler's state or None, and
        the Python and NumPy random states as lists)."""
        content = {
            **self.state_dict(),
            "epoch": epoch,
            "data": data,
            "schedule": schedule,
            "scaler": scaler,
            "rng": rng,
        }
        assert train_state_problem(content) is None, train_state_problem(content)
        return content


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The check of each counter's value, by its annotation in TrainState (a file written before a counter
# existed lacks it: the counter keeps its default). `step` is required.
_COUNTER_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": _is_count,
    "int | None": lambda v: v is None or _is_count(v),
    "float | None": lambda v: v is None or _is_number(v),
    "dict | None": lambda v: (
        v is None or (isinstance(v, dict) and all(isinstance(x, list) and all(map(_is_number, x)) for x in v.values()))
    ),
}
_REQUIRED_COUNTERS = ("step",)

# The other parts of train_state.json, what each must be, and whether a resume can do without it.
_PARTS: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "epoch": (False, _is_count, "epoch"),
    "schedule": (True, lambda v: isinstance(v, dict) and _is_count(v.get("total_steps")), "schedule"),
    "data": (True, lambda v: isinstance(v, dict), "data position"),
    "rng": (
        True,
        lambda v: isinstance(v, dict) and isinstance(v.get("python"), list) and isinstance(v.get("numpy"), list),
        "random-number states",
    ),
    "scaler": (False, lambda v: v is None or isinstance(v, dict), "scaler"),
}


def train_state_problem(saved: Any) -> str | None:
    """None when train_state.json has the fields a resume reads, with their types; else what is wrong."""
    if not isinstance(saved, dict):
        return "train_state.json is not an object"
    for field in dataclasses.fields(TrainState):
        if field.name not in saved:
            if field.name in _REQUIRED_COUNTERS:
                return f"train_state.json is corrupt ({field.name} is missing)"
            continue
        if not _COUNTER_CHECKS[field.type](saved[field.name]):
            return f"train_state.json is corrupt ({field.name} is {saved[field.name]!r})"
    for name, (required, ok, what) in _PARTS.items():
        if name not in saved:
            if required:
                return f"train_state.json is corrupt ({what} is missing)"
            continue
        if not ok(saved[name]):
            return f"train_state.json is corrupt ({what})"
    return None
