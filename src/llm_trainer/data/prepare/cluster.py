"""`prepare` as a datatrove pipeline: the same stages, run by datatrove's local, Slurm or Ray executor.

Two stages, each a datatrove pipeline whose steps call the functions the in-process prepare uses:

  per-file stage (`data.executor_tasks` tasks):  ReadFiles -> ProcessDocuments -> WriteParts
      Task r reads its contiguous range of the input files (`file_units`, balanced by bytes), cleans,
      filters and computes the dedup keys of every document (`DocumentProcessor`), tokenizes the ones a
      later stage may keep (`encode`, on the tokenizer's Rust threads while the next batch is processed)
      and writes them, with one record per document, into `parts/{r}/`.
  merge stage (one task):  MergeParts
      Replays the documents of all parts in the order the in-process prepare reads them (each source's
      files in order, sources mixed by `interleave` with the same seed), decides duplicates, the split
      and `max_documents` with the same `decide`, and writes shards, token files, manifest and
      data_report.json with the same `Build`. So the prepared folder is the one the in-process prepare
      writes, for any number of tasks and any executor (only timings differ).

The tokenizer is built once, before the tasks, by the same `_build_tokenizer` (BPE: on the first
`tokenizer_train_max_chars` characters of kept training text, in stream order) and saved in the work
folder; every task reads that file.

Resumable per task: datatrove writes `completions/{rank}` when a task has finished, and skips the
completed tasks when the same command runs again; a task that was killed starts its part over.
Where things are (`data.executor_logs`, default `{cache_dir}/.{fingerprint}.tasks/`):
  plan.json                       the input files, their assignment to tasks, the tokenizer's dtype:
                                  built from the config by every command, which hands the tasks its digest
  prepare/ and merge/             datatrove's folders of each stage: logs/task_NNNNN.log,
                                  console.log (what datatrove prints; on Slurm, the jobs' launch),
                                  completions/NNNNN, stats/, errors/NNNNN.json (a failed task's message)
  parts/NNNNN/                    the per-file stage's output (removed once the merge has finished)
  slurm_logs/, slurm_jobs.json    Slurm's own job output, the jobs the last command submitted (slurm)
  seconds.json                    each stage's wall time (local, ray)
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UsageError, first_line
from ...files.atomic import write_file
from ..text.dedup import MinHasher
from ..text.filters import FILTERS, Removal
from ..text.mixture import interleave
from ..text.sources import (
    BadInput,
    Document,
    FileUnit,
    SourceStats,
    empty_source,
    resolved_sources,
)
from .workers import Processed

PLAN = "plan.json"
PARTS = "parts"
STAGES = ("prepare", "merge")
# One record per document read, in a part: its UTF-8 size, its tokens (-1: not tokenized, it cannot be
# kept), exact-dedup key, curriculum score (NaN: none) and the filter that removed it (-1: none).
RECORD = np.dtype([("nbytes", "<i8"), ("tokens", "<i8"), ("key", "<u8"), ("score", "<f8"), ("reason", "<i1")])


class TaskFailed(RuntimeError):
    """A task of the pipeline failed for another reason than bad input; the message says which and how to resume."""


# ----------------------------------------------------------------------------------------------
# the plan: which files, which task


def task_ranges(sizes: list[int], tasks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of the units, one per task, balanced by bytes: unit i goes to task
    floor(tasks * (bytes before it + half its own) / all bytes). Deterministic; some ranges are empty when
    tasks > files."""
    total = sum(sizes)
    owner, before = [], 0
    for size in sizes:
        owner.append(min(tasks - 1, (2 * before + size) * tasks // (2 * total)) if total else 0)  # its middle
        before += size
    return [(bisect.bisect_left(owner, r), bisect.bisect_right(owner, r)) for r in range(tasks)]  # owner is sorted


@dataclass
class Plan:
    fingerprint: str
    tasks: int
    units: list[FileUnit]
    skipped: dict | None  # what the listing skipped (missing files, empty folders): SourceStats.to_json()
    dtype: str
    work: str
    directory: str
    started: float
    cwd: str  # the command's folder: relative paths of the config and the files are relative to it

    def enter(self) -> None:
        """Make the command's folder this process's (a Ray worker or a Slurm job may start elsewhere)."""
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)

    @property
    def root(self) -> Path:
        return Path(self.work).parent

    def record(self) -> dict:
        """The plan as plan.json holds it (JSON types throughout, so a record read back compares equal)."""
        return json.loads(json.dumps({**self.__dict__, "units": [list(u) for u in self.units]}))

    def matches(self, record: object) -> bool:
        """Whether plan.json's `record` is this plan up to when it started: the tasks that completed under
        it did this plan's work. Only compared, never read as the plan: the folder may be shared."""
        if not isinstance(record, dict):
            return False
        mine = self.record()
        return {k: v for k, v in record.items() if k != "started"} == {k: v for k, v in mine.items() if k != "started"}

    def save(self, path: Path) -> PlanFile:
        raw = json.dumps(self.record()).encode()
        write_file(path, raw)
        return PlanFile(str(path), hashlib.sha256(raw).hexdigest())

    def ranges(self) -> list[tuple[int, int]]:
        return task_ranges([u.size for u in self.units], self.tasks)


@dataclass(frozen=True)
class PlanFile:
    """plan.json as this command wrote it: what the steps carry to the tasks (a path and a digest, small to
    pickle for every task, where the plan itself may list a million files)."""

    path: str
    sha256: str

    @property
    def tasks_dir(self) -> Path:
        return Path(self.path).parent

    def load(self) -> Plan:
        """The plan, refused when the file is no longer the one the command wrote: the task folder may be
        shared, and a plan decides which files are read and where the result goes."""
        raw = Path(self.path).read_bytes()
        if hashlib.sha256(raw).hexdigest() != self.sha256:
            raise UsageError(
                f"{self.path} changed after the command wrote it (another prepare, or someone else writing "
                "its task folder); run the command again"
            )
        data = json.loads(raw)
        data["units"] = [FileUnit(*u) for u in data["units"]]
        return Plan(**data)


# ----------------------------------------------------------------------------------------------
# the per-file stage: datatrove steps calling prepare's functions


# ----------------------------------------------------------------------------------------------
# the per-file stage's output: one part per task, one set of files per source in it


def part_folder(tasks_dir: Path, rank: int) -> Path:
    return Path(tasks_dir) / PARTS / f"{rank:05d}"


class PartWriter:
    """What one task writes, per source s: {s}.records (RECORD per document read), {s}.tokens (the tokens
    of the tokenized documents, end-of-text after each), {s}.sigs (MinHash signatures, near dedup),
    {s}.meta.jsonl (per document: where it was read, the measured value of the filter that removed it,
    what the readers skipped before it; a line holding only a tab and where it was read when there is
    nothing else to say); done.json last (documents per source, skips after the last one)."""

    def __init__(self, folder: Path, dtype: np.dtype, with_signatures: bool):
        shutil.rmtree(folder, ignore_errors=True)  # a task that was killed starts its part over
        folder.mkdir(parents=True)
        self.folder, self.dtype, self.with_signatures = folder, np.dtype(dtype), with_signatures
        self.files: dict[int, dict] = {}
        self.sources: dict[int, dict] = {}

    def _files(self, source: int) -> dict:
        if source not in self.files:
            names = ["records", "tokens", "meta.jsonl"] + (["sigs"] if self.with_signatures else [])
            self.files[source] = {n: open(self.folder / f"{source}.{n}", "wb") for n in names}
            self.sources[source] = {"documents": 0, "trailing": None}
        return self.files[source]

    def add(
        self,
        source: int,
        metadata: list[dict],
        result: Processed,
        tokenized: list[int],
        tokens: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        files = self._files(source)
        records = np.zeros(len(metadata), dtype=RECORD)
        records["nbytes"] = result.nbytes
        records["tokens"] = -1
        records["tokens"][tokenized] = lengths
        records["key"] = result.keys
        records["score"] = [np.nan if m["score"] is None else m["score"] for m in metadata]
        records["reason"] = [-1 if r is None else FILTERS.index(r) for r in result.reasons]
        files["records"].write(records.tobytes())
        files["tokens"].write(tokens.astype(self.dtype, copy=False).tobytes())
        if self.with_signatures:
            files["sigs"].write(result.signatures.tobytes())
        lines = []
        for m, removal in zip(metadata, result.removals):
            origin = m["origin"]
            if (
                removal is None
                and not m["skips"]
                and isinstance(origin, str)
                and "\n" not in origin
                and "\r" not in origin
            ):
                lines.append(f"\t{origin}\n")  # the common case, read back without a JSON parse
                continue
            detail = [removal.value, removal.threshold, removal.setting] if removal is not None else [None] * 3
            lines.append(json.dumps([origin, *detail, m["skips"]]) + "\n")
        files["meta.jsonl"].write("".join(lines).encode())
        self.sources[source]["documents"] += len(metadata)

    def end_source(self, source: int, skips: dict | None) -> None:
        self._files(source)
        trailing = SourceStats.from_json(self.sources[source]["trailing"])
        trailing.update(SourceStats.from_json(skips))
        self.sources[source]["trailing"] = trailing.to_json()

    def close(self) -> None:
        for files in self.files.values():
            for handle in files.values():
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
        done = {"sources": {str(s): info for s, info in self.sources.items()}}
        write_file(self.folder / "done.json", json.dumps(done).encode())


def tokenized_rows(result: Processed, deduplication: str, seen: set[int] | None) -> list[int]:
    """The documents of a batch worth tokenizing: those the filters kept, less (exact dedup) the repeats
    of a key seen earlier in this task's part of the same source, which the merge must remove."""
    rows = []
    for i, reason in enumerate(result.reasons):
        if reason is not None:
            continue
        if seen is not None and deduplication == "exact":
            key = int(result.keys[i])
            if key in seen:
                continue
            if len(seen) < _SEEN_KEYS:
                seen.add(key)
        rows.append(i)
    return rows


_SEEN_KEYS = 1 << 18  # keys remembered per task and source for the above (memory stays bounded)


def write_error(tasks_dir: Path, stage: str, rank: int, tasks: int, file: str | None, exc: BaseException) -> None:
    """errors/{rank}.json in the stage's folder: what the driver reports for a failed task."""
    folder = Path(tasks_dir) / stage / "errors"
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "task": rank,
        "tasks": tasks,
        "file": file,
        "message": first_line(exc, None),
        "type": type(exc).__name__,
        "usage": isinstance(exc, UsageError),
    }
    write_file(folder / f"{rank:05d}.json", json.dumps(record).encode())


def clear_error(tasks_dir: Path, stage: str, rank: int) -> None:
    (Path(tasks_dir) / stage / "errors" / f"{rank:05d}.json").unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# the merge stage: the in-process prepare's decisions and writers over the parts, in stream order


class _Record:
    __slots__ = ("document", "nbytes", "reason", "removal", "key", "signature", "tokens")

    def __init__(self, document, nbytes, reason, removal, key, signature, tokens):
        self.document, self.nbytes, self.reason, self.removal = document, nbytes, reason, removal
        self.key, self.signature, self.tokens = key, signature, tokens


_CHUNK = 4096  # records read from a part at a time


def _part_records(folder: Path, source: int, name: str, count: int, dtype, num_perm: int | None, skipped: SourceStats):
    """The documents of one source in one part, in order; adds what the readers skipped before each to `skipped`."""
    if count == 0:
        return
    records = np.memmap(folder / f"{source}.records", dtype=RECORD, mode="r", shape=(count,))
    tokens_path = folder / f"{source}.tokens"
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if tokens_path.stat().st_size else np.zeros(0, dtype)
    sigs = None
    if num_perm is not None:
        sigs = np.memmap(folder / f"{source}.sigs", dtype=np.uint32, mode="r", shape=(count, num_perm))
    offset = 0
    with open(folder / f"{source}.meta.jsonl", encoding="utf-8") as meta:
        for start in range(0, count, _CHUNK):
            chunk = records[start : start + _CHUNK]
            fields = {name: chunk[name].tolist() for name in RECORD.names}
            for j in range(len(chunk)):
                line = meta.readline()
                if line[0] == "\t":
                    origin, value, threshold, setting = line[1:-1], None, None, None
                else:
                    origin, value, threshold, setting, skips = json.loads(line)
                    skipped.update(SourceStats.from_json(skips))
                reason = None if fields["reason"][j] < 0 else FILTERS[fields["reason"][j]]
                score = fields["score"][j]
                n = fields["tokens"][j]
                piece = None
                if n >= 0:
                    piece = (offset, n)
                    offset += n
                yield _Record(
                    Document("", name, None if score != score else score, origin),
                    fields["nbytes"][j],
                    reason,
                    Removal(reason, value, threshold, setting) if reason is not None else None,
                    fields["key"][j],
                    sigs[start + j] if sigs is not None else None,
                    (tokens, piece),
                )


def _merge_build():
    from .build import BATCH, Build, batched, decide
    from .shards import SPLITS, remove_shards

    class MergeBuild(Build):
        """`Build` whose document stream is the parts of the per-file stage instead of the readers."""

        def __init__(self, config: DataConfig, plan: Plan, tasks_dir: Path):
            super().__init__(config, plan.fingerprint, Path(plan.work), Path(plan.directory))
            self.plan, self.tasks_dir = plan, Path(tasks_dir)
            self.hasher = (
                MinHasher(config.minhash_num_perm, config.minhash_shingle_words, config.deduplication_threshold)
                if self.near
                else None
            )

        def run(self):
            remove_shards(self.work)  # a merge that was killed starts over
            return super().run()

        def _elapsed(self) -> float:
            return time.time() - self.plan.started

        def _source_stream(self, index: int, spec, dtype, skipped: SourceStats, bad: BadInput) -> Iterator[_Record]:
            count = 0
            num_perm = self.config.minhash_num_perm if self.near else None
            for rank in range(self.plan.tasks):
                folder = part_folder(self.tasks_dir, rank)
                info = json.loads((folder / "done.json").read_text())["sources"].get(str(index))
                if info is None:
                    continue
                for record in _part_records(folder, index, spec.name, info["documents"], dtype, num_perm, skipped):
                    yield record
                    count += 1
                    if spec.max_documents is not None and count >= spec.max_documents:
                        return
                skipped.update(SourceStats.from_json(info["trailing"]))
            if count == 0:
                empty_source(spec, bad)

        def _processed(self, batch: list[_Record]) -> Processed:
            signatures = bands = None
            if self.near:
                signatures = np.stack([np.asarray(r.signature) for r in batch])
                bands = self.hasher.band_keys(signatures)
            return Processed(
                [None] * len(batch),
                [r.reason for r in batch],
                [r.removal for r in batch],
                [r.nbytes for r in batch],
                np.asarray([r.key for r in batch], dtype=np.uint64),
                signatures,
                bands,
            )

        def _stream(self, tokenizer, dtype, writer, dedup, state, counts, progress) -> SourceStats:
            skipped = SourceStats.from_json(self.plan.skipped)
            stats = SourceStats()
            bad = BadInput(self.config.on_bad_input, stats)
            sources = resolved_sources(self.config)
            streams = [self._source_stream(i, spec, dtype, skipped, bad) for i, spec in enumerate(sources)]
            records = interleave(
                streams, [s.weight for s in sources], seed=self.config.seed, stopping=self.config.mixture_stopping
            )
            batches: list[list[_Record]] = []

            def processed():
                for i, batch in enumerate(batched(records, BATCH)):
                    batches[:] = [batch]
                    yield (i * BATCH, [r.document for r in batch]), self._processed(batch)

            writer.start()
            for decided in decide(self.config, processed(), dedup, None, 0):
                batch = batches[0]
                order = [i for s in SPLITS for i, split in zip(decided.kept, decided.kept_splits) if split == s]
                pieces = []
                for i in order:
                    tokens, piece = batch[i].tokens
                    if piece is None:
                        raise RuntimeError(f"{batch[i].document.origin} was kept but not tokenized")
                    pieces.append(tokens[piece[0] : piece[0] + piece[1]])
                flat = np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)
                lengths = np.asarray([len(p) for p in pieces], dtype=np.int64)
                self._write(decided, flat, lengths, writer, counts, progress)
                state.position, state.kept = decided.end, state.kept + len(decided.kept)
                if writer.pending_tokens() >= self.config.shard_tokens:
                    writer.commit(self._snapshot(state, counts))
                    writer.start()
            skipped.update(stats)
            state.phase, state.position, state.kept = 1, 0, 0
            writer.commit(self._snapshot(state, counts), done=True)
            return skipped

    return MergeBuild


def merge(config: DataConfig, plan_file: PlanFile) -> None:
    """The merge stage's one task: the prepared folder from the parts."""
    plan = plan_file.load()
    plan.enter()
    _merge_build()(config, plan, plan_file.tasks_dir).run()


# ----------------------------------------------------------------------------------------------
# the driver: plan, tokenizer, the two stages on the chosen executor, the result


def tasks_folder(config: DataConfig, fingerprint: str) -> Path:
    """`data.executor_logs`, else beside the prepared folder in this machine's cache: for a `cache_dir`
    URL that is its local copy (`DataConfig.local_cache_dir`), never a folder named after the URL."""
    if config.executor_logs:
        return Path(config.executor_logs).resolve()
    return (config.local_cache_dir / f".{fingerprint}.tasks").resolve()
