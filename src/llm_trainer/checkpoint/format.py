"""Checkpoints: a folder of named stateful parts plus JSON metadata, written atomically and verified on load.

    checkpoint-00000500/
        model.safetensors, model_config.json   the model (a model folder: eval/generate/export take it)
        tokenizer.json                          so the folder stands alone
        optimizer.safetensors                   optimizer state tensors (Adam moments, steps)
        optimizer.pt                            the rest of the optimizer state (param groups, structure),
                                                plain data only; loaded with weights_only=True
        rng.pt                                  torch CPU/CUDA generator states (tensors)
        train_state.json                        step, epoch, tokens seen, best metric, early stopping,
                                                data position, schedule, Python/NumPy RNG
        meta.json                               format, step, save sequence number, experiment config,
                                                size and checksum of every file, checksum of itself
    latest                                      name of the newest complete checkpoint (written last)
    best_model/                                 standalone model folder of the best evaluation

Writing (`durable.write_folder_atomically`): every part goes into a hidden temporary folder, meta.json
(with each file's size and checksum, see `checksums`) last, then the folder is renamed into place
and `latest` replaced. A crash, a kill -9 or a full disk at any point leaves every earlier checkpoint
untouched.

Reading: `resolve_checkpoint("latest")` takes the checkpoint saved last (by its save sequence
number, so a save that completed but was killed before `latest` was updated is not lost) and falls
back to the previous one, with a warning naming the reason, if a file is missing, truncated or does
not match its checksum. A checkpoint named explicitly is verified and refused if anything is wrong.
Tensors are read with safetensors and `torch.load(weights_only=True)` only: no pickled code runs.
A folder is read as untrusted (checksums prove integrity, not origin): meta.json and train_state.json
are type-checked, a symlink leading out of the folder is refused, and every pickle in `sharded/` is
proven to import nothing off an allow-list before DeepSpeed or DCP reads it (see `safe_pickle`).

Optimizer tensors go to safetensors (written about 3x faster than torch.save's zip archive, and
memory-mapped on load); optimizer.pt keeps only the structure around them, with a reference in
place of each tensor. Format 1 checkpoints (the whole optimizer state in optimizer.pt) still load.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..logs import log, warn
from .checksums import CRC32_TREE, XXH3_TREE, checksum_jobs, combine, meta_checksum, sha256_file, xxhash
from .durable import (
    FORMAT_VERSION,
    META,
    Writer,
    first_line,
    owner,
    read_meta,
    remove_stale,
    text_writer,
    write_folder_atomically,
    write_text_atomically,
)
from .model_folder import CONFIG_NAME, WEIGHTS_NAME, save_model_folder, write_model_config
from .safe_pickle import DEEPSPEED, check_torch_archive

SHARDED_DIR = "sharded"  # per-rank files: DCP shards (FSDP), DeepSpeed's files, RNG states
PREFIX = "checkpoint-"
LATEST = "latest"
BEST = "best_model"
OPTIMIZER = "optimizer.pt"
OPTIMIZER_TENSORS = "optimizer.safetensors"
RNG = "rng.pt"
TRAIN_STATE = "train_state.json"
# Files a training checkpoint cannot be resumed without; meta.json must list each of them.
REQUIRED = {
    "checkpoint": (WEIGHTS_NAME, CONFIG_NAME, OPTIMIZER, OPTIMIZER_TENSORS, RNG, TRAIN_STATE),
    "sharded_checkpoint": (CONFIG_NAME, RNG, TRAIN_STATE, f"{SHARDED_DIR}/.metadata"),
    "deepspeed_checkpoint": (WEIGHTS_NAME, CONFIG_NAME, RNG, TRAIN_STATE),  # + DeepSpeed's files in sharded/
}


def _sequence(path: Path) -> int | None:
    meta = read_meta(path)
    value = meta.get("sequence") if meta else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _next_sequence(root: Path) -> int:
    """1 + the highest save sequence number under `root`: orders saves by time, whatever their step."""
    numbers = [_sequence(p) for p in list_checkpoints(root)]
    return 1 + max((n for n in numbers if n is not None), default=0)


_TENSOR_REF = "__llm_trainer_tensor__"  # {_TENSOR_REF: key} stands for a tensor of optimizer.safetensors
_SAFETENSORS_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(structure with a reference in place of each dense tensor, {key: contiguous CPU tensor}).

    Tensors safetensors cannot hold (sparse, quantized, unusual dtypes) stay in the structure.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.dtype not in _SAFETENSORS_DTYPES:
                return value
            tensor = value.detach().to("cpu").contiguous()
            storage = tensor.untyped_storage()
            if tensor.numel() and (storage.data_ptr() in seen or storage.nbytes() != tensor.nbytes):
                tensor = tensor.clone()  # a view into shared memory: safetensors wants each tensor on its own
            seen.add(tensor.untyped_storage().data_ptr())
            key = where if where not in tensors else f"{where}#{len(tensors)}"
            tensors[key] = tensor
            return {_TENSOR_REF: key}
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{where}.{i}") for i, v in enumerate(value))
        return value

    return walk(state, ""), tensors


def join_tensors(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of split_tensors."""
    if isinstance(structure, dict):
        if len(structure) == 1 and _TENSOR_REF in structure:
            key = structure[_TENSOR_REF]
            if key not in tensors:
                raise KeyError(f"tensor {key!r} is missing from {OPTIMIZER_TENSORS}")
            return tensors[key]
        return {k: join_tensors(v, tensors) for k, v in structure.items()}
    if type(structure) in (list, tuple):
        return type(structure)(join_tensors(v, tensors) for v in structure)
    return structure


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
    extra_meta: dict | None = None,
    sharded_dir: Path | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write one checkpoint. With `sharded_dir` (FSDP: every rank's DCP shards of model and optimizer,
    already written), that folder moves in as `sharded/` in place of the weight and optimizer files.
    `model_state`, when given, holds the weights to write (a copy taken earlier, for a background
    save); `model` then only supplies the config."""
    root = Path(root)
    remove_stale(root)

    from safetensors.torch import save_file

    writers: list[Writer] = [
        lambda tmp: torch.save(rng_tensors, tmp / RNG),
        text_writer(TRAIN_STATE, json.dumps(train_state, indent=2)),
    ]
    weights_sharded = sharded_dir is not None and (Path(sharded_dir) / ".metadata").is_file()
    if not weights_sharded:
        writers.insert(0, lambda tmp: save_model_folder(model, tmp, state=model_state))  # model.safetensors + config
    if not weights_sharded and optimizer_state is not None:  # None: DeepSpeed's files in sharded_dir hold it
        optimizer_structure, optimizer_tensors = split_tensors(optimizer_state)
        writers[1:1] = [
            lambda tmp: save_file(optimizer_tensors, str(tmp / OPTIMIZER_TENSORS), metadata={"format": "pt"}),
            lambda tmp: torch.save(optimizer_structure, tmp / OPTIMIZER),
        ]
    if weights_sharded:
        writers.insert(0, lambda tmp: write_model_config(model, tmp))
    if sharded_dir is not None:  # per-rank files: RNG states, and the DCP shards under FSDP
        writers.insert(0, lambda tmp: shutil.move(str(sharded_dir), tmp / SHARDED_DIR))
    if tokenizer_json is not None:
        writers.append(text_writer("tokenizer.json", tokenizer_json))
    meta = {
        "kind": "sharded_checkpoint"
        if weights_sharded
        else "checkpoint"
        if optimizer_state is not None
        else "deepspeed_checkpoint",
        "step": step,
        "sequence": _next_sequence(root),
        "created": time.time(),
        "config": config,
        **(extra_meta or {}),
    }
    path = write_folder_atomically(root / f"{PREFIX}{step:08d}", writers, meta)
    write_text_atomically(root / LATEST, path.name)
    return path


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
        writers.append(text_writer("tokenizer.json", tokenizer_json))
    return write_folder_atomically(
        Path(root) / BEST, writers, {"kind": "best_model", "config": config, "metrics": metrics}
    )


# -- reading --------------------------------------------------------------------------------------

_verified: dict[str, tuple] = {}  # folder -> file signatures when it last verified, so resume hashes once


def _signature(path: Path) -> tuple | None:
    try:
        return tuple(
            (p.name, s.st_size, s.st_mtime_ns, s.st_ino)
            for p in sorted(path.iterdir())
            if p.is_file()
            for s in [p.stat()]
        )
    except OSError:
        return None


def _safe_file_name(name) -> bool:
    """A plain file name, or one inside the `sharded/` subfolder; nothing that could leave the folder."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    if len(parts) == 2 and parts[0] == SHARDED_DIR:
        parts = parts[1:]
    return len(parts) == 1 and Path(parts[0]).name == parts[0] and parts[0] not in ("", ".", "..")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# meta.json fields and the types they must have (a crafted meta.json is damage like any other).
_META_TYPES = {
    "format_version": _is_int,
    "sequence": _is_int,
    "step": _is_int,
    "kind": lambda v: isinstance(v, str),
    "checksum": lambda v: isinstance(v, str),
    "meta_sha256": lambda v: isinstance(v, str),
    "config": lambda v: isinstance(v, dict),
    "metrics": lambda v: isinstance(v, dict),
    "files": lambda v: isinstance(v, dict),
    "world_size": _is_int,
}


def _meta_problem(meta: dict) -> str | None:
    """None when every known field of meta.json has its type, else what is wrong."""
    for name, ok in _META_TYPES.items():
        if name in meta and not ok(meta[name]):
            return f"meta.json is corrupt ({name} is {type(meta[name]).__name__})"
    if "files" not in meta:
        return "meta.json is corrupt"
    plain_sha256 = meta.get("format_version", 1) < 2
    for name, entry in meta["files"].items():
        if plain_sha256:
            good = isinstance(entry, str)
        else:
            good = (
                isinstance(entry, dict)
                and _is_int(entry.get("size"))
                and entry["size"] >= 0
                and isinstance(entry.get("checksum"), str)
            )
        if not good:
            return f"meta.json is corrupt (the entry of {name!r})"
    return None


def link_outside(folder: Path, name: str) -> bool:
    """Whether `folder/name` (or a folder on the way) is a symlink leading out of `folder`."""
    try:
        root, target = Path(folder).resolve(strict=True), (Path(folder) / name).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop: not readable as a file of the folder
        return (Path(folder) / name).is_symlink()
    return root != target and root not in target.parents


def verify(path: Path) -> str | None:
    """None if the folder is a complete checkpoint whose files match their sizes and checksums, else the reason."""
    path = Path(path)
    if not (path / META).is_file():
        return "incomplete: no meta.json (the save was interrupted)"
    meta = read_meta(path)
    if meta is None:
        return "meta.json is corrupt"
    problem = _meta_problem(meta)
    if problem:
        return problem
    if "meta_sha256" in meta and meta["meta_sha256"] != meta_checksum(meta):
        return "meta.json does not match its checksum (corrupt)"
    files, folder_kind, version = meta["files"], meta.get("kind"), meta.get("format_version", 1)
    if version > FORMAT_VERSION:
        return f"unknown checkpoint format {version!r} (this llm-trainer reads up to {FORMAT_VERSION}); upgrade llm-trainer"
    kind = meta.get("checksum") if version >= 2 else None
    if version >= 2 and kind not in (CRC32_TREE, XXH3_TREE):
        return f"unknown checksum kind {kind!r} in meta.json"
    if kind == XXH3_TREE and xxhash is None:
        return f"its checksums are {XXH3_TREE}, which needs the xxhash package (pip install xxhash)"
    for name in REQUIRED.get(folder_kind, ()) if isinstance(folder_kind, str) else ():
        if name not in files and (version >= 2 or name != OPTIMIZER_TENSORS):
            return f"meta.json does not list {name}"
    plain_sha256 = version < 2
    for name in files:
        if not _safe_file_name(name):
            return f"meta.json names an invalid file {name!r}"
    for name in (META, SHARDED_DIR, *files):
        if link_outside(path, name):
            return f"{name} is a symlink that leads out of the checkpoint folder; refusing it"
    jobs: dict[str, Any] = {}
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if plain_sha256:
            jobs[name] = (entry, None)
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            return f"{name} is {what} ({size:,} bytes, {entry['size']:,} expected)"
        jobs[name] = (entry["checksum"], checksum_jobs(file, size, kind))
    for name, (expected, chunks) in jobs.items():
        actual = sha256_file(path / name) if chunks is None else combine(chunks, kind)
        if actual != expected:
            return f"{name} does not match its checksum (corrupt)"
    return None


def _verified_ok(path: Path) -> str | None:
    """verify(), skipped when this process already verified the folder and no file changed since."""
    key = str(Path(path).resolve())
    signature = _signature(Path(path))
    if signature is not None and _verified.get(key) == signature:
        return None
    problem = verify(Path(path))
    if problem is None and signature is not None:
        _verified[key] = signature
    return problem


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, highest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


def _named_latest(root: Path) -> str | None:
    """The checkpoint name `latest` holds, or None (no pointer, or an unreadable one, said as a warning)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        return pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        warn(f"{pointer} is unreadable; choosing the checkpoint by save order")
        return None


def _newest_first(root: Path, named: str | None) -> list[Path]:
    """Checkpoints in the order they were saved, newest first (save sequence; then `latest`; then step)."""
    candidates = list_checkpoints(root)
    sequences = {path: _sequence(path) for path in candidates}

    def key(path: Path):
        sequence = sequences[path]
        if sequence is None and path.name == named:  # `latest` names it but its meta is unreadable:
            sequence = 1 << 62  # try it first, so the warning says why it was skipped
        return (sequence if sequence is not None else -1, path.name == named, int(path.name[len(PREFIX) :]))

    return sorted(candidates, key=key, reverse=True)


def resolve_checkpoint(spec: str, root: Path) -> Path | None:
    """A checkpoint folder from a path or "latest"; "latest" skips unusable ones, saying why.

    Returns None for "latest" when there is no checkpoint yet (a fresh start, e.g. an elastic restart).
    """
    root = Path(root)
    if spec != "latest":
        path = _folder_of(Path(spec))
        if not path.is_dir():
            here = ", ".join(p.name for p in list_checkpoints(path.parent)[:3])
            raise CheckpointError(
                f"checkpoint {path} not found{f' ({path.parent} holds {here})' if here else ''}; "
                "pass a checkpoint folder or resume_from_checkpoint=latest"
            )
        if not (path / META).is_file():
            if (path / LATEST).is_file() or list_checkpoints(path):  # a checkpoints root was given
                return resolve_checkpoint("latest", path)
            if (path / "checkpoints").is_dir():  # an output folder
                return resolve_checkpoint("latest", path / "checkpoints")
        problem = _verified_ok(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        return path
    named = _named_latest(root)
    candidates = _newest_first(root, named)
    missing = named is not None and named not in {path.name for path in candidates}
    if missing:
        warn(f"{root / LATEST} names {named!r}, which is not a checkpoint folder here; taking the newest complete one")
    skipped = set()
    for path in candidates:
        problem = _verified_ok(path)
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
            f"no usable checkpoint in {root}: every one is corrupt or incomplete (see the warnings above)"
        )
    return None


def train_state_problem(saved: Any) -> str | None:
    """None when train_state.json has the fields a resume reads, with their types; else what is wrong."""
    if not isinstance(saved, dict):
        return "train_state.json is not an object"
    counters = ("step", "tokens_seen", "evals_without_improvement", "skipped_steps", "consecutive_bad_steps")
    for name in counters:
        if name in saved and not (_is_int(saved[name]) and saved[name] >= 0):
            return f"train_state.json is corrupt ({name} is {saved[name]!r})"
    best_loss, best_step = saved.get("best_val_loss"), saved.get("best_step")
    if not (best_loss is None or isinstance(best_loss, (int, float)) and not isinstance(best_loss, bool)) or not (
        best_step is None or _is_int(best_step)
    ):
        return "train_state.json is corrupt (best_val_loss / best_step)"
    schedule, rng = saved.get("schedule"), saved.get("rng")
    if not _is_int(saved.get("step")) or not isinstance(schedule, dict) or not _is_int(schedule.get("total_steps")):
        return "train_state.json is corrupt (step / schedule)"
    if (
        not isinstance(saved.get("data"), dict)
        or not isinstance(rng, dict)
        or not isinstance(rng.get("python"), list)
        or not isinstance(rng.get("numpy"), list)
    ):
        return "train_state.json is corrupt (data position / random-number states)"
    if saved.get("scaler") is not None and not isinstance(saved["scaler"], dict):
        return "train_state.json is corrupt (scaler)"
    return None


def _folder_of(path: Path) -> Path:
    """The training guide's `checkpoints/checkpoint-10000.pt` (also `checkpoint-10000`) names the folder
    `checkpoints/checkpoint-00010000`: the checkpoint of step 10000."""
    found = re.fullmatch(rf"{PREFIX}(\d+)(\.pt|\.pth|\.bin)?", path.name)
    if path.exists() or found is None:
        return path
    folder = path.with_name(f"{PREFIX}{int(found.group(1)):08d}")
    if folder.is_dir():
        log(f"resume: {path} is the checkpoint folder {folder}")
        return folder
    return path


def _refusal(exc: Exception) -> str:
    """Why torch.load(weights_only=True) refused a file, in one line."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand \d+", text)
    if "Weights only load failed" in text or found:
        detail = f" ({found.group(1) if found.lastindex else found.group(0)})" if found else ""
        return (
            f"it holds pickled objects other than tensors and plain data{detail}, which could run code; "
            "refusing to unpickle it (the file was not written by llm-trainer, or was altered)"
        )
    return first_line(exc)


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", *, verify_files: bool = True
) -> dict[str, Any]:
    """Every part of a checkpoint, verified first; tensors through safetensors or torch.load(weights_only=True).

    Model tensors are read on the CPU and optimizer tensors are mapped to `map_location`, so a
    checkpoint written on a GPU loads on a CPU-only machine. Large files are memory-mapped.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if verify_files:
        problem = _verified_ok(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
    if (path / SHARDED_DIR).is_dir():  # DeepSpeed torch.loads these without weights_only: prove them plain first
        for file in sorted((path / SHARDED_DIR).glob("*.pt")):
            check_torch_archive(file, DEEPSPEED)

    def optimizer(file: Path) -> Any:
        structure = _torch_load(file, map_location)
        tensors_file = path / OPTIMIZER_TENSORS
        if not tensors_file.is_file():  # format 1: everything in optimizer.pt
            return structure
        tensors = load_file(str(tensors_file), device="cpu")
        if map_location is not None and torch.device(map_location).type != "cpu":
            tensors = {k: v.to(map_location) for k, v in tensors.items()}
        return join_tensors(structure, tensors)

    sharded = (path / SHARDED_DIR / ".metadata").is_file()  # FSDP: each rank reads its model/optimizer part
    deepspeed = (read_meta(path) or {}).get("kind") == "deepspeed_checkpoint"  # optimizer in DeepSpeed's files
    parts: dict[str, Any] = {
        "model": None,
        "optimizer": None,
        "sharded": path / SHARDED_DIR if (path / SHARDED_DIR).is_dir() else None,
    }
    for key, name, load in (
        *(() if sharded else (("model", WEIGHTS_NAME, lambda f: load_file(str(f), device="cpu")),)),
        *(() if sharded or deepspeed else (("optimizer", OPTIMIZER, optimizer),)),
        ("rng", RNG, lambda f: _torch_load(f, "cpu")),
        ("train_state", TRAIN_STATE, lambda f: json.loads(f.read_text(encoding="utf-8"))),
        ("meta", META, lambda f: json.loads(f.read_text(encoding="utf-8"))),
    ):
        try:
            parts[key] = load(path / name)
        except Exception as exc:  # pickle.UnpicklingError for crafted files, OSError, safetensors and JSON errors
            raise CheckpointError(f"checkpoint {path} could not be loaded safely: {name}: {_refusal(exc)}") from None
    return parts


def _torch_load(file: Path, map_location) -> Any:
    try:  # memory-mapped: nothing is copied until used
        return torch.load(file, map_location=map_location, weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # only files torch.save did not write as a zip archive cannot be mapped
            raise
        return torch.load(file, map_location=map_location, weights_only=True)


def rotate(root: Path, keep_last: int | None, protect: set[str]) -> None:
    """Delete all but the newest `keep_last` checkpoints, never one named in `protect` (the best, the new one).

    A folder is renamed to a hidden name before it is deleted, so a crash mid-delete never leaves a
    half-deleted folder that looks like a checkpoint.
    """
    if keep_last is None:
        return
    root = Path(root)
    for path in _newest_first(root, _named_latest(root))[keep_last:]:
        if path.name in protect:
            continue
        doomed = root / f".del-{path.name}-{owner()}"
        try:
            path.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        log(f"checkpoint: removed {path.name} (save_total_limit={keep_last})")
