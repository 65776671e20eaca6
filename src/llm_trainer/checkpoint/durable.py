"""A checkpoint's folder written durably and atomically: a crash, a kill -9 or a full disk leaves the
previous version untouched. Built on `files.atomic`, which owns every rename into place.

`write_folder_atomically` fills a hidden temporary folder (`atomic.temporary_folder`) through writer
functions, checksums each file while the next is written, fsyncs them, writes meta.json (the caller's
metadata plus every file's size and checksum, and a checksum of itself) last, fsyncs the folder and
moves it into place (`atomic.move_into_place`: a folder that exists already, best_model, is swapped
with the new one in one atomic exchange, or parked as `.old-<name>-<host>-<pid>` between two renames
where the exchange is missing). Leftovers of a dead writer are handled by `remove_stale`: a parked
version whose folder is gone is put back (or the new one, when it is complete, as its checksums
say), never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, wait
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, first_line
from ..files.atomic import (
    TEMPORARY_FILES,
    Writeback,
    dead_writer,
    folder_version,
    fsync_dir,
    fsync_file,
    move_into_place,
    temporary_folder,
)
from ..files.checksums import CHECKSUM, XXH3_TREE, LazyPool, checksum_jobs, combine, meta_checksum
from ..files.disk import disk_full
from ..logs import log
from .layout import FORMAT_VERSION, META
from .verify import verify

_syncers = LazyPool(4, "checkpoint-fsync")  # fsync jobs (disk): their own threads, beside the checksums


def _prefix(writes: str) -> str:
    return "checkpoint" if writes == "save" else writes


def _recover(root: Path, parked: Path, name: str, writer: str, writes: str = "save") -> None:
    """A dead writer parked the previous `name` as `parked`: if `name` is gone (killed between the two
    renames), put back the writer's new folder when it is complete, else the parked one."""
    final = root / name
    if final.exists():
        shutil.rmtree(parked, ignore_errors=True)  # superseded by a complete `name`
        return
    fresh = temporary_folder(final, writer)
    if fresh.is_dir() and (fresh / META).is_file():
        if verify(fresh) is None:  # the checksums say whether the new version is whole
            move_into_place(fresh, final)
            shutil.rmtree(parked, ignore_errors=True)
            log(f"{_prefix(writes)}: restored {name} from the complete {writes} an interrupted run left ({fresh.name})")
            return
    move_into_place(parked, final)
    log(f"{_prefix(writes)}: restored the previous {name} that an interrupted {writes} had moved aside ({parked.name})")


def remove_stale(root: Path, names: Collection[str] | None = None, *, writes: str = "save") -> None:
    """Clean up after writers on this host that no longer run: a folder they moved aside is recovered
    (see `_recover`), their temporary folders and files are deleted. With `names`, only the leftovers
    of writes of those folders (a folder we share with the user's own files: touch nothing else).
    `writes`: what they were, as the messages say it (a checkpoint's "save", an "export")."""
    if os.name != "posix" or not root.is_dir():
        return  # os.kill(pid, 0) would terminate the process on Windows
    for parked in sorted(root.glob(".old-*")):
        version = folder_version(parked.name)
        if version is None or (names is not None and version[1] not in names):
            continue
        if dead_writer(parked.name):
            _recover(root, parked, name=version[1], writer=version[2], writes=writes)
    for path in root.iterdir():
        name, version = path.name, folder_version(path.name)
        kind = None if version is None else version[0]
        if names is not None and (kind not in ("tmp", "old") or version[1] not in names):
            continue
        if kind == "del":
            shutil.rmtree(path, ignore_errors=True)
            continue
        if kind is None and not fnmatch(name, TEMPORARY_FILES):
            continue
        if not dead_writer(name):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log(f"{_prefix(writes)}: removed {name}, left by an interrupted {writes}")


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
    (see `atomic.Writeback`). Then every file is fsynced,
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
    writeback: Writeback | None = None

    try:
        tmp.mkdir()
        writeback = Writeback(lambda: _files(tmp))  # the disk starts writing while the writers still run
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
        syncs.extend(_syncers.submit(fsync_file, tmp / name) for name in sorted(jobs))
        files = {name: {"size": size, "checksum": combine(chunks)} for name, (size, chunks) in sorted(jobs.items())}
        _write_meta(tmp, meta, files, in_store)
        for job in syncs:
            job.result()
        for sub in (p for p in tmp.iterdir() if p.is_dir()):
            fsync_dir(sub)
        fsync_dir(tmp)
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


def _write_meta(folder: Path, meta: dict[str, Any], files: dict[str, dict], in_store: dict[str, dict] | None) -> None:
    """meta.json of `folder`: `meta`, the format, and each file's size and checksum; fsynced."""
    version = FORMAT_VERSION if CHECKSUM == XXH3_TREE else 2  # CRC-32 chunks: format 2 readers take it
    full = {**meta, "format_version": version, "checksum": CHECKSUM, "files": {**files, **(in_store or {})}}
    if in_store:
        full["in_store"] = sorted(in_store)
    full["meta_sha256"] = meta_checksum(full)
    with open(folder / META, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(full, indent=2))
        handle.flush()
        os.fsync(handle.fileno())


def record_files(folder: Path, meta: dict[str, Any]) -> None:
    """meta.json for a folder whose files are written, as `write_folder_atomically` writes it: for a
    folder that another writer puts in place (`checkpoint.publish`: a consolidated model folder)."""
    files = {}
    for path in _files(folder):
        size = path.stat().st_size
        files[path.relative_to(folder).as_posix()] = {"size": size, "checksum": combine(checksum_jobs(path, size))}
    _write_meta(folder, meta, files, None)


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


def text_writer(name: str, content: str) -> Writer:
    def write(folder: Path) -> None:
        (folder / name).write_text(content, encoding="utf-8")

    return write
