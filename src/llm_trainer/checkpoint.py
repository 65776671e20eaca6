"""Checkpoints: a folder of named stateful parts plus JSON metadata, written atomically and verified on load.

    checkpoint-00000500/
        model.safetensors, model_config.json   the model (a model folder: eval/generate/export take it)
        tokenizer.json                          so the folder stands alone
        optimizer.safetensors                   optimizer state tensors (Adam moments, steps)
        optimizer.pt                            the rest of the optimizer state (param groups, structure),
                                                plain data only; loaded with weights_only=True
        rng.pt                                  torch CPU/CUDA generator states (tensors)
        train_state.json                        step, epoch, tokens seen, best metric, early stopping,
                                                data position, schedule, Python/NumPy RNG
        meta.json                               format, step, save sequence number, experiment config,
                                                size and checksum of every file, checksum of itself
    latest                                      name of the newest complete checkpoint (written last)
    best_model/                                 standalone model folder of the best evaluation

Writing: every part goes into a hidden temporary folder (`.tmp-<name>-<host>-<pid>`); each file is
checksummed by worker threads while the next one is written; then all are fsynced, meta.json goes
in last, the folder is fsynced, renamed into place, and `latest` is replaced. A crash, a kill -9 or a
full disk at any point leaves every earlier checkpoint untouched; leftovers of a dead writer are
removed by the next save.

Reading: `resolve_checkpoint("latest")` takes the checkpoint saved last (by its save sequence
number, so a save that completed but was killed before `latest` was updated is not lost) and falls
back to the previous one, with a warning naming the reason, if a file is missing, truncated or does
not match its checksum. A checkpoint named explicitly is verified and refused if anything is wrong.
Tensors are read with safetensors and `torch.load(weights_only=True)` only: no pickled code runs.

Optimizer tensors go to safetensors (written about 3x faster than torch.save's zip archive, and
memory-mapped on load); optimizer.pt keeps only the structure around them, with a reference in
place of each tensor.

Checksums ("xxh3_64-64MiB-tree", format 3): the XXH3-64 hash of each consecutive 64 MiB chunk of a
file, and sha256 over those hashes; chunks are hashed in parallel, straight from the page cache
through a memory map (no copy into a read buffer). They detect truncation, bit flips and torn writes
(a file's size is checked too); tampering is the safe loader's job, not theirs. XXH3 runs at memory
speed (about 10x CRC-32 in zlib), so verifying a checkpoint costs about as much as reading it once.
Format 2 checkpoints ("crc32-64MiB-tree": CRC-32 per chunk) still verify and load, as do format 1
ones (plain sha256 per file, the whole optimizer state in optimizer.pt). Without the `xxhash`
package, new checkpoints fall back to CRC-32 chunks (slower, same guarantees).
meta.json carries a sha256 of its own content.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import shutil
import socket
import sys
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

try:
    import xxhash
except ImportError:  # a declared dependency; without it new checkpoints use CRC-32 chunks (format 2's)
    xxhash = None

from .errors import UsageError
from .logs import log, warn
from .model_files import WEIGHTS_NAME, save_model_folder, write_model_config
from .sharded_checkpoint import SHARDED_DIR

FORMAT_VERSION = 3
CRC32_TREE = "crc32-64MiB-tree"  # format 2
XXH3_TREE = "xxh3_64-64MiB-tree"  # format 3
CHECKSUM = XXH3_TREE if xxhash is not None else CRC32_TREE  # what new checkpoints record
PREFIX = "checkpoint-"
META = "meta.json"
LATEST = "latest"
BEST = "best_model"
OPTIMIZER = "optimizer.pt"
OPTIMIZER_TENSORS = "optimizer.safetensors"
RNG = "rng.pt"
TRAIN_STATE = "train_state.json"
# Files a training checkpoint cannot be resumed without; meta.json must list each of them.
REQUIRED = {
    "checkpoint": (WEIGHTS_NAME, "model_config.json", OPTIMIZER, OPTIMIZER_TENSORS, RNG, TRAIN_STATE),
    "sharded_checkpoint": ("model_config.json", RNG, TRAIN_STATE, f"{SHARDED_DIR}/.metadata"),
    "deepspeed_checkpoint": (WEIGHTS_NAME, "model_config.json", RNG, TRAIN_STATE),  # + DeepSpeed's files in sharded/
}

_CHUNK = 64 << 20  # bytes per checksum chunk (one unit of parallel work)
_BUFFER = 1 << 20  # read buffer per worker thread, reused (no page faults per read)
_LOW_SPACE = 16 << 20  # a write failing with less free space than this is reported as a full disk


class CheckpointError(UsageError):
    """A checkpoint could not be written or read; the message says which and why."""


# -- checksums, computed by a small pool of worker threads (zlib.crc32 and fsync release the GIL) ---

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_sync_pool: ThreadPoolExecutor | None = None
_thread_buffers = threading.local()


def _workers() -> ThreadPoolExecutor:
    """Checksum jobs (CPU): one thread per core."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 2), thread_name_prefix="checkpoint-hash")
        return _pool


def _syncers() -> ThreadPoolExecutor:
    """fsync jobs (disk): their own threads, so they run while the checksums are computed."""
    global _sync_pool
    with _pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checkpoint-fsync")
        return _sync_pool


def _forget_pool_after_fork() -> None:  # a forked child (a data-loader worker) has none of the threads
    global _pool, _sync_pool, _pool_lock
    _pool, _sync_pool, _pool_lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _read_chunks(handle, length: int) -> Iterable[memoryview]:
    """Up to `length` bytes from `handle` in reused buffers (for files a memory map cannot cover)."""
    buffer = getattr(_thread_buffers, "view", None)
    if buffer is None:
        buffer = _thread_buffers.view = memoryview(bytearray(_BUFFER))
    while length > 0:
        n = handle.readinto(buffer[: min(_BUFFER, length)])
        if not n:
            return  # the file is shorter than its recorded size: the checksum will not match
        yield buffer[:n]
        length -= n


def _hash_range(path: Path, offset: int, length: int, kind: str = CHECKSUM) -> int:
    """The chunk hash (CRC-32 or XXH3-64) of `length` bytes of `path` from `offset`.

    Hashed through a memory map of the chunk: the page cache is read in place, with no copy. A file
    shorter than offset + length (truncated since its size was checked) is read instead, so the
    short read gives a wrong checksum rather than a SIGBUS.
    """
    with open(path, "rb", buffering=0) as handle:
        if length > 0 and os.fstat(handle.fileno()).st_size >= offset + length:
            try:
                view = mmap.mmap(handle.fileno(), length, offset=offset, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                view = None  # a file system without mmap: read it
            if view is not None:
                try:
                    if hasattr(view, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                        view.madvise(mmap.MADV_WILLNEED)  # cold cache: read the chunk ahead in one go
                    return xxhash.xxh3_64_intdigest(view) if kind == XXH3_TREE else zlib.crc32(view)
                finally:
                    view.close()
        handle.seek(offset)
        if kind == XXH3_TREE:
            state = xxhash.xxh3_64()
            for piece in _read_chunks(handle, length):
                state.update(piece)
            return state.intdigest()
        crc = 0
        for piece in _read_chunks(handle, length):
            crc = zlib.crc32(piece, crc)
        return crc


def _checksum_jobs(path: Path, size: int, kind: str = CHECKSUM) -> list[Future]:
    return [_workers().submit(_hash_range, path, offset, min(_CHUNK, size - offset), kind)
            for offset in range(0, size, _CHUNK)]


def _combine(jobs: Iterable[Future], kind: str = CHECKSUM) -> str:
    width = 8 if kind == XXH3_TREE else 4
    top = hashlib.sha256()
    for job in jobs:
        top.update(job.result().to_bytes(width, "big"))
    return top.hexdigest()


def file_checksum(path: str | Path, kind: str = CHECKSUM) -> str:
    """The checksum of a file that meta.json records: sha256 over the hash of each 64 MiB chunk
    (XXH3-64 for "xxh3_64-64MiB-tree", CRC-32 for format 2's "crc32-64MiB-tree")."""
    path = Path(path)
    return _combine(_checksum_jobs(path, path.stat().st_size, kind), kind)


def _sha256_file(path: Path) -> str:  # format 1 checkpoints
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _meta_checksum(meta: dict) -> str:
    """Checksum of meta.json's content (without its own checksum field): a bit flip in meta is caught too."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- writing --------------------------------------------------------------------------------------


def _owner() -> str:
    """`<host>-<pid>`: names this process's temporary files, so leftovers of dead writers can be found."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_sync_file_range():
    """Linux's sync_file_range(2), or None: it starts writing a file's dirty pages back without waiting."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


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


def remove_stale(root: Path) -> None:
    """Delete temporary folders/files left in `root` by writers on this host that no longer run."""
    if os.name != "posix" or not root.is_dir():
        return  # os.kill(pid, 0) would terminate the process on Windows
    host = _owner().rsplit("-", 1)[0]
    for path in root.iterdir():
        name = path.name
        if name.startswith(".del-"):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if not name.startswith((".tmp-", ".old-", f".{LATEST}.tmp-")):
            continue
        head, _, pid = name.rpartition("-")
        if not pid.isdigit() or not head.endswith(f"-{host}") or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log(f"checkpoint: removed {name}, left by an interrupted save")


def remove_staging(root: Path) -> None:
    """Delete the per-rank staging folders (`.staging-*`) a multi-process save killed mid-way left.
    Only safe before any rank saves again: call it at the start of a run, on rank 0."""
    if not Path(root).is_dir():
        return
    for path in Path(root).glob(".staging-*"):
        shutil.rmtree(path, ignore_errors=True)
        log(f"checkpoint: removed {path.name}, left by an interrupted save")


def _disk_full(exc: BaseException, directory: Path) -> bool:
    """ENOSPC/EDQUOT, however the writer reports it (safetensors and torch.save wrap the OS error)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return True
    text = str(exc).lower()
    if "no space left" in text or "os error 28" in text or "quota exceeded" in text:
        return True
    if isinstance(exc, (OSError, RuntimeError)):  # torch.save says only "unexpected pos" or "file write failed"
        try:
            return shutil.disk_usage(directory).free < _LOW_SPACE
        except OSError:
            return False
    return False


def _io_failure(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or "i/o error" in str(exc).lower() or "file write failed" in str(exc).lower()


Writer = Callable[[Path], None]  # creates one or more files in the folder it is given


def _files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder: its own, and those of its `sharded/` subfolder (FSDP)."""
    files = [p for p in sorted(folder.iterdir()) if p.is_file()]
    if (folder / SHARDED_DIR).is_dir():
        files += [p for p in sorted((folder / SHARDED_DIR).iterdir()) if p.is_file()]
    return files


def write_folder_atomically(final: Path, writers: Iterable[Writer], meta: dict[str, Any]) -> Path:
    """Create `final` by calling each writer on a temporary folder; add meta.json with sizes and checksums.

    Each file a writer produced is checksummed by worker threads (from the page cache, in 64 MiB
    chunks) while the next writer runs, and its writeback to disk starts while the writers run
    (see _Writeback). Then every file is fsynced,
    meta.json is written, the folder is fsynced and renamed to `final` (replacing an older folder of
    that name), and the parent folder is fsynced. On any error the temporary folder is
    removed and `final` (if it existed) is left as it was; a full disk says so.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{_owner()}"
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
                    jobs[name] = (size, _checksum_jobs(path, size))
        writeback.stop()
        # fsync only now: on ext4 an fsync stalls concurrent writes to other files of the same folder
        # (sync_file_range, above, only starts the writeback, and does not).
        syncs.extend(_syncers().submit(_fsync, tmp / name) for name in sorted(jobs))
        files = {name: {"size": size, "checksum": _combine(chunks)} for name, (size, chunks) in sorted(jobs.items())}
        version = FORMAT_VERSION if CHECKSUM == XXH3_TREE else 2  # CRC-32 chunks: format 2 readers take it
        full = {**meta, "format_version": version, "checksum": CHECKSUM, "files": files}
        full["meta_sha256"] = _meta_checksum(full)
        with open(tmp / META, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(full, indent=2))
            handle.flush()
            os.fsync(handle.fileno())
        for job in syncs:
            job.result()
        if (tmp / SHARDED_DIR).is_dir():
            _fsync_dir(tmp / SHARDED_DIR)
        _fsync_dir(tmp)
        if final.exists():
            old = final.parent / f".old-{final.name}-{_owner()}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            try:
                tmp.rename(final)
            except BaseException:
                old.rename(final)  # put the previous version back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(final.parent)
    except BaseException as exc:
        if writeback is not None:
            writeback.stop()
        pending = [job for _, chunks in jobs.values() for job in chunks] + syncs
        for job in pending:
            job.cancel()
        wait(pending)  # no worker may still read or fsync a file that is about to be deleted
        full_disk = isinstance(exc, Exception) and _disk_full(exc, final.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if full_disk:
            raise CheckpointError(
                f"disk full while saving {final.name} to {final.parent} ({_first_line(exc)}); the earlier "
                f"checkpoints and `latest` are intact. Free space there or lower training.save_total_limit, "
                f"then resume with training.resume_from_checkpoint=latest"
            ) from None
        if isinstance(exc, Exception) and _io_failure(exc):
            raise CheckpointError(
                f"could not write checkpoint {final} ({_first_line(exc)}); the earlier checkpoints are intact"
            ) from None
        raise
    return final


def _write_atomically(path: Path, text: str) -> None:
    """Replace a small file atomically (temporary file, fsync, rename, fsync of the folder)."""
    tmp = path.with_name(f".{path.name}.tmp-{_owner()}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
        _fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        reason = "disk full" if _disk_full(exc, path.parent) else "write failed"
        raise CheckpointError(f"could not update {path} ({reason}: {_first_line(exc)}); the checkpoints themselves are intact") from None


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    return meta if isinstance(meta, dict) else None


def _sequence(path: Path) -> int | None:
    meta = _read_meta(path)
    value = meta.get("sequence") if meta else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _next_sequence(root: Path) -> int:
    """1 + the highest save sequence number under `root`: orders saves by time, whatever their step."""
    numbers = [_sequence(p) for p in list_checkpoints(root)]
    return 1 + max((n for n in numbers if n is not None), default=0)


_TENSOR_REF = "__llm_trainer_tensor__"  # {_TENSOR_REF: key} stands for a tensor of optimizer.safetensors
_SAFETENSORS_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(structure with a reference in place of each dense tensor, {key: contiguous CPU tensor}).

    Tensors safetensors cannot hold (sparse, quantized, unusual dtypes) stay in the structure.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.dtype not in _SAFETENSORS_DTYPES:
                return value
            tensor = value.detach().to("cpu").contiguous()
            storage = tensor.untyped_storage()
            if tensor.numel() and (storage.data_ptr() in seen or storage.nbytes() != tensor.nbytes):
                tensor = tensor.clone()  # a view into shared memory: safetensors wants each tensor on its own
            seen.add(tensor.untyped_storage().data_ptr())
            key = where if where not in tensors else f"{where}#{len(tensors)}"
            tensors[key] = tensor
            return {_TENSOR_REF: key}
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{where}.{i}") for i, v in enumerate(value))
        return value

    return walk(state, ""), tensors


def join_tensors(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of split_tensors."""
    if isinstance(structure, dict):
        if len(structure) == 1 and _TENSOR_REF in structure:
            key = structure[_TENSOR_REF]
            if key not in tensors:
                raise KeyError(f"tensor {key!r} is missing from {OPTIMIZER_TENSORS}")
            return tensors[key]
        return {k: join_tensors(v, tensors) for k, v in structure.items()}
    if type(structure) in (list, tuple):
        return type(structure)(join_tensors(v, tensors) for v in structure)
    return structure


def _text_writer(name: str, content: str) -> Writer:
    def write(folder: Path) -> None:
        (folder / name).write_text(content, encoding="utf-8")

    return write


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer_state: dict | None,
    train_state: dict,
    rng_tensors: dict,
    config: dict,
    tokenizer_json: str | None,
    extra_meta: dict | None = None,
    sharded_dir: Path | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write one checkpoint. With `sharded_dir` (FSDP: every rank's DCP shards of model and optimizer,
    already written), that folder moves in as `sharded/` in place of the weight and optimizer files.
    `model_state`, when given, holds the weights to write (a copy taken earlier, for a background
    save); `model` then only supplies the config."""
    root = Path(root)
    remove_stale(root)

    from safetensors.torch import save_file

    writers: list[Writer] = [
        lambda tmp: torch.save(rng_tensors, tmp / RNG),
        _text_writer(TRAIN_STATE, json.dumps(train_state, indent=2)),
    ]
    weights_sharded = sharded_dir is not None and (Path(sharded_dir) / ".metadata").is_file()
    if not weights_sharded:
        writers.insert(0, lambda tmp: save_model_folder(model, tmp, state=model_state))  # model.safetensors + config
    if not weights_sharded and optimizer_state is not None:  # None: DeepSpeed's files in sharded_dir hold it
        optimizer_structure, optimizer_tensors = split_tensors(optimizer_state)
        writers[1:1] = [
            lambda tmp: save_file(optimizer_tensors, str(tmp / OPTIMIZER_TENSORS), metadata={"format": "pt"}),
            lambda tmp: torch.save(optimizer_structure, tmp / OPTIMIZER),
        ]
    if weights_sharded:
        writers.insert(0, lambda tmp: write_model_config(model, tmp))
    if sharded_dir is not None:  # per-rank files: RNG states, and the DCP shards under FSDP
        writers.insert(0, lambda tmp: shutil.move(str(sharded_dir), tmp / SHARDED_DIR))
    if tokenizer_json is not None:
        writers.append(_text_writer("tokenizer.json", tokenizer_json))
    meta = {
        "kind": "sharded_checkpoint" if weights_sharded else "checkpoint" if optimizer_state is not None
        else "deepspeed_checkpoint", "step": step,
        "sequence": _next_sequence(root), "created": time.time(), "config": config, **(extra_meta or {}),
    }
    path = write_folder_atomically(root / f"{PREFIX}{step:08d}", writers, meta)
    _write_atomically(root / LATEST, path.name)
    return path


def save_best_model(root: Path, model: torch.nn.Module, *, tokenizer_json: str | None, config: dict, metrics: dict,
                    state: dict[str, torch.Tensor] | None = None) -> Path:
    """A standalone model folder; `state` gives the weights when the model itself is sharded."""
    writers: list[Writer] = [lambda tmp: save_model_folder(model, tmp, state=state)]
    if tokenizer_json is not None:
        writers.append(_text_writer("tokenizer.json", tokenizer_json))
    return write_folder_atomically(Path(root) / BEST, writers, {"kind": "best_model", "config": config, "metrics": metrics})


# -- reading --------------------------------------------------------------------------------------

_verified: dict[str, tuple] = {}  # folder -> file signatures when it last verified, so resume hashes once


def _signature(path: Path) -> tuple | None:
    try:
        return tuple(
            (p.name, s.st_size, s.st_mtime_ns, s.st_ino)
            for p in sorted(path.iterdir()) if p.is_file() for s in [p.stat()]
        )
    except OSError:
        return None


def _safe_file_name(name) -> bool:
    """A plain file name, or one inside the `sharded/` subfolder; nothing that could leave the folder."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    if len(parts) == 2 and parts[0] == SHARDED_DIR:
        parts = parts[1:]
    return len(parts) == 1 and Path(parts[0]).name == parts[0] and parts[0] not in ("", ".", "..")


def verify(path: Path) -> str | None:
    """None if the folder is a complete checkpoint whose files match their sizes and checksums, else the reason."""
    path = Path(path)
    if not (path / META).is_file():
        return "incomplete: no meta.json (the save was interrupted)"
    meta = _read_meta(path)
    if meta is None or not isinstance(meta.get("files"), dict):
        return "meta.json is corrupt"
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_checksum(meta):
        return "meta.json does not match its checksum (corrupt)"
    files, folder_kind, version = meta["files"], meta.get("kind"), meta.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return f"unknown checkpoint format {version!r} (this llm-trainer reads up to {FORMAT_VERSION}); upgrade llm-trainer"
    kind = meta.get("checksum") if version >= 2 else None
    if version >= 2 and kind not in (CRC32_TREE, XXH3_TREE):
        return f"unknown checksum kind {kind!r} in meta.json"
    if kind == XXH3_TREE and xxhash is None:
        return f"its checksums are {XXH3_TREE}, which needs the xxhash package (pip install xxhash)"
    for name in REQUIRED.get(folder_kind, ()) if isinstance(folder_kind, str) else ():
        if name not in files and (version >= 2 or name != OPTIMIZER_TENSORS):
            return f"meta.json does not list {name}"
    plain_sha256 = version < 2
    jobs: dict[str, Any] = {}
    for name, entry in files.items():
        file = path / name
        if not _safe_file_name(name):
            return f"meta.json names an invalid file {name!r}"
        if not file.is_file():
            return f"{name} is missing"
        if plain_sha256:
            jobs[name] = (entry, None)
            continue
        if not isinstance(entry, dict) or "size" not in entry or "checksum" not in entry:
            return "meta.json is corrupt"
        size = file.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            return f"{name} is {what} ({size:,} bytes, {entry['size']:,} expected)"
        jobs[name] = (entry["checksum"], _checksum_jobs(file, size, kind))
    for name, (expected, chunks) in jobs.items():
        actual = _sha256_file(path / name) if chunks is None else _combine(chunks, kind)
        if actual != expected:
            return f"{name} does not match its checksum (corrupt)"
    return None


def _verified_ok(path: Path) -> str | None:
    """verify(), skipped when this process already verified the folder and no file changed since."""
    key = str(Path(path).resolve())
    signature = _signature(Path(path))
    if signature is not None and _verified.get(key) == signature:
        return None
    problem = verify(Path(path))
    if problem is None and signature is not None:
        _verified[key] = signature
    return problem


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, highest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def _newest_first(root: Path) -> list[Path]:
    """Checkpoints in the order they were saved, newest first (save sequence; then `latest`; then step)."""
    candidates = list_checkpoints(root)
    pointer = root / LATEST
    named = None
    if pointer.is_file():
        try:
            named = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            warn(f"{pointer} is unreadable; choosing the checkpoint by save order")

    sequences = {path: _sequence(path) for path in candidates}

    def key(path: Path):
        sequence = sequences[path]
        if sequence is None and path.name == named:  # `latest` names it but its meta is unreadable:
            sequence = 1 << 62  # try it first, so the warning says why it was skipped
        return (sequence if sequence is not None else -1, path.name == named, int(path.name[len(PREFIX):]))

    return sorted(candidates, key=key, reverse=True)


def resolve_checkpoint(spec: str, root: Path) -> Path | None:
    """A checkpoint folder from a path or "latest"; "latest" skips unusable ones, saying why.

    Returns None for "latest" when there is no checkpoint yet (a fresh start, e.g. an elastic restart).
    """
    root = Path(root)
    if spec != "latest":
        path = Path(spec)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} not found; pass a checkpoint folder or resume_from_checkpoint=latest")
        if not (path / META).is_file():
            if (path / LATEST).is_file() or list_checkpoints(path):  # a checkpoints root was given
                return resolve_checkpoint("latest", path)
            if (path / "checkpoints").is_dir():  # an output folder
                return resolve_checkpoint("latest", path / "checkpoints")
        problem = _verified_ok(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        return path
    candidates = _newest_first(root)
    for path in candidates:
        problem = _verified_ok(path)
        if problem is None:
            return path
        warn(f"skipping checkpoint {path}: {problem}; trying the previous one")
    if candidates:
        raise CheckpointError(f"no usable checkpoint in {root}: every one is corrupt or incomplete (see the warnings above)")
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


def _refusal(exc: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, in one line."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand \d+", text)
    if "Weights only load failed" in text or found:
        detail = f" ({found.group(1) if found.lastindex else found.group(0)})" if found else ""
        return (
            f"it holds pickled objects other than tensors and plain data{detail}, which could run code; "
            "refusing to unpickle it (the file was not written by llm-trainer, or was altered)"
        )
    return _first_line(exc)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", *, verify_files: bool = True) -> dict[str, Any]:
    """Every part of a checkpoint, verified first; tensors through safetensors or torch.load(weights_only=True).

    Model tensors are read on the CPU and optimizer tensors are mapped to `map_location`, so a
    checkpoint written on a GPU loads on a CPU-only machine. Large files are memory-mapped.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if verify_files:
        problem = _verified_ok(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
    def optimizer(file: Path) -> Any:
        structure = _torch_load(file, map_location)
        tensors_file = path / OPTIMIZER_TENSORS
        if not tensors_file.is_file():  # format 1: everything in optimizer.pt
            return structure
        tensors = load_file(str(tensors_file), device="cpu")
        if map_location is not None and torch.device(map_location).type != "cpu":
            tensors = {k: v.to(map_location) for k, v in tensors.items()}
        return join_tensors(structure, tensors)

    sharded = (path / SHARDED_DIR / ".metadata").is_file()  # FSDP: each rank reads its model/optimizer part
    deepspeed = (_read_meta(path) or {}).get("kind") == "deepspeed_checkpoint"  # optimizer in DeepSpeed's files
    parts: dict[str, Any] = {"model": None, "optimizer": None,
                             "sharded": path / SHARDED_DIR if (path / SHARDED_DIR).is_dir() else None}
    for key, name, load in (
        *(() if sharded else (("model", WEIGHTS_NAME, lambda f: load_file(str(f), device="cpu")),)),
        *(() if sharded or deepspeed else (("optimizer", OPTIMIZER, optimizer),)),
        ("rng", RNG, lambda f: _torch_load(f, "cpu")),
        ("train_state", TRAIN_STATE, lambda f: json.loads(f.read_text(encoding="utf-8"))),
        ("meta", META, lambda f: json.loads(f.read_text(encoding="utf-8"))),
    ):
        try:
            parts[key] = load(path / name)
        except Exception as exc:  # pickle.UnpicklingError for crafted files, OSError, safetensors and JSON errors
            raise CheckpointError(f"checkpoint {path} could not be loaded safely: {name}: {_refusal(exc)}") from None
    return parts


def _torch_load(file: Path, map_location) -> Any:
    try:  # memory-mapped: nothing is copied until used
        return torch.load(file, map_location=map_location, weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # only files torch.save did not write as a zip archive cannot be mapped
            raise
        return torch.load(file, map_location=map_location, weights_only=True)


def rotate(root: Path, keep_last: int | None, protect: set[str]) -> None:
    """Delete all but the newest `keep_last` checkpoints, never one named in `protect` (the best, the new one).

    A folder is renamed to a hidden name before it is deleted, so a crash mid-delete never leaves a
    half-deleted folder that looks like a checkpoint.
    """
    if keep_last is None:
        return
    root = Path(root)
    for path in _newest_first(root)[keep_last:]:
        if path.name in protect:
            continue
        doomed = root / f".del-{path.name}-{_owner()}"
        try:
            path.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        log(f"checkpoint: removed {path.name} (save_total_limit={keep_last})")
