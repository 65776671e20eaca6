"""Rank-aware console output: in a multi-process job only rank 0 speaks, unless asked otherwise.

Long loops (training, evaluation, the LR finder) show their progress through `Progress`: a tqdm bar
on a terminal, plain lines at a modest interval when stderr is a file (a bar's redraws would glue
to the log's lines). While a bar is shown, `log` writes above it (`tqdm.write`), so a line never
breaks the bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator

from . import launcher
from .launcher import is_main_process

__all__ = ["Progress", "is_main_process", "log", "shows_progress_bar", "warn", "warnings_once"]

LINE_INTERVAL_S = 30.0  # between two progress lines in a log file
_bars: list = []  # the tqdm bars now on the terminal


def log(message: str, *, all_ranks: bool = False) -> None:
    """One line to stderr (stdout stays clean for --json output); above the progress bar, if one is shown."""
    if all_ranks or is_main_process():
        prefix = f"[rank {launcher.rank()}] " if all_ranks and launcher.launched() else ""
        if _bars:
            _write_above_bars(prefix + message)
        else:
            write_line(prefix + message, sys.stderr)


def _write_above_bars(text: str) -> None:
    from tqdm.auto import tqdm

    try:
        tqdm.write(text, file=sys.stderr)
    except BrokenPipeError:
        to_null_device(sys.stderr)


def write_line(text: str, stream) -> None:
    """Print one line, its newline in the same write; a console whose reader has gone does not stop the run.

    Ctrl-C on `llm-trainer train ... 2>&1 | tee log` ends `tee` as well, so the lines that follow (the
    stop's own message, the checkpoint it saves) meet a closed pipe. The stream is then pointed at
    the null device: the run saves and exits as it would on a terminal, with nothing more shown.
    """
    try:
        stream.write(text + "\n")  # in one write: another thread's line (a background upload's) never lands inside
        stream.flush()
    except BrokenPipeError:
        to_null_device(stream)


def to_null_device(stream) -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())  # what is still buffered goes there too, at the next flush
        os.close(null)
    except (OSError, ValueError):  # a stream without a file descriptor: nothing more to do
        pass


def warn(message: str) -> None:
    log(f"warning: {message}")


@contextlib.contextmanager
def warnings_once() -> Iterator[None]:
    """Show each distinct warning once. Python's own "once per location" memory is cleared whenever a
    library enters `warnings.catch_warnings()` or adds a filter, which some do on every step, so a
    deprecation inside a per-step call (DeepSpeed's reduce-scatter) would otherwise print every step."""
    seen: set[tuple] = set()
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (str(message), category, filename, lineno)
        if key not in seen:
            seen.add(key)
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = previous


def shows_progress_bar(enabled: bool = True) -> bool:
    """A bar on a terminal only: written to a file, its redraws would glue to the log lines."""
    return enabled and is_main_process() and sys.stderr.isatty()


class Progress:
    """How far a long loop has come: a tqdm bar on a terminal (`bar`), else, with `lines`, one plain
    line (`eval: 120/400 batches (30%), 45s`) every `interval` seconds (default LINE_INTERVAL_S), else
    nothing. Only rank 0 shows
    anything. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        *,
        initial: int = 0,
        enabled: bool = True,
        bar: bool | None = None,
        lines: bool = True,
        interval: float | None = None,
        leave: bool = True,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = initial
        self.bar = None
        self.lines = lines and enabled and is_main_process()
        self.interval = LINE_INTERVAL_S if interval is None else interval
        self.started = self.last_line = time.monotonic()
        self.postfix: dict[str, str] = {}
        if shows_progress_bar(enabled) if bar is None else (bar and enabled):
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                dynamic_ncols=True,
                mininterval=0.5,
                leave=leave,
                file=sys.stderr,
            )
            _bars.append(self.bar)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and time.monotonic() - self.last_line >= self.interval:
            self.last_line = time.monotonic()
            log(self.line())

    def set_postfix(self, **values: str) -> None:
        """Values shown after the count (loss, lr, ...)."""
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def line(self) -> str:
        """The plain progress line: done/total unit (percent), seconds so far, the postfix values."""
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        extra = "".join(f", {key} {value}" for key, value in self.postfix.items())
        return f"{self.desc}: {count} {self.unit}{share}, {time.monotonic() - self.started:.0f}s{extra}"

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            if bar in _bars:
                _bars.remove(bar)
            bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
