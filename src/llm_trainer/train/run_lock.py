"""One run per output folder: an exclusive lock, held while a run writes there.

Two `train` runs started into one folder would interleave their metrics and overwrite each other's
checkpoints and best_model. `run_lock(folder)` takes an exclusive `flock` on `folder/.lock` and
writes the holder's PID into it. The OS releases the lock when the process ends, however it ends
(SIGKILL included), so a dead run never leaves a stale lock; a second run fails at once, in one line
naming the holder. The lock is reentrant within a process (`llm_trainer.train` holds it, and the
Trainer it starts takes it again).

Taking it also proves the folder is usable: a file in its place, or a folder we cannot write, is a
one-line error before anything is prepared or written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import UsageError
from ..filesystem import lock_exclusive

LOCK_FILE = ".lock"
_held: dict[str, list[int]] = {}  # resolved folder -> [descriptor, depth]
_WHAT = {"training.output_dir": "output folder", "training.checkpoint_dir": "checkpoint folder"}


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _open_lock(folder: Path, setting: str) -> int:
    """The lock file's descriptor, the folder created and proven writable; a UsageError otherwise."""
    what = f"{_WHAT.get(setting, 'folder')} {folder}"
    if folder.is_symlink() and not folder.exists():
        raise UsageError(f"{what} is a dangling symlink; choose another {setting}")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{what} is a file; choose another {setting}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(folder / LOCK_FILE, flags, 0o644)
    except OSError as exc:
        raise UsageError(
            f"cannot write into {what} ({_reason(exc)}); choose another {setting} or fix its permissions"
        ) from None
    probe = folder / f".write-probe-{os.getpid()}"
    try:  # the lock file may exist already: prove that new files can be made here too
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
        probe.unlink()
    except OSError as exc:
        os.close(fd)
        raise UsageError(
            f"cannot write into {what} ({_reason(exc)}); choose another {setting} or fix its permissions"
        ) from None
    return fd


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"PID {text}" if text.isdigit() else "another process"


@contextlib.contextmanager
def run_lock(folder: str | Path, setting: str = "training.output_dir") -> Iterator[None]:
    """Hold the exclusive lock of `folder` for the block; refuse at once if another process holds it.
    `setting`: the config field that named the folder, for the messages."""
    folder = Path(folder)
    key = str(folder.resolve())
    created = False
    if key in _held:
        _held[key][1] += 1
    else:
        created = not folder.exists()
        fd = _open_lock(folder, setting)
        if not lock_exclusive(fd, wait=False):  # another run holds it (on Windows, without flock, never)
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(
                f"{_WHAT.get(setting, 'folder')} {folder} is in use by a run still going ({holder}); "
                f"wait for it to end, or choose another {setting}"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full disk: the lock holds all the same, a second run just cannot name us
            pass
        _held[key] = [fd, 1]
    try:
        yield
    finally:
        entry = _held[key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            if created and [path.name for path in folder.iterdir()] == [LOCK_FILE]:
                (folder / LOCK_FILE).unlink()  # a run that failed before writing anything leaves no folder
                folder.rmdir()
            os.close(entry[0])  # releases the lock


@contextlib.contextmanager
def lock_run_folders(output_dir: str | Path, checkpoint_dir: str | Path, is_main: bool) -> Iterator[None]:
    """The output folder's lock, and the checkpoint folder's when it lies elsewhere; only the process
    that writes them (rank 0) takes them."""
    with contextlib.ExitStack() as stack:
        if is_main:
            output, checkpoints = Path(output_dir), Path(checkpoint_dir)
            stack.enter_context(run_lock(output))
            inside = checkpoints.resolve() == output.resolve() or output.resolve() in checkpoints.resolve().parents
            if not inside:
                stack.enter_context(run_lock(checkpoints, "training.checkpoint_dir"))
        yield
