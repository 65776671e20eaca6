"""Speed monitor: throughput, step time, data-wait time and MFU over a sliding window of steps.

Host-side timing only (no device syncs). A step's time runs from its start to the next step's start,
less the phases the loop leaves out (`leave_out`: evaluation, checkpoints). So it holds what the
loop does between steps for every step (logging, callbacks, layer statistics), and on a GPU the
wait at a logging step's read of the loss, while the device finishes the steps the host queued ahead
of it: measured only up to the end of its own launches, an asynchronous step would count the host's
time, not the device's. The window's sums are then the device's time in the steady state, as a
trainer that reads its loss every step measures it. Both timers read `clock` (`time.perf_counter`
unless given), so a test can drive them with a clock of its own.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable

import torch

Clock = Callable[[], float]  # seconds, monotonic


class SpeedMonitor:
    def __init__(
        self,
        window_size: int,
        flops_per_token: float | None,
        peak_flops: float | None,
        device: torch.device,
        *,
        clock: Clock = time.perf_counter,
    ):
        self.steps: deque[tuple[float, float, int, int]] = deque(
            maxlen=window_size
        )  # (step s, wait s, tokens, samples)
        self.flops_per_token, self.peak_flops, self.device = flops_per_token, peak_flops, device
        self.clock = clock
        self._step_start = clock()
        self._wait = 0.0
        self._left_out = 0.0  # seconds of the open step in phases that are not training (`leave_out`)
        self._ended: tuple[int, int] | None = None  # (tokens, samples) of the step whose time still runs

    def start_step(self) -> None:
        now = self.clock()
        if self._ended is not None:
            self.steps.append(self._timed(now))
            self._ended = None
        self._step_start, self._wait, self._left_out = now, 0.0, 0.0

    def leave_out(self, seconds: float) -> None:
        """Seconds since the last step's end that were not training (an evaluation, a checkpoint save)."""
        self._left_out += seconds

    def _timed(self, now: float) -> tuple[float, float, int, int]:
        """The step that ended last, as a window entry with its time up to `now`."""
        assert self._ended is not None
        tokens, samples = self._ended
        return (now - self._step_start - self._left_out, self._wait, tokens, samples)

    def timed_batch(self, loader):
        """loader.next_batch(), with the time spent waiting for it counted as data wait."""
        t = self.clock()
        with torch.profiler.record_function("data"):
            batch = loader.next_batch()
        self._wait += self.clock() - t
        return batch

    def end_step(self, tokens: int, samples: int) -> None:
        """The step's work is queued; its time runs on until the next step starts (the module docstring)."""
        self._ended = (tokens, samples)

    def metrics(self) -> dict[str, float]:
        """The window's figures, the step that ended last counted up to now: read them after the loss,
        whose read waits for the device."""
        window = list(self.steps)
        if self._ended is not None:
            window = [*window, self._timed(self.clock())][-(self.steps.maxlen or 1) :]
        if not window:
            return {}
        step_s = sum(s[0] for s in window)
        wait_s = sum(s[1] for s in window)
        tokens = sum(s[2] for s in window)
        out = {
            "tokens_per_s": tokens / max(step_s, 1e-9),
            "samples_per_s": sum(s[3] for s in window) / max(step_s, 1e-9),
            "step_time_s": step_s / len(window),
            "data_wait_fraction": wait_s / max(step_s, 1e-9),
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        if self.flops_per_token:
            out["flops_per_token"] = self.flops_per_token
            if self.peak_flops:
                out["mfu"] = self.flops_per_token * out["tokens_per_s"] / self.peak_flops
        return out


class PhaseTimer:
    """Seconds spent in named phases of the loop (evaluation, checkpoint), for the end-of-run summary;
    `monitor`, when given, leaves them out of its steps' time."""

    def __init__(self, *, clock: Clock = time.perf_counter, monitor: SpeedMonitor | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.clock = monitor.clock if monitor is not None else clock  # one clock for both
        self.monitor = monitor

    @contextlib.contextmanager
    def count(self, phase: str):
        start = self.clock()
        try:
            with torch.profiler.record_function(phase):  # a named range in a profiler trace
                yield
        finally:
            seconds = self.clock() - start
            self.seconds[phase] += seconds
            if self.monitor is not None:
                self.monitor.leave_out(seconds)


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10
