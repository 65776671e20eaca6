"""A checkpoint held while another process reads it (`export`, `eval`, `generate` on a run that is still
training): the training's rotation (`training.save_total_limit`) passes over a checkpoint a reader
holds, and removes it at a later save. A reader whose checkpoint was removed just before it took hold
(it named a run or checkpoints folder, or `latest`) takes the newest again.

The hold is a shared `flock` on the checkpoint's meta.json, which the rotation tries to take
exclusively, without waiting, before it removes the folder (`remove_unless_read`). A folder without
meta.json (a model folder of ours) is read as it is: no rotation removes it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ..errors import CheckpointError
from ..files.atomic import remove_folder
from ..files.disk import lock_exclusive, lock_shared
from ..logs import log
from .find import find_checkpoint
from .layout import META

READ_TRIES = 3  # checkpoints removed under a reader, one after another, before it gives up


@contextmanager
def held_checkpoint(spec: str | Path) -> Iterator[Path | None]:
    """The checkpoint folder `spec` names (`find_checkpoint`), held against removal while the block
    reads it; None when `spec` holds no checkpoint yet."""
    for _ in range(READ_TRIES):
        path = find_checkpoint(spec)
        if path is None or (path.is_dir() and not (path / META).exists()):
            yield path  # nothing yet, or a folder no rotation removes
            return
        held = _held(path / META)
        if held is not None:
            with held:
                yield path
            return
        if not Path(spec).exists():  # the very folder named: nothing newer to take
            raise CheckpointError(
                f"checkpoint {path} was removed as it was to be read, by the training that saves there "
                "(training.save_total_limit keeps its newest checkpoints); pass the run folder or a newer checkpoint"
            )
        log(f"checkpoint: {path} was removed as it was to be read (the training's save_total_limit); taking the newest")
    raise CheckpointError(
        f"{spec}: the checkpoint to read was removed {READ_TRIES} times in a row by the training that saves there; "
        "run again, or raise its training.save_total_limit"
    )


def _held(meta: Path) -> IO | None:
    """meta.json open and share-locked, still in its folder once locked; None when it is gone."""
    try:
        file = open(meta, "rb")
    except (FileNotFoundError, NotADirectoryError):
        return None
    lock_shared(file)
    try:
        in_place = os.stat(meta).st_ino == os.fstat(file.fileno()).st_ino
    except FileNotFoundError:
        in_place = False
    if not in_place:  # removed while this process waited for the lock
        file.close()
        return None
    return file


def remove_unless_read(path: Path) -> bool:
    """Remove the checkpoint folder `path` unless a reader holds it (`held_checkpoint`); whether it was
    removed. The lock is kept through the removal, so no reader takes hold of a folder going away."""
    try:
        meta = open(path / META, "rb")
    except FileNotFoundError:
        return remove_folder(path)
    with meta:
        if not lock_exclusive(meta, wait=False):
            return False
        return remove_folder(path)
