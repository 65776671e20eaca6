"""One run per output folder: an exclusive lock, held while a run writes there, that guards the
folder's whole subtree.

Two `train` runs started into one folder would interleave their metrics and overwrite each other's
checkpoints and best_model. `run_lock(folder)` takes an exclusive `flock` on `folder/.lock` and
writes the holder's PID into it, and the output folder of the run it belongs to. The OS releases
the lock when the process ends, however it ends (SIGKILL included), so a dead run never leaves a
stale lock; a second run fails at once, in one line naming the holder. A lock on a folder covers
everything below it: a run whose folder lies inside a folder another run holds (a
`checkpoint_dir` inside a running run's output folder) is refused the same way. The lock is
reentrant within a process (`llm_trainer.train` holds it, and the Trainer it starts takes it again).

The `.lock` file stays after the run and says whose folder it is: a run later pointed at a
checkpoint folder that holds another run's checkpoints (another output folder's, or one inside
another run's folder) is refused instead of rotating them away or taking its best_model as its own.

Taking it also proves the folder is usable: a file in its place, or a folder we cannot write, is a
one-line error before anything is prepared or written.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import UsageError
from ..files.disk import lock_exclusive

LOCK_FILE = ".lock"
_held: dict[str, list[int]] = {}  # resolved folder -> [descriptor, depth]
_WHAT = {"training.output_dir": "output folder", "training.checkpoint_dir": "checkpoint folder"}
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


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
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | _NO_FOLLOW, 0o644)
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


def _lines(fd: int) -> list[str]:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _holder(fd: int) -> str:
    lines = _lines(fd)
    text = lines[0].strip() if lines else ""
    return f"PID {text}" if text.isdigit() else "another process"


def _read_lock(folder: Path, *, probe: bool) -> tuple[str | None, list[str]] | None:
    """(the holder when another process holds `folder`'s lock and `probe`, else None; the lock file's
    lines), or None when the folder has no lock file. Creates nothing."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY | _NO_FOLLOW)
    except OSError:
        return None
    try:
        holder = _holder(fd) if probe and not _take(fd) else None  # (another's probe holds it an instant too)
        return holder, _lines(fd)
    finally:
        os.close(fd)  # releases the probe's lock, if it took one


def lock_holder(folder: Path) -> tuple[bool, int | None]:
    """(whether a live process holds `folder`'s lock, its PID when it recorded one): what `status` shows.
    Probes the lock for an instant, as a second run would; creates nothing."""
    found = _read_lock(Path(folder), probe=True)
    if found is None or found[0] is None:
        return False, None
    first = found[1][0].strip() if found[1] else ""
    return True, int(first) if first.isdigit() else None


def _refuse_held_ancestor(folder: Path, setting: str) -> None:
    """A lock on a folder guards its subtree: refuse `folder` inside a folder another run holds."""
    for ancestor in folder.parents:
        if str(ancestor) in _held:
            continue  # ours
        found = _read_lock(ancestor, probe=True)
        if found is not None and found[0] is not None:
            raise UsageError(
                f"{_WHAT.get(setting, 'folder')} {folder} lies inside {ancestor}, the folder of a run still going "
                f"({found[0]}); choose a {setting} outside it"
            )


def _owner(folder: Path) -> Path | None:
    """The output folder of the run whose checkpoints `folder` holds, as the nearest `.lock` at or above it
    records; a folder inside another run's folder belongs to that run. None when unknown."""
    for candidate in (folder, *folder.parents):
        found = _read_lock(candidate, probe=False)
        if found is None:
            continue
        lines = found[1]
        if len(lines) > 1 and lines[1].strip():
            return Path(lines[1].strip())
        return candidate if candidate != folder else None
    return None


def _refuse_foreign_checkpoints(checkpoints: Path, output: Path) -> None:
    """A checkpoint folder holding another run's checkpoints is not this run's to rotate or replace."""
    from ..checkpoint.layout import BEST, list_checkpoints

    if not (list_checkpoints(checkpoints) or (checkpoints / BEST).is_dir()):
        return
    run = _owner(checkpoints.resolve())
    if run is not None and run != output.resolve():
        raise UsageError(
            f"checkpoint folder {checkpoints} holds the checkpoints of the run in {run}; this run would rotate "
            f"them away and replace its best_model. Choose another training.checkpoint_dir, or continue that run "
            f"with training.output_dir={run}"
        )


def _take(fd: int) -> bool:
    """The lock, tried a few times over a tenth of a second: another process's probe of the same folder
    (`_read_lock`: a run checking the folders above its own, `status`) holds it for an instant, and must
    not pass for a run."""
    for _ in range(5):
        if lock_exclusive(fd, wait=False):
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def run_lock(
    folder: str | Path, setting: str = "training.output_dir", owner: str | Path | None = None
) -> Iterator[None]:
    """Hold the exclusive lock of `folder` for the block; refuse at once if another process holds it or
    a folder above it. `setting`: the config field that named the folder, for the messages. `owner`: the
    output folder of the run the folder belongs to (default: the folder itself), recorded in the lock."""
    folder = Path(folder)
    key = str(folder.resolve())
    created = False
    if key in _held:
        _held[key][1] += 1
    else:
        _refuse_held_ancestor(Path(key), setting)
        created = not folder.exists()
        fd = _open_lock(folder, setting)
        if not _take(fd):  # another run holds it (on Windows, without flock, never)
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(
                f"{_WHAT.get(setting, 'folder')} {folder} is in use by a run still going ({holder}); "
                f"wait for it to end, or choose another {setting}"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{Path(owner or folder).resolve()}\n".encode(), 0)
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
    """The output folder's lock, and the checkpoint folder's when it lies elsewhere (refused when it
    holds another run's checkpoints); only the process that writes them (rank 0) takes them."""
    with contextlib.ExitStack() as stack:
        if is_main:
            output, checkpoints = Path(output_dir), Path(checkpoint_dir)
            stack.enter_context(run_lock(output))
            inside = checkpoints.resolve() == output.resolve() or output.resolve() in checkpoints.resolve().parents
            if not inside:
                _refuse_foreign_checkpoints(checkpoints, output)
                stack.enter_context(run_lock(checkpoints, "training.checkpoint_dir", owner=output))
        yield
