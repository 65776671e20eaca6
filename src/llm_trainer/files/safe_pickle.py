"""Pickles from a folder someone else may have made: parsed by torch's own weights-only unpickler only.

A checksum proves a file is what meta.json says, not who wrote it: whoever crafts a folder can
recompute meta.json, and a pickle can name any importable callable and call it. So every pickle from
a folder (`optimizer.pt`, `rng.pt`, DeepSpeed's `sharded/*.pt`, DCP's `sharded/.metadata`) goes
through `torch.load(weights_only=True)`, from bytes already in memory (see `folder_files`), with no
more allowed than torch's tensors and plain data plus an explicit list of classes, given through
`torch.serialization.safe_globals`. That unpickler is maintained upstream: it builds and calls only
allowed types, and its `BUILD` sets state on instances of allowed types only (never on a class).

    load_pickle(data, source)                 tensors and plain data
    load_pickle(data, source, DEEPSPEED)      + the classes DeepSpeed writes into its checkpoint files
    load_pickle(data, source, DCP_METADATA)   + torch.distributed.checkpoint's metadata records

A refusal is a `CheckpointError` (exit status 2) naming the file and the global torch refused. The
lists are what torch 2.13 and DeepSpeed 0.19 write; a future version that pickles something new is
refused with its name, and the name goes on the list after a look at what it does.
"""

from __future__ import annotations

import importlib
import io
import re
import warnings
from typing import Any

import torch

from ..errors import CheckpointError, UsageError
from ..limits import check_archive

# torch.distributed.checkpoint's `.metadata` (as `sharded.SafeWriter` writes it): the records of
# each saved item. Dtypes, torch.Size, layouts and OrderedDict are torch's own defaults.
DCP_METADATA = (
    *(
        f"torch.distributed.checkpoint.metadata.{name}"
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
)
# DeepSpeed's model/optimizer files (ZeRO 0-3, fp32/bf16/fp16): its loss scaler, the ZeRO stage, and
# the records of each parameter's fragment.
DEEPSPEED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaleProfile",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _resolve(names: tuple[str, ...]) -> list[tuple[Any, str]]:
    """Each allowed name with the object it names (imported: a list names only modules we load anyway)."""
    found = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        found.append((getattr(importlib.import_module(module), attribute), name))
    return found


def refusal(exc: Exception) -> str:
    """Why torch.load(weights_only=True) refused bytes, in one line."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand \d+", text)
    if "Weights only load failed" in text or found:
        detail = f" ({found.group(1) if found.lastindex else found.group(0)})" if found else ""
        return (
            f"it holds pickled objects other than tensors and plain data{detail}, which could run code; "
            "refusing to unpickle it (the file was not written by llm-trainer, or was altered)"
        )
    lines = [line for line in text.splitlines() if line.strip()]
    return f"it is not a torch file ({(lines[0] if lines else type(exc).__name__)[:160]}); refusing to read it"


def load_pickle(data: bytes, source: str, allowed: tuple[str, ...] = (), map_location: Any = "cpu") -> Any:
    """`torch.load(weights_only=True)` of `data`, admitting the classes named in `allowed` besides
    tensors and plain data. `source` names the file in the error. An archive that would decompress past
    `limits.MAX_ARCHIVE_BYTES` is refused before anything is allocated."""
    try:
        check_archive(data, source)
    except UsageError as exc:
        raise CheckpointError(str(exc)) from None
    try:
        with torch.serialization.safe_globals(_resolve(allowed)), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a pickle not from torch.save
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError for crafted files; RuntimeError, EOFError for others
        raise CheckpointError(f"{source}: {refusal(exc)}") from None
