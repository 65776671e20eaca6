"""FSDP2 checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shards.

A sharded checkpoint folder holds `sharded/` (DCP files for the model and optimizer, keyed by
parameter name) in place of `model.safetensors` and the optimizer files; the rest of the folder is as
for any checkpoint. DCP reshards on load, so the same files load at another world size, and
`consolidate` turns them into one safetensors model in a single process.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .format import SHARDED_DIR
from .model_folder import clean_name


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the whole model on rank 0 (CPU); a collective, every rank must call it. Empty on others."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_name(k): v for k, v in state.items()}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its shards of model and optimizer into `directory` (a collective)."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
    """Load model (and optimizer) shards for this rank's part, whatever world size wrote them."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def consolidate(checkpoint: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, read in one process into `model`'s layout."""
    state = {"model": {k: v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / SHARDED_DIR), no_dist=True)
    return state["model"]
