"""The build engine of `prepare`: sources -> cleaned, filtered, deduplicated, tokenized shards ->
memory-mapped token files, in the prepared folder `{cache_dir}/{fingerprint}/` (its files: `data.format`).

The stages stream, so memory stays flat as the corpus grows:
  read + mix (main) -> clean, filter, dedup keys (main, or worker processes) -> dedup decision and
  train/val split (main, in stream order) -> tokenize (a thread running the Rust tokenizer on its own
  threads, or worker processes) -> shard writer (main)
Batches are pipelined: while one batch is being tokenized the main process prepares the next.

Resumable: the work happens in `{cache_dir}/.{fingerprint}.partial/`, shard by shard (see `shards`).
An interrupted run (Ctrl-C, SIGKILL, a crash of the machine) leaves that folder and the next run with
the same fingerprint resumes after its last committed shard, producing byte-identical output. An
error (bad input, a bug) removes it instead: fixing the cause changes the fingerprint anyway. The
fingerprint covers the data settings, the sources (paths, sizes, times) and the tokenizer, so a
changed config or source never reuses a folder, finished or partial.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing as mp
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UsageError
from ...files.atomic import move_into_place
from ...logs import log, warn
from ...tokenizer import Tokenizer
from ..format import FORMAT_VERSION, MANIFEST, PreparedData
from ..text.dedup import Deduplicator
from ..text.filters import QualityFilter
from ..text.mixture import interleave
from ..text.sources import Document, SourceStats, iter_source, resolved_sources, source_fingerprint
from .report import Counts, Progress, build_report, nothing_kept, padding_fractions, print_summary, write_report
from .shards import BY_TOKENS, SPLITS, ShardWriter, remove_shards
from .workers import DocumentProcessor, Processed, encode, worker_encode, worker_init, worker_process

BATCH = 256  # raw documents per pipeline batch
TOKENIZE_THREADS = 2
# Settings that change how the work is done or how the loader reads it, not what prepare writes.
_NOT_FINGERPRINTED = (
    "preprocessing_num_workers",
    "cache_dir",
    "stream_cache_dir",
    "stream_cache_limit",
    "progress_bar",
    "shard_tokens",
    "pack_sequences",
    "packing_strategy",
    "document_mask",
    "curriculum",
    "executor",
    "executor_tasks",
    "executor_workers",
    "executor_logs",
    "executor_partition",
    "executor_time",
    "executor_cpus_per_task",
    "executor_mem_per_cpu_gb",
    "executor_env_command",
    "executor_address",
)


def data_fingerprint(config: DataConfig) -> str:
    settings = {k: v for k, v in config.to_dict().items() if k not in _NOT_FINGERPRINTED}
    if config.tokenizer not in ("bpe", "char"):
        settings["tokenizer"] = Tokenizer.load(config.tokenizer).fingerprint()
    payload = json.dumps([FORMAT_VERSION, settings, source_fingerprint(config)], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# the document stream: phases (one, or train then val for a named split) of mixed sources


def _phases(config: DataConfig) -> list[tuple[str | None, Callable[[SourceStats], Iterator[Document]]]]:
    """(split or None, stream factory) per phase; None: the split is drawn per document by fraction."""
    sources = resolved_sources(config)

    def stream(split: str | None) -> Callable[[SourceStats], Iterator[Document]]:
        def make(stats: SourceStats) -> Iterator[Document]:
            readers = [iter_source(source, config, stats, split) for source in sources]
            return interleave(readers, [s.weight for s in sources], seed=config.seed, stopping=config.mixture_stopping)

        return make

    if isinstance(config.validation_split, str):
        if any(source.dataset_name is None for source in sources):
            raise UsageError(
                "data.validation_split names a split, which needs a dataset_name; use a fraction such as 0.1 for files"
            )
        return [("train", stream(None)), ("val", stream(config.validation_split))]
    return [(None, stream(None))]


def _fraction_split(i: int, fraction: float) -> str:
    """Document i (of its source) goes to validation when floor((i+1)f) > floor(if): an even, deterministic
    spread, so every source of a mixture holds out its own fraction (per-source validation losses)."""
    return "val" if int((i + 1) * fraction) > int(i * fraction) else "train"


def _kept_texts(config: DataConfig, splits: tuple[str, ...]) -> Iterator[str]:
    """Cleaned, filtered, deduplicated texts of the given splits in stream order (the tokenizer's corpus):
    the same decisions as the writing pass (`decide`), so the tokenizer is trained on the documents written."""
    processor, dedup = DocumentProcessor(config), Deduplicator(config)
    for split, make in _phases(config):
        raw = ((i * BATCH, batch) for i, batch in enumerate(batched(make(SourceStats()), BATCH)))
        processed = ((item, processor([d.text for d in item[1]])) for item in raw)
        for batch in decide(config, processed, dedup, split, kept=0):
            for i, doc_split in zip(batch.kept, batch.kept_splits):
                if doc_split in splits:
                    yield batch.processed.texts[i]


@dataclass
class Decided:
    """One batch after the dedup decision: what to tokenize (train texts first) and what to count."""

    documents: list[Document]
    processed: Processed
    outcomes: list[str | None]  # per raw document: removal reason, or None if kept
    kept: list[int]  # raw indices of kept documents, stream order
    kept_splits: list[str]
    end: int  # stream position after this batch
    texts: list[str] = field(default_factory=list)  # kept texts, train ones first
    n_train: int = 0


def decide(
    config: DataConfig,
    processed: Iterator[tuple[tuple[int, list[Document]], Processed]],
    dedup: Deduplicator,
    split: str | None,
    kept: int,
    kept_by_source: dict[str, int] | None = None,
) -> Iterator[Decided]:
    """The rule of which documents are kept and where they go: filtered ones and duplicates are removed,
    the kept ones split (by phase, or by fraction in stream order), and the phase stops after
    max_documents kept documents. `processed`: ((stream position, raw documents), stage-one result) per
    batch, in stream order; `kept`: documents of this phase kept before it (a resumed build), and
    `kept_by_source` the same per source."""
    by_source = dict(kept_by_source or {})
    cap = config.max_documents
    if cap is not None and kept >= cap:  # resumed after the cap was reached
        return
    for (start, documents), result in processed:
        outcomes, kept_idx, kept_splits = [], [], []
        for i in range(len(documents)):
            reason = result.reasons[i] or _duplicate(dedup, result, i)
            outcomes.append(reason)
            if reason is None:
                kept_idx.append(i)
                source = documents[i].source
                kept_splits.append(split or _fraction_split(by_source.get(source, 0), config.validation_split))
                by_source[source] = by_source.get(source, 0) + 1
                kept += 1
                if cap is not None and kept >= cap:
                    documents = documents[: i + 1]
                    break
        batch = Decided(documents, result, outcomes, kept_idx, kept_splits, start + len(documents))
        for wanted in SPLITS:
            batch.texts += [result.texts[i] for i, s in zip(kept_idx, kept_splits) if s == wanted]
        batch.n_train = kept_splits.count("train")
        yield batch
        if cap is not None and kept >= cap:
            return


def _duplicate(dedup: Deduplicator, result: Processed, i: int) -> str | None:
    signature = result.signatures[i] if result.signatures is not None else None
    bands = result.bands[i] if result.bands is not None else None
    return dedup.check(int(result.keys[i]), signature, bands)


def batched(documents: Iterator[Document], size: int) -> Iterator[list[Document]]:
    while batch := list(itertools.islice(documents, size)):
        yield batch


def _build_tokenizer(config: DataConfig) -> Tokenizer:
    if config.tokenizer == "char":  # vocabulary of the whole corpus, as char-level experiments expect
        return Tokenizer.build_char(_kept_texts(config, ("train", "val")))
    if config.tokenizer == "bpe":  # trained on a bounded sample: train_bpe stops reading at max_chars
        return Tokenizer.train_bpe(
            _kept_texts(config, ("train",)),
            vocab_size=config.tokenizer_vocab_size,
            max_chars=config.tokenizer_train_max_chars,
            pre_split=config.tokenizer_pre_split,
        )
    return Tokenizer.load(config.tokenizer)


# ----------------------------------------------------------------------------------------------
# pipelining


class _Done:
    """A finished 'future' for work done inline."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def ordered(items: Iterator, submit: Callable[[object], Future | _Done], depth: int) -> Iterator[tuple[object, object]]:
    """(item, result) in input order, with at most `depth` items submitted ahead of the one yielded."""
    pending: deque = deque()
    for item in items:
        pending.append((item, submit(item)))
        if len(pending) > depth:
            first, future = pending.popleft()
            yield first, future.result()
    while pending:
        first, future = pending.popleft()
        yield first, future.result()


@dataclass
class _State:
    """Where the build stands; saved with every committed shard."""

    phase: int = 0
    position: int = 0  # raw documents of the current phase consumed
    kept: int = 0  # documents kept in the current phase
    kept_by_source: dict = field(default_factory=dict)  # the same, per source name
    counts: dict | None = None
    skipped_done: dict = field(default_factory=dict)  # reader skips of finished phases
    skipped_named: dict = field(default_factory=dict)  # the first of each kind, named (SourceStats.named)
    seconds: float = 0.0  # time spent by earlier, interrupted runs
    split_by: str | None = None  # "tokens" once the shards hold each document split by its tokens


class Build:
    def __init__(self, config: DataConfig, fingerprint: str, work: Path, directory: Path):
        self.config, self.fingerprint, self.work, self.directory = config, fingerprint, work, directory
        self.near = config.deduplication == "near"
        self.with_scores = config.curriculum_key != "length"
        self.source_names = [source.name for source in resolved_sources(config)]
        self.source_index = {name: i for i, name in enumerate(self.source_names)}

    def run(self) -> PreparedData:
        self.started = time.perf_counter()
        tokenizer = self.tokenizer()
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        writer = ShardWriter(
            self.work, dtype, self.fingerprint, with_signatures=self.near, with_scores=self.with_scores
        )
        record = writer.resume()
        state = _State(**record["state"]) if record else _State()
        self.earlier_seconds = state.seconds
        removed_keys = QualityFilter(self.config).active()
        if self.config.deduplication != "none":
            removed_keys += ["exact_duplicates"] + (["near_duplicates"] if self.near else [])
        counts = Counts.from_json(state.counts) if state.counts else Counts(removed_keys)
        if record:
            log(
                f"data: resuming {self.directory.name} after shard {writer.index - 1} "
                f"({counts.documents_in:,} documents already read)"
            )
        else:
            log(f"data: preparing {self.directory}")
        skipped = SourceStats(Counter(state.skipped_done), dict(state.skipped_named))
        if not (record and record["done"]):
            dedup = Deduplicator(self.config)
            writer.restore_dedup(dedup)
            progress = Progress(self.config.progress_bar, counts.bytes_in)
            try:
                skipped = self._stream(tokenizer, dtype, writer, dedup, state, counts, progress)
            finally:
                writer.close()
                progress.close()
        splits = {s: dict(writer.totals[s]) for s in SPLITS}
        split_by = self._split_by(splits, state.split_by)
        if split_by == "tokens" and state.split_by is None:
            splits = self._split_by_tokens(tokenizer, dtype, writer, state, counts)
        if splits["train"]["tokens"] == 0:
            raise UsageError(nothing_kept(counts))
        writer.finalize(self.work)
        if split_by == "documents" and len(self.source_names) > 1:
            self._note_sources_without_validation()
        seconds = self._elapsed()
        padding = None
        if self.config.max_length:
            padding = padding_fractions(np.load(self.work / "train.idx.npy"), self.config.max_length)
        report = build_report(
            counts,
            splits,
            seconds=seconds,
            reader_skipped=skipped,
            padding=padding,
            shards=writer.index,
            resumed_from_shard=(record["shard"] + 1) if record else None,
        )
        report["validation_split_by"] = split_by
        write_report(self.work, report)
        manifest = {
            **self._manifest(tokenizer, dtype, splits, counts, skipped.skipped, seconds),
            "validation_split_by": split_by,
        }
        (self.work / MANIFEST).write_text(json.dumps(manifest, indent=2))
        move_into_place(self.work, self.directory)  # one there without a manifest is an old partial one: replaced
        remove_shards(self.directory)
        (self.directory / ".lock").unlink(missing_ok=True)
        print_summary(report)
        return PreparedData(self.directory, tokenizer, manifest)

    def _elapsed(self) -> float:
        """Seconds of work on this folder, earlier interrupted runs included."""
        return self.earlier_seconds + time.perf_counter() - self.started

    def tokenizer(self) -> Tokenizer:
        """Built once per fingerprint and kept in the work folder, so a resumed run uses the same one."""
        saved = self.work / "tokenizer.json"
        if saved.is_file():
            return Tokenizer.load(saved)
        tokenizer = _build_tokenizer(self.config)
        tokenizer.save(self.work)
        return tokenizer

    # -- the streaming pipeline -------------------------------------------------------------------

    @contextlib.contextmanager
    def _executors(self, tokenizer: Tokenizer, dtype):
        """(submit for stage one, submit for tokenization, lookahead depth)."""
        workers = self.config.preprocessing_num_workers
        if workers <= 1:  # the Rust tokenizer runs on its own threads, without the GIL, beside the main thread
            processor = DocumentProcessor(self.config)
            # Two threads: while one turns a finished batch's ids into arrays (under the GIL), the other
            # keeps the Rust tokenizer busy with the next batch.
            with ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize") as pool:
                yield (
                    (lambda texts: _Done(processor(texts))),
                    (lambda texts: pool.submit(encode, tokenizer, texts, dtype)),
                    TOKENIZE_THREADS + 1,
                )
            return
        context = mp.get_context("spawn")
        with ProcessPoolExecutor(
            workers,
            mp_context=context,
            initializer=worker_init,
            initargs=(self.config, tokenizer.to_json(), np.dtype(dtype).name),
        ) as pool:
            yield (
                (lambda texts: pool.submit(worker_process, texts)),
                (lambda texts: pool.submit(worker_encode, texts)),
                2 * workers,
            )

    def _stream(
        self, tokenizer, dtype, writer, dedup, state: _State, counts: Counts, progress: Progress
    ) -> SourceStats:
        """Run the phases from `state` to the end, committing shards; returns what the readers skipped."""
        skipped = SourceStats(Counter(state.skipped_done), dict(state.skipped_named))
        phases = _phases(self.config)
        writer.start()
        with self._executors(tokenizer, dtype) as (submit_process, submit_encode, depth):
            for phase in range(state.phase, len(phases)):
                split, make = phases[phase]
                stats = SourceStats()
                if phase != state.phase:
                    state.phase, state.position, state.kept, state.kept_by_source = phase, 0, 0, {}
                start = state.position  # raw documents that committed shards already hold: replayed, skipped
                documents = itertools.islice(make(stats), start, None)
                raw = ((start + i * BATCH, batch) for i, batch in enumerate(batched(documents, BATCH)))
                processed = ordered(raw, lambda item: submit_process([d.text for d in item[1]]), depth)
                decided = decide(self.config, processed, dedup, split, state.kept, state.kept_by_source)
                for batch, (tokens, lengths) in ordered(decided, lambda d: submit_encode(d.texts), depth):
                    self._write(batch, tokens, lengths, writer, counts, progress)
                    state.position, state.kept = batch.end, state.kept + len(batch.kept)
                    for i in batch.kept:
                        source = batch.documents[i].source
                        state.kept_by_source[source] = state.kept_by_source.get(source, 0) + 1
                    if writer.pending_tokens() >= self.config.shard_tokens:
                        writer.commit(self._snapshot(state, counts))
                        writer.start()
                skipped.update(stats)
                state.skipped_done, state.skipped_named = dict(skipped.skipped), skipped.named
        state.phase, state.position, state.kept, state.kept_by_source = len(phases), 0, 0, {}
        writer.commit(self._snapshot(state, counts), done=True)
        return skipped

    def _write(
        self,
        batch: Decided,
        tokens: np.ndarray,
        lengths: np.ndarray,
        writer: ShardWriter,
        counts: Counts,
        progress: Progress,
    ) -> None:
        n_train = batch.n_train
        cut = int(lengths[:n_train].sum())
        order = [
            i for s in SPLITS for i, split in zip(batch.kept, batch.kept_splits) if split == s
        ]  # raw index per row
        sources = np.asarray([self.source_index[batch.documents[i].source] for i in order], dtype=np.int16)
        scores = None
        if self.with_scores:
            scores = np.asarray(
                [np.nan if batch.documents[i].score is None else batch.documents[i].score for i in order]
            )
        writer.add(
            "train", tokens[:cut], lengths[:n_train], sources[:n_train], None if scores is None else scores[:n_train]
        )
        writer.add(
            "val", tokens[cut:], lengths[n_train:], sources[n_train:], None if scores is None else scores[n_train:]
        )
        result = batch.processed
        writer.add_keys(result.keys[batch.kept], result.signatures[batch.kept] if self.near else None)
        tokens_of = dict(zip(order, lengths.tolist()))
        for i, document in enumerate(batch.documents):
            counts.document(
                document.source,
                result.nbytes[i],
                batch.outcomes[i],
                tokens_of.get(i, 0),
                origin=document.origin,
                removal=result.removals[i],
            )
        progress.update(
            sum(result.nbytes[: len(batch.documents)]),
            counts.documents_out,
            writer.totals["train"]["tokens"] + writer.totals["val"]["tokens"] + writer.pending_tokens(),
        )

    # -- too few documents for a split by documents: each one is split by position -----------------

    def _split_by(self, splits: dict, done: str | None) -> str | None:
        """How validation was taken: "name" (a named split), "documents" (a fraction of them), "tokens"
        (a fraction that leaves no document to validate on: the end of each one instead), None (no split).
        `done`: "tokens" where the shards hold that split already (an interrupted build resumed)."""
        fraction = self.config.validation_split
        if isinstance(fraction, str):
            return "name"
        if fraction == 0 or splits["train"]["documents"] + splits["val"]["documents"] == 0:
            return None
        total = splits["train"]["documents"] + (0 if done == "tokens" else splits["val"]["documents"])
        if splits["val"]["documents"] and done != "tokens":
            log(
                f"data: validation: {splits['val']['documents']:,} of {total:,} documents (validation_split {fraction:g})"
            )
            return "documents"
        log(
            f"data: {total} document(s) are too few for a {fraction:g} split by documents; validation is the last "
            f"{fraction:.0%} of each document's tokens"
        )
        return "tokens"

    def _note_sources_without_validation(self) -> None:
        """A source of a mixture with fewer documents than a fraction's one in 1/f holds none out: it has
        no validation loss of its own. Said, by name."""
        held = {
            split: np.bincount(np.load(self.work / f"{split}.sources.npy"), minlength=len(self.source_names))
            for split in SPLITS
        }
        missing = [
            f"{name} ({held['train'][i]:,} documents)" for i, name in enumerate(self.source_names) if not held["val"][i]
        ]
        if missing:
            warn(
                f"data: {', '.join(missing)}: too few documents for validation_split "
                f"{self.config.validation_split:g} to hold any out, so no validation loss of their own; raise "
                "validation_split, or give them more documents"
            )

    def _split_by_tokens(self, tokenizer, dtype, writer: ShardWriter, state: _State, counts: Counts) -> dict:
        """Each document's first 1-f of its tokens train, the rest validate. The first pass held no document
        out, so every one is in its training shards, encoded, in stream order: each is read back from there
        into a second set of shards, which then replaces the first (`ShardWriter.replace_with`)."""
        fraction = self.config.validation_split
        split = ShardWriter(
            self.work, dtype, self.fingerprint, with_signatures=self.near, with_scores=self.with_scores, name=BY_TOKENS
        )
        split.discard()  # what an interrupted split left
        split.start()
        end = np.asarray([tokenizer.eot_id], dtype=dtype)
        for tokens, source, score in writer.documents("train"):
            ids = tokens[:-1]  # (n,): the document without its end-of-text
            cut = min(len(ids) - 1, max(1, int(len(ids) * (1 - fraction)))) if len(ids) > 1 else len(ids)
            for name, part in zip(SPLITS, (ids[:cut], ids[cut:])):
                if len(part):
                    piece = np.concatenate([part, end])
                    split.add(name, piece, np.asarray([len(piece)], dtype=np.int64), source, score)
        split.add_keys(
            np.zeros(0, np.uint64), np.zeros((0, self.config.minhash_num_perm), np.uint32) if self.near else None
        )
        state.split_by = "tokens"
        split.commit(self._snapshot(state, counts), done=True)
        writer.replace_with(split)
        return {s: dict(writer.totals[s]) for s in SPLITS}

    def _snapshot(self, state: _State, counts: Counts) -> dict:
        """The state to resume from, saved in the record of the shard being committed."""
        return {
            "phase": state.phase,
            "position": state.position,
            "kept": state.kept,
            "kept_by_source": dict(state.kept_by_source),
            "counts": counts.to_json(),
            "skipped_done": dict(state.skipped_done),
            "seconds": round(self._elapsed(), 3),
            "split_by": state.split_by,
        }

    def _manifest(self, tokenizer, dtype, splits, counts: Counts, skipped: Counter, seconds: float) -> dict:
        settings = {k: v for k, v in self.config.to_dict().items() if k not in _NOT_FINGERPRINTED}
        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "tokenizer_fingerprint": tokenizer.fingerprint(),
            "source_fingerprint": _short_hash(source_fingerprint(self.config)),
            "settings_fingerprint": _short_hash(settings),
            "splits": splits,
            "source_names": self.source_names,
            "tokens": sum(s["tokens"] for s in splits.values()),
            "documents_in": counts.documents_in,
            "documents_out": counts.documents_out,
            "removed": dict(counts.removed),  # documents: documents_in - removed = documents_out
            "skipped_inputs": dict(skipped),  # whole files and records never read as documents
            "seconds": round(seconds, 3),
            "config": self.config.to_dict(),
        }


def _short_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
