"""Everything applied to the model from outside, in one place and one order:
activation checkpointing, then compilation (then, for multi-process runs, DDP/FSDP wrapping).

`model.py` stays the plain architecture; wrappers here never change parameter names in files
(see `model_files.clean_name`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from .logs import log


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        log("gradient_checkpointing: the model has no .blocks; left as is")
        return
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)


def parallelize(model: nn.Module, *, gradient_checkpointing: bool, compile: bool) -> nn.Module:
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        model = torch.compile(model)
    return model
