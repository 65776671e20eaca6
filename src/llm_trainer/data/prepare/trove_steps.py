"""The steps of `prepare` as datatrove pipeline steps (see `cluster` for the stages and the files).

Each step calls the function the in-process prepare calls for that stage: `iter_unit` (the readers),
`DocumentProcessor` (cleaning, quality filters, exact-dedup key, MinHash signature), `encode` (the
tokenizer) and `Build` (dedup decisions, split, shards, report) in the merge. A document removed by a
filter is not dropped from the datatrove stream: it is carried to the part writer with its reason, so
the merge can count and name it as the in-process report does.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.logging import logger
from datatrove.utils.stats import PipelineStats

from ...config import DataConfig
from ...tokenizer import Tokenizer
from ..text.sources import SourceStats, iter_unit
from .build import BATCH, TOKENIZE_THREADS, ordered
from .cluster import (
    PartWriter,
    PlanFile,
    clear_error,
    merge,
    part_folder,
    tokenized_rows,
    write_error,
)
from .workers import DocumentProcessor, encode

_END = "end_of_source"  # a marker document: the task read the last of its files of this source
_current: dict = {}  # the file the reader of this process is in, named when a task fails
CONSOLE: list = []  # the command's stderr while datatrove's console log goes to a file (executors._run)


def _to_console() -> contextlib.AbstractContextManager:
    """Our own lines (warnings, the merge's progress and summary) on the command's console."""
    return contextlib.redirect_stderr(CONSOLE[0]) if CONSOLE else contextlib.nullcontext()


class ReadFiles(PipelineStep):
    """The task's contiguous range of input files, read as the in-process prepare reads them."""

    name = "llm-trainer files"
    type = "📖 - READER"

    def __init__(self, config: DataConfig, plan_file: PlanFile):
        super().__init__()
        self.config, self.plan_file = config, plan_file

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        plan = self.plan_file.load()
        plan.enter()
        start, end = plan.ranges()[rank]
        source, pending = None, SourceStats()
        for index in range(start, end):
            unit = plan.units[index]
            if source is not None and unit.source != source:
                yield _end_marker(source, pending)
                pending = SourceStats()
            source = unit.source
            _current["file"] = unit.path
            stats = SourceStats()
            for document in iter_unit(unit, self.config, stats):
                pending.update(stats.take())  # what the reader skipped since the last document
                self.stat_update("documents")
                yield Document(
                    text=document.text,
                    id=document.origin or unit.path,
                    metadata={
                        "source": unit.source,
                        "origin": document.origin,
                        "score": document.score,
                        "skips": pending.to_json(),
                    },
                )
                pending = SourceStats()
            pending.update(stats.take())
        if source is not None:
            yield _end_marker(source, pending)


def _end_marker(source: int, skips: SourceStats) -> Document:
    return Document(text="", id=_END, metadata={_END: source, "skips": skips.to_json()})


def _is_marker(document: Document) -> bool:
    return _END in document.metadata


class ProcessDocuments(PipelineStep):
    """Cleaning, quality filters and dedup keys (`DocumentProcessor`), a batch of one source at a time."""

    name = "llm-trainer clean, filter, dedup keys"
    type = "🔻 - FILTER"

    def __init__(self, config: DataConfig):
        super().__init__()
        self.config = config

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        processor = DocumentProcessor(self.config)
        batch: list[Document] = []

        def flush():
            with self.track_time("batch"):
                result = processor([d.text for d in batch])
            for i, document in enumerate(batch):
                document.metadata["batch"], document.metadata["row"] = result, i
                self.stat_update("kept" if result.reasons[i] is None else f"removed_{result.reasons[i]}")
            yield from batch
            batch.clear()

        for document in data:
            if _is_marker(document) or (batch and document.metadata["source"] != batch[0].metadata["source"]):
                yield from flush() if batch else ()
            if _is_marker(document):
                yield document
                continue
            batch.append(document)
            if len(batch) == BATCH:
                yield from flush()
        if batch:
            yield from flush()


class WriteParts(PipelineStep):
    """Tokenizes what the merge may keep (`encode`, on the tokenizer's threads while the next batch is
    read and processed) and writes the task's part; a failure is recorded with the file it was in."""

    name = "llm-trainer tokenize, write part"
    type = "💽 - WRITER"

    def __init__(self, config: DataConfig, plan_file: PlanFile):
        super().__init__()
        self.config, self.plan_file = config, plan_file

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with _to_console():  # the steps before this one run inside it, as it pulls their documents
            self._write(data, rank, world_size)
        yield from ()

    def _write(self, data: DocumentsPipeline, rank: int, world_size: int) -> None:
        tasks_dir = self.plan_file.tasks_dir
        clear_error(tasks_dir, "prepare", rank)
        _current["file"] = None
        try:
            plan = self.plan_file.load()
            plan.enter()
            tokenizer = Tokenizer.load(Path(plan.work) / "tokenizer.json")
            dtype = np.dtype(plan.dtype)
            writer = PartWriter(part_folder(tasks_dir, rank), dtype, self.config.deduplication == "near")
            seen: dict[int, set[int]] = {}
            with ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize") as pool:

                def submit(item):
                    if item[0] == "end":
                        return pool.submit(lambda: None)
                    _, documents, rows = item
                    cleaned = documents[0].metadata["batch"].texts  # what the filters and dedup decided on
                    return pool.submit(encode, tokenizer, [cleaned[i] for i in rows], dtype)

                items = self._batches(data, seen)
                for item, encoded in ordered(items, submit, TOKENIZE_THREADS + 1):
                    if item[0] == "end":
                        writer.end_source(item[1], item[2])
                        continue
                    _, documents, rows = item
                    tokens, lengths = encoded
                    result = documents[0].metadata["batch"]
                    writer.add(
                        documents[0].metadata["source"], [d.metadata for d in documents], result, rows, tokens, lengths
                    )
                    self.stat_update("tokens", value=int(lengths.sum()), unit="batch")
            writer.close()
        except BaseException as exc:
            write_error(tasks_dir, "prepare", rank, world_size, _current.get("file"), exc)
            raise

    def _batches(self, data: DocumentsPipeline, seen: dict) -> Iterator[tuple]:
        """("batch", documents, rows to tokenize) per processed batch; ("end", source, skips) per marker."""
        batch: list[Document] = []
        for document in data:
            if batch and (_is_marker(document) or document.metadata["batch"] is not batch[0].metadata["batch"]):
                yield self._batch(batch, seen)
                batch = []
            if _is_marker(document):
                yield ("end", document.metadata[_END], document.metadata["skips"])
            else:
                batch.append(document)
        if batch:
            yield self._batch(batch, seen)

    def _batch(self, batch: list[Document], seen: dict) -> tuple:
        result = batch[0].metadata["batch"]
        source_seen = seen.setdefault(batch[0].metadata["source"], set())
        return ("batch", batch, tokenized_rows(result, self.config.deduplication, source_seen))


class MergeParts(PipelineStep):
    """The merge stage's one task (`cluster.merge`): dedup decisions, split, shards, manifest, report."""

    name = "llm-trainer merge parts"
    type = "💽 - WRITER"

    def __init__(self, config: DataConfig, plan_file: PlanFile):
        super().__init__()
        self.config, self.plan_file = config, plan_file

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        tasks_dir = self.plan_file.tasks_dir
        clear_error(tasks_dir, "merge", rank)
        try:
            with _to_console():
                merge(self.config, self.plan_file)
        except BaseException as exc:
            write_error(tasks_dir, "merge", rank, world_size, None, exc)
            raise
        yield from ()


class SlurmThisPython(SlurmPipelineExecutor):
    """datatrove's Slurm executor, whose jobs run the pickled pipeline with the interpreter that submitted
    them rather than the `launch_pickled_pipeline` script found on the job's PATH (absent unless the
    virtual environment is activated: `venv/bin/llm-trainer`, cron, a job script), and with no
    stats-merging job, which would wait for ever behind a failed task (the stats stay in stats/)."""

    def get_launch_file_contents(self, sbatch_args: dict, run_script: str) -> str:
        ours = f"{shlex.quote(sys.executable)} -m datatrove.tools.launch_pickled_pipeline "
        return super().get_launch_file_contents(sbatch_args, run_script.replace("launch_pickled_pipeline ", ours, 1))

    def launch_merge_stats(self) -> None:
        return None


class LocalTasksInProcesses(LocalPipelineExecutor):
    """datatrove's local executor, whose tasks run in forked worker processes that, when one dies (the
    out-of-memory killer, a crash in a native library), end the run with `BrokenProcessPool` instead of
    waiting for ever: datatrove's own pool (multiprocessing's `Pool`) replaces a dead worker and never
    delivers its task's result, where the standard library's `ProcessPoolExecutor` marks itself broken.
    One task at a time (`workers` 1) runs in this process, as datatrove runs it.

    Fork, so that a worker starts with this process's modules imported (a fresh interpreter per worker
    would import llm_trainer and torch again: seconds on a small machine); the worker finds the executor
    in `_FORKED` rather than receiving it pickled."""

    def run(self):
        if self.workers == 1:
            return super().run()
        self._launched = True
        ranks = self.get_incomplete_ranks(range(self.tasks))
        if not ranks:
            logger.info(f"Not doing anything as all {self.tasks} tasks have already been completed.")
            return PipelineStats()
        if skipped := self.tasks - len(ranks):
            logger.info(f"Skipping {skipped} already completed tasks")
        self.save_executor_as_json()
        _FORKED[:] = [self]
        try:
            context = multiprocessing.get_context("fork")
            workers = min(self.workers, len(ranks))
            with ProcessPoolExecutor(workers, context, initializer=_end_with, initargs=(os.getpid(),)) as pool:
                running = [pool.submit(_run_forked_task, rank, slot % self.workers) for slot, rank in enumerate(ranks)]
                try:
                    stats = sum((task.result() for task in as_completed(running)), start=PipelineStats())
                except BaseException:
                    pool.shutdown(cancel_futures=True)  # the tasks started finish (and are kept); no other starts
                    raise
        finally:
            _FORKED.clear()
        with self.logging_dir.open("stats.json", "wt") as file:
            stats.save_to_disk(file)
        logger.success(stats.get_repr(f"All {self.tasks} tasks"))
        return stats


_FORKED: list[LocalTasksInProcesses] = []  # the executor whose tasks the forked workers run
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that forked it ends


def _end_with(driver: int) -> None:
    """A worker ends when the command that forked it does: one left behind by a command killed alone
    would go on taking tasks and writing their parts while the same command, run again, writes them too.
    Linux ends it with the command (`PR_SET_PDEATHSIG`); elsewhere a thread watches for the command's end."""
    try:
        set_parent_death_signal = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        set_parent_death_signal = None
    if set_parent_death_signal is not None and set_parent_death_signal(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
        if os.getppid() != driver:  # the command ended before the signal was set
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == driver:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-the-command", daemon=True).start()


def _run_forked_task(rank: int, local_rank: int) -> PipelineStats:
    """One task, in a forked worker of `LocalTasksInProcesses`; local rank 0 prints datatrove's task log."""
    return _FORKED[0]._run_for_rank(rank, local_rank)


def per_file_pipeline(config: DataConfig, plan_file: PlanFile) -> list[PipelineStep]:
    """The steps carry the digest of the plan the command built from the config: a task follows that plan
    or none, whoever else can write the task folder."""
    return [ReadFiles(config, plan_file), ProcessDocuments(config), WriteParts(config, plan_file)]


def merge_pipeline(config: DataConfig, plan_file: PlanFile) -> list[PipelineStep]:
    return [MergeParts(config, plan_file)]
