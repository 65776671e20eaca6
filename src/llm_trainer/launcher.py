"""What the launcher (torchrun, SLURM through torchrun, DeepSpeed's launcher) told this process.

The one place that reads RANK / LOCAL_RANK / WORLD_SIZE. Logging asks it whether this process is
rank 0, and `parallel.distributed.setup` builds its `DistInfo` from it, so both always agree. It sits
on the ground floor beside `logs` and imports nothing (no torch: data-preparation workers use the
logger too).
"""

from __future__ import annotations

import os


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Processes on this node (torchrun sets it; without it, all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size())))


def launched() -> bool:
    """True under a launcher (WORLD_SIZE set), even with one process."""
    return "WORLD_SIZE" in os.environ


def is_main_process() -> bool:
    return rank() == 0
