"""Token shards: how `prepare` writes its output so that an interruption loses at most one shard.

Shard k, in `{work folder}/shards/`, is
  {k}.train.bin / {k}.val.bin          tokens (uint16/uint32), each document followed by end-of-text
  {k}.train.len.npy / {k}.val.len.npy  int64 token count of each document
  {k}.train.src.npy / {k}.val.src.npy  int16 source of each document (index into the manifest's source_names)
  {k}.keys.npy / {k}.sigs.npy          dedup keys (and MinHash signatures) of its kept documents, in order
  {k}.train.scores.npy / ...           curriculum scores, when curriculum_key names a column
  {k}.json                             the commit record, written last, atomically
A split by tokens (too few documents to hold one out) writes its shards into `shards.by-tokens/`, which
then takes the place of `shards/` (`ShardWriter.replace_with`).
The record says where the input stream stood after the shard and holds the counters at that point. A
shard without a record (the one being written when the process died), or whose files do not have the
recorded sizes, is deleted and redone: a half-written shard is never taken for a complete one.

`finalize` concatenates the shards into train.bin / val.bin + train.idx.npy / val.idx.npy (document
offsets), the layout `PreparedData` and the loader read; only tokens and one int64 per document are
held in memory at a time, so memory stays flat however large the corpus.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ...files.atomic import move_into_place, parked_folders, write_file

SPLITS = ("train", "val")
SHARDS = "shards"
BY_TOKENS = "shards.by-tokens"  # the shards of a split by tokens, until they replace the first pass's
_COPY_BUFFER = 16 * 2**20


def _save_npy(path: Path, array: np.ndarray) -> None:
    write_file(path, lambda handle: np.save(handle, array))


class ShardWriter:
    """Appends batches to the current shard, commits it when it holds `shard_tokens`, resumes, finalises."""

    def __init__(
        self,
        work: Path,
        dtype: np.dtype,
        fingerprint: str,
        *,
        with_signatures: bool,
        with_scores: bool,
        name: str = SHARDS,
    ):
        self.folder = work / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype, self.fingerprint = np.dtype(dtype), fingerprint
        self.with_signatures, self.with_scores = with_signatures, with_scores
        self.index = 0  # the shard being written
        self.totals = {s: {"documents": 0, "tokens": 0} for s in SPLITS}  # committed shards only
        self._files: dict[str, object] = {}

    # -- resume -----------------------------------------------------------------------------------

    def resume(self) -> dict | None:
        """Keep the committed shards (checked against their records), delete the rest; the last record or None."""
        last = None
        while (record := self._valid_record(self.index)) is not None:
            last = record
            for split in SPLITS:
                for key in ("documents", "tokens"):
                    self.totals[split][key] += record["splits"][split][key]
            self.index += 1
        for path in self.folder.iterdir():  # the shard in progress and anything after it
            number = path.name.split(".", 1)[0]
            if not number.isdigit() or int(number) >= self.index:
                path.unlink()
        return last

    def _valid_record(self, k: int) -> dict | None:
        path = self.folder / f"{k:05d}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if record.get("fingerprint") != self.fingerprint:
            return None
        for name, size in record["files"].items():
            file = self.folder / name
            if not file.is_file() or file.stat().st_size != size:
                return None
        return record

    def restore_dedup(self, dedup) -> None:
        """Give the deduplicator the keys of every document the committed shards kept."""
        for k in range(self.index):
            keys = np.load(self.folder / f"{k:05d}.keys.npy")
            sigs = np.load(self.folder / f"{k:05d}.sigs.npy") if self.with_signatures else None
            dedup.restore(keys, sigs)

    # -- writing ----------------------------------------------------------------------------------

    def _name(self, suffix: str) -> Path:
        return self.folder / f"{self.index:05d}.{suffix}"

    def start(self) -> None:
        self._files = {s: open(self._name(f"{s}.bin"), "wb") for s in SPLITS}
        self._lengths: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self._sources: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self._scores: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self._keys: list[np.ndarray] = []
        self._sigs: list[np.ndarray] = []
        self.pending = {s: {"documents": 0, "tokens": 0} for s in SPLITS}

    def add(
        self, split: str, tokens: np.ndarray, lengths: np.ndarray, sources: np.ndarray, scores: np.ndarray | None = None
    ) -> None:
        """tokens: (sum(lengths),) of self.dtype, end-of-text included; lengths, sources, scores: (D,)."""
        self._files[split].write(tokens.tobytes())
        self._lengths[split].append(lengths)
        self._sources[split].append(sources)
        if self.with_scores:
            self._scores[split].append(scores)
        self.pending[split]["documents"] += len(lengths)
        self.pending[split]["tokens"] += int(lengths.sum())

    def add_keys(self, keys: np.ndarray, signatures: np.ndarray | None) -> None:
        """keys: (D,) uint64 of the kept documents of both splits in stream order; signatures (D, P) uint32."""
        self._keys.append(keys)
        if self.with_signatures:
            self._sigs.append(signatures)

    def pending_tokens(self) -> int:
        return sum(p["tokens"] for p in self.pending.values())

    def commit(self, state: dict, *, done: bool = False) -> None:
        """Make the current shard durable, then write its record (the only thing that marks it complete)."""
        for handle in self._files.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        for split in SPLITS:
            _save_npy(self._name(f"{split}.len.npy"), _concat(self._lengths[split], np.int64))
            _save_npy(self._name(f"{split}.src.npy"), _concat(self._sources[split], np.int16))
            if self.with_scores:
                _save_npy(self._name(f"{split}.scores.npy"), _concat(self._scores[split], np.float64))
        _save_npy(self._name("keys.npy"), _concat(self._keys, np.uint64))
        if self.with_signatures:
            _save_npy(self._name("sigs.npy"), np.concatenate(self._sigs) if self._sigs else np.zeros((0, 0), np.uint32))
        files = {
            p.name: p.stat().st_size
            for p in sorted(self.folder.glob(f"{self.index:05d}.*"))
            if not p.name.endswith(".json")
        }
        record = {
            "fingerprint": self.fingerprint,
            "shard": self.index,
            "done": done,
            "files": files,
            "splits": self.pending,
            "state": state,
        }
        write_file(self._name("json"), json.dumps(record).encode())
        for split in SPLITS:
            for key in ("documents", "tokens"):
                self.totals[split][key] += self.pending[split][key]
        self.index += 1

    def close(self) -> None:
        """Close the files of an uncommitted shard (after an error)."""
        for handle in self._files.values():
            handle.close()

    def discard(self) -> None:
        """Forget every shard (what an interrupted split by tokens left in its folder)."""
        self.close()
        shutil.rmtree(self.folder)
        self.folder.mkdir()
        self.index = 0
        self.totals = {s: {"documents": 0, "tokens": 0} for s in SPLITS}

    def documents(self, split: str) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """The committed shards' documents of `split`, in order: (tokens, end-of-text included; source (1,);
        score (1,) or None), the tokens read from the file as they are reached."""
        for k in range(self.index):
            lengths = np.load(self.folder / f"{k:05d}.{split}.len.npy")
            if not len(lengths):
                continue
            tokens = np.memmap(self.folder / f"{k:05d}.{split}.bin", dtype=self.dtype, mode="r")
            sources = np.load(self.folder / f"{k:05d}.{split}.src.npy")
            scores = np.load(self.folder / f"{k:05d}.{split}.scores.npy") if self.with_scores else None
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for i in range(len(lengths)):
                score = None if scores is None else scores[i : i + 1]
                yield tokens[offsets[i] : offsets[i + 1]], sources[i : i + 1], score

    def replace_with(self, other: ShardWriter) -> None:
        """`other`'s committed shards become this writer's: its folder takes this one's place
        (`files.atomic.move_into_place`), so an interruption leaves one complete set of shards under this
        folder's name, never a mixture; what it leaves beside them, `remove_shards` deletes."""
        move_into_place(other.folder, self.folder)
        self.index, self.totals = other.index, other.totals

    # -- the final layout -------------------------------------------------------------------------

    def _join(self, split: str, joined) -> None:
        """Copy the committed shards' tokens of `split` one after the other into the open file `joined`."""
        for k in range(self.index):
            with open(self.folder / f"{k:05d}.{split}.bin", "rb") as part:
                shutil.copyfileobj(part, joined, _COPY_BUFFER)

    def finalize(self, out: Path) -> dict:
        """Concatenate the committed shards into {split}.bin, {split}.idx.npy, {split}.sources.npy in `out`."""
        for split in SPLITS:
            write_file(out / f"{split}.bin", lambda joined, split=split: self._join(split, joined))
            lengths = [np.load(self.folder / f"{k:05d}.{split}.len.npy") for k in range(self.index)]
            offsets = np.concatenate([[0], np.cumsum(_concat(lengths, np.int64))]).astype(np.int64)
            _save_npy(out / f"{split}.idx.npy", offsets)
            sources = [np.load(self.folder / f"{k:05d}.{split}.src.npy") for k in range(self.index)]
            _save_npy(out / f"{split}.sources.npy", _concat(sources, np.int16))
            if self.with_scores:
                scores = [np.load(self.folder / f"{k:05d}.{split}.scores.npy") for k in range(self.index)]
                _save_npy(out / f"{split}.scores.npy", _concat(scores, np.float64))
        return {s: dict(self.totals[s]) for s in SPLITS}


def remove_shards(folder: Path) -> None:
    """Delete every set of shards a build keeps in `folder` (its own working folders, nothing else)."""
    for path in (folder / SHARDS, folder / BY_TOKENS, *parked_folders(folder / SHARDS)):
        shutil.rmtree(path, ignore_errors=True)


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
