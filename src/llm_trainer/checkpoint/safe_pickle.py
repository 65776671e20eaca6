"""Pickles inside a folder someone else may have made: proven harmless before any library reads them.

A checksum proves a file is what meta.json says, not who wrote it: whoever crafts a folder can
recompute meta.json. A pickle can name any importable callable and call it, so two libraries we hand
checkpoint files to would run code from them: torch.distributed.checkpoint unpickles `sharded/.metadata`,
and DeepSpeed `torch.load`s its `*_states.pt` files without `weights_only`. Before either sees a file:

    load_restricted(file, DCP_METADATA)   unpickle with a `find_class` that admits only the allow-list
    check_torch_archive(file, DEEPSPEED)  read each pickle of a torch zip archive, opcode by opcode (as
                                          picklescan/modelscan do), and refuse any global not on the
                                          allow-list, or one that cannot be told statically

A refusal is a `CheckpointError` (exit status 2) naming the file and the global. The allow-lists are
what torch 2.13 and DeepSpeed 0.19 write; a future version that pickles something new is refused
with its name, and the name goes on the list after a look at what it does when called.
"""

from __future__ import annotations

import pickle
import pickletools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

_TENSORS = frozenset(
    {
        "collections.OrderedDict",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
        "torch.nn.parameter.Parameter",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._tensor._rebuild_from_type_v2",
    }
)
# torch.distributed.checkpoint's `.metadata`: dataclasses describing each saved item, plus the
# folder it was saved to as a path (torch.distributed.checkpoint.metadata.StorageMeta.checkpoint_id).
DCP_METADATA = frozenset(
    {
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
        "torch.serialization._get_layout",
        "torch.Size",
        "collections.OrderedDict",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
    }
)
# DeepSpeed's model/optimizer files (ZeRO 0-3, fp32/bf16/fp16) and our per-rank RNG files.
DEEPSPEED = frozenset(
    {
        *_TENSORS,
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.fp16.loss_scaler.LossScaleProfile",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


def _allowed(module: str, name: str, allowed: frozenset[str]) -> bool:
    """On the list, or a torch dtype or typed storage class (torch.float32, torch.FloatStorage)."""
    if f"{module}.{name}" in allowed:
        return True
    if module != "torch" or not name.isidentifier():
        return False
    value = getattr(torch, name, None)
    return isinstance(value, torch.dtype) or (name.endswith("Storage") and isinstance(value, type))


def _refusal(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{file} holds a pickle that {what}, which could run code; refusing to load it (the folder was not "
        "written by llm-trainer, or was altered)"
    )


class _Restricted(pickle.Unpickler):
    def __init__(self, handle, file: Path, allowed: frozenset[str]):
        super().__init__(handle)
        self.file, self.allowed = file, allowed

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name, self.allowed):
            raise _refusal(self.file, f"names {module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _refusal(self.file, "refers to outside storage")


def load_restricted(file: Path, allowed: frozenset[str]) -> Any:
    """Unpickle `file`, resolving only the globals on `allowed`."""
    file = Path(file)
    try:
        with open(file, "rb") as handle:
            return _Restricted(handle, file, allowed).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or malformed: pickle raises many types
        raise CheckpointError(
            f"{file} could not be read ({type(exc).__name__}: {str(exc)[:120]}); the file is corrupt"
        ) from None


_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_UNKNOWN = object()


def pickle_globals(data: bytes) -> Iterator[tuple[str, str] | None]:
    """Every global a pickle would import, in order; None for one that cannot be told without running
    it (a STACK_GLOBAL whose names are not plain strings, an extension-registry code). The stack is
    followed symbolically from each opcode's declared effect, so names reached through the memo count."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            yield module, attr
        elif name == "STACK_GLOBAL":
            module, attr = (stack[-2], stack[-1]) if len(stack) >= 2 else (_UNKNOWN, _UNKNOWN)
            yield (module, attr) if isinstance(module, str) and isinstance(attr, str) else None
        elif name in ("EXT1", "EXT2", "EXT4"):
            yield None
        if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack:
                raise ValueError("memo write on an empty stack")
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            continue
        before = op.stack_before
        if pickletools.markobject in before:
            if not marks:
                raise ValueError(f"{name} without a mark")
            del stack[marks.pop() :]
            count = before.index(pickletools.markobject)
        else:
            count = len(before)
        if count > len(stack):
            raise ValueError(f"{name} on a stack too short")
        del stack[len(stack) - count :]
        for item in op.stack_after:
            if item is pickletools.markobject:
                marks.append(len(stack))
            elif name in _STRINGS:
                stack.append(arg if isinstance(arg, str) else _UNKNOWN)
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg, _UNKNOWN))
            else:
                stack.append(_UNKNOWN)


def check_pickle(data: bytes, file: Path, allowed: frozenset[str]) -> None:
    """Refuse the pickle if it imports anything off `allowed` (nothing is unpickled)."""
    try:
        for found in pickle_globals(data):
            if found is None:
                raise _refusal(file, "imports a name that cannot be read without running it")
            if not _allowed(*found, allowed):
                raise _refusal(file, f"names {found[0]}.{found[1]}")
    except CheckpointError:
        raise
    except Exception as exc:  # pickletools: truncated data, unknown opcodes
        raise CheckpointError(f"{file} is not a readable pickle ({str(exc)[:120]}); refusing to load it") from None


def check_torch_archive(file: Path, allowed: frozenset[str]) -> None:
    """Every pickle inside a `torch.save` zip archive passes `check_pickle`; the records are read
    with torch's own archive reader, so they are exactly the bytes `torch.load` would unpickle."""
    file = Path(file)
    try:
        reader = torch._C.PyTorchFileReader(str(file))
        records = [name for name in reader.get_all_records() if name.endswith(".pkl")]
        if not records:
            raise ValueError("no pickle records")
        contents = [(name, bytes(reader.get_record(name))) for name in records]
    except Exception as exc:
        raise CheckpointError(
            f"{file} is not a torch archive ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}); "
            "refusing to load it"
        ) from None
    for _, data in contents:
        check_pickle(data, file, allowed)
