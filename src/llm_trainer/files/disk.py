"""What the operating system's file layer tells us, decided once: whether a failed write means a
full disk, whether a folder can be written, an exclusive lock on an open file that dies with its
process, the mode new files get, and an opener that follows no symlink."""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
from pathlib import Path
from typing import IO

from ..errors import UsageError

# Errors of a write that found no room: the disk is full, or the user's quota is spent.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
LOW_SPACE = 16 << 20  # a write failing with less free space than this is reported as a full disk


def disk_full(exc: BaseException, directory: Path | None = None) -> bool:
    """Whether `exc` means the disk (or quota) is full, however the writer reports it.

    safetensors and torch.save wrap the OS error in their own message; torch.save may only say
    "unexpected pos" or "file write failed". With `directory`, an OSError or RuntimeError while that
    folder has almost no free space left counts as a full disk too.
    """
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    text = str(exc).lower()
    if "no space left" in text or "os error 28" in text or "quota exceeded" in text:
        return True
    if directory is not None and isinstance(exc, (OSError, RuntimeError)):
        try:
            return shutil.disk_usage(directory).free < LOW_SPACE
        except OSError:
            return False
    return False


def lock_exclusive(file: int | IO, *, wait: bool) -> bool:
    """Take an exclusive `flock` on an open file (a descriptor or a file object).

    The OS releases it when the file is closed or the process ends, however it ends, so a dead
    holder never leaves a stale lock. With `wait`, block until it is free; without, return False at
    once when another process holds it. Where flock does not exist (Windows) nothing is locked and
    True is returned.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no flock
        return True
    if wait:
        fcntl.flock(file, fcntl.LOCK_EX)
        return True
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def lock_shared(file: int | IO) -> None:
    """Take a shared `flock` on an open file, waiting while another process holds it exclusively: many
    processes may hold it at once, and none can take it exclusively (`lock_exclusive`) meanwhile. Released
    like `lock_exclusive`'s, when the file is closed or the process ends; nothing where flock does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no flock
        return
    fcntl.flock(file, fcntl.LOCK_SH)


def writable_folder(folder: Path, what: str) -> Path:
    """`folder`, created when missing and proven writable (a new file made and removed there); a
    one-line `UsageError` naming `what` (the flag or setting that chose it) otherwise."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{what} {folder} is a file, not a folder; choose a folder")
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
        probe.unlink()
    except OSError as exc:
        reason = "disk full" if disk_full(exc) else (exc.strerror or type(exc).__name__)
        raise UsageError(f"cannot write into {what} {folder} ({reason}); choose another folder or fix it") from None
    return folder


def check_output_file(path: str | Path, overwrite: bool, *, example: str, suffix: str | None = None) -> Path:
    """A file a command will write at `--output`, refused before any work: a folder there, or a name
    ending in a slash (`example` names a file in it), a name without `suffix` where the format is that
    one (a PNG plot), a file there without `overwrite` (the user's: never replaced unasked), or a folder
    to hold it that cannot be written."""
    named_as_folder = str(path).endswith(("/", os.sep))
    path = Path(path).expanduser()
    if path.is_dir() or named_as_folder:
        raise UsageError(f"--output {path} is a folder; give the file's path (e.g. {path / example})")
    if suffix is not None and path.suffix.lower() != suffix:
        raise UsageError(f"--output {path} must name a {suffix} file: it is written in that format")
    if path.exists() and not overwrite:
        raise UsageError(f"--output {path} exists; choose another file or pass --overwrite to replace it")
    writable_folder(path.absolute().parent, "the folder of --output")
    return path


@functools.cache
def new_file_mode() -> int:
    """The permission bits a new file gets here: 0666 less the process's umask (read from /proc, so that
    no thread ever sees a changed umask; elsewhere, set and restored once)."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found is not None:
        mask = int(found.group(1), 8)
    else:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def with_default_mode(path: str | Path) -> None:
    """Give `path` the mode any new file gets here. safetensors writes its files 0600, which a folder's
    other files (0644 under the usual umask) are not: copied to another user, the weights alone would
    be unreadable."""
    os.chmod(path, new_file_mode())


def no_follow(path: str, flags: int) -> int:
    """An `open(..., opener=no_follow)` that refuses a symlink planted at the path (files we write in
    an output folder must not be redirected elsewhere)."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
