"""FSDP2 checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shards.

A sharded checkpoint folder holds `sharded/` (DCP files for the model and optimizer, keyed by
parameter name) in place of `model.safetensors` and the optimizer files; the rest of the folder is as
for any checkpoint. DCP reshards on load, so the same files load at another world size, and
`consolidate` turns them into one safetensors model in a single process.

DCP's own reader unpickles `.metadata` and its planner `torch.load`s non-tensor items without
`weights_only`: a crafted folder would run code. Every load here goes through `SafeReader` (the
metadata unpickled against `safe_pickle.DCP_METADATA`, every data file a plain name inside the
folder) and `SafePlanner` (non-tensor items with `weights_only=True`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import CheckpointError
from ..limits import check_dcp_items
from .layout import SHARDED_DIR
from .model_folder import clean_name
from .safe_pickle import DCP_METADATA, load_restricted


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled against an allow-list and whose data files must
    be plain names inside the checkpoint folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        rank = kwargs.get("rank")
        file = folder / (".metadata" if rank is None else f"__{rank}.metadata")
        metadata = load_restricted(file, DCP_METADATA)
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"{file} is not DCP metadata; the checkpoint is corrupt")
        for info in metadata.storage_data.values():
            name = getattr(info, "relative_path", None)
            if (
                not isinstance(name, str)
                or Path(name).name != name
                or name in ("", ".", "..")
                or (folder / name).is_symlink()
                or not (folder / name).is_file()
            ):
                raise CheckpointError(
                    f"{file} names the data file {name!r}, which is not a file inside {folder}; refusing to load it"
                )
        check_dcp_items(metadata.storage_data, str(file))  # compressed items: refused before any is read
        if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader.read_metadata adds
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor items (optimizer hyperparameters) with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"the sharded checkpoint's item {read_item.dest_index.fqn} holds more than plain data "
                f"({str(exc).splitlines()[0][:120]}); refusing to load it"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _load(state: dict, directory: Path, no_dist: bool = False) -> None:
    """dcp.load through the safe reader and planner. The metadata is checked here first, so a refusal
    comes out as itself (not as DCP's per-rank CheckpointException, after DCP logged a traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeReader(str(directory))
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        for failure in exc.failures.values():
            if isinstance(failure[0], CheckpointError):
                raise failure[0] from None
        raise


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
    _load(state, directory)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def consolidate(checkpoint: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, read in one process into `model`'s layout."""
    state = {"model": {k: v for k, v in model.state_dict().items()}}
    _load(state, Path(checkpoint) / SHARDED_DIR, no_dist=True)
    return state["model"]
