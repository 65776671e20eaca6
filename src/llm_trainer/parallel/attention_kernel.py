"""training.sdpa_backend: which scaled-dot-product-attention kernel the run uses, chosen once and held.

PyTorch picks an SDPA kernel per call from what the inputs allow, silently; a run that falls back to the
math kernel on a GPU is several times slower and nothing says so. Here the backend is chosen once at
setup, checked on the run's device with the model's head size and compute dtype (a backend this device
or shape cannot run is one line, exit 2), and the run is held to that one kernel through
`torch.nn.attention.sdpa_kernel`, so the run header can say which kernel ran. `model.py` stays the
plain architecture: nothing here changes it.

`auto` picks by device: cuDNN, then flash, on Hopper and later GPUs; flash, then memory-efficient, on
other CUDA GPUs; the CPU's flash kernel on a CPU; the first of these the device runs, math last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UsageError

BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass(frozen=True)
class AttentionKernel:
    """The chosen kernel: `name` (a key of BACKENDS), how it was chosen, and what the model runs instead
    of SDPA where it does not call it."""

    name: str
    requested: str
    instead: str | None = None  # e.g. FlexAttention for document masks

    @property
    def held(self) -> SDPBackend:
        """The one SDPA backend the run is held to."""
        return BACKENDS[self.name]

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Every SDPA call inside (the compiled graphs are traced inside too) uses the chosen backend only."""
        with sdpa_kernel([self.held]):
            yield

    def describe(self) -> str:
        """The run header's words for the kernel."""
        how = "auto" if self.requested == "auto" else "training.sdpa_backend"
        if self.instead is None:
            return f"attention {self.name} ({how})"
        return f"attention {self.instead}; SDPA calls: {self.name} ({how})"


def candidates(device: torch.device) -> list[str]:
    """`auto`'s order on this device: the fastest kernel first, math last."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return ["cudnn", "flash", "efficient", "math"] if major >= 9 else ["flash", "efficient", "math"]
    if device.type == "cpu":
        return ["flash", "math"]
    return ["math"]


def runs_here(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, gqa: bool) -> bool:
    """Whether `backend` runs a causal SDPA forward and backward on `device` at this head size and dtype:
    a tiny call under `sdpa_kernel`, so the answer is PyTorch's own (its checks differ by version and GPU)."""
    shape = (1, 2, 16, head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn((1, 1 if gqa else 2, 16, head_dim), device=device, dtype=dtype, requires_grad=True)
    try:
        with sdpa_kernel([BACKENDS[backend]]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=gqa).sum().backward()
    except RuntimeError:
        return False
    return True


def choose(requested: str, model: nn.Module, device: torch.device, amp_dtype: torch.dtype | None) -> AttentionKernel:
    """The kernel for `requested` (training.sdpa_backend) on `device`; raises UsageError for a backend that
    cannot run here. A model that does not call SDPA (FlexAttention; bfloat16 on a CPU, where the model
    writes the math out as the faster path) is reported as what it runs, and the setting is checked all the same."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", 64)
    gqa = getattr(config, "n_kv_heads", None) not in (None, getattr(config, "n_heads", None))
    dtype = amp_dtype or torch.float32
    if requested == "auto":
        name = next(b for b in candidates(device) if b == "math" or runs_here(b, device, dtype, head_dim, gqa))
    else:
        if not runs_here(requested, device, dtype, head_dim, gqa):
            available = [b for b in BACKENDS if runs_here(b, device, dtype, head_dim, gqa)]
            raise UsageError(
                f"training.sdpa_backend {requested} does not run on {device} with head size {head_dim} in "
                f"{str(dtype).removeprefix('torch.')}; use auto, or one this device runs: {', '.join(available)}"
            )
        name = requested
    if getattr(config, "attention_backend", "sdpa") == "flex":
        return AttentionKernel(name, requested, instead="FlexAttention for document masks")
    if device.type == "cpu" and dtype == torch.bfloat16:
        return AttentionKernel(name, requested, instead="written out (bfloat16 on a CPU)")
    return AttentionKernel(name, requested)
