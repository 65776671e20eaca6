"""Rank-aware console output: in a multi-process job only rank 0 speaks, unless asked otherwise."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator

from .parallel import launcher
from .parallel.launcher import is_main_process

__all__ = ["is_main_process", "log", "warn", "warnings_once"]


def log(message: str, *, all_ranks: bool = False) -> None:
    """One line to stderr (stdout stays clean for --json output)."""
    if all_ranks or is_main_process():
        prefix = f"[rank {launcher.rank()}] " if all_ranks and launcher.launched() else ""
        write_line(prefix + message, sys.stderr)


def write_line(text: str, stream) -> None:
    """Print one line; a console whose reader has gone does not stop the run.

    Ctrl-C on `llm-trainer train ... 2>&1 | tee log` ends `tee` as well, so the lines that follow (the
    stop's own message, the checkpoint it saves) meet a closed pipe. The stream is then pointed at
    the null device: the run saves and exits as it would on a terminal, with nothing more shown.
    """
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        _to_null_device(stream)


def _to_null_device(stream) -> None:
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
