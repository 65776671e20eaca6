"""training.sdpa_backend: which scaled-dot-product-attention kernel the run uses, chosen once and held.

PyTorch picks an SDPA kernel per call from what the inputs allow, silently; a run that falls back to the
math kernel on a GPU is several times slower and nothing says so. Here the backend is chosen once at
setup, checked on the run's device with the training step's own attention call (head size, compute
dtype, grouped-query heads, attention dropout, a document mask): a backend that cannot run that call is
one line, exit 2. The run is then held to it through `torch.nn.attention.sdpa_kernel`, with math as the
only other kernel, for calls outside the step the chosen one cannot take (e.g. a KV-cache chunk's mask
in downstream scoring), so the run header can say which kernel the step runs. `model.py` stays the
plain architecture: nothing here changes it.

`auto` picks by device: cuDNN, then flash, on Hopper and later GPUs; flash, then memory-efficient, on
other CUDA GPUs; the CPU's flash kernel on a CPU; the first of these the device runs, math last.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import ModelConfig
from ..errors import UsageError

BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass(frozen=True)
class AttentionCall:
    """What the training step asks of SDPA: the kernels differ in which of these they take."""

    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    gqa: bool = False  # fewer key/value heads than query heads
    dropout: float = 0.0  # attention dropout while training
    masked: bool = False  # a (B, 1, T, T) document mask instead of is_causal

    @classmethod
    def of(cls, model: nn.Module, amp_dtype: torch.dtype | None, document_mask: bool) -> AttentionCall:
        """The call `model` (one of ours; another module: the defaults) makes in a training step."""
        config = getattr(model, "config", None)
        n_heads = getattr(config, "n_heads", None)
        return cls(
            head_dim=getattr(config, "head_dim", 64),
            dtype=amp_dtype or torch.float32,
            gqa=getattr(config, "n_kv_heads", None) not in (None, n_heads),
            dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            masked=document_mask and getattr(config, "attention_backend", "sdpa") == "sdpa",
        )

    def describe(self) -> str:
        """The call in words, for the error that names a kernel unable to run it."""
        parts = [f"head size {self.head_dim}", str(self.dtype).removeprefix("torch.")]
        parts += ["grouped-query heads"] * self.gqa + ["attention dropout"] * bool(self.dropout)
        return ", ".join(parts + ["a document mask"] * self.masked)


@dataclass(frozen=True)
class AttentionKernel:
    """The chosen kernel: `name` (a key of BACKENDS), how it was chosen, and what the model runs instead
    of SDPA where it does not call it."""

    name: str
    requested: str
    instead: str | None = None  # e.g. FlexAttention for document masks
    ours: bool = True  # the model is llm-trainer's, whose attention calls are known; else its SDPA calls, if any

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Inside, SDPA calls (the compiled graphs' too: they are traced inside) use the chosen backend, or
        math for a call it cannot take; the step's own call was checked to run on the chosen one."""
        backends = [BACKENDS[self.name]] + ([SDPBackend.MATH] if self.name != "math" else [])
        with sdpa_kernel(backends, set_priority=True):
            yield

    def describe(self) -> str:
        """The run header's words for the kernel."""
        how = "auto" if self.requested == "auto" else "training.sdpa_backend"
        if not self.ours:
            return f"the model's SDPA calls, if any: {self.name} ({how})"
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


def runs_here(backend: str, device: torch.device, call: AttentionCall) -> bool:
    """Whether `backend` runs the step's attention call, forward and backward, on `device`: a tiny call
    under `sdpa_kernel`, so the answer is PyTorch's own (its checks differ by version and GPU)."""
    q = torch.randn((1, 2, 16, call.head_dim), device=device, dtype=call.dtype, requires_grad=True)
    kv = torch.randn((1, 1 if call.gqa else 2, 16, call.head_dim), device=device, dtype=call.dtype, requires_grad=True)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device=device).tril() if call.masked else None
    try:  # PyTorch warns why a kernel refuses a call: the answer is all that is asked here
        with sdpa_kernel([BACKENDS[backend]]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.scaled_dot_product_attention(
                q, kv, kv, attn_mask=mask, is_causal=not call.masked, dropout_p=call.dropout, enable_gqa=call.gqa
            ).sum().backward()
    except RuntimeError:
        return False
    return True


def choose(
    requested: str,
    model: nn.Module,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    *,
    document_mask: bool = False,
) -> AttentionKernel:
    """The kernel for `requested` (training.sdpa_backend) on `device`; raises UsageError for a backend that
    cannot run the step's attention call here. A model that does not call SDPA (FlexAttention for document
    masks; bfloat16 on a CPU, where the model writes the math out as the faster path) is reported as what
    it runs, and the setting is checked all the same."""
    call = AttentionCall.of(model, amp_dtype, document_mask)
    if requested == "auto":
        name = next(b for b in candidates(device) if b == "math" or runs_here(b, device, call))
    elif runs_here(requested, device, call):
        name = requested
    else:
        available = [b for b in BACKENDS if runs_here(b, device, call)]
        raise UsageError(
            f"training.sdpa_backend {requested} does not run this model's attention on {device} ({call.describe()}); "
            f"use auto, or one that does: {', '.join(available)}"
        )
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):  # a model of the user's: what it calls is its own
        return AttentionKernel(name, requested, ours=False)
    if document_mask and getattr(config, "attention_backend", "sdpa") == "flex":
        return AttentionKernel(name, requested, instead="FlexAttention for document masks")
    if device.type == "cpu" and call.dtype == torch.bfloat16:
        return AttentionKernel(name, requested, instead="written out (bfloat16 on a CPU)")
    return AttentionKernel(name, requested)
