"""Any iterable of batches (a torch DataLoader, a list) read through the loader interface the loop uses:
`next_batch()` that cycles epochs, `epoch`, and a position a checkpoint can save and restore."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterable, Sequence

import torch

from ..data.batches.loader import IGNORE_INDEX
from ..limits import check_skip_forward


class IterableBatches:
    """Adapts any iterable of batches (e.g. a torch DataLoader) to the loader interface the loop uses.

    Accepted batches: (inputs, targets) already aligned; a dict with `input_ids` (and optional
    `labels` and `attention_mask`, Hugging Face style, shifted here); or a tensor of token rows (shifted
    here). As in `transformers`, a position whose attention_mask is 0 (padding) is never a target.
    """

    def __init__(self, iterable: Iterable, device: torch.device, processes: int = 1):
        self.iterable, self.device = iterable, device
        self.processes = processes  # the run's world size: the position counts this rank's batches
        self.epoch, self.position, self._it = 0, 0, None
        self._epoch_start: dict | None = None  # the random states this pass started from (`_start_epoch`)
        # rows per batch, for the effective batch the Trainer prints: a DataLoader knows it, a list shows it
        self.batch_size: int | None = getattr(iterable, "batch_size", None)
        if self.batch_size is None and isinstance(iterable, Sequence) and len(iterable) > 0:
            self.batch_size = _rows(iterable[0])

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def batches_per_epoch(self) -> int:
        return len(self)

    def _convert(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, dict):
            ids = batch["input_ids"]
            labels = batch.get("labels", ids)
            mask = batch.get("attention_mask")
            if mask is not None:  # padding is not learned (labels=-100 there, as transformers' collators do)
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
            x, y = ids[:, :-1], labels[:, 1:]
        elif isinstance(batch, (tuple, list)):
            if len(batch) > 2:  # (inputs, targets, doc_ids)
                return tuple(t.to(self.device, non_blocking=True) for t in batch[:3])
            x, y = batch[0], batch[1]
        else:
            x, y = batch[:, :-1], batch[:, 1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def next_batch(self):
        if self._it is None:
            self._start_epoch()
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.position = self.epoch + 1, 0
            self._start_epoch()
            batch = next(self._it)
        self.position += 1
        return self._convert(batch)

    def _start_epoch(self) -> None:
        """A new pass over the iterable, its first batch read. A shuffling DataLoader draws the pass's order
        (and its workers' seeds) from torch's random state, or its own generator's, as the pass starts and
        its first batch is read: that state is kept (`epoch_start` in the position), so that a resume in
        this pass starts from it again (`_replay_epoch_start`) and reads the same order."""
        generator = self._generator()
        self._epoch_start = {"torch": _encoded(torch.get_rng_state())}
        if generator is not None:
            self._epoch_start["generator"] = _encoded(generator.get_state())
        self._open_pass()

    def _replay_epoch_start(self, drawn_from: dict) -> None:
        """The pass a checkpoint was saved in, started again from the random states it started from; the
        run's own random stream then goes on from the checkpoint's, as if the pass had not been started."""
        generator = self._generator()
        now = torch.get_rng_state()
        try:
            try:
                torch.set_rng_state(_decoded(drawn_from["torch"]))
                if generator is not None and "generator" in drawn_from:
                    generator.set_state(_decoded(drawn_from["generator"]))
            except (KeyError, RuntimeError):
                raise TypeError("epoch_start does not hold torch's random states") from None
            self._epoch_start = drawn_from
            self._open_pass()
        finally:
            torch.set_rng_state(now)

    def _generator(self) -> torch.Generator | None:
        generator = getattr(self.iterable, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    def _open_pass(self) -> None:
        """An iterator over the iterable with its first batch read (a DataLoader draws its order then)."""
        it = iter(self.iterable)
        first = next(it, _END)
        self._it = it if first is _END else itertools.chain([first], it)

    def __iter__(self):
        return (self._convert(b) for b in self.iterable)

    def state_dict(self) -> dict:
        start = self._epoch_start
        return {
            "epoch": self.epoch,
            "position": self.position,
            "processes": self.processes,
            **({"epoch_start": start} if start is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Generic iterables cannot seek: skip forward to the saved position (slower, same data). How
        the iterable splits its data among processes is its own: the position holds for its world size only."""
        if state.get("processes", self.processes) != self.processes:
            raise ValueError(
                f"the checkpoint's data position counts batches of a DataLoader split among {state['processes']} "
                f"process(es), this run has {self.processes}; resume with {state['processes']}, or train with "
                "llm-trainer's own loaders (build_loaders), whose position holds at any world size"
            )
        epoch, position = state["epoch"], state["position"]
        for name, value in (("epoch", epoch), ("position", position)):
            if type(value) is not int or value < 0:  # (a checkpoint may come from elsewhere)
                raise TypeError(f"{name} {value!r} is not a whole number >= 0")
        check_skip_forward(position)
        start = state.get("epoch_start")
        if start is not None and not (isinstance(start, dict) and all(isinstance(v, str) for v in start.values())):
            raise TypeError(f"epoch_start {str(start)[:60]!r} is not a mapping of random states")
        self.epoch = epoch
        if start is None:  # a position saved without the pass's random states: this run's own draw
            self._start_epoch()
        else:
            self._replay_epoch_start(start)
        for taken in range(position):
            if next(self._it, None) is None:
                raise ValueError(
                    f"the checkpoint's data position (batch {position:,} of epoch {epoch}) is past the end of this "
                    f"DataLoader ({taken:,} batches); resume with the data the run was saved with"
                )
        self.position = position


_END = object()  # an iterable with no batch


def _encoded(state: torch.Tensor) -> str:
    """A random state (a uint8 tensor) as text, for train_state.json."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decoded(text: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except ValueError:
        raise TypeError("epoch_start holds a random state that is not base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _rows(batch) -> int | None:
    """The rows of one batch in any accepted form (see IterableBatches), or None for another form."""
    first = (
        batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    )
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape else None


def as_loader(loader, device: torch.device, processes: int = 1):
    """Our loaders (with `next_batch`) as they are; anything else wrapped (`processes`: the world size)."""
    return loader if hasattr(loader, "next_batch") else IterableBatches(loader, device, processes)
