"""Curriculum: easy rows first, in stages, then the usual shuffled epochs; reproducible from the seed.

`DataConfig.curriculum: [{until_step: N, max_difficulty: X}, ...]`. Until optimizer step N_1 the
batches come from the rows whose difficulty is at most X_1, until N_2 from those at most X_2, and so
on; after the last stage the loader runs its ordinary epochs over every row. Within a stage the
eligible rows are drawn in a shuffled order seeded by (seed, stage, cycle), cycling if the stage
needs more batches than it has rows, so any position can be recomputed: checkpoints resume exactly.

A document's difficulty is its length in tokens (`curriculum_key: length`) or the value of a numeric
column read at prepare time (`curriculum_key: <column>`). A row's difficulty is that of its hardest
document (greedy windows: every document the window touches).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...config import CurriculumStage
from ...errors import UsageError
from ...logs import log
from .loader import BatchLoader, DocumentRows, WindowRows, is_count, to_device


def document_difficulty(offsets: np.ndarray, scores: np.ndarray | None, key: str) -> np.ndarray:
    """(D,) float64 per document: token length, or the column's scores."""
    if key == "length":
        return np.diff(offsets).astype(np.float64)
    if scores is None:
        raise UsageError(f"curriculum_key {key!r} names a column, but the prepared data has no scores; prepare again")
    missing = int(np.isnan(scores).sum())
    if missing:
        raise UsageError(f"curriculum_key {key!r}: {missing} documents have no value (text files carry no columns)")
    return scores


def row_difficulty(rows, offsets: np.ndarray, doc_difficulty: np.ndarray) -> np.ndarray:
    """(R,) difficulty of each row of `rows` (for WindowRows: in its current epoch's layout)."""
    if isinstance(rows, DocumentRows):
        out = np.empty(len(rows))
        for r, segments in enumerate(rows.rows):
            docs = np.searchsorted(offsets, [s for s, _ in segments], side="right") - 1
            out[r] = doc_difficulty[docs].max()
        return out
    if isinstance(rows, WindowRows):
        starts = rows.offset + np.arange(len(rows), dtype=np.int64) * rows.length
        first = np.searchsorted(offsets, starts, side="right") - 1  # (R,)
        last = np.searchsorted(offsets, np.minimum(starts + rows.length, offsets[-1] - 1), side="right") - 1
        return np.array([doc_difficulty[a : b + 1].max() for a, b in zip(first.tolist(), last.tolist())])
    raise TypeError(f"a curriculum needs WindowRows or DocumentRows, got {type(rows).__name__}")


class CurriculumLoader(BatchLoader):
    """A BatchLoader whose first batches follow the curriculum stages; seekable like its parent."""

    def __init__(
        self,
        rows,
        batch_size: int,
        *,
        difficulty: np.ndarray,
        stages: list[CurriculumStage],
        accumulation: int = 1,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        ahead: bool | None = None,
        check_ids: Callable[..., None] | None = None,
    ):
        super().__init__(
            rows,
            batch_size,
            shuffle=True,
            seed=seed,
            drop_last=True,
            rank=rank,
            world_size=world_size,
            device=device,
            accumulation=accumulation,
            ahead=ahead,
            check_ids=check_ids,
        )
        self.stages = stages
        self.stage_ends = [s.until_step * accumulation for s in stages]  # in this rank's batches
        self.eligible = []
        for i, stage in enumerate(stages):
            chosen = np.flatnonzero(difficulty <= stage.max_difficulty)
            if len(chosen) < batch_size:
                raise UsageError(
                    f"curriculum stage {i} (max_difficulty {stage.max_difficulty}) has {len(chosen)} rows, fewer than "
                    f"one batch of {batch_size}; raise its max_difficulty (row difficulties run from "
                    f"{difficulty.min():g} to {difficulty.max():g})"
                )
            self.eligible.append(chosen)
        self.taken = 0  # batches this rank has taken from the curriculum
        self._cycles: dict[tuple[int, int], np.ndarray] = {}
        self._announced: int | None = None  # the stage the last `curriculum:` line named

    def _announce(self) -> None:
        """One line when a stage starts (and when the curriculum is over), so a log shows it applies."""
        stage = next((i for i, end in enumerate(self.stage_ends) if self.taken < end), len(self.stage_ends))
        if stage == self._announced:
            return
        self._announced = stage
        step = self.taken // self.accumulation
        if stage == len(self.stages):
            log(f"curriculum: stages done at step {step}; every row from here, in shuffled epochs")
            return
        rule = self.stages[stage]
        log(
            f"curriculum: stage {stage + 1} of {len(self.stages)} from step {step} to {rule.until_step}: "
            f"{len(self.eligible[stage]):,} of {len(self.rows):,} rows (difficulty <= {rule.max_difficulty:g})"
        )

    def _stage_batch(self) -> np.ndarray:
        stage = next(i for i, end in enumerate(self.stage_ends) if self.taken < end)
        begin = self.stage_ends[stage - 1] if stage else 0
        g = (self.taken - begin) * self.world_size + self.rank  # global batch within the stage
        pool = self.eligible[stage]
        slots = g * self.batch_size + np.arange(self.batch_size)
        cycles, within = np.divmod(slots, len(pool))
        out = np.empty(self.batch_size, dtype=np.int64)
        for cycle in np.unique(cycles).tolist():
            key = (stage, cycle)
            if key not in self._cycles:
                self._cycles = {key: np.random.default_rng([self.seed, 1 + stage, cycle]).permutation(pool)}
            out[cycles == cycle] = self._cycles[key][within[cycles == cycle]]
        return out

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        self._announce()
        while self.taken < self.stage_ends[-1]:
            self.rows.set_epoch(0)  # difficulties were measured on epoch 0's layout
            indices = self._stage_batch()
            self.taken += 1
            start, self.samples = self.samples, self.samples + self.batch_size * self.world_size
            if not self.skipped(start):  # a rewind's skipped range is passed over here too
                return tuple(to_device(a, self.device) for a in self._read(indices))
        return super().next_batch()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "curriculum_samples": self.taken * self.batch_size * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """The curriculum's position in global samples (in this rank's batches, "curriculum_taken", before)."""
        state = dict(state)
        taken = state.pop("curriculum_taken", 0)
        samples = state.pop("curriculum_samples", None)
        super().load_state_dict(state)  # the global batch is checked there
        for name, value in (("curriculum_taken", taken), ("curriculum_samples", samples)):
            if value is not None and not is_count(value):  # (a checkpoint may come from elsewhere)
                raise TypeError(f"{name} {value!r} is not a whole number >= 0")
        self.taken = taken if samples is None else samples // (self.batch_size * self.world_size)
