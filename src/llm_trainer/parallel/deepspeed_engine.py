"""DeepSpeed ZeRO (stages 0-3, CPU optimizer offload) through DeepSpeed's own engine.

Our loop stays the loop. The engine replaces the model call, `backward` and the optimizer step; the
optimizer is ours (built from TrainingConfig) and is handed to DeepSpeed as its client optimizer, our
schedule sets its learning rate, and `managed_gradient_accumulation: false` lets the loop own the
micro-batches: DeepSpeed reduces gradients and steps when the loop calls `step()`, once per step.

The user's `deepspeed_config` (a JSON file or an inline dict, e.g. the usual ZeRO-2/ZeRO-3 files, or
a file with a concrete optimizer and scheduler) is honoured as written: before anything is
built, `merge_into_training` folds what it decides that TrainingConfig also holds (micro batch,
accumulation, total batch, clipping, fp16/bf16, AdamW's lr/betas/eps/weight_decay, WarmupLR /
WarmupDecayLR / WarmupCosineLR) into the training config; a field the training config sets to
another value is a conflict, and every conflict is reported in one message. Then `build_config`
fills the remaining "auto" values from TrainingConfig and drops the optimizer and scheduler sections:
ours (the same values, now) stand in for them.

Checkpoints: every rank's DeepSpeed files (`engine.save_checkpoint`) become the checkpoint's
`sharded/` folder; rank 0 adds the usual model folder, train state and RNG, so eval, generate and
export take a DeepSpeed checkpoint like any other. DeepSpeed's files are pickles, which its own
checkpoint engine unpickles in full; while it loads, `FolderLoads` stands in for that engine: each
file is read once, checked against meta.json on those bytes, and unpickled by torch's weights-only
unpickler with only `checkpoint.safe_pickle.DEEPSPEED`'s classes allowed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config import TrainingConfig
from ..config_aliases import one_message
from ..errors import CheckpointError, UsageError
from ..files.folder_files import SHARDED_DIR, FolderFiles
from ..files.safe_pickle import DEEPSPEED, load_pickle
from ..logs import log

TAG = "deepspeed"  # DeepSpeed's tag folder inside the staging area; its files move into `sharded/`
_OWN_SECTIONS = ("optimizer", "scheduler")  # ours stand in for them (with the file's values folded in)
_ADAMW_TYPES = ("adamw", "adam", "fusedadam", "cpuadam", "deepspeedcpuadam")  # optimizer.type, lowercase, no "_"
_SCHEDULES = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
_IGNORED_OPTIMIZER_PARAMS = ("torch_adam", "adam_w_mode", "fused", "bias_correction")
Setting = tuple[str, str, Any]  # (where in the DeepSpeed file, TrainingConfig field, value)


def _import_deepspeed(device: torch.device):
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
        with _mlflow_hidden():
            import deepspeed
    except ImportError:
        raise UsageError(
            "distributed_strategy deepspeed needs DeepSpeed: pip install '.[deepspeed]' "
            "(or use distributed_strategy ddp or fsdp)"
        ) from None
    if device.type == "cpu":
        # On the CPU accelerator DeepSpeed's communication backend JIT-compiles a shared-memory op
        # (a minute of C++ build, and a hang behind a stale lock if a build was ever killed) that only
        # serves inference all-reduce. Training does not use it.
        comm = importlib.import_module("deepspeed.comm.torch")
        if hasattr(comm, "build_shm_op"):
            comm.build_shm_op = lambda: None
    return deepspeed


@contextlib.contextmanager
def _mlflow_hidden():
    """Where mlflow is installed, DeepSpeed's import imports it too, for its autotuner, which training
    never runs: seconds of every rank's start. While DeepSpeed is imported, `import mlflow` fails unless
    mlflow is imported already (the autotuner then leaves it unused); afterwards it imports as usual, for
    `report_to: mlflow`."""
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hidden and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


# Sections this module reads entries of: each must be a JSON object where given
_OBJECT_SECTIONS = {
    "bf16": '{"enabled": true}',
    "fp16": '{"enabled": true}',
    "zero_optimization": '{"stage": 2}',
    "optimizer": '{"type": "AdamW", "params": {...}}',
    "scheduler": '{"type": "WarmupCosineLR", "params": {...}}',
    "tensor_parallel": '{"autotp_size": 1}',
}


def _shape_problems(cfg: dict) -> list[str]:
    """The sections given as something other than the JSON object DeepSpeed (and this module) reads."""
    problems = [
        f"{key} must be a JSON object such as {example}, got {cfg[key]!r}"
        for key, example in _OBJECT_SECTIONS.items()
        if key in cfg and not isinstance(cfg[key], dict)
    ]
    for key in ("optimizer", "scheduler"):
        section = cfg.get(key)
        if isinstance(section, dict) and "params" in section and not isinstance(section["params"], dict):
            problems.append(f"{key}.params must be a JSON object, got {section['params']!r}")
    return problems


def load_user_config(value: str | dict | None) -> dict:
    if value is None:
        return {"zero_optimization": {"stage": 2}}
    loaded = copy.deepcopy(value) if isinstance(value, dict) else _read_user_config(value)
    problems = _shape_problems(loaded)
    if problems:
        raise UsageError(f"training.deepspeed_config: {'; '.join(problems)}")
    return loaded


def _read_user_config(value: str) -> dict:
    path = Path(value)
    if not path.is_file():
        raise UsageError(
            f"training.deepspeed_config: {value} does not exist; pass a DeepSpeed JSON file or an inline dict"
        )
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"training.deepspeed_config: {value} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"training.deepspeed_config: {value} must hold a JSON object")
    return loaded


def _given(value: Any) -> bool:
    return value is not None and value != "auto"


def _concrete(section: Any) -> bool:
    """An optimizer/scheduler section with a value of its own (all "auto" stands for ours)."""
    params = section.get("params", {}) if isinstance(section, dict) else section
    return any(_given(value) for _, value in _flatten(params))


def _precision_settings(cfg: dict) -> tuple[list[Setting], list[str]]:
    enabled = {
        key: cfg[key].get("enabled", "auto") if isinstance(cfg.get(key), dict) else "auto" for key in ("fp16", "bf16")
    }
    if enabled["fp16"] is True and enabled["bf16"] is True:
        return [], ["fp16.enabled and bf16.enabled are both true; enable one"]
    for key, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        if enabled[key] is True:
            return [(f"{key}.enabled", "use_amp", True), (f"{key}.enabled", "amp_dtype", dtype)], []
    if enabled["fp16"] is False and enabled["bf16"] is False:
        return [("fp16/bf16.enabled", "use_amp", False)], []
    return [], []


def _optimizer_kind(name: Any) -> str:
    """An optimizer.type as `_ADAMW_TYPES` spells them: "FusedAdam", "fused_adam" -> "fusedadam"."""
    return str(name).lower().replace("_", "")


def _optimizer_settings(section: dict) -> tuple[list[Setting], list[str], list[str]]:
    settings, problems, notes = [], [], []
    kind = _optimizer_kind(section.get("type", "AdamW"))
    params = section.get("params") or {}
    if kind in _ADAMW_TYPES:  # DeepSpeed's Adam is AdamW by default
        decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
        settings.append(("optimizer.type", "optimizer", "adamw" if decoupled else "adam"))
    else:
        problems.append(
            f"optimizer.type {section.get('type')!r} is not supported: llm-trainer runs torch's AdamW "
            "(type AdamW or Adam)"
        )
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if not _given(value) or key in _IGNORED_OPTIMIZER_PARAMS:
            continue
        if key == "lr":
            settings.append((where, "learning_rate", value))
        elif key == "weight_decay":
            settings.append((where, "weight_decay", value))
        elif key == "eps":
            settings.append((where, "adam_epsilon", value))
        elif key == "betas" and isinstance(value, (list, tuple)) and len(value) == 2:
            settings += [(where + "[0]", "adam_beta1", value[0]), (where + "[1]", "adam_beta2", value[1])]
        else:
            notes.append(f"{where} is not used")
    return settings, problems, notes


def _scheduler_settings(section: dict, lr: float) -> tuple[list[Setting], list[str], list[str]]:
    """WarmupLR -> constant_with_warmup, WarmupDecayLR -> linear, WarmupCosineLR -> cosine; our warmup is
    linear from lr/warmup_steps, so a log warmup or a warmup floor is followed approximately."""
    kind = section.get("type")
    if kind not in _SCHEDULES:
        return (
            [],
            [
                f"scheduler.type {kind!r} is not supported; use WarmupLR, WarmupDecayLR or WarmupCosineLR, "
                "or set training.lr_scheduler and remove the section"
            ],
            [],
        )
    params = {k: v for k, v in (section.get("params") or {}).items() if _given(v)}
    where = "scheduler.params."
    settings: list[Setting] = [("scheduler.type", "lr_scheduler", _SCHEDULES[kind])]
    notes = []
    if "warmup_num_steps" in params:
        settings.append((where + "warmup_num_steps", "warmup_steps", params["warmup_num_steps"]))
    if "total_num_steps" in params:
        settings.append((where + "total_num_steps", "max_steps", params["total_num_steps"]))
    if "warmup_max_lr" in params:
        settings.append((where + "warmup_max_lr", "learning_rate", params["warmup_max_lr"]))
        lr = params["warmup_max_lr"]
    if kind == "WarmupDecayLR" and "warmup_min_lr" in params:
        settings.append((where + "warmup_min_lr", "min_lr", params["warmup_min_lr"]))
    if kind == "WarmupCosineLR":
        settings.append((where + "cos_min_ratio", "min_lr", params.get("cos_min_ratio", 0.0001) * lr))
    if params.get("warmup_type", "log") != "linear" and params.get("warmup_num_steps", 1) > 0:
        notes.append(f"{where}warmup_type {params.get('warmup_type', 'log')!r}: llm-trainer warms up linearly")
    if params.get("warmup_min_lr", 0) or params.get("warmup_min_ratio", 0):
        notes.append("the warmup starts from learning_rate/warmup_steps, not from the file's warmup minimum")
    return settings, [], notes


def _stands_for_ours(name: str, section: Any, training: TrainingConfig) -> list[str]:
    """A note when an all-"auto" section names a type other than what the training config runs (which
    it stands for): a WarmupDecayLR file trained with a cosine schedule is not what the file reads as."""
    kind = section.get("type") if isinstance(section, dict) else None
    if kind is None:
        return []
    field = "lr_scheduler" if name == "scheduler" else "optimizer"
    ours = getattr(training, field)
    if name == "scheduler":
        same = _SCHEDULES.get(kind) == ours
    else:
        same = ours == "adamw" and _optimizer_kind(kind) in _ADAMW_TYPES
    if same:
        return []
    return [
        f'{name}.type {kind!r} has only "auto" params, so it stands for the training config\'s '
        f"training.{field}: {ours}"
        + (f" (set training.lr_scheduler: {_SCHEDULES[kind]} for the file's)" if kind in _SCHEDULES else "")
    ]


def file_settings(cfg: dict, training: TrainingConfig) -> tuple[list[Setting], list[str], list[str]]:
    """What a DeepSpeed config decides that TrainingConfig also holds: (settings, unsupported parts, notes)."""
    settings: list[Setting] = []
    for key, field in (
        ("train_micro_batch_size_per_gpu", "batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("gradient_clipping", "max_grad_norm"),
    ):
        if _given(cfg.get(key)):
            settings.append((key, field, cfg[key]))
    tensor_parallel = cfg.get("tensor_parallel")  # AutoTP: read as ours, so the mesh check refuses it in one line
    if isinstance(tensor_parallel, dict) and _given(tensor_parallel.get("autotp_size")):
        settings.append(("tensor_parallel.autotp_size", "tensor_parallel_degree", tensor_parallel["autotp_size"]))
    precision, problems = _precision_settings(cfg)
    settings += precision
    notes: list[str] = []
    for name in _OWN_SECTIONS:  # the optimizer first: a cosine floor is a ratio of its lr
        section = cfg.get(name)
        if section is None:
            continue
        if not _concrete(section):
            notes += _stands_for_ours(name, section, training)
            continue
        if not isinstance(section, dict):
            problems.append(f"{name} must be a JSON object with type and params")
            continue
        lr = next((v for _, f, v in settings if f == "learning_rate"), training.learning_rate)
        found = _optimizer_settings(section) if name == "optimizer" else _scheduler_settings(section, lr)
        settings += found[0]
        problems += found[1]
        notes += found[2]
    return settings, problems, notes


def merge_into_training(training: TrainingConfig, world_size: int, device: torch.device) -> TrainingConfig:
    """The training config with the DeepSpeed file's own values folded in (see the module docstring).

    A field the training config leaves at its default takes the file's value; one it sets to another
    value is a conflict. Every conflict, an unsupported section and fp16 on a device without it are
    reported together in one UsageError."""
    cfg = load_user_config(training.deepspeed_config)
    name = training.deepspeed_config if isinstance(training.deepspeed_config, str) else "the inline DeepSpeed config"
    settings, problems, notes = file_settings(cfg, training)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}
    changes: dict[str, Any] = {}
    taken_from: dict[str, str] = {}
    for where, field, value in settings:
        current = changes.get(field, getattr(training, field))
        if current == value:
            taken_from.setdefault(field, where)
        elif field in taken_from:
            problems.append(f"{taken_from[field]}={current!r} but {where}={value!r} (both set training.{field})")
        elif current == defaults[field]:
            changes[field], taken_from[field] = value, where
        else:
            problems.append(f"{where}={value!r} but training.{field}={current!r}")
    total = cfg.get("train_batch_size")
    if _given(total):  # = micro batch x accumulation x world size; as in DeepSpeed, a missing accumulation follows
        micro = changes.get("batch_size", training.batch_size)
        accum = changes.get("gradient_accumulation_steps", training.gradient_accumulation_steps)
        if (
            micro * accum * world_size != total
            and "gradient_accumulation_steps" not in taken_from
            and accum == defaults["gradient_accumulation_steps"]
            and total % (micro * world_size) == 0
        ):
            accum = changes["gradient_accumulation_steps"] = total // (micro * world_size)
        if micro * accum * world_size != total:
            problems.append(
                f"train_batch_size={total} but batch_size x gradient_accumulation_steps x world size = "
                f"{micro} x {accum} x {world_size} = {micro * accum * world_size}"
            )
    merged_amp = changes.get("use_amp", training.use_amp) and changes.get("amp_dtype", training.amp_dtype) == "float16"
    if merged_amp and device.type != "cuda":
        problems.append(
            f"fp16 needs a CUDA GPU and this run is on {device.type}: use bf16 instead "
            '("bf16": {"enabled": true} and "fp16": {"enabled": false})'
        )
    if problems:
        raise UsageError(f"training.deepspeed_config {name}: {one_message(problems)}")
    for note in notes:
        log(f"deepspeed_config: {note}")
    if not changes:
        return training
    log(f"deepspeed_config: {name} sets " + ", ".join(f"training.{k}={v!r}" for k, v in changes.items()))
    try:
        return dataclasses.replace(training, **changes)
    except ValueError as exc:
        raise UsageError(f"training.deepspeed_config {name}: {exc}") from None


def build_config(training: TrainingConfig, world_size: int, d_model: int | None) -> dict:
    """The DeepSpeed config: the user's, with every "auto" filled from TrainingConfig (which already
    holds the file's own values, see `merge_into_training`)."""
    cfg = load_user_config(training.deepspeed_config)
    settings, problems, _ = file_settings(cfg, training)
    checked_below = ("batch_size", "gradient_accumulation_steps", "max_grad_norm")
    problems += [
        f"{where}={value!r} but training.{field}={getattr(training, field)!r}"
        for where, field, value in settings
        if field not in checked_below and getattr(training, field) != value
    ]
    if problems:
        raise UsageError(f"training.deepspeed_config: {one_message(problems)}")
    for section in _OWN_SECTIONS:  # ours, with the same values, stand in for DeepSpeed's
        cfg.pop(section, None)
    ours = {
        "train_micro_batch_size_per_gpu": training.batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "train_batch_size": training.batch_size * training.gradient_accumulation_steps * world_size,
        "gradient_clipping": float(training.max_grad_norm or 0.0),
    }
    for key, value in ours.items():
        given = cfg.get(key, "auto")
        if given == "auto":
            cfg[key] = value
        elif given != value:
            raise UsageError(
                f"training.deepspeed_config: {key}={given!r} but the training config gives {value!r}; "
                f'set it to "auto" or remove it'
            )
    amp = {
        "bf16": training.use_amp and training.amp_dtype == "bfloat16",
        "fp16": training.use_amp and training.amp_dtype == "float16",
    }
    for key, enabled in amp.items():
        section = cfg.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = enabled
    zero = cfg.setdefault("zero_optimization", {"stage": 0})
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise UsageError(
            f"training.deepspeed_config: zero_optimization.stage must be 0, 1, 2 or 3, got {zero.get('stage')!r}"
        )
    width = d_model or 1024  # bucket sizes from the model's width, as DeepSpeed's own docs suggest
    sizes = {
        "reduce_bucket_size": width * width,
        "stage3_prefetch_bucket_size": int(0.9 * width * width),
        "stage3_param_persistence_threshold": 10 * width,
    }
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    cfg["managed_gradient_accumulation"] = False  # the loop owns micro-batches; step() is the boundary
    cfg.setdefault("zero_allow_untested_optimizer", True)  # our optimizer is a torch one
    cfg.setdefault("zero_force_ds_cpu_optimizer", False)  # offload runs our torch AdamW: no compiled CPUAdam
    cfg.setdefault("steps_per_print", 2**31 - 1)  # progress is reported by our loggers
    leftover = [key for key, value in _flatten(cfg) if value == "auto"]
    if leftover:
        raise UsageError(
            f'training.deepspeed_config: llm-trainer cannot fill "auto" for {", ".join(leftover)}; give a value'
        )
    return cfg


def _flatten(value: Any, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


# The process group of the first DeepSpeed run in this process. DeepSpeed keeps the groups it is first
# set up with in its module state for the life of the process, so a later run on a new group (the first
# run's ended with it) fails inside DeepSpeed, on the ended group.
_FIRST_GROUP: list[Any] = []


def _check_group_is_deepspeeds() -> None:
    """Refuse, in one line, a DeepSpeed run in a process whose earlier DeepSpeed run's group has ended."""
    group = torch.distributed.group.WORLD
    if _FIRST_GROUP and _FIRST_GROUP[0] is not group:
        raise UsageError(
            "DeepSpeed ran in this process before, on a process group that has ended, and keeps that group "
            "for the life of the process; run each DeepSpeed training in a process of its own (a new python "
            "or torchrun command)"
        )
    _FIRST_GROUP[:] = [group]


def wrap(
    model: nn.Module, optimizer: torch.optim.Optimizer, training: TrainingConfig, world_size: int, device: torch.device
):
    """deepspeed.initialize around our model and optimizer; returns the engine (what the loop calls)."""
    if not optimizer.defaults.get("fused"):  # the loop skips non-finite steps through the fused kernels' found_inf
        raise UsageError(
            f"distributed_strategy deepspeed needs training.optimizer adamw or adam on CPU or CUDA "
            f"(got {training.optimizer} on {device.type})"
        )
    deepspeed = _import_deepspeed(device)
    _check_group_is_deepspeeds()
    d_model = getattr(getattr(model, "config", None), "d_model", None)
    config = build_config(training, world_size, d_model)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except (ValueError, AssertionError, NotImplementedError) as exc:  # its sanity checks: fp16 on CPU, ...
        # pydantic's first line counts the errors; the field and what it should be follow it
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:3]
        reason = ": ".join(lines)[:400] if lines else type(exc).__name__
        raise UsageError(
            f"DeepSpeed refused this configuration on {device.type}: {reason}; fix training.deepspeed_config "
            "(or training.use_amp / amp_dtype)"
        ) from None
    if training.compile:
        engine.compile()
    return engine


def zero_stage(engine) -> int:
    return engine.zero_optimization_stage() if engine.zero_optimization() else 0


def full_model_state(engine) -> dict[str, torch.Tensor] | None:
    """Under ZeRO-3 (parameters partitioned): every rank calls this; rank 0 gets a full copy of the
    weights. Below stage 3 every rank holds them whole already: None (read the module)."""
    if zero_stage(engine) < 3:
        return None
    import deepspeed

    from ..checkpoint.model_folder import model_tensors

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        return {name: tensor.to("cpu", copy=True) for name, tensor in model_tensors(engine.module).items()}


def save(engine, staging: Path, is_main: bool) -> None:
    """Every rank: DeepSpeed's model/optimizer files into `staging` (the future `sharded/`)."""
    from . import distributed

    scratch = staging.parent / f"{staging.name}-{TAG}"
    if is_main:
        shutil.rmtree(scratch, ignore_errors=True)
    distributed.barrier()
    engine.save_checkpoint(str(scratch), tag=TAG, save_latest=False)
    distributed.barrier()
    if is_main:
        for file in sorted((scratch / TAG).iterdir()):
            shutil.move(str(file), staging / file.name)
        shutil.rmtree(scratch, ignore_errors=True)  # DeepSpeed's recovery scripts: not part of our checkpoint


class FolderLoads:
    """DeepSpeed's checkpoint engine while it loads from a checkpoint folder (its `load` is how DeepSpeed
    reads every file of the checkpoints our runs write): a file is read once through `FolderFiles`
    (listed in meta.json, inside the folder, checked against its checksum on the bytes read) and those
    bytes unpickled by torch's weights-only unpickler with the classes DeepSpeed writes allowed. A file
    it asks for that the checkpoint does not list (DeepSpeed finds its model files by a pattern) is
    refused."""

    def __init__(self, engine, files: FolderFiles):
        self.engine, self.files = engine, files

    def load(self, path: str, map_location: Any = None) -> Any:
        file = Path(path)
        if file.parent != self.files.folder / SHARDED_DIR:
            raise CheckpointError(f"DeepSpeed asked for {file}, which is not in {self.files.folder / SHARDED_DIR}")
        name = f"{SHARDED_DIR}/{file.name}"
        return load_pickle(self.files.read(name), str(file), DEEPSPEED, map_location)

    def __getattr__(self, name: str) -> Any:  # everything but loading: DeepSpeed's own engine
        return getattr(self.engine, name)


def load(engine, files: FolderFiles) -> None:
    """Every rank: model and optimizer state from a checkpoint's `sharded/` folder (verified already),
    each file read by `FolderLoads`."""
    if not any(name.endswith("model_states.pt") for name in files.listed or ()):
        raise UsageError(
            f"{files.folder} was not saved with distributed_strategy deepspeed; resume it with the "
            "strategy it was saved with"
        )
    own = engine.checkpoint_engine
    engine.checkpoint_engine = FolderLoads(own, files)
    try:
        path, _ = engine.load_checkpoint(
            str(files.folder),
            tag=SHARDED_DIR,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
    finally:
        engine.checkpoint_engine = own
    if path is None:
        raise UsageError(
            f"DeepSpeed could not load {files.folder / SHARDED_DIR}; was it saved at another world size or ZeRO stage?"
        )
