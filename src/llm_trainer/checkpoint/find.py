"""Which checkpoint a path or "latest" means.

`latest_checkpoint(root)` takes the checkpoint saved last (by its save sequence number, so a save
that completed but was killed before `latest` was updated is not lost) and falls back to the
previous one, with a warning naming the reason, if a file is missing, truncated or does not match
its checksum. `find_checkpoint(path)` turns whatever folder a user names (a checkpoint, a run, a
checkpoints folder, another trainer's `checkpoint-N.pt`) into one checkpoint folder; resume, eval,
generate and export all go through it. A checkpoint named explicitly is verified and refused if
anything is wrong (`resolve_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..logs import log, warn
from .layout import CHECKPOINTS_DIR, LATEST, META, folder_of, list_checkpoints, read_meta, step_of
from .model_folder import CONFIG_NAME, refuse_transformers_folder
from .verify import verify_once


def _sequence(path: Path) -> int | None:
    meta = read_meta(path)
    value = meta.get("sequence") if meta else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def next_sequence(root: Path) -> int:
    """1 + the highest save sequence number under `root`: orders saves by time, whatever their step."""
    numbers = [_sequence(p) for p in list_checkpoints(root)]
    return 1 + max((n for n in numbers if n is not None), default=0)


def named_latest(root: Path) -> str | None:
    """The checkpoint name `latest` holds, or None (no pointer, or an unreadable one, said as a warning)."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    try:
        return pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        warn(f"{pointer} is unreadable; choosing the checkpoint by save order")
        return None


def newest_first(root: Path, named: str | None) -> list[Path]:
    """Checkpoints in the order they were saved, newest first (save sequence; then `latest`; then step)."""
    candidates = list_checkpoints(root)
    sequences = {path: _sequence(path) for path in candidates}

    def key(path: Path):
        sequence = sequences[path]
        if sequence is None and path.name == named:  # `latest` names it but its meta is unreadable:
            sequence = 1 << 62  # try it first, so the warning says why it was skipped
        return (sequence if sequence is not None else -1, path.name == named, step_of(path))

    return sorted(candidates, key=key, reverse=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest usable checkpoint under `root`; unusable ones are skipped, saying why.

    None when there is no checkpoint yet (a fresh start, e.g. an elastic restart); a CheckpointError
    when there are some but none is usable.
    """
    root = Path(root)
    named = named_latest(root)
    candidates = newest_first(root, named)
    missing = named is not None and named not in {path.name for path in candidates}
    if missing:
        warn(f"{root / LATEST} names {named!r}, which is not a checkpoint folder here; taking the newest complete one")
    skipped = set()
    for path in candidates:
        problem = verify_once(path)
        if problem is None:
            if named is not None and path.name != named:
                why = (
                    "it does not exist"
                    if missing
                    else "it is unusable"
                    if named in skipped
                    else "this one was saved after it (the run stopped before updating `latest`)"
                )
                log(f"checkpoint: using {path} instead of {named}, which `latest` names: {why}")
            return path
        skipped.add(path.name)
        warn(f"skipping checkpoint {path}: {problem}; trying the previous one")
    if candidates:
        raise CheckpointError(
            f"no usable checkpoint in {root}: every one is corrupt or incomplete (see the warnings above); to "
            "start the run anew there, pass --overwrite instead of resume_from_checkpoint (or choose another output_dir)"
        )
    return None


def find_checkpoint(path: str | Path) -> Path | None:
    """The one folder a user's path names:

        a checkpoint, best_model or model folder      the folder itself (not verified here)
        checkpoint-N, checkpoint-N.pt (.pth, .bin)    the folder checkpoint-0000000N beside it
        a checkpoints folder (`latest`, checkpoint-*) its newest usable checkpoint
        the `latest` pointer file itself              the same: its folder's newest usable checkpoint
        a run's output folder (with checkpoints/)     the newest usable checkpoint in checkpoints/

    None when a checkpoints or run folder holds no checkpoint yet; a CheckpointError when the path
    does not exist.
    """
    path = folder_of(Path(path))
    if path.name == LATEST and path.is_file():
        return latest_checkpoint(path.parent)
    if not path.is_dir():
        here = ", ".join(p.name for p in list_checkpoints(path.parent)[:3])
        what = "is a file, not a checkpoint folder" if path.exists() else "not found"
        raise CheckpointError(
            f"checkpoint {path} {what}{f' ({path.parent} holds {here})' if here else ''}; pass a checkpoint, "
            "best_model or output folder"
        )
    if (path / META).is_file() or (path / CONFIG_NAME).is_file():
        return path
    if (path / LATEST).is_file() or list_checkpoints(path):
        return latest_checkpoint(path)
    if (path / CHECKPOINTS_DIR).is_dir():
        return latest_checkpoint(path / CHECKPOINTS_DIR)
    return path


def resolve_checkpoint(spec: str, root: Path) -> Path | None:
    """The checkpoint a resume continues from: "latest" under `root`, or the folder `spec` names
    (see `find_checkpoint`), verified. None when there is no checkpoint yet."""
    if spec == "latest":
        return latest_checkpoint(root)
    try:
        path = find_checkpoint(spec)
    except CheckpointError as exc:  # a resume may also take the newest of its own checkpoints
        raise CheckpointError(f"{exc} (or resume_from_checkpoint=latest: this run's newest)") from None
    if path is None:
        return None
    refuse_transformers_folder(path, "resume from")
    problem = verify_once(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
    return path
