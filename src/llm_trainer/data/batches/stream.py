"""Training tokens streamed from object storage in chunks, through a bounded local cache.

When `data.cache_dir` is a URL, the prepared folder's small files (manifest, tokenizer, offsets, sources,
the validation split) are downloaded whole, but `train.bin` is read by byte range, one chunk at a time:

  train.chunks.json   written next to train.bin before the folder is uploaded (the manifest stays the
                      upload's last file): the file's size, the chunk size, and each chunk's checksum
  {prepared folder}/train.chunks/   the chunks that have arrived, each checked against its checksum
                      (a mismatch is fetched once more, then one error), written atomically; those read
                      longest ago are evicted first (never those read ahead), to keep the whole
                      `data.stream_cache_dir` under `data.stream_cache_limit`

A background pool reads ahead the chunks the loader will need next (it knows its future samples), so
the training loop waits only for a chunk that has not arrived yet (counted in `data_wait_fraction`).

The training order of such a folder is a sliding-window shuffle (`block_order`), so that a stretch of
training touches a bounded set of chunks while every batch mixes many of them: per epoch, a seeded
permutation of the chunks, and each row given a key, its chunk's place in that permutation plus a
uniform offset of up to WINDOW chunks (wrapping around the end); the rows are trained in key order. At
any point of the epoch the rows come evenly from about WINDOW chunks, and that set slides along by one
chunk at a time (each chunk is fetched as it enters, a few ahead, and becomes the cache's oldest as it
leaves). It is a function of the seed, the epoch and the folder's chunk layout only (never of the world
size or the cache size), and it applies to every run whose prepared folder has a chunk record, whether
its tokens stream or are on local disk (the run that prepared and uploaded them), so resuming elsewhere
continues the same order. A local `data.cache_dir` has no chunk record: its tokens are a memory map and
its order the global permutation, as before. A remote folder prepared by a version without chunk
records is downloaded whole, as before.
"""

from __future__ import annotations

import atexit
import itertools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UsageError
from ...files import buckets
from ...files.atomic import remove_dead_temporary_files, write_cache_file, write_file
from ...files.checksums import CHECKSUM, data_checksum
from ..format import PreparedData

CHUNKS = "train.chunks.json"  # the chunk record of train.bin, uploaded with the prepared folder
CHUNK_FOLDER = "train.chunks"  # the chunks that have arrived, in the local prepared folder
TARGET_CHUNKS = 256  # a file is cut into about this many chunks, within the bounds below
MIN_CHUNK_BYTES = 1 << 10
MAX_CHUNK_BYTES = 8 << 20  # one range read: long enough to amortise the store's latency
WINDOW = 64  # chunks whose rows are mixed at any point of an epoch (part of the order: never from settings)
READ_AHEAD = 8  # chunks fetched ahead of the loop, in the order it first needs them
THREADS = 4  # concurrent range reads


def window(n_chunks: int) -> int:
    """Chunks live at once in the order of a file of `n_chunks` (all of them for a small file)."""
    return max(1, min(WINDOW, n_chunks))


def min_cached(n_chunks: int) -> int:
    """Chunks the cache folder must hold: the live window, the read-ahead and the reads in flight."""
    return min(n_chunks, window(n_chunks) + READ_AHEAD + THREADS + 1)


def in_memory(n_chunks: int) -> int:
    """Chunks kept mapped in memory: the live window, the read-ahead, and neighbours rows straddle into."""
    return window(n_chunks) + READ_AHEAD + 2


def chunk_bytes_for(size: int) -> int:
    """The chunk size for a file of `size` bytes: a power of two (whole tokens of any dtype)."""
    wanted = max(1, -(-size // TARGET_CHUNKS))
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, 1 << (wanted - 1).bit_length()))


def write_chunk_record(directory: Path) -> None:
    """Write `train.chunks.json` for `directory/train.bin`: its size, chunk size and per-chunk checksums."""
    path = directory / "train.bin"
    size = path.stat().st_size
    chunk = chunk_bytes_for(size)
    sums = []
    with open(path, "rb") as handle:
        for _ in range(0, size, chunk):
            sums.append(data_checksum(handle.read(chunk)))
    record = {"file": "train.bin", "size": size, "chunk_bytes": chunk, "checksum": CHECKSUM, "chunks": sums}
    write_file(directory / CHUNKS, json.dumps(record).encode())


def chunk_record_problem(record: object, manifest: dict) -> str | None:
    """What makes a chunk record (from a bucket) unusable with its folder's `manifest` (already checked),
    or None: a positive chunk size of whole tokens, the size of the training tokens, one checksum per
    chunk (no fewer, no more) and a checksum kind this version computes."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    itemsize = np.dtype(manifest["dtype"]).itemsize
    chunk, size, sums = record.get("chunk_bytes"), record.get("size"), record.get("chunks")
    if type(chunk) is not int or chunk <= 0 or chunk % itemsize:
        return f"has chunk_bytes {chunk!r}, not a positive multiple of the token size ({itemsize})"
    expected = manifest["splits"]["train"]["tokens"] * itemsize
    if size != expected:
        return f"has size {size!r}, but the manifest's training tokens take {expected:,} bytes"
    if not isinstance(sums, list) or not all(isinstance(s, str) for s in sums):
        return "has no list of chunk checksums"
    if len(sums) != -(-size // chunk):
        return f"lists {len(sums)} chunk checksums for {-(-size // chunk)} chunks of {chunk:,} bytes"
    try:
        data_checksum(b"", record.get("checksum"))
    except (ValueError, TypeError):
        return f"has checksum kind {record.get('checksum')!r}, which this version cannot compute"
    return None


def block_order(first: np.ndarray, n_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """The rows' order for an epoch, given each row's first chunk (`first`): each row keyed by its chunk's
    place in a seeded permutation of the chunks plus a uniform offset of up to `window` chunks, modulo the
    chunk count, and sorted by key. Every stretch of the order draws evenly from the ~`window` chunks whose
    keys span it, so batches mix many chunks (all of them, as a global shuffle, when the file has no more
    chunks than WINDOW) while the cache holds only those. A function of (seed, epoch, layout) only."""
    rng = np.random.default_rng([seed, epoch, 2])
    rank = np.empty(n_chunks, dtype=np.int64)
    rank[rng.permutation(n_chunks)] = np.arange(n_chunks)
    keys = np.mod(rank[first] + rng.random(len(first)) * window(n_chunks), n_chunks)
    return np.argsort(keys, kind="stable")


def schedule(order: np.ndarray, first: np.ndarray, last: np.ndarray, n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample index, chunk) of each chunk's first use in the epoch `order`, by sample index, and of each
    use after a gap longer than a chunk's time in the window (a chunk whose keys wrapped around the end,
    read at the epoch's start and again at its end): the read-ahead plan. A row needs its first and last
    chunks (a row straddles at most one boundary unless it is longer than a chunk; chunks between are
    fetched when read)."""
    n = len(order)
    chunks = np.concatenate([first[order], last[order]])
    samples = np.concatenate([np.arange(n), np.arange(n)])
    by = np.lexsort((samples, chunks))
    chunks, samples = chunks[by], samples[by]
    life = max(1, window(n_chunks) * n // max(1, n_chunks))  # samples a chunk stays in the window
    head = np.ones(len(chunks), dtype=bool)
    head[1:] = (chunks[1:] != chunks[:-1]) | (samples[1:] - samples[:-1] > life)
    chunks, samples = chunks[head], samples[head]
    by = np.argsort(samples, kind="stable")
    return samples[by], chunks[by]


class ChunkedTokens:
    """The training tokens as a read-only 1-D array for the row layouts (len, a slice, an integer array
    of positions), read by chunks: from the local `whole` file when it is there, else from the store at
    `url` through the cache folder `folder` holding at most `budget` bytes."""

    def __init__(self, record: dict, dtype: str, *, url: str, folder: Path, budget: int, whole: Path | None = None):
        self.dtype = np.dtype(dtype)
        self.url, self.folder, self.record = url, folder, record
        self.chunk_bytes, self.size = int(record["chunk_bytes"]), int(record["size"])
        self.chunk_tokens = self.chunk_bytes // self.dtype.itemsize
        self.n = self.size // self.dtype.itemsize
        self.n_chunks = len(record["chunks"])
        self.whole = np.memmap(whole, dtype=self.dtype, mode="r") if whole is not None else None
        self.budget = budget
        self.evicted: list[int] = []  # chunks evicted from the cache folder, in order (for tests and logs)
        self._memory: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pending: dict[int, Future] = {}
        self._pinned: set[int] = set()
        self._reserved = 0  # bytes of fetches in flight
        self._uses = itertools.count()
        self._last_use: dict[int, int] = {}  # chunk -> when this process last read it (eviction order)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        if self.whole is None:
            needed = min_cached(self.n_chunks)
            if budget < needed * self.chunk_bytes:
                raise UsageError(
                    f"data.stream_cache_limit leaves {max(0, budget):,} bytes for streaming {url}, which needs "
                    f"{needed * self.chunk_bytes:,} ({needed} chunks of {self.chunk_bytes:,}); "
                    "raise data.stream_cache_limit"
                )
            folder.mkdir(parents=True, exist_ok=True)
            remove_dead_temporary_files(folder)  # partial writes of processes that died

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.n)
            assert step == 1, "only contiguous slices"
            return self._range(start, max(start, stop))
        if isinstance(key, (int, np.integer)):
            key = int(key) + (self.n if key < 0 else 0)
            if not 0 <= key < self.n:
                raise IndexError(key)
            return self._range(key, key + 1)[0]
        positions = np.asarray(key, dtype=np.int64)
        out = np.empty(positions.shape, dtype=self.dtype)
        which = positions // self.chunk_tokens
        for c in np.unique(which).tolist():
            mask = which == c
            out[mask] = self.chunk(c)[positions[mask] - c * self.chunk_tokens]
        return out

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        ct = self.chunk_tokens
        parts = [self.chunk(c) for c in range(start // ct, (stop - 1) // ct + 1)]
        joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
        base = (start // ct) * ct
        return joined[start - base : stop - base]

    # ------------------------------------------------------------------------------------------
    # chunks: in memory, in the cache folder, or fetched

    def chunk(self, c: int) -> np.ndarray:
        """Chunk c's tokens, waiting for it when it has not arrived."""
        if self.whole is not None:
            return self.whole[c * self.chunk_tokens : (c + 1) * self.chunk_tokens]
        self._last_use[c] = next(self._uses)
        found = self._memory.get(c)
        if found is not None:
            self._memory.move_to_end(c)
            return found
        with self._lock:
            job = self._pending.get(c)
        if job is None:
            data = self._from_disk(c)
            if data is None:
                data = self._fetch(c)
        else:
            data = job.result()
        self._memory[c] = data
        while len(self._memory) > in_memory(self.n_chunks):
            self._memory.popitem(last=False)
        return data

    def read_ahead(self, chunks) -> None:
        """Fetch these chunks (the next READ_AHEAD ones the loader will read, in order of need) in the
        background; they are not evicted before the next call."""
        if self.whole is None:
            chunks = [int(c) for c in chunks][:READ_AHEAD]
            with self._lock:
                self._pinned = set(chunks)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="stream")
                    atexit.register(self._pool.shutdown, wait=False, cancel_futures=True)  # no reads at exit
                for c in chunks:
                    if c not in self._pending and c not in self._memory and not self._path(c).is_file():
                        self._pending[c] = self._pool.submit(self._fetch, c)

    def _path(self, c: int) -> Path:
        return self.folder / f"{c:08d}.bin"

    def _from_disk(self, c: int) -> np.ndarray | None:
        """Chunk c from the cache folder (checked when it arrived), or None when it is not there whole."""
        try:
            data = _mapped(self._path(c), self.dtype)
        except (FileNotFoundError, ValueError):
            return None
        if data.nbytes != min(self.chunk_bytes, self.size - c * self.chunk_bytes):
            return None
        buckets.touch(self._path(c))
        return data

    def _fetch(self, c: int) -> np.ndarray:
        """Chunk c read from the store by byte range, checked against its checksum (fetched once more on
        a mismatch), written into the cache folder after evicting the chunks read longest ago."""
        try:
            start = c * self.chunk_bytes
            end = min(self.size, start + self.chunk_bytes)
            expected = self.record["chunks"][c]
            what = f"streaming chunk {c} (bytes {start}-{end})"
            for attempt in range(2):
                data = buckets.read_bytes(self.url, start, end, what=what)
                if len(data) == end - start and data_checksum(data, self.record["checksum"]) == expected:
                    break
                if attempt == 1:
                    raise UsageError(
                        f"{self.url} chunk {c} (bytes {start}-{end}) does not match its checksum in {CHUNKS} "
                        "(damaged in the store or in transit); prepare the data again"
                    )
            self._store(c, data)
            try:  # mapped, so the live window costs page cache, not this process's memory
                return _mapped(self._path(c), self.dtype)
            except (FileNotFoundError, ValueError):  # evicted at once by another process
                return np.frombuffer(data, dtype=self.dtype)
        finally:
            with self._lock:
                self._pending.pop(c, None)

    def _store(self, c: int, data: bytes) -> None:
        with self._lock:
            self._make_room(len(data))
            self._reserved += len(data)
        try:
            write_cache_file(self._path(c), data)
        finally:
            with self._lock:
                self._reserved -= len(data)

    def _make_room(self, needed: int) -> None:
        """Evict the chunks used longest ago (not the pinned read-ahead ones) until `needed` bytes fit:
        first those this process never read (another's, by age), then by this process's last read."""
        files = []
        for path, stat in self._files("*.bin"):
            if not (path.stem.isdigit() and len(path.stem) == 8):  # not a chunk this code wrote: left alone
                continue
            files.append((self._last_use.get(int(path.stem), -1), stat.st_mtime_ns, path, stat.st_size))
        used = sum(size for *_, size in files) + self._reserved
        for *_, path, size in sorted(files):
            if used + needed <= self.budget:
                break
            if int(path.stem) in self._pinned:
                continue
            path.unlink(missing_ok=True)
            self.evicted.append(int(path.stem))
            used -= size

    def _files(self, pattern: str):
        """(path, stat) of the cache folder's files (one evicted by another thread or process is passed over)."""
        for path in self.folder.glob(pattern):
            try:
                yield path, path.stat()
            except FileNotFoundError:
                continue

    def used_bytes(self) -> int:
        """Bytes in the cache folder now, partial writes included."""
        return sum(stat.st_size for _, stat in self._files("*")) if self.folder.is_dir() else 0


def _mapped(path: Path, dtype: np.dtype) -> np.ndarray:
    """A chunk file mapped read-only (the mapping outlives the file's eviction)."""
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass
class StreamedData(PreparedData):
    """A prepared folder with a chunk record: its training tokens are `ChunkedTokens` (streamed from
    `remote` unless train.bin is in the folder); everything else is read from the folder as usual."""

    remote: str
    budget: int

    def tokens(self, split: str):
        if split != "train" or self.manifest["splits"][split]["tokens"] == 0:
            return super().tokens(split)
        record = json.loads((self.directory / CHUNKS).read_text())
        whole = self.directory / "train.bin"
        return ChunkedTokens(
            record,
            self.manifest["dtype"],
            url=buckets.join(self.remote, "train.bin"),
            folder=self.directory / CHUNK_FOLDER,
            budget=self.budget,
            whole=whole if whole.is_file() else None,
        )
