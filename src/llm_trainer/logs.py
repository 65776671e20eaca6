"""Rank-aware console output: in a multi-process job only rank 0 speaks, unless asked otherwise."""

from __future__ import annotations

import os
import sys


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def log(message: str, *, all_ranks: bool = False) -> None:
    """One line to stderr (stdout stays clean for --json output)."""
    if all_ranks or is_main_process():
        prefix = f"[rank {rank()}] " if all_ranks and "WORLD_SIZE" in os.environ else ""
        print(prefix + message, file=sys.stderr, flush=True)


def warn(message: str) -> None:
    log(f"warning: {message}")
