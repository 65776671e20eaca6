"""Optimizer state as safetensors plus a plain structure around them.

`split_tensors` takes the tensors out of a nested state (the optimizer's state_dict) for
optimizer.safetensors, leaving a reference in place of each; optimizer.pt keeps only that structure
(plain data, loaded with weights_only=True). safetensors is written faster than torch.save's zip
archive (see bench/README.md) and is memory-mapped on load. `join_tensors` puts them back.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import OPTIMIZER_TENSORS

_TENSOR_REF = "__llm_trainer_tensor__"  # {_TENSOR_REF: key} stands for a tensor of optimizer.safetensors
_SAFETENSORS_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(structure with a reference in place of each dense tensor, {key: contiguous CPU tensor}).

    Tensors safetensors cannot hold (sparse, quantized, unusual dtypes) stay in the structure.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.dtype not in _SAFETENSORS_DTYPES:
                return value
            tensor = value.detach().to("cpu").contiguous()
            storage = tensor.untyped_storage()
            if tensor.numel() and (storage.data_ptr() in seen or storage.nbytes() != tensor.nbytes):
                tensor = tensor.clone()  # a view into shared memory: safetensors wants each tensor on its own
            seen.add(tensor.untyped_storage().data_ptr())
            key = where if where not in tensors else f"{where}#{len(tensors)}"
            tensors[key] = tensor
            return {_TENSOR_REF: key}
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{where}.{i}") for i, v in enumerate(value))
        return value

    return walk(state, ""), tensors


def join_tensors(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of split_tensors."""
    if isinstance(structure, dict):
        if len(structure) == 1 and _TENSOR_REF in structure:
            key = structure[_TENSOR_REF]
            if key not in tensors:
                raise KeyError(f"tensor {key!r} is missing from {OPTIMIZER_TENSORS}")
            return tensors[key]
        return {k: join_tensors(v, tensors) for k, v in structure.items()}
    if type(structure) in (list, tuple):
        return type(structure)(join_tensors(v, tensors) for v in structure)
    return structure
