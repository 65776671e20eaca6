"""Where a step's time and memory go, on request: a torch.profiler trace of `training.profile_steps`
and, on CUDA, an allocator snapshot (`training.memory_snapshot`).

The trace is a Chrome trace (`{output_dir}/profile/rank{R}.steps-{first}-{last}.pt.trace.json`): open it
in Perfetto (ui.perfetto.dev) or chrome://tracing, or point TensorBoard's profiler plugin at the folder.
The loop's phases appear as named ranges: `data` (waiting for the batch), `forward_backward`,
`optimizer` (clip and step), `logging`, `evaluation`, `checkpoint` (the copy into host buffers, or the
whole write when synchronous), each inside `ProfilerStep#N`.

`memory_snapshot` records the CUDA caching allocator's history from the start of the run; the snapshot
(`memory_snapshot.pickle`, for pytorch.org/memory_viz) is written after the last profiled step (or at
the end of the run without profile_steps) and before a CUDA out-of-memory error ends the run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import TrainingConfig
from ..errors import UsageError, first_line
from ..logs import log

PROFILE_DIR = "profile"  # in output_dir
_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot


class StepProfiler:
    """`begin_step(n)` before optimizer step n (1-based); the trace covers profile_steps [first, last]."""

    def __init__(self, config: TrainingConfig, output_dir: Path, device: torch.device, rank: int, total_steps: int):
        self.steps = config.profile_steps
        if self.steps is not None and self.steps[1] > total_steps:
            raise UsageError(
                f"training.profile_steps {self.steps} ends after the run's last step ({total_steps}); "
                "choose steps within the run"
            )
        self.folder, self.rank = Path(output_dir) / PROFILE_DIR, rank
        self.snapshot = config.memory_snapshot and device.type == "cuda"
        if config.memory_snapshot and device.type != "cuda":
            log("note: training.memory_snapshot records the CUDA allocator; this run is on the CPU, so none is written")
        self._profiler: torch.profiler.profile | None = None
        self._range: torch.profiler.record_function | None = None  # the step being traced
        self._first, self._done = 0, False  # the first step traced; whether the trace was written (once a run)
        self.snapshot_path: Path | None = None  # the last allocator snapshot written

    def __enter__(self) -> StepProfiler:
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)
        return self

    def __exit__(self, *exc) -> None:
        if self._profiler is not None:  # the run ended inside the profiled steps
            self._finish()
        if self.snapshot:
            self.write_snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)

    def begin_step(self, n: int) -> None:
        """Optimizer step n (1-based) begins: the trace starts at the first profiled step, marks each
        one (`ProfilerStep#n`) and ends once the last has run, logging and saving included."""
        if self.steps is None:
            return
        first, last = self.steps
        if self._profiler is None and not self._done and first <= n <= last:  # (a resumed run: from where it is)
            self._first = n
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self._profiler.start()
        if self._profiler is None:
            return
        self._close_range()
        if n > last:
            self._finish()
            return
        self._range = torch.profiler.record_function(f"ProfilerStep#{n}")  # the name torch's own schedule gives
        self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _finish(self) -> None:
        self._close_range()
        profiler, self._profiler, self._done = self._profiler, None, True
        profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}.steps-{self._first}-{self.steps[1]}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        log(f"profile: steps {self._first}-{self.steps[1]} traced into {path} (open it in ui.perfetto.dev)")
        if self.snapshot:
            self.write_snapshot()

    def write_snapshot(self) -> Path | None:
        if not self.snapshot:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"memory_snapshot.rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        self.snapshot_path = path
        log(f"profile: CUDA allocator snapshot written to {path} (open it in pytorch.org/memory_viz)")
        return path


def out_of_memory(error: BaseException, profiler: StepProfiler | None, config: TrainingConfig) -> UsageError:
    """The one-line error for a device out-of-memory (the profiler wrote the allocator snapshot, if recording)."""
    path = profiler.snapshot_path if profiler is not None else None  # written as the loop's `with` ended
    where = (
        f"; the allocator's history is in {path}" if path else "; training.memory_snapshot=true records where it went"
    )
    knobs = [f"training.batch_size (now {config.batch_size}) with more gradient_accumulation_steps"]
    if not config.gradient_checkpointing:
        knobs.append("training.gradient_checkpointing=true")
    knobs.append("a shorter data.max_length")
    return UsageError(
        f"out of device memory ({first_line(error, 160)}): lower {', or '.join(knobs)}; `llm-trainer estimate` predicts the "
        f"memory a config needs{where}"
    )
