"""A new run never lands silently on an old one.

`train` into an output folder that already holds a run (its metrics.jsonl, or checkpoints) would mix
the two: metrics.jsonl would hold the old run's rows, its summary, then the new run's, and `latest`
would move to a new early checkpoint beside the old ones. `check_output_folder` refuses that in one
line, naming the three ways on: resume the run, choose another folder, or start over. Starting over
(`training.overwrite_output_dir`, `train --overwrite`) removes what a run writes there and nothing
else (`RUN_FILES`, the checkpoints, the TensorBoard logs), so the new run starts clean.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..checkpoint.layout import BEST, CHECKPOINTS_DIR, LATEST, list_checkpoints
from ..config import TrainingConfig
from ..errors import UsageError
from ..logs import log
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


def _checkpoint_entries(folder: Path) -> list[Path]:
    """What runs save into a checkpoint folder: its checkpoints, `latest` and best_model."""
    named = [folder / LATEST, folder / BEST]
    return [*list_checkpoints(folder), *(path for path in named if path.exists() or path.is_symlink())]


def run_traces(training: TrainingConfig) -> list[str]:
    """What of an earlier run lies in the folders `training` writes to: [] for a fresh folder."""
    output, checkpoints = Path(training.output_dir), training.resolved_checkpoint_dir
    found = [METRICS_FILE] if (output / METRICS_FILE).exists() else []
    if _checkpoint_entries(checkpoints):
        found.append(f"{CHECKPOINTS_DIR if _default_layout(training) else checkpoints}/")
    return found


def _default_layout(training: TrainingConfig) -> bool:
    """The checkpoints in `{output_dir}/checkpoints`, a folder only runs write."""
    return training.resolved_checkpoint_dir.resolve() == (Path(training.output_dir) / CHECKPOINTS_DIR).resolve()


def check_output_folder(training: TrainingConfig, *, is_main: bool) -> None:
    """Refuse an output folder that holds a run unless the run resumes or starts over (see the module
    docstring); starting over removes the earlier run's files here (on the main process only)."""
    if training.resume_from_checkpoint:
        if training.overwrite_output_dir:
            raise UsageError(
                "training.resume_from_checkpoint continues a run and --overwrite (training.overwrite_output_dir) "
                "starts it over; pass one of them"
            )
        return
    if training.overwrite_output_dir:
        if is_main:
            clear_run_files(training)
        return
    traces = run_traces(training)
    if traces:
        raise UsageError(
            f"{training.output_dir} already holds a run ({', '.join(traces)}); resume it with "
            "training.resume_from_checkpoint=latest, choose another training.output_dir, or pass --overwrite "
            "(training.overwrite_output_dir=true) to start over"
        )


def clear_run_files(training: TrainingConfig) -> list[Path]:
    """Remove what a run writes (RUN_FILES, the checkpoints, the TensorBoard logs) from its folders;
    every other file stays. Returns what was removed."""
    output, checkpoints = Path(training.output_dir), training.resolved_checkpoint_dir
    targets = [output / name for name in RUN_FILES]
    targets += [checkpoints] if _default_layout(training) else _checkpoint_entries(checkpoints)
    targets.append(tensorboard_dir(training))
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
        log(f"overwrite: starting over in {output}; removed {', '.join(names)}")
    return removed
