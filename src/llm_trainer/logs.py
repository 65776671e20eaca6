"""Rank-aware console output: in a multi-process job only rank 0 speaks, unless asked otherwise."""

from __future__ import annotations

import sys

from .parallel import launcher
from .parallel.launcher import is_main_process

__all__ = ["is_main_process", "log", "warn"]


def log(message: str, *, all_ranks: bool = False) -> None:
    """One line to stderr (stdout stays clean for --json output)."""
    if all_ranks or is_main_process():
        prefix = f"[rank {launcher.rank()}] " if all_ranks and launcher.launched() else ""
        print(prefix + message, file=sys.stderr, flush=True)


def warn(message: str) -> None:
    log(f"warning: {message}")
