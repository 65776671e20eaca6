"""Everything applied to the model from outside, in one place and one fixed order:

    1. activation checkpointing, per transformer block
    2. data parallelism: DDP, or FSDP2 (`fully_shard` per block, then the root)
    3. torch.compile of the whole (wrapped) model

DeepSpeed takes the place of 2 and 3: its engine needs the optimizer, so the Trainer wraps the model
right after building it (`deepspeed_engine.wrap`, which also compiles through the engine).

`model.py` stays the plain architecture. Wrappers never change parameter names in files
(`model_files.clean_name`). A model built on the meta device is materialised here after sharding,
so a model larger than one device's memory can start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from .config import TrainingConfig
from .distributed import DistInfo
from .logs import log


@dataclass
class Parallelized:
    model: nn.Module  # what the loop calls: possibly compiled and wrapped
    ddp: nn.Module | None = None  # the DDP wrapper, for no_sync()
    fsdp: bool = False


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        log("gradient_checkpointing: the model has no .blocks; left as is")
        return
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_fsdp(model: nn.Module, config: TrainingConfig, device: torch.device) -> None:
    """FSDP2: shard each block, then the root. Strategies map onto FSDP2 options and meshes:
    full_shard (reshard after forward), shard_grad_op (keep params gathered until backward),
    hybrid_shard (2-D mesh: replicate across nodes, shard within a node)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = int(os.environ["WORLD_SIZE"])
    if config.fsdp_sharding == "hybrid_shard":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    options = dict(mesh=mesh, reshard_after_forward=config.fsdp_sharding != "shard_grad_op")
    if config.use_amp:  # compute in the autocast dtype, reduce gradients in float32
        dtype = torch.bfloat16 if config.amp_dtype == "bfloat16" else torch.float16
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in getattr(model, "blocks", []):
        fully_shard(block, **options)
    fully_shard(model, **options)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device model's (sharded) storage on `device` and initialise it there.

    Each parameter is drawn as one full tensor from the shared seed and this rank keeps its shard:
    the weights equal a single-process initialisation at any world size (sharded random ops would
    not: on CPU meshes every rank would draw the same shard). One parameter at a time bounds memory.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    model.to_empty(device=device)
    if hasattr(model, "tie_weights") and not sharded:  # FSDP2 keeps shared parameters shared itself
        model.tie_weights()
    if not hasattr(model, "init_weight"):
        model.reset_parameters()
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                full = torch.empty(param.shape, dtype=param.dtype, device=device)
                model.init_weight(name, full)
                param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
            else:
                model.init_weight(name, param)
        model.init_buffers()


def parallelize(model: nn.Module, *, config: TrainingConfig, dist: DistInfo, device: torch.device,
                gradient_checkpointing: bool) -> Parallelized:
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    on_meta = any(p.is_meta for p in model.parameters())
    result = Parallelized(model=model)
    if dist.strategy == "fsdp":
        apply_fsdp(model, config, device)
        if on_meta:
            materialize(model, device)
        result.fsdp = True
    else:
        if on_meta:  # built without storage (see pipeline.build_model): allocate and initialise here
            materialize(model, device)
        model.to(device)
        if dist.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            result.ddp = DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=config.ddp_find_unused_parameters,
            )
            result.model = result.ddp
    if config.compile and dist.strategy != "deepspeed":
        result.model = torch.compile(result.model)
    return result
