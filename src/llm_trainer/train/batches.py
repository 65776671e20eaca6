"""Any iterable of batches (a torch DataLoader, a list) read through the loader interface the loop uses:
`next_batch()` that cycles epochs, `epoch`, and a position a checkpoint can save and restore."""

from __future__ import annotations

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
            self._it = iter(self.iterable)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.position, self._it = self.epoch + 1, 0, iter(self.iterable)
            batch = next(self._it)
        self.position += 1
        return self._convert(batch)

    def __iter__(self):
        return (self._convert(b) for b in self.iterable)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "processes": self.processes}

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
        self.epoch, self._it = epoch, iter(self.iterable)
        for taken in range(position):
            if next(self._it, None) is None:
                raise ValueError(
                    f"the checkpoint's data position (batch {position:,} of epoch {epoch}) is past the end of this "
                    f"DataLoader ({taken:,} batches); resume with the data the run was saved with"
                )
        self.position = position


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
