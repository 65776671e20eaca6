"""File checksums for checkpoint integrity: chunked, parallel, straight from the page cache.

("xxh3_64-64MiB-tree", format 3): the XXH3-64 hash of each consecutive 64 MiB chunk of a file, and
sha256 over those hashes; chunks are hashed in parallel through a memory map (no copy into a read
buffer). They detect truncation, bit flips and torn writes (a file's size is checked too); a
checksum proves integrity, not origin. XXH3 runs at memory speed, well ahead of zlib's CRC-32
(see bench/README.md).
Format 2 ("crc32-64MiB-tree": CRC-32 per chunk) and format 1 (plain sha256 per file) still verify.
Without the `xxhash` package new checkpoints fall back to CRC-32 chunks (slower, same guarantees).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

try:
    import xxhash
except ImportError:  # a declared dependency; without it new checkpoints use CRC-32 chunks (format 2's)
    xxhash = None

CRC32_TREE = "crc32-64MiB-tree"  # format 2
XXH3_TREE = "xxh3_64-64MiB-tree"  # format 3
CHECKSUM = XXH3_TREE if xxhash is not None else CRC32_TREE  # what new checkpoints record

_CHUNK = 64 << 20  # bytes per checksum chunk (one unit of parallel work)
_BUFFER = 1 << 20  # read buffer per worker thread, reused (no page faults per read)

_thread_buffers = threading.local()


class LazyPool:
    """A thread pool started on first use, and forgotten in a forked child (a data-loader worker),
    which has none of its threads."""

    def __init__(self, max_workers: int, name: str):
        self.max_workers, self.name = max_workers, name
        self._lock, self._pool = threading.Lock(), None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def submit(self, fn, *args) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=self.name)
            return self._pool.submit(fn, *args)

    def _forget(self) -> None:
        self._lock, self._pool = threading.Lock(), None


_workers = LazyPool(min(16, os.cpu_count() or 2), "checkpoint-hash")  # checksum jobs (CPU): one thread per core


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


def checksum_jobs(path: Path, size: int, kind: str = CHECKSUM) -> list[Future]:
    return [
        _workers.submit(_hash_range, path, offset, min(_CHUNK, size - offset), kind)
        for offset in range(0, size, _CHUNK)
    ]


def combine(jobs: Iterable[Future], kind: str = CHECKSUM) -> str:
    return tree_checksum((job.result() for job in jobs), kind)


def tree_checksum(chunk_hashes: Iterable[int], kind: str = CHECKSUM) -> str:
    """The checksum of a file from its chunks' hashes, in order: sha256 over their big-endian bytes."""
    width = 8 if kind == XXH3_TREE else 4
    top = hashlib.sha256()
    for value in chunk_hashes:
        top.update(value.to_bytes(width, "big"))
    return top.hexdigest()


def file_checksum(path: str | Path, kind: str = CHECKSUM) -> str:
    """The checksum of a file that meta.json records: sha256 over the hash of each 64 MiB chunk
    (XXH3-64 for "xxh3_64-64MiB-tree", CRC-32 for format 2's "crc32-64MiB-tree")."""
    path = Path(path)
    return combine(checksum_jobs(path, path.stat().st_size, kind), kind)


def _hash_bytes(view: memoryview, kind: str) -> int:
    return xxhash.xxh3_64_intdigest(view) if kind == XXH3_TREE else zlib.crc32(view)


def data_checksum(data: bytes, kind: str = CHECKSUM) -> str:
    """`file_checksum` of bytes already in memory (a file read once, checked and then parsed from the
    same bytes); "sha256" gives format 1's plain sha256."""
    if kind == "sha256":
        return hashlib.sha256(data).hexdigest()
    if kind not in (CRC32_TREE, XXH3_TREE) or (kind == XXH3_TREE and xxhash is None):
        raise ValueError(f"cannot compute checksums of kind {kind!r}")
    view = memoryview(data)
    jobs = [
        _workers.submit(_hash_bytes, view[offset : offset + _CHUNK], kind) for offset in range(0, len(view), _CHUNK)
    ]
    return combine(jobs, kind)


class StreamChecksum:
    """`file_checksum` of bytes as they are written to a stream (a file in a store, never read back):
    each 64 MiB chunk hashed as it fills, in the current format."""

    def __init__(self) -> None:
        self.size, self._filled, self._hashes = 0, 0, []
        self._state = self._fresh()

    @staticmethod
    def _fresh():
        return xxhash.xxh3_64() if CHECKSUM == XXH3_TREE else [0]

    def _close_chunk(self) -> None:
        self._hashes.append(self._state.intdigest() if CHECKSUM == XXH3_TREE else self._state[0])
        self._state, self._filled = self._fresh(), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            piece, view = view[: _CHUNK - self._filled], view[_CHUNK - self._filled :]
            if CHECKSUM == XXH3_TREE:
                self._state.update(piece)
            else:
                self._state[0] = zlib.crc32(piece, self._state[0])
            self._filled += len(piece)
            self.size += len(piece)
            if self._filled == _CHUNK:
                self._close_chunk()

    def entry(self) -> dict:
        """{"size", "checksum"} as meta.json and files.json record them (no further update after)."""
        if self._filled:
            self._close_chunk()
        return {"size": self.size, "checksum": tree_checksum(self._hashes)}


def sha256_file(path: Path) -> str:  # format 1 checkpoints
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def meta_checksum(meta: dict) -> str:
    """Checksum of meta.json's content (without its own checksum field): a bit flip in meta is caught too."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
