"""float8 training (`training.float8`): the transformer blocks' linear layers swapped for torchao's
`Float8Linear`, which casts each matmul's inputs to float8 with dynamic per-tensor scales and runs them
on the tensor cores' float8 path (`torch._scaled_mm`); weights, gradients and optimizer state stay in
their own precision. torchao's layers, not kernels of our own: torchtitan's float8 recipe.

Applied from outside the model (`parallelize`), before compile and FSDP2 as torchtitan orders it, so
the compiled graph fuses the casts and FSDP shards the swapped layers. `Float8Linear` is an `nn.Linear`
with the same parameters, so state dicts, checkpoints and exports are unchanged.

Left in their precision: the output head (its logits feed the loss directly; float8 there costs the
most accuracy for the least speed, as torchtitan does) and the embeddings (lookups, no matmul), and
any linear layer whose dimensions are not multiples of 16 (float8 matmuls need them). With
`training.float8_layers: auto` also the layers too small to gain: torchao's tables of float8 against
bf16 matmuls on an H100 (tensorwise scaling) show a layer of at most 4096 inputs and 1024 outputs
running slower in float8, since casting its inputs costs more than its shorter matmul saves; `all`
converts those too. A model with no layer above that size trains as it would without float8.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..errors import UsageError

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
ALIGNMENT = 16  # float8 matmuls need both dimensions of the weight to be multiples of this
SKIPPED = ("lm_head",)  # by name: the output head stays in the run's precision
# At most this many inputs and outputs, a layer runs slower in float8 (torchao's H100 tables, tensorwise)
SMALL_IN, SMALL_OUT = 4096, 1024


def check_float8(device: torch.device) -> None:
    """One line naming what is missing when this process cannot train in float8: a CUDA GPU of compute
    capability 8.9 or later, then torchao."""
    if device.type != "cuda" or not torch.cuda.is_available():
        found = f"the device is {device.type}"
    else:
        major, minor = torch.cuda.get_device_capability(device)
        found = None if (major, minor) >= MIN_CAPABILITY else f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
    if found is not None:
        raise UsageError(
            "training.float8 needs a CUDA GPU of compute capability 8.9 or later (Ada, Hopper: H100, H200; "
            f"{found}); set training.float8: false"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UsageError(
            "training.float8 needs torchao's float8 layers, not installed: pip install torchao "
            "(or pip install 'llm-trainer[float8]')"
        ) from None


def converts(module: nn.Module, name: str, layers: str = "auto") -> bool:
    """Whether `module` (called `name` in the model) becomes a float8 linear layer; `layers` as
    `training.float8_layers`."""
    return (
        isinstance(module, nn.Linear)
        and name.rsplit(".", 1)[-1] not in SKIPPED
        and module.in_features % ALIGNMENT == 0
        and module.out_features % ALIGNMENT == 0
        and (layers == "all" or module.in_features > SMALL_IN or module.out_features > SMALL_OUT)
    )


def apply_float8(model: nn.Module, layers: str = "auto") -> tuple[list[str], list[str]]:
    """Swap the linear layers that `converts` picks for torchao's `Float8Linear`, in place: the names of
    those swapped, and of the blocks' aligned layers left in their precision as too small to gain. Call
    `check_float8` first: this one assumes torchao is there."""
    from torchao.float8 import convert_to_float8_training

    picked = [name for name, module in model.named_modules() if converts(module, name, layers)]
    small = [name for name, module in model.named_modules() if converts(module, name, "all") and name not in picked]
    convert_to_float8_training(model, module_filter_fn=functools.partial(converts, layers=layers))
    return picked, small
