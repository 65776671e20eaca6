"""Speed monitor: throughput, step time, data-wait time and MFU over a sliding window of steps.

Host-side timing only (no device syncs): on CUDA the loop already syncs at logging steps, so the
window averages are right even though single steps are asynchronous. Both timers read `clock`
(`time.perf_counter` unless given), so a test can drive them with a clock of its own.
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

    def start_step(self) -> None:
        self._step_start, self._wait = self.clock(), 0.0

    def timed_batch(self, loader):
        """loader.next_batch(), with the time spent waiting for it counted as data wait."""
        t = self.clock()
        with torch.profiler.record_function("data"):
            batch = loader.next_batch()
        self._wait += self.clock() - t
        return batch

    def end_step(self, tokens: int, samples: int) -> None:
        self.steps.append((self.clock() - self._step_start, self._wait, tokens, samples))

    def metrics(self) -> dict[str, float]:
        if not self.steps:
            return {}
        step_s = sum(s[0] for s in self.steps)
        wait_s = sum(s[1] for s in self.steps)
        tokens = sum(s[2] for s in self.steps)
        out = {
            "tokens_per_s": tokens / max(step_s, 1e-9),
            "samples_per_s": sum(s[3] for s in self.steps) / max(step_s, 1e-9),
            "step_time_s": step_s / len(self.steps),
            "data_wait_fraction": wait_s / max(step_s, 1e-9),
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        if self.flops_per_token:
            out["flops_per_token"] = self.flops_per_token
            if self.peak_flops:
                out["mfu"] = self.flops_per_token * out["tokens_per_s"] / self.peak_flops
        return out


class PhaseTimer:
    """Seconds spent in named phases of the loop (evaluation, checkpoint), for the end-of-run summary."""

    def __init__(self, *, clock: Clock = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.clock = clock

    @contextlib.contextmanager
    def count(self, phase: str):
        start = self.clock()
        try:
            with torch.profiler.record_function(phase):  # a named range in a profiler trace
                yield
        finally:
            self.seconds[phase] += self.clock() - start


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10
