"""Writes that a crash, a kill -9 or a full disk never leave half done: the one module that renames a
file or a folder into place.

    write_file(path, content)      a file replaced in one rename: written to a new temporary file
                                   beside it, fsynced, renamed over `path`, the folder fsynced
    write_cache_file(path, data)   the same without the fsyncs, for a cache entry that is fetched again
                                   when a crash loses it (never a partial file under its name either)
    write_bytes / write_text       `write_file` for a file the user reads or a run's small state (config,
                                   metrics, plots, `latest`): a failure is one `UsageError` line
    put_in_place(complete, path)   a complete file of ours (a download, a file written by a library that
                                   takes a path) renamed over `path`, the folder fsynced
    temporary_folder(final)        where the next version of the folder `final` is built, and
    move_into_place(tmp, final)    how it takes `final`'s place: one atomic exchange (Linux renameat2)
                                   when `final` exists, so there is no moment without a complete one
    remove_folder(path)            a folder renamed to a hidden name, then deleted (never half-deleted
                                   under its own name)
    fsync_file, fsync_dir, Writeback   durability, and an early start of it while a folder is filled
    owner, dead_writer             who made a temporary file or folder, and whether it still runs

Temporary names carry the writer's `<host>-<pid>` last (`.{name}.tmp-<thread>-<host>-<pid>` for files,
`.tmp-{name}-<host>-<pid>` and `.old-{name}-<host>-<pid>` for folders), so the leftovers of a writer
that died can be told from those of one still running (`dead_writer`).
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import UsageError, first_line
from .disk import disk_full, no_follow


def owner() -> str:
    """`<host>-<pid>`: names this process's temporary files, so leftovers of dead writers can be found."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def dead_writer(name: str) -> bool:
    """Whether `name` (ending `-<host>-<pid>`, see `owner`) was made by a process of this host that no
    longer runs. Never true on Windows, where os.kill(pid, 0) would end the process."""
    head, _, pid = name.rpartition("-")
    host = owner().rsplit("-", 1)[0]
    if os.name != "posix" or not pid.isdigit() or not head.endswith(f"-{host}") or int(pid) == os.getpid():
        return False
    return not pid_alive(int(pid))


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the names in a folder (a rename into it) durable; nothing on Windows, where folders cannot be
    opened for fsync and renames are durable."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file(path: str, flags: int) -> int:
    return no_follow(path, flags | os.O_EXCL)


def through_link(path: Path) -> Path:
    """Where a new version of `path` is put: a symlink's target, so the link stays and what it names gets
    the new version (as `cp` writes through one), where a rename onto the link would replace the link
    and leave its target as it was. Any other path as it is."""
    return path.resolve() if path.is_symlink() else path


TEMPORARY_FILES = ".*.tmp-*"  # the names `temporary_file` gives, as a pattern (fnmatch, Path.glob)


def temporary_file(path: Path) -> Path:
    """Where this thread writes the next version of the file `path` (hidden, its writer in the name)."""
    return path.with_name(f".{path.name}.tmp-{threading.get_native_id()}-{owner()}")


def remove_dead_temporary_files(folder: Path, of: str | None = None) -> None:
    """Delete the `temporary_file`s in `folder` (of the file named `of` only, when given) that a writer
    of this host left when it died: partial writes, never renamed into place."""
    pattern = TEMPORARY_FILES if of is None else f".{glob.escape(of)}.tmp-*"
    for partial in folder.glob(pattern):
        if dead_writer(partial.name) and not partial.is_dir():
            partial.unlink(missing_ok=True)


def write_file(path: Path, content: bytes | Callable[[BinaryIO], None], *, sync: bool = True) -> None:
    """Replace the file `path` in one rename with `content` (bytes, or a function writing into the open
    file). The temporary file is created anew (a symlink planted at its name is not followed), and the
    rename replaces a symlink at `path` instead of following it. With `sync`, the file is fsynced
    before the rename and the folder after it, so a crash leaves the old file or the new one, whole.
    An OSError is raised as it came (the temporary file removed)."""
    path = Path(path)
    tmp = temporary_file(path)
    try:
        tmp.unlink(missing_ok=True)
        with open(tmp, "wb", opener=_new_file) as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)


def write_cache_file(path: Path, data: bytes) -> None:
    """`write_file` without fsync: for a cache entry, which a crash may lose (it is fetched again) but
    never leaves partial under its name."""
    write_file(path, data, sync=False)


def write_bytes(path: Path, data: bytes) -> None:
    """`write_file` for a file the user reads or a run's small state; a failure is one `UsageError` line
    saying the file is as it was."""
    try:
        write_file(path, data)
    except OSError as exc:
        reason = "disk full" if disk_full(exc, Path(path).parent) else "write failed"
        raise UsageError(f"could not update {path} ({reason}: {first_line(exc)}); the file is as it was") from None


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def put_in_place(complete: Path, path: Path) -> None:
    """Rename the complete file `complete` (a download, a file a library wrote by name; fsynced by the
    caller where that matters) over `path`, in the same folder or on the same file system, then fsync
    `path`'s folder."""
    os.replace(complete, path)
    fsync_dir(Path(path).parent)


# ----------------------------------------------------------------------------------------------
# folders


def _libc(name: str, argtypes: tuple, restype):
    """A Linux libc function through ctypes (errno kept), or None elsewhere or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def _libc_renameat2():
    """glibc's renameat2(2), or None (another libc, or not Linux)."""
    import ctypes

    return _libc(
        "renameat2", (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint), ctypes.c_int
    )


def _libc_sync_file_range():
    """Linux's sync_file_range(2), or None: it starts writing a file's dirty pages back without waiting."""
    import ctypes

    return _libc("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint), ctypes.c_int)


_renameat2 = _libc_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the dirty pages; wait for nothing
_WRITEBACK_EVERY = 0.05  # seconds between two writeback kicks while the writers run


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step; False where the system or file system cannot (nothing moved)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    import ctypes

    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return False
    raise OSError(code, os.strerror(code), str(b))


def temporary_folder(final: Path, writer: str | None = None) -> Path:
    """Where this process (or `writer`, another's `owner()`) builds the next version of the folder
    `final` (`.tmp-<name>-<host>-<pid>`)."""
    return _version_folder("tmp", final, writer)


def parked_folder(final: Path) -> Path:
    """Where `move_into_place` parks the previous `final` where the atomic exchange is missing."""
    return _version_folder("old", final)


def parked_folders(final: Path) -> list[Path]:
    """The versions of `final` that `move_into_place` parked and a killed process left, by any process."""
    return sorted(final.parent.glob(f"{glob.escape(f'.old-{final.name}-')}*"))


FOLDER_VERSIONS = ("tmp", "old", "del")  # temporary_folder, parked_folder, remove_folder


def _version_folder(kind: str, final: Path, writer: str | None = None) -> Path:
    """`.<kind>-<name>-<host>-<pid>` beside `final`: a version of it that this process (or `writer`) made."""
    assert kind in FOLDER_VERSIONS
    return final.parent / f".{kind}-{final.name}-{writer or owner()}"


def folder_version(name: str) -> tuple[str, str, str] | None:
    """What the folder name `name` is, when `_version_folder` gave it: (kind, the name of the folder it is
    a version of, its writer's `<host>-<pid>`); None for any other name (a `temporary_file`'s included)."""
    kind, dash, rest = name[1:].partition("-")
    parts = rest.rsplit("-", 2)  # <name>-<host>-<pid>: a host name has no "-" (`owner`)
    if not name.startswith(".") or not dash or kind not in FOLDER_VERSIONS or len(parts) != 3:
        return None
    folder, host, pid = parts
    if not folder or not host or not pid.isdigit():
        return None
    return kind, folder, f"{host}-{pid}"


def _discard(previous: Path) -> None:
    """Delete the version a new one replaced; a symlink to a folder is removed, its target kept."""
    if previous.is_symlink():
        previous.unlink()
    else:
        shutil.rmtree(previous, ignore_errors=True)


def move_into_place(tmp: Path, final: Path) -> None:
    """Put the complete folder `tmp` (see `temporary_folder`) at `final`, then fsync the parent. A `final`
    that exists is swapped out in one atomic exchange and deleted; where the exchange is missing it is
    parked (`parked_folder`) between two renames, and put back if the second fails. A process killed
    in between leaves the parked folder, which its owner's next start recovers (checkpoint.durable's
    `remove_stale`)."""
    if final.exists() and exchange(tmp, final):  # the new version in, the previous one now at `tmp`
        _discard(tmp)
    elif final.exists():
        old = parked_folder(final)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        try:
            tmp.rename(final)
        except BaseException:
            old.rename(final)  # put the previous version back
            raise
        _discard(old)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)


def remove_folder(path: Path) -> bool:
    """Delete the folder `path`: renamed to `.del-<name>-<host>-<pid>` first, so a crash mid-delete never
    leaves a half-deleted folder under its name (checkpoint.durable's `remove_stale` finishes the job).
    False when it could not be moved (gone already, or in use elsewhere): nothing was deleted."""
    doomed = _version_folder("del", path)
    try:
        path.rename(doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


class Writeback:
    """While writers fill a folder, keep the disk busy: every 50 ms, start the writeback of whatever
    they have written so far (sync_file_range, which does not wait), so the disk writes while the CPU
    writes the next bytes into the page cache, and the fsync at the end finds little left to do. Only a
    head start: the fsyncs still decide durability. A no-op where sync_file_range does not exist (or
    with LLM_TRAINER_EARLY_WRITEBACK=0). `files()` lists the files written so far."""

    def __init__(self, files: Callable[[], list[Path]]):
        self.files, self.handles = files, {}
        self.done = threading.Event()
        self.thread = None
        if _sync_file_range is not None and os.environ.get("LLM_TRAINER_EARLY_WRITEBACK", "1") != "0":
            self.thread = threading.Thread(target=self._run, name="checkpoint-writeback", daemon=True)
            self.thread.start()

    def _kick(self) -> None:
        try:
            paths = self.files()
        except OSError:
            return
        for path in paths:
            try:
                fd = self.handles.get(path)
                if fd is None:
                    fd = self.handles[path] = os.open(path, os.O_RDONLY)
                _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
            except OSError:
                pass  # a file moved or vanished: the fsyncs later are what count

    def _run(self) -> None:
        while not self.done.wait(_WRITEBACK_EVERY):
            self._kick()
        self._kick()  # the files written last

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        for fd in self.handles.values():
            os.close(fd)
        self.handles.clear()
