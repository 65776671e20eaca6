"""FSDP2 checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shards.

A sharded checkpoint folder holds `sharded/` (DCP files for the model and optimizer, keyed by
parameter name) in place of `model.safetensors` and the optimizer files; the rest of the folder is as
for any checkpoint. DCP reshards on load, so the same files load at another world size, and
`consolidate` turns them into one safetensors model in a single process.

DCP's own reader unpickles `.metadata` with plain `pickle` and its planner `torch.load`s non-tensor
items without `weights_only`: a crafted folder would run code. So `SafeWriter` writes `.metadata`
with `torch.save` (protocol 2, which torch's weights-only unpickler reads; the folder as a string,
not a path object), and every load goes through `SafeReader` (`.metadata` read once, checked against
meta.json, and unpickled by `safe_pickle` with exactly DCP's metadata records allowed; every data
file under `folder_files`' rule) and `SafePlanner` (non-tensor items with `weights_only=True`).
A `.metadata` in DCP's own format (an FSDP checkpoint written before) is refused, not unpickled.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
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
from .folder_files import SHARDED_DIR, FolderFiles
from .model_folder import check_fits, clean_name
from .safe_pickle import DCP_METADATA, load_pickle

METADATA = ".metadata"  # DCP's index of the shards, inside `sharded/`


class SafeWriter(FileSystemWriter):
    """FileSystemWriter whose `.metadata` torch's weights-only unpickler can read: DCP writes its own,
    then it is replaced (an atomic rename) by the same records through `torch.save`."""

    def finish(self, metadata: Metadata, results: list) -> None:
        super().finish(metadata, results)  # fills in metadata.storage_data and storage_meta
        if metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id is not None:
            metadata.storage_meta.checkpoint_id = str(metadata.storage_meta.checkpoint_id)  # not a pathlib object
        target = Path(self.path) / METADATA
        temporary = target.with_name(f"{METADATA}.tmp")
        with open(temporary, "wb") as handle:
            torch.save(metadata, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read once, checked against the checkpoint's meta.json and
    unpickled by torch's weights-only unpickler; every data file it names must be one the folder may
    be read for (`folder_files`)."""

    def __init__(self, path: str, files: FolderFiles | None = None):
        super().__init__(path)
        folder = Path(path)
        self.files = files if files is not None else FolderFiles.of(folder.parent)  # the checkpoint folder
        self.metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} holds per-rank DCP metadata, which llm-trainer never writes")
        if self.metadata is None:  # read once: `_load` checks it before DCP asks for it
            self.metadata = self._read_metadata()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def _read_metadata(self) -> Metadata:
        name = f"{SHARDED_DIR}/{METADATA}"
        source = self.files.folder / name
        metadata = load_pickle(self.files.read(name), str(source), DCP_METADATA)
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"{source} is not DCP metadata; the checkpoint is corrupt")
        for info in metadata.storage_data.values():
            data_file = getattr(info, "relative_path", None)
            if not isinstance(data_file, str) or "/" in data_file:
                raise CheckpointError(f"{source} names the data file {data_file!r}, which is not a file name")
            self.files.path(f"{SHARDED_DIR}/{data_file}")  # inside, a regular file, listed: else refused
        check_dcp_items(metadata.storage_data, str(source))  # compressed items: refused before any is read
        if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader.read_metadata adds
            metadata.storage_meta = StorageMeta()
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
    dcp.save(state, storage_writer=SafeWriter(str(directory)))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path) -> None:
    """Load model (and optimizer) shards for this rank's part, whatever world size wrote them; into a
    model that is not sharded (one process, DDP), the whole of each tensor."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    _load(state, directory, no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_whole(
    model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optimizer_state: dict, source: str
) -> None:
    """A whole checkpoint's weights and optimizer state (`optimizer.state_dict()` of the same model and
    parameter groups, in one process or DDP) into a sharded model: each rank keeps its own shards."""
    check_fits(model, weights, source)
    options = StateDictOptions(full_state_dict=True, strict=False)  # a tied output head is saved once
    set_model_state_dict(model, weights, options=options)
    by_param = {id(p): clean_name(name) for name, p in model.named_parameters()}
    names = [by_param[id(p)] for group in optimizer.param_groups for p in group["params"]]  # the saved ids' order
    state = {
        "state": {names[i]: value for i, value in optimizer_state["state"].items()},
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [names[i] for i in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, state, options=options)


def consolidate(checkpoint: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, read in one process into `model`'s layout."""
    state = {"model": {k: v for k, v in model.state_dict().items()}}
    _load(state, Path(checkpoint) / SHARDED_DIR, no_dist=True)
    return state["model"]
