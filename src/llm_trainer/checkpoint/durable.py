"""Durable, atomic writes of whole folders: a crash, a kill -9 or a full disk leaves the previous
version untouched.

`write_folder_atomically` fills a hidden temporary folder (`.tmp-<name>-<host>-<pid>`) through
writer functions, checksums each file while the next is written, fsyncs them, writes meta.json (the
caller's metadata plus every file's size and checksum, and a checksum of itself) last, fsyncs the
folder, renames it into place and fsyncs the parent. A folder that exists already (best_model) is
swapped with the new one in one atomic exchange (Linux renameat2), so there is no moment without a
complete one; where the exchange is missing, two renames with the old version parked as
`.old-<name>-<host>-<pid>` in between. Leftovers of a dead writer are handled by `remove_stale`: a
parked version whose folder is gone is put back (or the new one, when it is complete), never deleted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..filesystem import disk_full
from ..logs import log
from .checksums import CHECKSUM, XXH3_TREE, LazyPool, checksum_jobs, combine, meta_checksum
from .layout import FORMAT_VERSION, META
from .verify import verify

_syncers = LazyPool(4, "checkpoint-fsync")  # fsync jobs (disk): their own threads, beside the checksums


def owner() -> str:
    """`<host>-<pid>`: names this process's temporary files, so leftovers of dead writers can be found."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _libc_sync_file_range():
    """Linux's sync_file_range(2), or None: it starts writing a file's dirty pages back without waiting."""
    import ctypes

    return _libc("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint), ctypes.c_int)


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the dirty pages; wait for nothing
_WRITEBACK_EVERY = 0.05  # seconds between two writeback kicks while the writers run


class _Writeback:
    """While the writers fill the temporary folder, keep the disk busy: every 50 ms, start the
    writeback of whatever they have written so far (sync_file_range, which does not wait), so the
    disk writes while the CPU writes the next bytes into the page cache, and the fsync at the end
    finds little left to do. Only a head start: the fsyncs still decide durability. A no-op where
    sync_file_range does not exist (or with LLM_TRAINER_EARLY_WRITEBACK=0)."""

    def __init__(self, folder: Path):
        self.folder, self.handles = folder, {}
        self.done = threading.Event()
        self.thread = None
        if _sync_file_range is not None and os.environ.get("LLM_TRAINER_EARLY_WRITEBACK", "1") != "0":
            self.thread = threading.Thread(target=self._run, name="checkpoint-writeback", daemon=True)
            self.thread.start()

    def _kick(self) -> None:
        try:
            paths = _files(self.folder)
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


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":  # directories cannot be opened for fsync on Windows; renames there are durable
        _fsync(path, directory=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _libc_renameat2():
    """glibc's renameat2(2), or None (another libc, or not Linux)."""
    import ctypes

    return _libc(
        "renameat2", (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint), ctypes.c_int
    )


_renameat2 = _libc_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


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


def _recover(root: Path, parked: Path, name: str, writer: str) -> None:
    """A dead writer parked the previous `name` as `parked`: if `name` is gone (killed between the two
    renames), put back the writer's new folder when it is complete, else the parked one."""
    final = root / name
    if final.exists():
        shutil.rmtree(parked, ignore_errors=True)  # superseded by a complete `name`
        return
    fresh = root / f".tmp-{name}-{writer}"
    if fresh.is_dir() and (fresh / META).is_file():
        if verify(fresh) is None:  # the checksums say whether the new version is whole
            fresh.rename(final)
            shutil.rmtree(parked, ignore_errors=True)
            log(f"checkpoint: restored {name} from the complete save an interrupted run left ({fresh.name})")
            return
    parked.rename(final)
    log(f"checkpoint: restored the previous {name} that an interrupted save had moved aside ({parked.name})")


def temporary_folder(final: Path) -> Path:
    """Where this process builds the next version of `final` (the name `remove_stale` and `_recover` know)."""
    return final.parent / f".tmp-{final.name}-{owner()}"


def _discard(previous: Path) -> None:
    """Delete the version a new one replaced; a symlink to a folder is removed, its target kept."""
    if previous.is_symlink():
        previous.unlink()
    else:
        shutil.rmtree(previous, ignore_errors=True)


def move_into_place(tmp: Path, final: Path) -> None:
    """Put the complete folder `tmp` (see `temporary_folder`) at `final`, then fsync the parent. A `final`
    that exists is swapped out in one atomic exchange and deleted; where the exchange is missing it is
    parked as `.old-<name>-<host>-<pid>` between two renames, put back by `remove_stale` if this process
    dies in between. At no moment is there no complete `final`."""
    if final.exists() and exchange(tmp, final):  # the new version in, the previous one now at `tmp`
        _discard(tmp)
    elif final.exists():
        old = final.parent / f".old-{final.name}-{owner()}"
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
    _fsync_dir(final.parent)


def remove_stale(root: Path, names: Collection[str] | None = None) -> None:
    """Clean up after writers on this host that no longer run: a folder they moved aside is recovered
    (see `_recover`), their temporary folders and files are deleted. With `names`, only the leftovers
    of writes of those folders (a folder we share with the user's own files: touch nothing else)."""
    if os.name != "posix" or not root.is_dir():
        return  # os.kill(pid, 0) would terminate the process on Windows
    host = owner().rsplit("-", 1)[0]
    for parked in sorted(root.glob(".old-*")):
        parts = parked.name[len(".old-") :].rsplit("-", 2)  # <name>-<host>-<pid>
        if len(parts) != 3:
            continue
        name, writer_host, pid = parts
        if names is not None and name not in names:
            continue
        if name and pid.isdigit() and writer_host == host and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            _recover(root, parked, name, f"{writer_host}-{pid}")
    for path in root.iterdir():
        name = path.name
        if names is not None and not (name.startswith((".tmp-", ".old-")) and name[5:].rsplit("-", 2)[0] in names):
            continue
        if name.startswith(".del-"):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if not (name.startswith((".tmp-", ".old-")) or ".tmp-" in name):  # write_text_atomically's ".{name}.tmp-"
            continue
        head, _, pid = name.rpartition("-")
        if not pid.isdigit() or not head.endswith(f"-{host}") or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log(f"checkpoint: removed {name}, left by an interrupted save")


def _io_failure(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or "i/o error" in str(exc).lower() or "file write failed" in str(exc).lower()


Writer = Callable[[Path], None]  # creates one or more files in the folder it is given


def _files(folder: Path) -> list[Path]:
    """The files of a folder being written: its own, and those of its subfolders one level down
    (a checkpoint's `sharded/`)."""
    files = [p for p in sorted(folder.iterdir()) if p.is_file()]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files += [p for p in sorted(sub.iterdir()) if p.is_file()]
    return files


def write_folder_atomically(
    final: Path, writers: Iterable[Writer], meta: dict[str, Any], in_store: dict[str, dict] | None = None
) -> Path:
    """Create `final` by calling each writer on a temporary folder; add meta.json with sizes and checksums.

    `in_store`: {name: {"size", "checksum"}} of files written straight into a store (a sharded
    checkpoint's shards), listed in meta.json beside the local files and named under its "in_store".

    Each file a writer produced is checksummed by worker threads (from the page cache, in 64 MiB
    chunks) while the next writer runs, and its writeback to disk starts while the writers run
    (see _Writeback). Then every file is fsynced,
    meta.json is written, the folder is fsynced and renamed to `final` (replacing an older folder of
    that name), and the parent folder is fsynced. On any error the temporary folder is
    removed and `final` (if it existed) is left as it was; a full disk says so.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(final)
    shutil.rmtree(tmp, ignore_errors=True)
    jobs: dict[str, tuple[int, list[Future]]] = {}
    syncs: list[Future] = []
    writeback: _Writeback | None = None

    try:
        tmp.mkdir()
        writeback = _Writeback(tmp)  # the disk starts writing while the writers still run
        for write in writers:
            write(tmp)
            for path in _files(tmp):  # checksum the new files while the next writer runs
                name = path.relative_to(tmp).as_posix()
                if name not in jobs:
                    size = path.stat().st_size
                    jobs[name] = (size, checksum_jobs(path, size))
        writeback.stop()
        # fsync only now: on ext4 an fsync stalls concurrent writes to other files of the same folder
        # (sync_file_range, above, only starts the writeback, and does not).
        syncs.extend(_syncers.submit(_fsync, tmp / name) for name in sorted(jobs))
        files = {name: {"size": size, "checksum": combine(chunks)} for name, (size, chunks) in sorted(jobs.items())}
        version = FORMAT_VERSION if CHECKSUM == XXH3_TREE else 2  # CRC-32 chunks: format 2 readers take it
        full = {**meta, "format_version": version, "checksum": CHECKSUM, "files": {**files, **(in_store or {})}}
        if in_store:
            full["in_store"] = sorted(in_store)
        full["meta_sha256"] = meta_checksum(full)
        with open(tmp / META, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(full, indent=2))
            handle.flush()
            os.fsync(handle.fileno())
        for job in syncs:
            job.result()
        for sub in (p for p in tmp.iterdir() if p.is_dir()):
            _fsync_dir(sub)
        _fsync_dir(tmp)
        move_into_place(tmp, final)
    except BaseException as exc:
        if writeback is not None:
            writeback.stop()
        pending = [job for _, chunks in jobs.values() for job in chunks] + syncs
        for job in pending:
            job.cancel()
        wait(pending)  # no worker may still read or fsync a file that is about to be deleted
        failure = save_failure(exc, final)  # before the folder goes: a full disk is judged on it
        shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure from None
        raise
    return final


def save_failure(exc: BaseException, final: Path) -> CheckpointError | None:
    """The one-line error for `exc`, raised while writing the checkpoint `final` (any of its files, a
    rank's shards included): a full disk or an I/O failure. None for another error, raised as it is."""
    if not isinstance(exc, Exception):
        return None
    if disk_full(exc, final.parent):
        return CheckpointError(
            f"disk full while saving {final.name} to {final.parent} ({first_line(exc)}); the earlier "
            f"checkpoints and `latest` are intact. Free space there or lower training.save_total_limit, "
            f"then resume with training.resume_from_checkpoint=latest"
        )
    if _io_failure(exc):
        return CheckpointError(
            f"could not write checkpoint {final} ({first_line(exc)}); the earlier checkpoints are intact"
        )
    return None


def no_follow(path: str, flags: int) -> int:
    """An `open(..., opener=no_follow)` that refuses a symlink planted at the path (files we write in
    an output folder must not be redirected elsewhere)."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)


def _new_file(path: str, flags: int) -> int:
    return no_follow(path, flags | os.O_EXCL)


def write_text_atomically(path: Path, text: str) -> None:
    write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Replace a small file atomically (temporary file, fsync, rename, fsync of the folder). The
    temporary file is created anew and the rename replaces a symlink at `path` instead of following it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{owner()}")
    try:
        tmp.unlink(missing_ok=True)
        with open(tmp, "wb", opener=_new_file) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        reason = "disk full" if disk_full(exc, path.parent) else "write failed"
        raise CheckpointError(
            f"could not update {path} ({reason}: {first_line(exc)}); the file is as it was, and the "
            "checkpoints are intact"
        ) from None


def text_writer(name: str, content: str) -> Writer:
    def write(folder: Path) -> None:
        (folder / name).write_text(content, encoding="utf-8")

    return write


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]
