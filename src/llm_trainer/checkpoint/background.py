"""Checkpoints written by a background thread, so training stalls only for a copy of its state.

The training loop copies every tensor it saves (model and optimizer) into host memory, hands the
copy to one worker thread and goes on training. The worker writes it with the same atomic,
checksummed, fsynced `local.save_checkpoint` a synchronous save uses. At most one write is in
flight: the next save, the final one and a stop wait for it first, and a write's error (a full
disk, say) is raised there, in the training thread. A crash or a kill -9 during a write loses only
that checkpoint: `latest` and every earlier checkpoint are untouched, as with a synchronous save.

The price is host memory for one copy of the model and optimizer state, kept for the whole run so
later saves reuse it (`training.async_checkpoint=false` writes in the training thread instead).

Sharded checkpoints are copied and their shards written by `dcp.async_save` (`sharded.BackgroundShards`);
each rank's worker waits for that write, then rank 0's writes the rest of the folder as above.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


class HostSnapshot:
    """Copies of the state's tensors in host memory, in buffers kept from one save to the next.

    `reserve` allocates them ahead (in the writer thread); every save then only copies into them. On
    a VM, first touches of fresh memory (page faults) cost more than the copy itself.
    CUDA tensors are copied into pinned buffers without blocking, then synchronized once.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def reserve(self, state: Any) -> Callable[[], None]:
        """A job for the writer thread: allocate (and touch) ahead of time the buffers `take(state)`
        will fill, so that even the first save only copies. Reads only shapes and dtypes now."""
        specs: dict[str, tuple] = {}
        _map_tensors(state, lambda where, tensor: specs.setdefault(where, (tensor.shape, tensor.dtype, tensor.is_cuda)))

        def allocate() -> None:
            for where, (shape, dtype, pinned) in specs.items():
                if where not in self._buffers:
                    self._buffers[where] = torch.zeros(shape, dtype=dtype, pin_memory=pinned)

        return allocate

    def take(self, state: Any) -> Any:
        """The same nested structure with every tensor replaced by its host copy. The copies stay
        valid until the next take(): the caller waits for the previous write before taking again."""
        copied = _map_tensors(state, self._copy)
        if any(buffer.is_pinned() for buffer in self._buffers.values()):
            torch.cuda.synchronize()
        return copied

    def _copy(self, where: str, value: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            self._buffers[where] = buffer
        return buffer.copy_(value.detach(), non_blocking=value.is_cuda)


def _map_tensors(value: Any, fn: Callable[[str, torch.Tensor], Any], where: str = "") -> Any:
    """`value` with fn(path, tensor) in place of each tensor; the path names its place in the structure."""
    if torch.is_tensor(value):
        return fn(where, value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn, f"{where}/{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn, f"{where}/{i}") for i, item in enumerate(value))
    return value


class BackgroundWriter:
    """One worker thread that runs checkpoint writes, one at a time, in the order submitted.

    The worker runs torch ops on one core only. With OpenMP, a thread that starts a parallel region
    gets a thread team of its own that lives as long as the process; on a machine with few cores its
    idle threads then compete with the training thread's team at every step, whether or not a write
    is running, and every later step is slower (see bench/README.md). A background write has no
    deadline, so it gets no team.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None
        _single_threaded_torch(self._pool)

    def submit(self, write: Callable[[], Path]) -> None:
        assert self._pending is None, "wait() for the write in flight before submitting another"
        self._pending = self._pool.submit(write)

    def submitted(self) -> bool:
        """Whether a write was submitted whose result (or error) has not been taken yet."""
        return self._pending is not None

    def done(self) -> bool:
        """Whether the write submitted has completed (its result or error not taken yet)."""
        return self._pending is not None and self._pending.done()

    def finished(self) -> Path | None:
        """The folder of a write that has completed (its error raised here), else None. Never blocks."""
        if self._pending is None or not self._pending.done():
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Block until the write in flight, if any, is complete; return its folder or raise its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Let a write in flight finish (never abandon a half-written checkpoint), then stop the thread."""
        self._pool.shutdown(wait=True)


def _single_threaded_torch(pool: ThreadPoolExecutor) -> None:
    """Make torch's intra-op parallelism one thread in the pool's (single) worker, and nowhere else.

    `torch.set_num_threads` sets the calling thread's count and the default that a thread takes up
    at its first torch op; once taken up, a thread keeps its count. So the worker takes up the
    default, sets 1 for itself, and this thread then puts the default back for every other thread.
    """
    threads = torch.get_num_threads()
    pool.submit(_one_thread_here).result()
    torch.set_num_threads(threads)


def _one_thread_here() -> None:
    torch.get_num_threads()  # take up the default first: it would replace the 1 at the first op
    torch.set_num_threads(1)
