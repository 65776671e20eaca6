"""Weights written before attention's q, k, v and SwiGLU's gate, up were separate matrices.

Our files once held `attn.qkv` (rows [q | k | v]) and, for SwiGLU, `mlp.fc` (rows [gate | up]). The
model now has `attn.q`, `attn.k`, `attn.v`, `mlp.gate` and `mlp.up` (tensor parallelism shards each by
its own rows). Every whole state dict read from a file passes through `split_fused` before it is checked
against the model, so a folder written before loads as it did, with the same logits. The rule of the
old layout lives here only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from ..config import ModelConfig
from ..errors import UsageError

V = TypeVar("V")


def _parts(name: str, config: ModelConfig) -> list[tuple[str, int]] | None:
    """The new names of a fused tensor's row blocks with their row counts, or None for any other name."""
    for fused, suffix in (("attn.qkv.", ("weight", "bias")), ("mlp.fc.", ("weight", "bias"))):
        for kind in suffix:
            if not name.endswith(fused + kind):
                continue
            stem = name[: -len(fused + kind)]
            if fused == "attn.qkv.":
                kv = config.n_kv_heads * config.head_dim
                sizes = (("q", config.n_heads * config.head_dim), ("k", kv), ("v", kv))
                return [(f"{stem}attn.{part}.{kind}", rows) for part, rows in sizes]
            if config.activation != "swiglu":
                return None  # an ungated MLP keeps its one fc
            return [(f"{stem}mlp.{part}.{kind}", config.d_ff) for part in ("gate", "up")]
    return None


def _new_layout(names) -> bool:
    """Whether the tensors are of today's layout (separate q, k, v): an ungated MLP's `mlp.fc` there is
    its input layer, not [gate | up] (a GPT-2 checkpoint given a SwiGLU model's config)."""
    return any(name.endswith("attn.q.weight") for name in names)


def is_fused(names, config: ModelConfig) -> bool:
    """Whether any of `names` is a fused projection of the old layout."""
    config = config.resolved()
    names = list(names)
    return not _new_layout(names) and any(_parts(name, config) is not None for name in names)


def _split(state: Mapping[str, V], config: ModelConfig, cut: Callable[[V, list[int]], list[V]]) -> dict[str, V]:
    if _new_layout(state):
        return dict(state)
    config = config.resolved()
    out: dict[str, V] = {}
    for name, value in state.items():
        parts = _parts(name, config)
        if parts is None:
            out[name] = value
            continue
        for (new_name, _), piece in zip(parts, cut(value, [rows for _, rows in parts]), strict=True):
            out[new_name] = piece
    return out


def split_fused(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` with every fused projection cut into its parts (row blocks, contiguous copies); other
    tensors as they are."""
    return _split(state, config, lambda tensor, rows: [t.contiguous() for t in tensor.split(rows, dim=0)])


def split_fused_shapes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The same renaming on tensor shapes (a file's header), so a misfit is named in the model's terms."""
    return _split(shapes, config, lambda shape, rows: [(n, *shape[1:]) for n in rows])


def refuse_resume(names, config: ModelConfig, source: str) -> None:
    """A training checkpoint of the old layout cannot resume: its optimizer state is per fused matrix.
    Its weights still start a new run."""
    if is_fused(names, config):
        raise UsageError(
            f"{source} was saved when attention's q, k, v (and SwiGLU's gate, up) were one matrix, so its optimizer "
            f"state cannot resume this model; start a new run from its weights with model.init_from={source}"
        )
