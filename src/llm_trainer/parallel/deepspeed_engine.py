"""DeepSpeed ZeRO (stages 0-3, CPU optimizer offload) through DeepSpeed's own engine.

Our loop stays the loop. The engine replaces the model call, `backward` and the optimizer step; the
optimizer is ours (built from TrainingConfig) and is handed to DeepSpeed as its client optimizer, our
schedule sets its learning rate, and `managed_gradient_accumulation: false` lets the loop own the
micro-batches: DeepSpeed reduces gradients and steps when the loop calls `step()`, once per step.

The user's `deepspeed_config` (a JSON file or an inline dict, e.g. the usual ZeRO-2/ZeRO-3 files) has
its "auto" values filled from TrainingConfig. Its optimizer and scheduler sections, when all "auto",
stand for ours; concrete values there are refused with the TrainingConfig fields to set instead.

Checkpoints: every rank's DeepSpeed files (`engine.save_checkpoint`) become the checkpoint's
`sharded/` folder; rank 0 adds the usual model folder, train state and RNG, so eval, generate and
export take a DeepSpeed checkpoint like any other. DeepSpeed's files are pickles, which DeepSpeed
unpickles in full: it reads them only after meta.json's checksums are verified and every pickle in
`sharded/` is proven to import nothing off `checkpoint.safe_pickle.DEEPSPEED` (see `format.load_checkpoint`).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config import TrainingConfig
from ..errors import UsageError

TAG = "deepspeed"  # DeepSpeed's tag folder inside the staging area; its files move into `sharded/`

# Fields DeepSpeed needs that TrainingConfig already decides ("auto", or absent, takes ours).
_OWN_SECTIONS = {
    "optimizer": "training.optimizer, learning_rate, weight_decay, adam_beta1/2, adam_epsilon",
    "scheduler": "training.lr_scheduler, warmup_steps, min_lr",
}


def _import_deepspeed(device: torch.device):
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
        import deepspeed
    except ImportError:
        raise UsageError("distributed_strategy deepspeed needs DeepSpeed: pip install '.[deepspeed]' "
                         "(or use distributed_strategy ddp or fsdp)") from None
    if device.type == "cpu":
        # On the CPU accelerator DeepSpeed's communication backend JIT-compiles a shared-memory op
        # (a minute of C++ build, and a hang behind a stale lock if a build was ever killed) that only
        # serves inference all-reduce. Training does not use it.
        comm = importlib.import_module("deepspeed.comm.torch")
        if hasattr(comm, "build_shm_op"):
            comm.build_shm_op = lambda: None
    return deepspeed


def load_user_config(value: str | dict | None) -> dict:
    if value is None:
        return {"zero_optimization": {"stage": 2}}
    if isinstance(value, dict):
        return copy.deepcopy(value)
    path = Path(value)
    if not path.is_file():
        raise UsageError(f"training.deepspeed_config: {value} does not exist; pass a DeepSpeed JSON file or an inline dict")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"training.deepspeed_config: {value} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(loaded, dict):
        raise UsageError(f"training.deepspeed_config: {value} must hold a JSON object")
    return loaded


def build_config(training: TrainingConfig, world_size: int, d_model: int | None) -> dict:
    """The DeepSpeed config: the user's, with every "auto" filled from TrainingConfig."""
    cfg = load_user_config(training.deepspeed_config)
    for section, fields in _OWN_SECTIONS.items():  # ours replace DeepSpeed's; an all-"auto" section says just that
        given = cfg.pop(section, None)
        params = given.get("params", {}) if isinstance(given, dict) else given
        if given is not None and any(value != "auto" for _, value in _flatten(params)):
            raise UsageError(f"training.deepspeed_config sets {section} values; llm-trainer takes them from "
                             f"{fields}: set them there, and \"auto\" (or nothing) in the DeepSpeed config")
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
            raise UsageError(f"training.deepspeed_config: {key}={given!r} but the training config gives {value!r}; "
                             f"set it to \"auto\" or remove it")
    amp = {"bf16": training.use_amp and training.amp_dtype == "bfloat16",
           "fp16": training.use_amp and training.amp_dtype == "float16"}
    for key, enabled in amp.items():
        section = cfg.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = enabled
    zero = cfg.setdefault("zero_optimization", {"stage": 0})
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise UsageError(f"training.deepspeed_config: zero_optimization.stage must be 0, 1, 2 or 3, got {zero.get('stage')!r}")
    width = d_model or 1024  # bucket sizes from the model's width, as DeepSpeed's own docs suggest
    sizes = {"reduce_bucket_size": width * width, "stage3_prefetch_bucket_size": int(0.9 * width * width),
             "stage3_param_persistence_threshold": 10 * width}
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    cfg["managed_gradient_accumulation"] = False  # the loop owns micro-batches; step() is the boundary
    cfg.setdefault("zero_allow_untested_optimizer", True)  # our optimizer is a torch one
    cfg.setdefault("zero_force_ds_cpu_optimizer", False)  # offload runs our torch AdamW: no compiled CPUAdam
    cfg.setdefault("steps_per_print", 2**31 - 1)  # progress is reported by our loggers
    leftover = [key for key, value in _flatten(cfg) if value == "auto"]
    if leftover:
        raise UsageError(f"training.deepspeed_config: llm-trainer cannot fill \"auto\" for {', '.join(leftover)}; "
                         "give a value")
    return cfg


def _flatten(value: Any, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, training: TrainingConfig, world_size: int,
         device: torch.device):
    """deepspeed.initialize around our model and optimizer; returns the engine (what the loop calls)."""
    if not optimizer.defaults.get("fused"):  # the loop skips non-finite steps through the fused kernels' found_inf
        raise UsageError(f"distributed_strategy deepspeed needs training.optimizer adamw or adam on CPU or CUDA "
                         f"(got {training.optimizer} on {device.type})")
    deepspeed = _import_deepspeed(device)
    d_model = getattr(getattr(model, "config", None), "d_model", None)
    config = build_config(training, world_size, d_model)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except (ValueError, AssertionError, NotImplementedError) as exc:  # its sanity checks: fp16 on CPU, ...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"DeepSpeed refused this configuration on {device.type}: {reason}; change "
                         "training.use_amp / amp_dtype or training.deepspeed_config") from None
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


def load(engine, sharded: Path) -> None:
    """Every rank: model and optimizer state from a checkpoint's `sharded/` folder (verified already)."""
    if not any(sharded.glob("*model_states.pt")):
        raise UsageError(f"{sharded.parent} was not saved with distributed_strategy deepspeed; resume it with the "
                         "strategy it was saved with")
    path, _ = engine.load_checkpoint(str(sharded.parent), tag=sharded.name, load_module_strict=True,
                                     load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None:
        raise UsageError(f"DeepSpeed could not load {sharded}; was it saved at another world size or ZeRO stage?")
