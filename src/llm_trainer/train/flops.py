"""Parameters, training FLOPs per token and devices' peak FLOP/s: what MFU is computed from.

Counted from the model itself (built on the meta device), so the numbers follow our architecture;
`llm-trainer estimate` and the speed monitor both read them from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig


@dataclass(frozen=True)
class ParameterCount:
    total: int  # unique parameters (a tied head counted once)
    embedding: int  # lookups only: the token embedding when untied, learned position embeddings
    matmul: int  # total - embedding: the N of 6N (includes the output head, norms and biases)
    matmul_weights: int  # weights of nn.Linear layers only (what autocast copies to 16-bit)
    per_block: int  # parameters of one transformer block
    block_matmul_weights: int  # nn.Linear weights of one block
    head: int  # parameters of the output head matrix (V x d)


def meta_model(model_config: ModelConfig):
    """Our Transformer built on the meta device: exact shapes, no memory, no initialisation cost.

    One model per distinct config, kept for the next few asks: `estimate`'s layout search reads the same
    model's shapes for every layout it tries, and building a 70B's 80 blocks takes most of a second each
    time. Callers only read it (shapes, parameter identity); one that changes a model builds its own with
    `Transformer.on_meta`."""
    from ..model import Transformer

    if model_config.vocab_size is None:
        raise ValueError("model.vocab_size is not set; set it (or pass vocab_size) to count parameters")
    key = repr(model_config)  # every field: the config is a mutable dataclass, so not hashable itself
    model = _META_MODELS.pop(key, None) or Transformer.on_meta(model_config)
    _META_MODELS[key] = model  # the most recent last
    while len(_META_MODELS) > _META_MODELS_KEPT:
        del _META_MODELS[next(iter(_META_MODELS))]
    return model


_META_MODELS: dict[str, Any] = {}  # repr(ModelConfig) -> its meta model, oldest first
_META_MODELS_KEPT = 4


def count_parameters(model_config: ModelConfig) -> ParameterCount:
    """Exact parameter counts from the model built on the meta device."""
    model = meta_model(model_config)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    embedding = 0
    if model.pos_emb is not None:
        embedding += model.pos_emb.weight.numel()
    if model.lm_head.weight is not model.tok_emb.weight:
        embedding += model.tok_emb.weight.numel()
    seen: set[int] = set()
    linear = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            linear += module.weight.numel()
    first = model.blocks[0] if len(model.blocks) else torch.nn.Module()
    return ParameterCount(
        total=total,
        embedding=embedding,
        matmul=total - embedding,
        matmul_weights=linear,
        per_block=sum(p.numel() for p in first.parameters()),
        block_matmul_weights=sum(m.weight.numel() for m in first.modules() if isinstance(m, torch.nn.Linear)),
        head=model.lm_head.weight.numel(),
    )


def flops_per_token(model_config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B / nanoGPT's `estimate_mfu`:

        6 * N  +  12 * n_layers * d_model * seq_len

    * `N` = every parameter except embedding *lookups*: the token embedding is left out when it is
      untied, learned position embeddings always; the output head (d_model x vocab) stays in, since it
      is a real matmul, padding rows included (`model.vocab_pad_multiple`: the head multiplies them,
      its logits masked afterwards). For tied GPT-2 this equals nanoGPT's `get_num_params()` (its
      50,304 padded rows, our default: 123.69M; unpadded 50,257 rows: 123.65M).
      Norm weights and biases are included (negligible).
    * 6 = 2 FLOPs per multiply-add x (1 forward + 2 backward).
    * The attention term counts QK^T and AV (2 matmuls of d_model x seq_len per token per layer, x 6
      for forward + backward) over the *full* seq_len, as PaLM does: causal masking and flash
      kernels' recomputation are ignored, so MFU is comparable with published numbers.

    `seq_len` defaults to `model_config.max_seq_len`; pass the training sequence length. Our
    `Transformer` is accepted in place of its config; so is any other `nn.Module` (e.g. a Hugging Face
    model), counted from its own parameters (nn.Embedding weights not shared with a Linear are lookups)
    with the layer count and width read from its `config` (n_layers/n_layer/num_hidden_layers,
    d_model/n_embd/hidden_size). Raises ValueError when that is not possible.
    """
    config = getattr(model_config, "config", model_config)
    if isinstance(config, ModelConfig):
        seq_len = config.max_seq_len if seq_len is None else int(seq_len)
        n = count_parameters(config).matmul
        return float(6 * n + 12 * config.n_layers * config.d_model * seq_len)
    if isinstance(model_config, torch.nn.Module):
        return _module_flops_per_token(model_config, seq_len)
    raise ValueError(f"flops_per_token needs a ModelConfig or a model, got {type(model_config).__name__}")


def _config_value(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _module_flops_per_token(model: torch.nn.Module, seq_len: int | None) -> float:
    config = getattr(model, "config", None)
    layers = _config_value(config, "n_layers", "n_layer", "num_hidden_layers", "num_layers")
    width = _config_value(config, "d_model", "n_embd", "hidden_size")
    seq_len = seq_len or _config_value(config, "max_seq_len", "n_positions", "max_position_embeddings")
    if not (layers and width and seq_len):
        raise ValueError("cannot tell the model's layers, width and sequence length from its config")
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - linear
    n = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    return float(6 * n + 12 * layers * width * int(seq_len))


# Dense (no structured sparsity) peak FLOP/s. Keys are matched against torch.cuda.get_device_name()
# in order; values: (16-bit tensor core, TF32 tensor core, FP32 without tensor cores). None = the
# dtype has no fast path there (V100/T4 have no bf16; they fall back to their fp32 rate).
_PEAKS: list[tuple[str, tuple[float | None, float | None, float]]] = [
    (r"\bB200\b", (2250e12, 1100e12, 80e12)),
    (r"\bGH200\b|\bH200\b", (989.4e12, 494.7e12, 66.9e12)),
    (r"\bH100\b.*\bNVL\b", (835.5e12, 417.5e12, 60.0e12)),
    (r"\bH100\b.*\bPCI[Ee]\b", (756.0e12, 378.0e12, 51.2e12)),
    (r"\bH100\b", (989.4e12, 494.7e12, 66.9e12)),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bA100\b", (312.0e12, 156.0e12, 19.5e12)),
    (r"\bA10G\b", (70.0e12, 35.0e12, 31.2e12)),  # AWS g5
    (r"\bA10\b", (125.0e12, 62.5e12, 31.2e12)),
    (r"\bL40S\b", (362.05e12, 183.0e12, 91.6e12)),
    (r"\bL4\b", (121.0e12, 60.0e12, 30.3e12)),
    (r"\bRTX A6000\b", (154.8e12, 77.4e12, 38.7e12)),
    (r"\bV100\b.*\bPCI[Ee]\b", (112.0e12, None, 14.0e12)),
    (r"\bV100\b", (125.0e12, None, 15.7e12)),  # SXM2; fp16 only (no bf16)
    (r"\bRTX 4090\b", (165.2e12, 82.6e12, 82.6e12)),  # fp16/bf16 with fp32 accumulate
    (r"\bRTX 3090\b", (71.0e12, 35.6e12, 35.6e12)),
    (r"\bT4\b", (65.0e12, None, 8.1e12)),  # fp16 only (no bf16)
]
_NO_BF16 = (r"\bV100\b", r"\bT4\b")


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "").lower()
    return {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
        "tf32": "tfloat32",
    }.get(name, name)


def peak_flops(device_name: str, dtype: Any = torch.float32, *, tf32: bool | None = None) -> float | None:
    """The device's dense peak FLOP/s for matmuls in `dtype`, or None (CPU, MPS, an unknown device).

    `device_name` is `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 80GB HBM3"); `dtype` a torch
    dtype or its name ("bfloat16", "float16", "float32"). For float32, TF32 tensor cores count when
    `tf32` is true or, if None, when `torch.get_float32_matmul_precision()` allows them ("high"/"medium").
    """
    name = (device_name or "").strip()
    if not name or name.lower().split(":")[0] in ("cpu", "mps", "meta"):
        return None
    kind = _dtype_name(dtype)
    for pattern, (half, tf, fp32) in _PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            if kind == "bfloat16" and any(re.search(p, name, flags=re.IGNORECASE) for p in _NO_BF16):
                return fp32
            if kind in ("bfloat16", "float16"):
                return half
            if kind == "tfloat32":
                return tf or fp32
            if tf32 is None:
                tf32 = torch.get_float32_matmul_precision() in ("high", "medium")
            return (tf or fp32) if tf32 else fp32
    return None
