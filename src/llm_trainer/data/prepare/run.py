"""`prepare_data`: the prepared folder for a DataConfig, found, downloaded or built (its files:
`data.format`; its stages: `data.prepare.build`). One prepare per folder at a time; `data.executor`
builds it with a datatrove pipeline (`data.prepare.cluster`) instead of in this process; a
`data.cache_dir` URL is prepared locally and uploaded (`storage`), and its training tokens are
streamed from there (`data.batches.stream`)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from ...config import DataConfig
from ...errors import UsageError
from ...files import buckets
from ...files.disk import disk_full, lock_exclusive
from ...logs import log, warn
from ...tokenizer import Tokenizer
from ..batches.stream import CHUNK_FOLDER, CHUNKS, StreamedData, chunk_record_problem, write_chunk_record
from ..format import MANIFEST, PreparedData, manifest_problem
from ..text.mixture import weights_without_effect
from ..text.sources import one_listing
from .build import Build, data_fingerprint
from .executors import check_executor, prepare_with_executor
from .shards import remove_shards


@contextlib.contextmanager
def _locked(work: Path):
    """One prepare per work folder at a time; a second waits (the lock dies with its process)."""
    work.mkdir(parents=True, exist_ok=True)
    handle = open(work / ".lock", "a")
    try:
        lock_exclusive(handle, wait=True)
        yield
    finally:
        handle.close()


def _load(directory: Path, origin: str | None = None) -> PreparedData:
    """The finished folder `directory` (downloaded from `origin`, when it names a URL), its manifest checked."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        manifest = None
    problem = "is not JSON" if manifest is None else manifest_problem(manifest)
    if problem is not None:
        raise UsageError(f"{_damaged(directory, origin, MANIFEST)}: it {problem}; {_refetch(directory, origin)}")
    remove_shards(directory)  # left if the last run stopped right after its rename
    log(f"data: reusing {directory} ({manifest['splits']['train']['tokens']:,} training tokens)")
    return PreparedData(directory, Tokenizer.load(directory), manifest)


def find_prepared(cache_dir: str | Path, fingerprint: str) -> PreparedData | None:
    """The finished folder `{cache_dir}/{fingerprint}/`, opened read-only, or None.

    For a config that came with a checkpoint (eval's default data): it can only point at data
    prepared earlier, in this layout; nothing is read from elsewhere, written or removed.
    """
    if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9a-f]{16}", fingerprint):
        return None
    directory = Path(cache_dir) / fingerprint
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        val = manifest["splits"]["val"]["tokens"]
        if (
            manifest["fingerprint"] != fingerprint
            or manifest_problem(manifest) is not None
            or not isinstance(val, int)
            or any((directory / name).is_symlink() for name in (MANIFEST, "val.bin", "val.idx.npy", "tokenizer.json"))
        ):
            return None
        return PreparedData(directory, Tokenizer.load(directory), manifest)
    except (OSError, ValueError, TypeError, KeyError):  # missing, not JSON, not our layout, no tokenizer
        return None


EVAL_SPLIT_FILES = ("manifest.json", "tokenizer.json", "val.bin", "val.idx.npy", "val.sources.npy", "val.scores.npy")


def fetch_validation(url: str, fingerprint: str, root: Path) -> PreparedData | None:
    """The validation split of the finished folder `{url}/{fingerprint}/` (a run's `data.cache_dir` in a
    store), as a read-only copy `{root}/{fingerprint}/` of its manifest, tokenizer and val files (each
    checked against the folder's `files.json`; the training tokens stay in the store), or None when the
    store holds no finished folder there. `root` is kept apart from the prepared folders training uses: a
    folder without its training tokens must never be taken for one."""
    if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9a-f]{16}", fingerprint):
        return None
    found = find_prepared(root, fingerprint)
    if found is not None:
        return found
    remote = buckets.join(url, fingerprint)
    skip = [name for name in buckets.children(remote) if name not in EVAL_SPLIT_FILES]
    root.mkdir(parents=True, exist_ok=True)
    if not buckets.get_folder(remote, root / fingerprint, last=[MANIFEST], skip=skip):
        return None
    log(f"data: downloaded the validation split of {remote} into {root / fingerprint}")
    return find_prepared(root, fingerprint)


def prepare_data(config: DataConfig) -> PreparedData:
    """Build (or reuse, or resume) the token files for `config` (the folder's files: `data.format`). Each
    folder, pattern and store URL of the data is listed once for all of it (`sources.one_listing`)."""
    config.check_source()
    if config.executor is not None:
        check_executor(config)
    if (unweighted := weights_without_effect(config)) is not None:
        warn(unweighted)
    with one_listing():
        if config.remote_cache_dir:
            return _prepare_in_store(config)
        return _prepare_here(config, Path(config.cache_dir))


def _prepare_in_store(config: DataConfig) -> PreparedData:
    """`data.cache_dir` is a URL: the prepared folder `{cache_dir}/{fingerprint}/` is downloaded (every file
    checksummed on arrival) into `{stream_cache_dir}/prepared/{the URL's name}/`, except its training tokens,
    which stream in chunks (`data.batches.stream`); or it is prepared there and uploaded, with a chunk record, its
    manifest last. The local copies are bounded by `stream_cache_limit`, least recently used evicted.
    A folder uploaded without a chunk record (an earlier version) is downloaded whole."""
    cache, limit = Path(config.stream_cache_dir), config.stream_cache_limit
    fingerprint = data_fingerprint(config)
    remote = buckets.join(config.cache_dir, fingerprint)
    directory = config.local_cache_dir / fingerprint
    if (directory / MANIFEST).is_file() and buckets.mark_in_use(directory) and (directory / MANIFEST).is_file():
        buckets.touch(directory)
        return _open(directory, remote, cache, limit)
    directory.parent.mkdir(parents=True, exist_ok=True)
    room = lambda size: buckets.make_room(cache, size, limit)  # noqa: E731
    streamed = buckets.exists(buckets.join(remote, CHUNKS))
    if buckets.get_folder(remote, directory, last=[MANIFEST], room=room, skip=["train.bin"] if streamed else []):
        log(f"data: downloaded {remote} into {directory}" + (", its training tokens stream" if streamed else ""))
        buckets.mark_in_use(directory)
        return _open(directory, remote, cache, limit)
    buckets.check_writable(config.cache_dir, "data.cache_dir")
    _prepare_here(config, directory.parent)
    write_chunk_record(directory)
    buckets.put_folder(directory, remote, last=[MANIFEST])
    log(f"data: uploaded {directory} to {remote}")
    buckets.mark_in_use(directory)  # after the upload: the mark is no file of the folder's
    buckets.make_room(cache, 0, limit, keep=[directory])
    return _open(directory, remote, cache, limit)


def _damaged(directory: Path, origin: str | None, name: str) -> str:
    """The damaged file named as the user knows it: in the store when it came from one, else locally."""
    where = f"{buckets.join(origin, name)} (copied to {directory})" if origin else str(directory / name)
    return f"the prepared data's {where}"


def _refetch(directory: Path, origin: str | None) -> str:
    """The fix for a damaged prepared folder; a local copy of a bucket's folder is removed (it is this
    cache's own download), so the next run fetches the folder again."""
    if origin is None:
        return f"remove {directory} and prepare again"
    shutil.rmtree(directory, ignore_errors=True)
    return f"the folder in the store is damaged or not ours: remove {origin} (or use another data.cache_dir) and prepare again"


def _open(directory: Path, remote: str, cache: Path, limit: int) -> PreparedData:
    """The local prepared folder; with a chunk record, its training tokens read by chunks (streamed from
    `remote` when train.bin is not here) within what `limit` leaves of the cache. The manifest and the
    chunk record came from the store: both are checked before anything reads them."""
    prepared = _load(directory, remote)
    if not (directory / CHUNKS).is_file():
        return prepared
    try:
        record = json.loads((directory / CHUNKS).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        record = None
    problem = "is not JSON" if record is None else chunk_record_problem(record, prepared.manifest)
    if problem is not None:
        raise UsageError(f"{_damaged(directory, remote, CHUNKS)}: it {problem}; {_refetch(directory, remote)}")
    chunks = directory / CHUNK_FOLDER
    others = buckets.folder_size(cache) - (buckets.folder_size(chunks) if chunks.is_dir() else 0)
    return StreamedData(prepared.directory, prepared.tokenizer, prepared.manifest, remote=remote, budget=limit - others)


def _prepare_here(config: DataConfig, cache_root: Path) -> PreparedData:
    if cache_root.exists() and not cache_root.is_dir():
        raise UsageError(f"data.cache_dir {cache_root} is a file; point data.cache_dir at a folder")
    fingerprint = data_fingerprint(config)
    directory = cache_root / fingerprint
    if (directory / MANIFEST).is_file():
        return _load(directory)
    work = cache_root / f".{fingerprint}.partial"
    try:
        return _prepare(config, fingerprint, work, directory)
    except OSError as exc:  # the cache could not be written: nothing of it is kept (see _prepare)
        if disk_full(exc):
            raise UsageError(
                f"disk full while preparing data in {cache_root} ({exc.strerror or exc}); free space "
                "there or set data.cache_dir to another disk"
            ) from None
        if exc.filename is not None and Path(exc.filename).resolve().is_relative_to(cache_root.resolve()):
            raise UsageError(
                f"cannot write the data cache {cache_root} ({exc.strerror or exc}); set data.cache_dir "
                "to a folder you can write"
            ) from None
        raise


def _prepare(config: DataConfig, fingerprint: str, work: Path, directory: Path) -> PreparedData:
    with _locked(work):
        if (directory / MANIFEST).is_file():  # another process finished it while this one waited
            shutil.rmtree(work, ignore_errors=True)
            return _load(directory)
        if config.executor is not None:  # a datatrove pipeline; finished tasks are kept whatever happens
            return prepare_with_executor(config, fingerprint, work, directory)
        try:
            return Build(config, fingerprint, work, directory).run()
        except (KeyboardInterrupt, SystemExit):
            log(f"data: interrupted; the next prepare with this config resumes from the shards in {work}")
            raise
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
