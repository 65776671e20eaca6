"""Batches made ready before the training loop asks for them.

A worker thread reads the coming batches' rows (a gather from the memory-mapped tokens, or chunks
streamed from object storage) and, on a GPU, copies them from pinned memory on a side stream. The
step then takes a batch that is already on the device: the host's gather, the pinning and the copy's
launch leave the hot path, and the copy overlaps the previous step's kernels instead of queueing
between them.

Each batch is named by a key its loader derives from its position. The loop receives a ready batch
only when its key is the one the loader's own state names next, so what it trains on is what it
would read without this class; on any other key (a resume, a rewind's skipped range) every queued
batch is dropped and the loader reads in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import numpy as np
import torch

Read = Callable[[], tuple[np.ndarray, ...]]  # a batch's rows, read where the worker runs


def reads_ahead(asked: bool | None, device: torch.device) -> bool:
    """Whether a loader reads ahead: as asked, or by default on a GPU. There the copy and the host's
    work leave the step; on a CPU a batch's gather takes microseconds, and handing it over from a
    thread costs more than it (bench/README.md, "Batches read ahead")."""
    return device.type == "cuda" if asked is None else asked


class BatchesAhead:
    """A queue of batches read (and, on CUDA, copied) on one worker thread, taken in the order queued."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._queued: deque[tuple[Hashable, Future]] = deque()

    def keys(self) -> list[Hashable]:
        return [key for key, _ in self._queued]

    def submit(self, key: Hashable, read: Read) -> None:
        if self._pool is None:
            if self.device.type == "cuda":
                if self.device.index is None:  # the worker's current device is its own: name the loop's
                    self.device = torch.device("cuda", torch.cuda.current_device())
                self._stream = torch.cuda.Stream(device=self.device)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches-ahead")
        self._queued.append((key, self._pool.submit(self._ready, read)))

    def _ready(self, read: Read) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event | None]:
        """On the worker: the rows as tensors; on CUDA already copied, with the event that marks the copy's end."""
        arrays = read()
        if self._stream is None:
            return tuple(torch.from_numpy(a) for a in arrays), None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            tensors = tuple(torch.from_numpy(a).pin_memory().to(self.device, non_blocking=True) for a in arrays)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return tensors, copied

    def take(self, key: Hashable) -> tuple[torch.Tensor, ...] | None:
        """The batch queued under `key` when it is next in line (a read's error is raised here, where
        reading in place would have raised it); otherwise None, and the queue is dropped."""
        if not self._queued or self._queued[0][0] != key:
            self.drop()
            return None
        tensors, copied = self._queued.popleft()[1].result()
        if copied is None:
            return tuple(t.to(self.device) for t in tensors)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)  # the step's kernels start after the copy
        for t in tensors:
            t.record_stream(stream)  # made on the side stream, freed after the step's use of it
        return tensors

    def drop(self) -> None:
        """Forget every queued batch, after the one being read has finished (the loader may change its rows next)."""
        for _, future in self._queued:
            future.cancel()
        wait_for([future for _, future in self._queued])
        self._queued.clear()

    def close(self) -> None:
        """Drop the queue and let the worker thread end."""
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
