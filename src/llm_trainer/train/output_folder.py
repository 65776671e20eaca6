"""A new run never lands silently on an old one.

`train` into an output folder that already holds a run (its metrics.jsonl, or checkpoints) would mix
the two: metrics.jsonl would hold the old run's rows, its summary, then the new run's, and `latest`
would move to a new early checkpoint beside the old ones. `check_output_folder` refuses that in one
line, naming the three ways on: resume the run, choose another folder, or start over. Starting over
(`training.overwrite_output_dir`, `train --overwrite`) removes what a run writes there and nothing
else (`RUN_FILES`, the checkpoints, the TensorBoard logs), so the new run starts clean.

A URL output_dir (s3://bucket/runs/x) holds the same run: the run writes in a local staging folder
(`TrainingConfig.local_output_dir`), its checkpoints go to `{output_dir}/checkpoints` as any URL
checkpoint_dir's do (`checkpoint.remote`, `latest` last), and its other files are uploaded after each
checkpoint and at the end (`upload_run_files`, with a `files.json` record of them), so that a resume on
a machine whose staging folder is empty or behind the store finds metrics.jsonl as it was
(`fetch_run_files`); a history in the store that cannot be checked against its record is copied aside
before anything is uploaded over it. The checks above read the store instead of the disk; starting over
removes the same names there.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import yaml

from ..checkpoint import remote as remote_checkpoints
from ..checkpoint.layout import BEST, CHECKPOINTS_DIR, LATEST, list_checkpoints
from ..config import ExperimentConfig, TrainingConfig
from ..errors import UsageError
from ..files import buckets
from ..files.atomic import put_in_place, write_text
from ..logs import log, warn
from ..tokenizer import TOKENIZER_FILE, Tokenizer
from .callbacks import Callback
from .metrics import tensorboard_dir
from .profiling import PROFILE_DIR

METRICS_FILE = "metrics.jsonl"
RUN_FILES = (
    METRICS_FILE,
    "config.yaml",
    "tokenizer.json",
    "plots",
    PROFILE_DIR,
)  # in output_dir, beside the checkpoints


def recorded_checkpoint_folder(run: Path, named: object) -> Path:
    """Where a finished or running run folder keeps its checkpoints, as its config.yaml records
    training.checkpoint_dir (`named`, from a file that may be anyone's: any value): that folder when it
    exists (absolute, or relative to where the run started, tried from here), else `{run}/checkpoints`."""
    if isinstance(named, str) and named and not buckets.Location(named).url and Path(named).is_dir():
        return Path(named)
    return Path(run) / CHECKPOINTS_DIR


def _checkpoint_entries(folder: Path) -> list[Path]:
    """What runs save into a checkpoint folder: its checkpoints, `latest` and best_model."""
    named = [folder / LATEST, folder / BEST]
    return [*list_checkpoints(folder), *(path for path in named if path.exists() or path.is_symlink())]


def run_traces(training: TrainingConfig) -> list[str]:
    """What of an earlier run lies in the folders `training` writes to: [] for a fresh folder."""
    if url := training.remote_output_dir:  # the store is the run folder; the staging folder is a copy of it
        found = [METRICS_FILE] if buckets.exists(buckets.join(url, METRICS_FILE)) else []
        remote = training.remote_checkpoint_dir
        if remote and remote_checkpoints.held_checkpoints(remote):
            found.append(f"{CHECKPOINTS_DIR}/" if remote == buckets.join(url, CHECKPOINTS_DIR) else f"{remote}/")
        elif not remote and _checkpoint_entries(training.resolved_checkpoint_dir):  # a local checkpoint_dir
            found.append(f"{training.resolved_checkpoint_dir}/")
        return found
    output, checkpoints = Path(training.output_dir), training.resolved_checkpoint_dir
    found = [METRICS_FILE] if (output / METRICS_FILE).exists() else []
    if _checkpoint_entries(checkpoints):
        found.append(f"{CHECKPOINTS_DIR if _default_layout(training) else checkpoints}/")
    return found


def finished_run(training: TrainingConfig, step: int) -> UsageError:
    """The refusal of a run into (or a resume of) a folder whose run ended at `step`."""
    return UsageError(
        f"{training.output_dir} holds a finished run (it ended at step {step:,}); choose another "
        "training.output_dir, pass --overwrite (training.overwrite_output_dir=true) to start over, or raise "
        "training.max_steps and resume it (training.resume_from_checkpoint=latest) to train on"
    )


def finished_at(training: TrainingConfig) -> int | None:
    """The step a run in the local output folder ended at, when its metrics.jsonl ends with the summary of
    a run that was not stopped by a signal; None otherwise (an interrupted run, or no local history)."""
    path = training.local_output_dir / METRICS_FILE
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 65536))  # the last row is well within the tail
            last = handle.read().splitlines()[-1]
        row = json.loads(last)
    except (OSError, IndexError, ValueError):
        return None
    if not isinstance(row, dict) or row.get("kind") != "summary" or row.get("stopped_by_signal"):
        return None
    return row["step"] if isinstance(row.get("step"), int) else None


def _default_layout(training: TrainingConfig) -> bool:
    """The checkpoints in `{output_dir}/checkpoints`, a folder only runs write."""
    return training.resolved_checkpoint_dir.resolve() == (training.local_output_dir / CHECKPOINTS_DIR).resolve()


def check_output_folder(training: TrainingConfig, *, is_main: bool) -> None:
    """Refuse an output folder that holds a run unless the run resumes or starts over (see the module
    docstring). Starting over removes the earlier run's files only once the new run has passed every
    check and starts its loop (`clear_run_files`, from the metrics' start): a refusal in between (a
    typo in the data's path, a W&B login missing) leaves the earlier run as it was."""
    if (url := training.remote_output_dir) and is_main:
        log(
            f"output: {url}; the run is written in {training.local_output_dir} first and uploaded there at "
            "each checkpoint and at the end"
        )
        buckets.check_writable(url, "training.output_dir")  # a missing bucket is said now, naming the setting
    if training.resume_from_checkpoint:
        if training.overwrite_output_dir:
            raise UsageError(
                "training.resume_from_checkpoint continues a run and --overwrite (training.overwrite_output_dir) "
                "starts it over; pass one of them"
            )
        return
    if training.overwrite_output_dir:
        return
    traces = run_traces(training)
    if traces and (step := finished_at(training)) is not None:  # resuming it would train no step
        raise finished_run(training, step)
    if traces:
        raise UsageError(
            f"{training.output_dir} already holds a run ({', '.join(traces)}); resume it with "
            "training.resume_from_checkpoint=latest, choose another training.output_dir, or pass --overwrite "
            "(training.overwrite_output_dir=true) to start over"
        )
    output = training.local_output_dir
    theirs = [
        name for name in ("config.yaml", TOKENIZER_FILE) if (output / name).exists() or (output / name).is_symlink()
    ]
    if theirs and not training.remote_output_dir:  # no run wrote them (a run writes metrics.jsonl first)
        raise UsageError(
            f"{training.output_dir} holds {' and '.join(theirs)} but no run (no metrics.jsonl or checkpoints), "
            f"and a run writes its own {' and '.join(theirs)} there; move yours elsewhere (a config passed with "
            "--config is read from anywhere), choose another training.output_dir, or pass --overwrite "
            "(training.overwrite_output_dir=true) to replace them"
        )
    if training.remote_output_dir and is_main:  # a fresh run: what staging holds is no run's copy
        _clear_local(training, why=f"a fresh run into {training.output_dir}", staging_only=True)


def clear_run_files(training: TrainingConfig) -> list[Path]:
    """Remove what a run writes (RUN_FILES, the checkpoints, the TensorBoard logs) from its folders;
    every other file stays. Returns what was removed (locally)."""
    if url := training.remote_output_dir:
        names = [n for n in (*RUN_FILES, _tensorboard_name(training), buckets.FILES_RECORD) if n]
        removed = [n for n in names if buckets.exists(buckets.join(url, n))]
        for name in removed:
            buckets.remove(buckets.join(url, name))
        if remote := training.remote_checkpoint_dir:
            removed += [f"{CHECKPOINTS_DIR}/{n}" for n in remote_checkpoints.remove_checkpoints(remote)]
        if removed:
            log(f"overwrite: starting over in {url}; removed {', '.join(removed)}")
    return _clear_local(training, why="overwrite: starting over")


def _tensorboard_name(training: TrainingConfig) -> str | None:
    """The TensorBoard folder's name in the output folder, when it lies there."""
    folder = tensorboard_dir(training)
    return folder.name if folder.parent == training.local_output_dir else None


def _clear_local(training: TrainingConfig, why: str, staging_only: bool = False) -> list[Path]:
    """Remove what a run writes from its local folders; `staging_only`: from the staging folder of a URL
    output_dir only (a copy of the store's run, which a fresh run there replaces)."""
    output, checkpoints = training.local_output_dir, training.resolved_checkpoint_dir
    targets = [output / name for name in RUN_FILES]
    targets += [checkpoints] if _default_layout(training) else _checkpoint_entries(checkpoints)
    targets.append(tensorboard_dir(training))
    if staging_only:
        targets = [path for path in targets if output.resolve() in path.resolve().parents]
    removed, names = [path for path in targets if path.exists() or path.is_symlink()], []
    for path in removed:
        name = str(path.relative_to(output)) if output in path.parents else str(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            name += "/"
        else:
            path.unlink()
        names.append(name)
    if removed:
        log(f"{why} in {output}; removed {', '.join(names)}")
    return removed


# ----------------------------------------------------------------------------------------------
# a URL output_dir: the run's files (all but the checkpoints) between the staging folder and the store


def _run_files(training: TrainingConfig) -> list[Path]:
    """The files of the staging folder that are the run's, beside its checkpoints: every file but the
    checkpoint folder's (uploaded on their own) and hidden ones (the lock, temporary files)."""
    output, checkpoints = training.local_output_dir, training.resolved_checkpoint_dir.resolve()
    found = []
    for path in sorted(output.rglob("*")):
        parts = path.relative_to(output).parts
        if path.is_symlink() or not path.is_file() or any(part.startswith(".") for part in parts):
            continue
        if checkpoints == path.resolve() or checkpoints in path.resolve().parents:
            continue
        found.append(path)
    return found


def upload_run_files(training: TrainingConfig, uploaded: dict | None = None) -> dict:
    """Upload the run's files to the URL output_dir (those changed since `uploaded`, the record this
    returned last time), `files.json` after them. A copy is uploaded, taken now: a file the run goes on
    appending to (metrics.jsonl, TensorBoard's) matches its recorded checksum in the store."""
    url, output = training.remote_output_dir, training.local_output_dir
    assert url is not None, "only a URL output_dir is uploaded"
    copy = output.parent / f".{output.name}.upload"
    shutil.rmtree(copy, ignore_errors=True)
    try:
        for path in _run_files(training):
            target = copy / path.relative_to(output)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        copy.mkdir(parents=True, exist_ok=True)
        return buckets.put_folder(copy, url, unchanged=uploaded)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def fetch_run_files(training: TrainingConfig) -> None:
    """Before a resume: the run's files from the URL output_dir into the staging folder, each checked
    against the store's record, unless the staging folder's metrics.jsonl continues the store's (this
    machine ran last). A staging metrics.jsonl the store has moved past (another machine ran since) is
    replaced; the run's other files are fetched where the staging folder lacks them.
    A history in the store that cannot be checked (no record, a damaged one, a file that does not match
    it) is never uploaded over: it is copied aside in the store first, and a warning says where."""
    url, output = training.remote_output_dir, training.local_output_dir
    assert url is not None, "only a URL output_dir is fetched"
    output.mkdir(parents=True, exist_ok=True)
    try:
        record = buckets.read_record(url)
    except buckets.UnverifiedFolder as exc:
        _keep_aside(url, str(exc))
        return
    if record is None:
        if buckets.exists(buckets.join(url, METRICS_FILE)):  # uploaded, then cut short before its record
            _keep_aside(url, f"{buckets.join(url, METRICS_FILE)} has no {buckets.FILES_RECORD} record")
        return
    if _continues(output / METRICS_FILE, record.get(METRICS_FILE)):
        return
    copy = output.parent / f".{output.name}.download"
    try:
        try:
            if not buckets.get_folder(url, copy):
                return
        except buckets.UnverifiedFolder as exc:
            _keep_aside(url, str(exc))
            return
        for path in sorted(copy.rglob("*")):
            target = output / path.relative_to(copy)
            if path.is_file() and (not target.exists() or target == output / METRICS_FILE):
                target.parent.mkdir(parents=True, exist_ok=True)
                put_in_place(path, target)  # this run's own files (its config.yaml) stay
        log(f"resume: downloaded the run's files from {url} into {output}")
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _continues(local: Path, stored: tuple[int, str] | None) -> bool:
    """Whether the local metrics.jsonl holds the store's (`stored`: its size and checksum) as its start:
    the store's rows and maybe the rows this machine wrote since. False when there is no local file."""
    from ..files.checksums import checksum_jobs, combine

    if not local.is_file():
        return False
    if stored is None:
        return True
    size, checksum = stored
    return local.stat().st_size >= size and combine(checksum_jobs(local, size)) == checksum


def _keep_aside(url: str, why: str) -> None:
    """Copy the store's metrics.jsonl and files.json into a new `unverified-<time>/` folder beside them,
    before this run uploads its own: a history that could not be checked is never overwritten unseen."""
    aside = buckets.join(url, f"unverified-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
    kept = []
    for name in (METRICS_FILE, buckets.FILES_RECORD):
        if buckets.exists(buckets.join(url, name)):
            buckets.copy(buckets.join(url, name), buckets.join(aside, name))
            kept.append(name)
    warn(
        f"the run's files in {url} could not be verified ({why}); "
        + (f"kept {' and '.join(kept)} aside in {aside}; " if kept else "")
        + "this run's metrics.jsonl replaces it in the store"
    )


class RunFilesAtStart(Callback):
    """The run's config.yaml and tokenizer.json, written when the loop starts: after a resume has been
    accepted, so a refused one (another model shape, another tokenizer) leaves the folder as it was."""

    def __init__(self, output: Path, experiment: ExperimentConfig, tokenizer: Tokenizer):
        self.output, self.experiment, self.tokenizer = output, experiment, tokenizer

    def on_train_begin(self, trainer) -> None:
        if trainer.dist.is_main:
            write_text(self.output / "config.yaml", yaml.safe_dump(self.experiment.to_dict(), sort_keys=False))
            write_text(self.output / TOKENIZER_FILE, self.tokenizer.to_json())
