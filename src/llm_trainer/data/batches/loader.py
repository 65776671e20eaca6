"""Fixed-length training rows over memory-mapped tokens, and a batch loader that can seek.

A row is `max_length + 1` tokens: inputs are its first `max_length`, targets its last `max_length`
(so every token is a target once). Padding targets are -100 and leave the loss.

Row layouts:
  greedy     documents (each ending in end-of-text) concatenated and cut into windows; each epoch
             shifts the window grid by a seeded offset so the model sees new boundaries
  first_fit  first-fit-decreasing bins: documents are never split unless longer than a row
  unpacked   one document (or a row-sized piece of a long one) per row, padded

Document boundaries: rows built with `eot_id` (greedy) or `document_ids=True` (the others) return a
third array, the document index of each input token within its row (an end-of-text token belongs to
the document it ends; each padding token is its own document). The model turns it into a
block-diagonal causal mask and positions that restart per document (`Transformer.forward(doc_ids=)`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from ...errors import UsageError
from ...limits import check_skip
from ...logs import warn
from ...model import IGNORE_INDEX
from .ahead import BatchesAhead, reads_ahead
from .packing import document_pieces, first_fit_decreasing
from .stream import READ_AHEAD, ChunkedTokens, block_order, schedule


def document_ids(x: np.ndarray, eot_id: int) -> np.ndarray:
    """(B, L) inputs -> (B, L) int64: how many documents end before each token in its row."""
    ends = x == eot_id
    return (np.cumsum(ends, axis=1) - ends).astype(np.int64)  # exclusive: end-of-text stays with its document


class WindowRows:
    """Greedy packing: row i of epoch e is tokens[offset_e + i*L : offset_e + i*L + L + 1].

    eot_id: when set, `batch` also returns document ids (for document masking).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        length: int,
        *,
        seed: int | None = None,
        keep_partial: bool = False,
        eot_id: int | None = None,
    ):
        self.tokens, self.length, self.seed, self.keep_partial = tokens, length, seed, keep_partial
        self.eot_id = eot_id
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        n = len(self.tokens)
        self.offset = 0 if self.seed is None else int(np.random.default_rng([self.seed, epoch]).integers(self.length))
        if n - self.offset <= self.length:
            self.offset = 0
        usable = n - 1 - self.offset
        self.count = max(0, -(-usable // self.length) if self.keep_partial else usable // self.length)

    def __len__(self) -> int:
        return self.count

    def token_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """The first and last token position of each row of this epoch (what a streamed row needs)."""
        first = self.offset + np.arange(self.count, dtype=np.int64) * self.length
        return first, np.minimum(first + self.length, len(self.tokens) - 1)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """(inputs, targets) each (B, L) int64, plus (B, L) document ids when eot_id is set."""
        L = self.length
        starts = self.offset + np.asarray(indices, dtype=np.int64) * L  # (B,)
        if not self.keep_partial:
            rows = self.tokens[starts[:, None] + np.arange(L + 1)].astype(np.int64)  # (B, L+1)
            x, y = rows[:, :-1], rows[:, 1:]
        else:
            x = np.zeros((len(starts), L), dtype=np.int64)
            y = np.full((len(starts), L), IGNORE_INDEX, dtype=np.int64)
            for r, s in enumerate(starts):
                row = self.tokens[s : s + L + 1].astype(np.int64)
                x[r, : len(row) - 1] = row[:-1]
                y[r, : len(row) - 1] = row[1:]
        if self.eot_id is None:
            return x, y
        return x, y, document_ids(x, self.eot_id)


class DocumentRows:
    """Rows made of whole documents (first_fit) or one document piece each (unpacked), padded.

    pad_id must be the end-of-text id when document_ids=True (padding then reads as one-token documents).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        length: int,
        *,
        pack: bool,
        pad_id: int,
        document_ids: bool = False,
    ):
        self.tokens, self.length, self.pad_id, self.document_ids = tokens, length, pad_id, document_ids
        pieces = document_pieces(offsets, length + 1)  # (N, 2) start, end
        self.rows = first_fit_decreasing(pieces, length + 1) if pack else [[p] for p in pieces.tolist()]

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self.rows)

    def token_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """The first and last token position of each row (its first and last pieces': a first-fit row's
        pieces between may lie anywhere, and are read when the row is)."""
        first = np.array([row[0][0] for row in self.rows], dtype=np.int64)
        return first, np.array([row[-1][1] - 1 for row in self.rows], dtype=np.int64)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """(inputs, targets) each (B, L) int64, plus (B, L) document ids when document_ids is set."""
        L = self.length
        x = np.full((len(indices), L), self.pad_id, dtype=np.int64)
        y = np.full((len(indices), L), IGNORE_INDEX, dtype=np.int64)
        for r, i in enumerate(indices):
            row = np.concatenate([self.tokens[s:e] for s, e in self.rows[i]]).astype(np.int64)
            x[r, : len(row) - 1] = row[:-1]
            y[r, : len(row) - 1] = row[1:]
        if not self.document_ids:
            return x, y
        return x, y, document_ids(x, self.pad_id)

    def padding_fraction(self) -> float:
        used = sum(e - s for row in self.rows for s, e in row)
        return 1.0 - used / max(1, len(self.rows) * (self.length + 1))


CHUNK_ORDER = "chunk-window"  # a saved position's order over chunked tokens: `stream.block_order`'s
ORDER_NAMES = {None: "a global permutation", CHUNK_ORDER: "by chunks", "chunks": "by chunks in groups of 4"}


class BatchLoader:
    """Batches of rows in a seeded order per epoch, with a position that checkpoints can save and seek to.

    The order is a function of the seed and the epoch only: global sample i of an epoch is row
    `permutation[i]` (rows over `ChunkedTokens`, prepared in object storage, take `stream.block_order`
    instead, and the chunks of the coming samples are read ahead). Each rank takes every world_size-th
    batch of it, so no row is read twice, and an optimizer step (`accumulation` batches per rank) takes
    the next `global_batch` samples whatever the split into processes and micro-batches. The saved
    position is in global samples, so a checkpoint resumes on any number of processes that keeps the
    global batch.

    `ahead` (default: on a GPU): the coming batches are read, and copied to the device, on a worker
    thread while the step runs (`ahead.BatchesAhead`); the batches and the saved position are the same.
    `check_ids`: called with each batch's (inputs, targets) as read, to refuse ids the model has no row
    for (`PreparedData.check_ids`).
    """

    def __init__(
        self,
        rows,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        accumulation: int = 1,
        ahead: bool | None = None,
        check_ids: Callable[..., None] | None = None,
    ):
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.check_ids = check_ids
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.accumulation = accumulation  # batches per rank per optimizer step (the Trainer sets it)
        self.device = torch.device(device)
        self.epoch, self.position = 0, 0  # position: batches this rank has taken in this epoch
        self.samples = 0  # global sample index: rows all ranks have drawn since the run began (skipped ones too)
        # [start, end) global sample ranges never trained on (a rewind's): sorted and disjoint (`merged_ranges`)
        self.skip: list[tuple[int, int]] = []
        self._order: np.ndarray | None = None
        self._plan: tuple[np.ndarray, np.ndarray] | None = None  # streamed tokens: (sample, chunk) first needs
        # the next step's batches, read and copied to the device on a worker thread while this step runs
        self._ahead = BatchesAhead(self.device) if reads_ahead(ahead, self.device) else None
        if self.batches_per_epoch() == 0:
            raise UsageError(
                f"not enough data for one batch: {len(rows)} rows of {getattr(rows, 'length', '?')} tokens, "
                f"batch_size {batch_size} x world size {world_size}; use more data or a smaller batch/max_length"
            )

    @property
    def reads_ahead(self) -> bool:
        """Whether the coming batches are read on a worker thread (the run's start line says so)."""
        return self._ahead is not None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: batch_size x accumulation x world_size."""
        return self.batch_size * self.accumulation * self.world_size

    def batches_per_epoch(self) -> int:
        """This rank's batches per epoch; with drop_last, whole optimizer steps only, so an epoch ends at
        the same sample on any number of processes."""
        n = len(self.rows)
        if self.drop_last:
            return n // self.global_batch * self.accumulation
        return -(-n // (self.batch_size * self.world_size))

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            self._drop_ahead()  # the rows change their layout next
            self.rows.set_epoch(self.epoch)
            n = len(self.rows)
            tokens = getattr(self.rows, "tokens", None)
            if not self._chunked():
                self._order = (
                    np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
                )
                return self._order
            first, last = (bound // tokens.chunk_tokens for bound in self.rows.token_bounds())
            self._order = block_order(first, tokens.n_chunks, self.seed, self.epoch) if self.shuffle else np.arange(n)
            self._plan = schedule(self._order, first, last, tokens.n_chunks) if tokens.whole is None else None
        return self._order

    def state_dict(self) -> dict:
        """The position in world-size-independent units: global samples taken in this epoch
        (`epoch_samples`) and since the run began (`samples`, which `skip` ranges count in)."""
        return {
            "epoch": self.epoch,
            "epoch_samples": self.position * self.batch_size * self.world_size,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "row_length": self.rows.length,
            "samples": self.samples,
            "skip": [list(r) for r in self.skip],
            **({"order": CHUNK_ORDER} if self._chunked() else {}),
        }

    def _chunked(self) -> bool:
        """Whether the rows read `ChunkedTokens` (prepared in object storage): the block order."""
        return isinstance(getattr(self.rows, "tokens", None), ChunkedTokens)

    def load_state_dict(self, state: dict) -> None:
        """Seek to a saved position in O(1). The global batch must be the one the position was saved
        with; a position saved as this rank's batches (no "epoch_samples") needs the same world size."""
        if state.get("row_length", self.rows.length) != self.rows.length:  # (saved since rows recorded it)
            raise ValueError(
                f"the checkpoint's rows were {state['row_length']} tokens long, this run's are {self.rows.length} "
                "(model.max_seq_len, or data.max_length): its data position would name other rows; resume with "
                f"{state['row_length']}, or start a new run from its weights (model.init_from=<checkpoint>)"
            )
        if "epoch_samples" in state:
            saved, done = state.get("global_batch", self.global_batch), state["epoch_samples"]
            if saved != self.global_batch:
                raise ValueError(_global_batch_changed(saved, self))
            per_batch = self.batch_size * self.world_size
            if type(done) is not int or done < 0 or done % per_batch:
                raise TypeError(f"epoch_samples {done!r} is not a whole number of batches of {per_batch}")
            position = done // per_batch
        elif state.get("world_size", 1) != self.world_size:
            raise ValueError(
                f"the checkpoint's data position is for world size {state.get('world_size')}, this run has "
                f"{self.world_size}; resume with the same number of processes"
            )
        else:
            position = state["position"]
        for name, value in (("epoch", state["epoch"]), ("seed", state["seed"]), ("position", position)):
            if not is_count(value):  # (a checkpoint may come from elsewhere)
                raise TypeError(f"{name} {value!r} is not a whole number >= 0")
        samples, skip = state.get("samples", 0), state.get("skip", [])
        ranges = isinstance(skip, list) and all(
            isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r) and 0 <= r[0] < r[1] for r in skip
        )
        if not is_count(samples) or not ranges:
            raise TypeError(f"samples {samples!r}, skip {skip!r}")
        check_skip(skip, samples, self.batch_size * self.world_size)
        saved_order, order = state.get("order"), CHUNK_ORDER if self._chunked() else None
        if self.shuffle and saved_order != order:
            cause = (
                "an earlier version's order"
                if saved_order is not None and order is not None
                else "data.cache_dir changed between a URL and a folder"
            )
            warn(
                f"the checkpoint's data order was {ORDER_NAMES.get(saved_order, repr(saved_order))}, this run's is "
                f"{ORDER_NAMES[order]} ({cause}): the rest of the epoch follows this run's order"
            )
        if self.shuffle and state["seed"] != self.seed:
            warn(
                f"training.seed is {self.seed}, the checkpoint's {state['seed']}: the resume keeps the checkpoint's "
                "data order (and random streams); a run of another seed starts anew (model.init_from=<checkpoint>)"
            )
        self._drop_ahead()
        if getattr(self.rows, "seed", None) == self.seed:  # windows placed by the run's seed: by the checkpoint's
            self.rows.seed = state["seed"]
        self.epoch, self.position, self.seed, self._order = state["epoch"], position, state["seed"], None
        self.samples, self.skip = samples, merged_ranges([(a, b) for a, b in skip])

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """The next (inputs, targets[, doc_ids]), each (B, L) int64 on the loader's device; rolls over epochs.
        Batches that start inside a `skip` range are passed over."""
        while True:
            self._epoch_order()  # lay the rows out for this epoch first: their count can change with the epoch
            taken = next(self._coming(), None)
            if taken is not None:
                break
            remaining = max(0, self.batches_per_epoch() - self.position)  # all skipped: counted, not read
            self.samples += remaining * self.batch_size * self.world_size
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        self.position, self.samples, global_batch = taken
        if self._plan is not None:  # the chunks first needed from this batch on, fetched in the background
            samples, chunks = self._plan
            first = np.searchsorted(samples, global_batch * self.batch_size)
            self.rows.tokens.read_ahead(chunks[first : first + READ_AHEAD])
        batch = self._ahead.take(self._key(global_batch)) if self._ahead is not None else None
        if batch is None:
            batch = tuple(to_device(a, self.device) for a in self._read(self._indices(global_batch)))
        if self._ahead is not None:
            self._queue_coming()
        return batch

    def _coming(self):
        """(position, samples, global batch) after each batch this rank takes next in this epoch, in
        order, passing over skipped ones. Reads the loader's state and changes nothing."""
        per, end = self.batch_size * self.world_size, self.batches_per_epoch()
        position, samples = self.position, self.samples
        while position < end:
            start, global_batch = samples, position * self.world_size + self.rank
            position, samples = position + 1, samples + per
            if not self.skipped(start):
                yield position, samples, global_batch

    def _indices(self, global_batch: int) -> np.ndarray:
        return self._epoch_order()[global_batch * self.batch_size : (global_batch + 1) * self.batch_size]

    def _key(self, global_batch: int) -> tuple[int, int, int]:
        """What names a batch's rows: the epoch's order (seed, epoch) and the batch's place in it."""
        return self.seed, self.epoch, global_batch

    def _queue_coming(self) -> None:
        """Queue this epoch's coming batches up to the next step's and one more; the queue holds those
        already queued as its first entries."""
        queued = set(self._ahead.keys())
        for _, _, global_batch in itertools.islice(self._coming(), self.accumulation + 1):
            if self._key(global_batch) not in queued:
                self._ahead.submit(self._key(global_batch), partial(self._read, self._indices(global_batch)))

    def _read(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """The rows at these indices, as `rows.batch` gives them, checked."""
        batch = self.rows.batch(indices)
        if self.check_ids is not None:
            self.check_ids(*batch[:2])
        return batch

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.drop()

    def skipped(self, sample: int) -> bool:
        """Whether the batch starting at this global sample index is in a skipped range."""
        at = bisect.bisect_right(self.skip, (sample, math.inf)) - 1  # the last range starting at or before it
        return at >= 0 and sample < self.skip[at][1]

    def __iter__(self):
        """One pass over the data in order (for evaluation); does not touch the saved position.

        With several ranks, every rank yields the same number of batches (sharded models run
        collectives in forward): a rank short of data gets a batch whose targets are all ignored.
        """
        plan = list(self.eval_batch_indices())
        if self._ahead is None:
            for indices, real in plan:
                yield tuple(to_device(a, self.device) for a in self._eval_batch(indices, real))
            return
        ahead, queued = BatchesAhead(self.device), 0  # a queue of its own: the training one stays
        try:
            for i in range(len(plan)):
                while queued < min(i + 2, len(plan)):  # this batch and the next
                    ahead.submit(queued, partial(self._eval_batch, *plan[queued]))
                    queued += 1
                yield ahead.take(i)
        finally:
            ahead.close()

    def _eval_batch(self, indices: np.ndarray, real: bool) -> tuple[np.ndarray, ...]:
        x, y, *rest = self._read(indices)
        return x, (y if real else np.full_like(y, IGNORE_INDEX)), *rest

    def eval_batch_indices(self):
        """(row indices, real) of each batch `__iter__` yields, in order; `real` is False for a rank's
        padding batch (its targets are ignored)."""
        order = self._epoch_order()
        per, n = self.batch_size, len(self.rows)
        n_batches = n // per if self.drop_last else -(-n // per)
        padded = -(-n_batches // self.world_size) * self.world_size
        for b in range(self.rank, padded, self.world_size):
            yield (order[b * per : (b + 1) * per] if b < n_batches else order[:per]), b < n_batches

    def __len__(self) -> int:
        return self.batches_per_epoch()


def merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) ranges sorted, overlapping and touching ones joined: the form `BatchLoader.skip`
    holds, so whether a sample is skipped is one binary search."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def is_count(value) -> bool:
    return type(value) is int and value >= 0


def _global_batch_changed(saved: int, loader: BatchLoader) -> str:
    """One line: the global batch changed on resume, both values, and the setting that restores it."""
    per_step = loader.batch_size * loader.world_size
    if saved % per_step == 0:
        fix = f"set training.gradient_accumulation_steps={saved // per_step}"
    elif saved % (loader.accumulation * loader.world_size) == 0:
        fix = f"set training.batch_size={saved // (loader.accumulation * loader.world_size)}"
    else:
        fix = f"choose batch_size x gradient_accumulation_steps x world size = {saved}"
    return (
        f"the checkpoint was trained with a global batch of {saved} samples per step, this run has "
        f"{loader.global_batch} = {loader.batch_size} batch_size x {loader.accumulation} accumulation x "
        f"{loader.world_size} process(es); {fix} to resume it"
    )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
