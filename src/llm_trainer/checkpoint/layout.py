"""What a checkpoint folder holds, by name, and what kind of checkpoint a folder is.

    checkpoints/                                the checkpoint folder of a run (its output_dir/checkpoints)
        checkpoint-00000500/
            model.safetensors, model_config.json   the model (a model folder: eval/generate/export take it)
            tokenizer.json                          so the folder stands alone
            optimizer.safetensors                   optimizer state tensors (Adam moments, steps)
            optimizer.pt                            the rest of the optimizer state (param groups, structure),
                                                    plain data only; loaded with weights_only=True
            rng.pt                                  torch CPU/CUDA generator states (tensors)
            train_state.json                        TrainState's counters, epoch, data position, schedule,
                                                    Python/NumPy RNG (the schema: `train_state`)
            sharded/                                per-rank files: RNG states, DCP shards, DeepSpeed's files
            meta.json                               format, kind, step, save sequence number, experiment
                                                    config, size and checksum of every file, checksum of itself
        latest                                      name of the newest complete checkpoint (written last)
        best_model/                                 standalone model folder of the best evaluation

meta.json's `kind` says which of these files a checkpoint has (`CheckpointKind`): the Parallelism
that saved it chooses the kind, the save writes its files, verification requires them and a resume
reads them, all from the one record here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..files.folder_files import META, SHARDED_DIR  # the names the reading rule knows, defined with it
from ..limits import parse_json
from ..logs import log
from .model_folder import CONFIG_NAME, WEIGHTS_NAME

FORMAT_VERSION = 3  # of meta.json: 3 = XXH3 chunk checksums, 2 = CRC-32 chunks, 1 = sha256 per file
CHECKPOINTS_DIR = "checkpoints"  # inside a run's output folder
DCP_METADATA = f"{SHARDED_DIR}/.metadata"  # the index of DCP shards
PREFIX = "checkpoint-"
STAGING = ".staging-"  # + a checkpoint's name: the folder every rank writes its own files into first
LATEST = "latest"
BEST = "best_model"
OPTIMIZER = "optimizer.pt"
OPTIMIZER_TENSORS = "optimizer.safetensors"
RNG = "rng.pt"
TRAIN_STATE = "train_state.json"


@dataclass(frozen=True, kw_only=True)
class CheckpointKind:
    """One kind of training checkpoint, as meta.json's `kind` names it: where its weights and its
    optimizer state are, and so which files it cannot be resumed without."""

    name: str
    weights_in_shards: bool  # model and optimizer only in sharded/ (DCP shards): no model.safetensors
    optimizer_in_shards: bool  # the optimizer state only in sharded/ (DCP shards or DeepSpeed's files)
    required: tuple[str, ...]  # meta.json must list each of these files


WHOLE = CheckpointKind(
    name="checkpoint",
    weights_in_shards=False,
    optimizer_in_shards=False,
    required=(WEIGHTS_NAME, CONFIG_NAME, OPTIMIZER, OPTIMIZER_TENSORS, RNG, TRAIN_STATE),
)
SHARDED = CheckpointKind(  # FSDP: every rank's DCP shards of model and optimizer
    name="sharded_checkpoint",
    weights_in_shards=True,
    optimizer_in_shards=True,
    required=(CONFIG_NAME, RNG, TRAIN_STATE, DCP_METADATA),
)
DEEPSPEED = CheckpointKind(  # the model folder, and DeepSpeed's own files in sharded/ for the optimizer
    name="deepspeed_checkpoint",
    weights_in_shards=False,
    optimizer_in_shards=True,
    required=(WEIGHTS_NAME, CONFIG_NAME, RNG, TRAIN_STATE),
)
KINDS = {kind.name: kind for kind in (WHOLE, SHARDED, DEEPSPEED)}
BEST_KIND = "best_model"  # meta.json's kind of best_model/: a model folder, not a checkpoint to resume
CONSOLIDATED_KIND = "consolidated_model"  # ... of `consolidate --output`'s model folder, which --overwrite may replace


def read_meta(path: Path) -> dict | None:
    """The folder's meta.json as a dict, or None when it is missing or unreadable (not yet verified)."""
    try:
        meta = parse_json((Path(path) / META).read_text(encoding="utf-8"), str(Path(path) / META))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON, nested past the limit
        return None
    return meta if isinstance(meta, dict) else None


def kind_of(path: Path) -> CheckpointKind | None:
    """The kind of training checkpoint meta.json records; None for any other folder (best_model, a
    model folder, no meta.json)."""
    meta = read_meta(path) or {}
    kind = meta.get("kind")
    return KINDS.get(kind) if isinstance(kind, str) else None


def holds_dcp_shards(folder: Path) -> bool:
    """Whether the folder's weights are DCP shards (an FSDP checkpoint). Readers of a folder for
    inference ask the files, not meta.json's kind: the folder may not be ours, and its shards must
    go through the safe reader whatever meta.json claims."""
    return (Path(folder) / DCP_METADATA).is_file()


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def step_of(path: Path) -> int:
    """The step of a checkpoint folder, from its name."""
    return int(Path(path).name[len(PREFIX) :])


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, highest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=step_of, reverse=True)


def folder_of(path: Path) -> Path:
    """The checkpoint folder beside `path` that another trainer's name for it means, when `path` itself
    does not exist: `checkpoint-10000.pt`, `checkpoint_step_10000.pt` (also `.pth`, `.bin`, or no
    suffix) is `checkpoint-00010000`; `best_model.pt`, `checkpoint_best.pt` is `best_model`."""
    path = Path(path)
    name = None if path.exists() else _folder_named(path.name)
    if name is None:
        return path
    folder = path.with_name(name)
    if folder.is_dir():
        log(f"resume: {path} is the checkpoint folder {folder}")
        return folder
    return path


def _folder_named(name: str) -> str | None:
    """Our folder's name for another trainer's checkpoint file name (`folder_of`), or None."""
    stem = re.sub(r"\.(?:pt|pth|bin)$", "", name)
    step = re.fullmatch(rf"(?:{PREFIX}|checkpoint_(?:step_)?|step_)(\d+)", stem)
    if step is not None:
        return checkpoint_name(int(step.group(1)))
    return BEST if stem in ("best_model", "checkpoint_best", "model_best", "best") else None
