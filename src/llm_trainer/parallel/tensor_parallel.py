"""Tensor parallelism with sequence parallelism (Megatron-LM's, through `torch.distributed.tensor.parallel`)
for our GPT-2 and LLaMA blocks, as torchtitan applies it to its LLaMA.

Inside each block the matrices are split over the `tp` ranks of one model replica: attention's q, k, v
by heads and the MLP's gate/up (or fc) by hidden units (column-wise: each rank computes its heads and
units whole), the two output projections by their inputs (row-wise: each rank's partial sum is
reduce-scattered). Between them the residual stream is split along the sequence (sequence parallelism):
the residual stream and the norms hold each rank's T/tp positions (local tensors), and attention and the MLP gather the whole sequence first.

The token and position embeddings, the output head and the loss stay whole on every rank of the replica
(the head's matmul is repeated on each; its weight is not split, so a tied head stays tied): the
embeddings' output is cut along the sequence before the first block, the final norm's output is gathered
back. Each rank then computes the same loss from the same batch.

`model.py` reads its head counts from each `Attention`; the plan sets them to this rank's share, as
torchtitan does.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _block_plan(block: nn.Module) -> dict:
    """Each block's modules and how they split (an unwrapped `model.Block`)."""
    mlp_in = ("mlp.gate", "mlp.up") if block.mlp.gated else ("mlp.fc",)
    plan = {
        "attn_norm": SequenceParallel(use_local_output=True),
        # x (positions split), rope, cache, layer, doc_mask -> x whole for q, k, v
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
        ),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(use_local_output=True),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    plan.update({name: ColwiseParallel() for name in mlp_in})
    return plan


def local_parameter_count(block: nn.Module, tp: int) -> int:
    """Elements of `block`'s parameters one of `tp` ranks holds under the plan (the estimate's count):
    column-wise weights and biases and row-wise weights split, row-wise biases and the norms whole."""
    plan = _block_plan(block)
    count = 0
    for name, param in block.named_parameters():
        module, _, kind = name.rpartition(".")
        style = plan.get(module)
        split = isinstance(style, ColwiseParallel) or (isinstance(style, RowwiseParallel) and kind == "weight")
        count += param.numel() // tp if split else param.numel()
    return count


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split `model`'s blocks over the 1-D `mesh` (the tensor-parallel ranks of one replica), in place.
    Before activation checkpointing, compile and FSDP2, which wrap what this leaves."""
    tp = mesh.size()
    for block in model.blocks:
        parallelize_module(block, mesh, _block_plan(block))
        block.attn.n_heads //= tp  # each rank's share of the heads (the degree divides them: mesh.py)
        block.attn.n_kv_heads //= tp
    if model.config.pre_norm:
        parallelize_module(model, mesh, {"norm": SequenceParallel(use_local_output=True)})
    model.blocks[0].register_forward_pre_hook(_split_sequence(mesh))
    model.norm.register_forward_hook(_gather_sequence(mesh))


def split_at_stage_ends(stages: list[nn.Module], mesh: DeviceMesh) -> None:
    """Under pipeline parallelism too: each stage's hidden states travel whole (B, T, C) to the next
    stage (whose positions count from its input's length), so every stage cuts the sequence before its
    first block and gathers it after its last, as the whole model does around all its blocks."""
    for stage in stages:
        indices = list(stage.blocks.keys())  # `pipeline_parallel.StageBlocks`: the whole model's indices
        if indices[0] != "0":  # block 0 cuts it already (`apply_tensor_parallel`)
            stage.blocks[indices[0]].register_forward_pre_hook(_split_sequence(mesh))
        if stage.lm_head is None:  # the last stage gathers after its final norm
            stage.blocks[indices[-1]].register_forward_hook(_gather_sequence(mesh))


def _split_sequence(mesh: DeviceMesh):
    """Before the first block: the embeddings' (B, T, C), whole on every rank, cut to this rank's
    positions (B, T/tp, C); in backward their gradients are gathered whole again."""

    def hook(module, args):
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [Shard(1)]).to_local(), *args[1:])

    return hook


def _gather_sequence(mesh: DeviceMesh):
    """After the final norm: this rank's positions gathered into the whole (B, T, C) the head reads."""

    def hook(module, args, output):
        x = DTensor.from_local(output, mesh, [Shard(1)], run_check=False)
        return x.redistribute(mesh, [Replicate()]).to_local()

    return hook


def split_groups_by_mesh(optimizer) -> None:
    """During each step, give each parameter group's tensors of one device mesh a group of their own.

    Fused and foreach optimizer kernels take one group's tensors together, and cannot mix the blocks'
    DTensors with the whole embeddings and head (plain tensors, or on another mesh under FSDP2). The
    split groups live only for the step (copies of the groups' current settings; the state is per
    parameter): outside it, and so in checkpoints, the groups are those of every other layout, which
    is what lets a checkpoint resume at another one."""
    whole: list = []

    def split(opt, args, kwargs):
        whole[:] = opt.param_groups
        groups = []
        for group in whole:
            by_mesh: dict[int, list] = {}
            for p in group["params"]:
                by_mesh.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
            groups += [{**group, "params": params} for params in by_mesh.values()]
        opt.param_groups = groups

    def join(opt, args, kwargs):
        opt.param_groups = list(whole)

    optimizer.register_step_pre_hook(split)
    optimizer.register_step_post_hook(join)
