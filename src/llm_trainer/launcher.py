"""What the launcher (torchrun, SLURM through torchrun, DeepSpeed's launcher) told this process.

The one place that reads RANK / LOCAL_RANK / WORLD_SIZE. Logging asks it whether this process is
rank 0, and `parallel.distributed.setup` builds its `DistInfo` from it, so both always agree. It sits
on the ground floor beside `logs` and imports only `errors` (no torch: data-preparation workers use the
logger too). A value that is not a count, or a rank outside the world, is a usage error in one line.
"""

from __future__ import annotations

import os

from .errors import UsageError


def _count(name: str, default: int) -> int:
    """A launcher's variable as a number; one that is not (a stale or mistyped export) is said in one line."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(
            f"the environment variable {name}={text!r} is not a count; unset it or let a launcher (torchrun) set it"
        )
    return value


def rank() -> int:
    value, world = _count("RANK", 0), world_size()
    if value >= world:
        raise UsageError(
            f"RANK={value} with WORLD_SIZE={world}: ranks count from 0 below the world size; unset stale launcher "
            "variables (RANK, WORLD_SIZE, LOCAL_RANK) or start the processes with torchrun"
        )
    return value


def local_rank() -> int:
    return _count("LOCAL_RANK", 0)


def world_size() -> int:
    return _count("WORLD_SIZE", 1)


def local_world_size() -> int:
    """Processes on this node (torchrun sets it; without it, all of them)."""
    return _count("LOCAL_WORLD_SIZE", world_size())


def launched() -> bool:
    """True under a launcher (WORLD_SIZE set), even with one process."""
    return "WORLD_SIZE" in os.environ


def is_main_process() -> bool:
    return rank() == 0
