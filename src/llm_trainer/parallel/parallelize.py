"""Everything applied to the model from outside, in one place and one fixed order (torchtitan's):

    0. float8 training (`training.float8`): the blocks' linear layers swapped for torchao's float8
       ones (`float8`), before compile (which fuses their casts) and FSDP2 (which shards them); then
       tensor parallelism with sequence parallelism (`tensor_parallel`), over the mesh's `tp` dimension
       (the two are not combined: mesh.py refuses float8 with a tensor degree)
    1. activation checkpointing, per transformer block
    2. torch.compile, in place: the whole model with its loss (embeddings, blocks, final norm, the
       chunked head + cross-entropy: one graph, nothing left eager), or per transformer block under
       FSDP2 and pipeline parallelism (the blocks repeat, so one compiled graph serves them all, and
       FSDP's per-block hooks and the stages' boundaries stay outside the graphs)
    2b. pipeline parallelism: the model split into this rank's stages (`pipeline_parallel`), over
       the mesh's `pp` dimension; what follows applies to the stages
    3. data parallelism: DDP, or FSDP2 (`fully_shard` per block, then the root, over the mesh's
       data-parallel and context-parallel dimensions; the model's `extend` registered as a forward, so
       it gathers the weights as `forward` does)
    4. the optimizer, over the (sharded) parameters

Context parallelism wraps no module: the step hands each `cp` rank a share of every row's positions
and runs attention as PyTorch's ring attention meanwhile (`context_parallel`, through the
`Parallelism`'s `context_mesh`).

Each step wraps what the one before made: a block is checkpointed inside its compiled graph, and FSDP
shards the compiled block. DeepSpeed takes the place of 2 and 3: its engine takes the model and our
optimizer (and compiles through the engine). `parallelize` returns the backend's `Parallelism` (see
`strategies`), which is all the training loop knows of how it runs.

`model.py` stays the plain architecture. Wrappers never change parameter names in files
(`model_folder.clean_name`). A model built on the meta device is materialised here after sharding,
so a model larger than one device's memory can start.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from .. import launcher
from ..checkpoint.model_folder import clean_name
from ..config import TrainingConfig
from ..errors import UsageError
from ..logs import log, warn
from ..model import set_fused_projections
from .distributed import DistInfo
from .float8 import ALIGNMENT, SMALL_IN, SMALL_OUT, apply_float8, check_float8
from .mesh import compiles_whole_model, resolve_layout, stacks_projections
from .strategies import DDP, FSDP, DeepSpeed, Parallelism, Pipeline


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        log("gradient_checkpointing: the model has no .blocks; left as is")
        return
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_compile(model: nn.Module, *, per_block: bool = False) -> None:
    """torch.compile the whole model (forward and, through its `targets=` forward, the loss), or with
    `per_block` each transformer block (for FSDP2, whose hooks, added afterwards, must run between the
    blocks' graphs; a model without `.blocks` is still compiled whole). In place (`nn.Module.compile`):
    the modules and their parameter names stay as they are, so state dicts and resumes see the same model."""
    blocks = getattr(model, "blocks", None) if per_block else None
    for module in blocks if blocks is not None else [model]:
        module.compile()


def device_mesh(config: TrainingConfig, device: torch.device):
    """The run's `DeviceMesh` with named dimensions (dp_replicate, dp_shard, pp, cp, tp), torchtitan's
    order (tensor-parallel ranks adjacent: a replica's ranks share a node's fast links), and `dp_shard_cp`,
    the ranks FSDP2 shards over: context-parallel ranks hold the same weights and their gradients add
    up, so they shard them as data-parallel ranks do."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = resolve_layout(config, launcher.world_size())
    mesh = init_device_mesh(
        device.type,
        (layout.dp_replicate, layout.dp_shard, layout.pp, layout.cp, layout.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "pp", "cp", "tp"),
    )
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def apply_fsdp(
    model: nn.Module,
    config: TrainingConfig,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    mesh,
    roots: list[nn.Module] | None = None,
) -> None:
    """FSDP2: shard each block, then the root (`roots`: each pipeline stage's), over the mesh's
    data-parallel dimensions. Strategies map onto FSDP2 options and meshes: full_shard (reshard after
    forward), shard_grad_op (keep params gathered until backward), hybrid_shard (2-D: replicate across
    nodes, shard within a node)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = mesh["dp_replicate", "dp_shard_cp"] if config.fsdp_sharding == "hybrid_shard" else mesh["dp_shard_cp"]
    options = dict(mesh=mesh, reshard_after_forward=config.fsdp_sharding != "shard_grad_op")
    if amp_dtype is not None:  # compute in the autocast dtype, reduce gradients in float32
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    for block in getattr(model, "blocks", []):
        fully_shard(block, **options)
    for root in roots or [model]:
        fully_shard(root, **options)
    # evaluation's forward with given positions and mask gathers the root's weights too (not a pipeline's)
    if hasattr(model, "extend") and not roots:
        register_fsdp_forward_method(model, "extend")


def materialize(model: nn.Module, device: torch.device, every: list[tuple[str, torch.Tensor]] | None = None) -> None:
    """Allocate a meta-device model's (sharded) storage on `device` and initialise it there.

    Each parameter is drawn as one full tensor from the shared seed and this rank keeps its shard:
    the weights equal a single-process initialisation at any world size (sharded random ops would
    not: on CPU meshes every rank would draw the same shard). One parameter at a time bounds memory.
    `every`: the whole model's (meta) parameters by name, in order, where `model` holds some of them (a
    pipeline stage): the others are drawn too, and dropped, so each one's values are the whole model's.
    """
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    fsdp_sharded = head is not None and _is_dtensor(head)  # tensor parallelism leaves the head whole
    model.to_empty(device=device)
    if hasattr(model, "tie_weights") and not fsdp_sharded:  # FSDP2 keeps shared parameters shared itself
        model.tie_weights()
    if not hasattr(model, "init_weight"):
        model.reset_parameters()
        return
    with torch.no_grad():
        held = dict(model.named_parameters())
        for name, like in every or held.items():
            if name not in held:
                model.init_weight(name, torch.empty_like(like, device=device))
                continue
            param = held[name]
            if _is_dtensor(param):
                from torch.distributed.tensor import distribute_tensor

                full = torch.empty(param.shape, dtype=param.dtype, device=device)
                model.init_weight(name, full)
                param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
            else:
                model.init_weight(name, param)
        model.init_buffers()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Without importing torch.distributed.tensor (most of a second) when nothing was sharded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def parallelize(
    model: nn.Module,
    *,
    config: TrainingConfig,
    dist: DistInfo,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    activation_checkpointing: bool,
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
) -> Parallelism:
    """Wrap `model` for `dist.strategy` in the order above; `build_optimizer(model)` makes the optimizer
    once the parameters are in their final (sharded, on-device) form."""
    if config.optimizer == "muon" and dist.strategy in ("fsdp", "deepspeed"):
        raise UsageError(
            f"optimizer muon needs each weight whole, and distributed_strategy {dist.strategy} shards "
            "them; use distributed_strategy ddp, or optimizer adamw"
        )
    model_config = getattr(model, "config", None)
    if getattr(model_config, "attention_backend", None) == "flex":
        if device.type != "cuda":
            raise UsageError(
                "model.attention_backend flex trains on CUDA only (this torch's FlexAttention has no backward "
                f"on {device.type}); use attention_backend: sdpa"
            )
        if model_config.head_dim < 16:  # the compiled FlexAttention kernel's smallest head
            raise UsageError(
                "model.attention_backend flex needs a head size of at least 16, got d_model/n_heads = "
                f"{model_config.head_dim}; use fewer heads, a wider d_model, or attention_backend: sdpa"
            )
    if config.float8:
        check_float8(device)
        if dist.strategy == "deepspeed":
            raise UsageError(
                "training.float8 runs under DDP or FSDP2, not deepspeed; use distributed_strategy ddp or fsdp"
            )
    if dist.world_size > 1 and dist.strategy != "deepspeed":
        log(f"mesh: {resolve_layout(config, dist.world_size).describe()}")
    if config.float8:
        swapped, small = apply_float8(model, config.float8_layers)
        if swapped:
            kept = f"; {len(small)} smaller ones do not (training.float8_layers: all converts them)" if small else ""
            log(f"float8: {len(swapped)} linear layers train in float8 (torchao){kept}; the head and embeddings do not")
        elif not small:
            warn(
                "training.float8: no linear layer of the model has dimensions that are multiples of "
                f"{ALIGNMENT}, as float8 matmuls need, so it trains as without float8"
            )
        else:
            warn(
                f"training.float8: none of the model's {len(small)} linear layers is large enough to run faster in "
                f"float8 (more than {SMALL_IN} inputs or {SMALL_OUT} outputs), so it trains as without float8; "
                "training.float8_layers: all converts them anyway"
            )
    mesh = device_mesh(config, device) if dist.strategy == "fsdp" else None
    tp = mesh["tp"].size() if mesh is not None else 1
    pp = mesh["pp"].size() if mesh is not None else 1
    cp = mesh["cp"].size() if mesh is not None else 1
    if tp > 1:
        from .tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    # sharded weights are gathered per layer: no stacked copies of them (model.project)
    set_fused_projections(model, stacks_projections(dist.strategy, tp))
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if config.compile and dist.strategy != "deepspeed":
        apply_compile(model, per_block=not compiles_whole_model(config, dist.strategy))
    on_meta = any(p.is_meta for p in model.parameters())
    every = list(model.named_parameters()) if pp > 1 and on_meta else None
    stages, names = None, [clean_name(name) for name, _ in model.named_parameters()] if pp > 1 else []
    if pp > 1:
        from .pipeline_parallel import split_model

        model, stages = split_model(model, config, pp, mesh["pp"].get_local_rank())
        if tp > 1:
            from .tensor_parallel import split_at_stage_ends

            split_at_stage_ends([stage for _, stage in stages], mesh["tp"])
    common = dict(dist=dist, device=device, amp_dtype=amp_dtype, context_mesh=mesh["cp"] if cp > 1 else None)
    # FSDP2 unless the ranks split the model only (TP/PP alone); context-parallel ranks reduce through it
    fsdp = dist.strategy == "fsdp" and (tp * pp == 1 or mesh["dp_replicate", "dp_shard_cp"].size() > 1)
    if fsdp:
        apply_fsdp(model, config, device, amp_dtype, mesh, roots=[stage for _, stage in stages or []])
    if on_meta:  # built without storage (see pipeline.build_model): allocate and initialise here, after sharding
        materialize(model, device, every)
    if not fsdp:  # (FSDP2 placed its shards on the device)
        model.to(device)
    if dist.world_size > 1:  # same initial weights everywhere (drawn above), different dropout per rank
        torch.manual_seed(config.seed + dist.rank)
    optimizer = build_optimizer(model)
    if tp > 1:
        from .tensor_parallel import split_groups_by_mesh

        split_groups_by_mesh(optimizer)
    if dist.strategy == "deepspeed":
        from . import deepspeed_engine

        engine = deepspeed_engine.wrap(model, optimizer, config, dist.world_size, device)
        return DeepSpeed(model, engine, optimizer, **common)
    if pp > 1:
        group = mesh["pp"].get_group()
        return Pipeline(model, optimizer, stages=stages, group=group, config=config, names=names, **common)
    if dist.strategy == "fsdp":
        return FSDP(model, model, optimizer, tensor_parallel=tp > 1, **common)
    if dist.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=config.ddp_find_unused_parameters,
        )
        return DDP(model, ddp, optimizer, ddp=ddp, **common)
    return Parallelism(model, model, optimizer, **common)
