"""Saving, loading and rotating checkpoint folders on this machine's disk (their files: `layout`; the same
checkpoints in a store: `remote`).

Writing (`durable.write_folder_atomically`): every part goes into a hidden temporary folder, meta.json
(with each file's size and checksum, see `files.checksums`) last, then the folder is renamed into place
and `latest` replaced. A crash, a kill -9 or a full disk at any point leaves every earlier checkpoint
untouched.

Reading: a folder is verified first (`verify`); every file is read under `files.folder_files`' rule, each
pickle once into memory, checked against meta.json on those bytes and parsed by torch's weights-only
unpickler (`files.safe_pickle`), so no pickled code runs; DeepSpeed's own files are read the same way
(`parallel.deepspeed_engine`). Format 1 checkpoints (the whole optimizer state in optimizer.pt) still load.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, UsageError, first_line
from ..files.atomic import write_text
from ..files.disk import with_default_mode
from ..files.folder_files import FolderFiles
from ..files.safe_pickle import load_pickle
from ..logs import log
from ..tokenizer import TOKENIZER_FILE
from .durable import Writer, remove_stale, text_writer, write_folder_atomically
from .find import named_latest, newest_first, next_sequence
from .layout import (
    BEST,
    BEST_KIND,
    KINDS,
    LATEST,
    OPTIMIZER,
    OPTIMIZER_TENSORS,
    RNG,
    SHARDED_DIR,
    TRAIN_STATE,
    WHOLE,
    CheckpointKind,
    checkpoint_name,
)
from .model_folder import WEIGHTS_NAME, save_model_folder, write_model_config
from .reading import remove_unless_read
from .tensors import join_tensors, split_tensors
from .verify import verify_once


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer_state: dict | None,
    train_state: dict,
    rng_tensors: dict,
    config: dict,
    tokenizer_json: str | None,
    kind: CheckpointKind = WHOLE,
    extra_meta: dict | None = None,
    sharded_dir: Path | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
    in_store: dict[str, dict] | None = None,
) -> Path:
    """Write one checkpoint of `kind` (the Parallelism's: which parts live in `sharded_dir`).

    `sharded_dir`: every rank's own files, already written (RNG states; FSDP's DCP shards of model
    and optimizer, DeepSpeed's files); it moves in as `sharded/`. `optimizer_state` is None where the
    kind keeps it there. `model_state`, when given, holds the weights to write (a copy taken earlier,
    for a background save); `model` then only supplies the config. `in_store`: the records of the
    shards the ranks wrote straight into the store (`sharded.save_sharded_to_store`), listed in meta.json.
    """
    assert (optimizer_state is None) == kind.optimizer_in_shards, kind.name
    assert sharded_dir is not None or not kind.optimizer_in_shards, kind.name
    root = Path(root)
    remove_stale(root)

    from safetensors.torch import save_file

    writers: list[Writer] = []
    if sharded_dir is not None:
        writers.append(lambda tmp: shutil.move(str(sharded_dir), tmp / SHARDED_DIR))
    if kind.weights_in_shards:
        writers.append(lambda tmp: write_model_config(model, tmp))
    else:
        writers.append(lambda tmp: save_model_folder(model, tmp, state=model_state))  # model.safetensors + config
    writers.append(lambda tmp: torch.save(rng_tensors, tmp / RNG))
    if optimizer_state is not None:
        optimizer_structure, optimizer_tensors = split_tensors(optimizer_state)

        def save_optimizer_tensors(tmp: Path) -> None:
            save_file(optimizer_tensors, str(tmp / OPTIMIZER_TENSORS), metadata={"format": "pt"})
            with_default_mode(tmp / OPTIMIZER_TENSORS)  # safetensors writes 0600; the folder's files are alike

        writers[-1:-1] = [save_optimizer_tensors, lambda tmp: torch.save(optimizer_structure, tmp / OPTIMIZER)]
    writers.append(text_writer(TRAIN_STATE, json.dumps(train_state, indent=2)))
    if tokenizer_json is not None:
        writers.append(text_writer(TOKENIZER_FILE, tokenizer_json))
    meta = {
        "kind": kind.name,
        "step": step,
        "sequence": next_sequence(root),
        "created": time.time(),
        "config": config,
        **(extra_meta or {}),
    }
    path = write_folder_atomically(root / checkpoint_name(step), writers, meta, in_store)
    point_latest(root, path)
    return path


def point_latest(root: Path, path: Path) -> None:
    """`latest` in `root` names the checkpoint `path` (written last, once the checkpoint is complete)."""
    try:
        write_text(root / LATEST, path.name)
    except UsageError as exc:  # the checkpoint is complete, and found by `latest` as the newest
        raise CheckpointError(f"{exc}, and the checkpoints are intact") from None


def save_best_model(
    root: Path,
    model: torch.nn.Module,
    *,
    tokenizer_json: str | None,
    config: dict,
    metrics: dict,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A standalone model folder; `state` gives the weights when the model itself is sharded."""
    writers: list[Writer] = [lambda tmp: save_model_folder(model, tmp, state=state)]
    if tokenizer_json is not None:
        writers.append(text_writer(TOKENIZER_FILE, tokenizer_json))
    return write_folder_atomically(
        Path(root) / BEST, writers, {"kind": BEST_KIND, "config": config, "metrics": metrics}
    )


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, verify_files: bool = True, rank: int = 0
) -> dict[str, Any]:
    """Every part of a checkpoint, verified first; tensors through safetensors or torch.load(weights_only=True).

    Each pickle and JSON file is read once into memory, checked against meta.json's size and checksum
    on those bytes and parsed from them (`files.folder_files`); pickles only by torch's weights-only
    unpickler (`files.safe_pickle`). The safetensors files (tensors only) are memory-mapped. Model tensors
    are read on the CPU and optimizer tensors are mapped to `map_location`, so a checkpoint written on
    a GPU loads on a CPU-only machine. `rank`: this process's rank, whose own RNG file in `sharded/`
    stands in for rng.pt. The parts read are those its kind holds; a folder of no known kind is read
    as a whole checkpoint (and a file it lacks is named in the error). parts["files"] reads the rest
    (DeepSpeed's files in `sharded/`) under the same rule.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if verify_files:
        problem = verify_once(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
    files = FolderFiles.of(path)
    if files.meta is None:
        raise CheckpointError(f"checkpoint {path} is unusable: incomplete: no meta.json")

    def unpickle(name: str, location) -> Any:
        return load_pickle(files.read(name), f"checkpoint {path} could not be loaded safely: {name}", (), location)

    def optimizer(name: str) -> Any:
        structure = unpickle(name, map_location)
        if OPTIMIZER_TENSORS not in files.listed:  # format 1: everything in optimizer.pt
            return structure
        tensors = load_file(str(files.path(OPTIMIZER_TENSORS)), device="cpu")
        if map_location is not None and torch.device(map_location).type != "cpu":
            tensors = {k: v.to(map_location) for k, v in tensors.items()}
        return join_tensors(structure, tensors)

    own_rng = f"{SHARDED_DIR}/rng-rank{rank}.pt"  # each rank continues its own dropout stream
    recorded = files.meta.get("kind")  # FSDP: each rank reads its model/optimizer part from sharded/ later
    kind = (KINDS.get(recorded) if isinstance(recorded, str) else None) or WHOLE
    parts: dict[str, Any] = {
        "model": None,
        "optimizer": None,
        "sharded": path / SHARDED_DIR if (path / SHARDED_DIR).is_dir() or files.meta.get("in_store") else None,
        "files": files,
        "meta": files.meta,
    }
    for key, name, load in (
        *(
            ()
            if kind.weights_in_shards
            else (("model", WEIGHTS_NAME, lambda n: load_file(str(files.path(n)), device="cpu")),)
        ),
        *(() if kind.optimizer_in_shards else (("optimizer", OPTIMIZER, optimizer),)),
        ("rng", own_rng if own_rng in files.listed else RNG, lambda n: unpickle(n, "cpu")),
        ("train_state", TRAIN_STATE, lambda n: json.loads(files.read(n).decode("utf-8"))),
    ):
        try:
            parts[key] = load(name)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors and JSON errors
            raise CheckpointError(f"checkpoint {path} could not be loaded safely: {name}: {first_line(exc)}") from None
    return parts


def rotate(root: Path, keep_last: int | None, protect: set[str]) -> None:
    """Delete all but the newest `keep_last` checkpoints, never one named in `protect` (the best, the new one).

    A folder is renamed to a hidden name before it is deleted (`atomic.remove_folder`), so a crash
    mid-delete never leaves a half-deleted folder that looks like a checkpoint. One that another process
    is reading (`reading.held_checkpoint`: an export, eval or generate) is kept until a later save.
    """
    if keep_last is None:
        return
    root = Path(root)
    for path in newest_first(root, named_latest(root))[keep_last:]:
        if path.name in protect:
            continue
        if remove_unless_read(path):
            log(f"checkpoint: removed {path.name} (save_total_limit={keep_last})")
        elif path.is_dir():
            log(f"checkpoint: {path.name} is being read by another process; it is removed at a later save")
