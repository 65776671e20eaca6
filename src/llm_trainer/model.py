"""The decoder-only transformer: GPT-2 style and LLaMA style from one set of modules.

Only the architecture lives here. Compilation, activation checkpointing and distributed wrapping are
applied from outside by `llm_trainer.parallel.parallelize`, so this file reads like the paper.

Shapes: B batch, T time (sequence), C d_model, H query heads, K key/value heads, D head size, V vocab.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .loss import IGNORE_INDEX, linear_cross_entropy, real_columns, token_logprobs


def _norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.rms_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.rms_norm_eps, bias=bool(config.bias))


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_len, head_dim / 2): pair (i, i + D/2) turns by angle i
    (the rotate-half layout LLaMA uses)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (D/2,)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # (T, D/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (..., T, heads, D) by the angles of their positions; cos/sin
    (T, 1, D/2) or (B, T, 1, D/2). Half-width tables: three multiply-adds per pair, no negation."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class CausalLMOutput:
    """What a call in the transformers shape returns (`model(input_ids=..., labels=...)`): the mean
    next-token loss over the targets that count (None without labels) and the logits (B, T, V)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) at position t against labels (B, T) at t + 1, as
    transformers computes it: labels equal to `IGNORE_INDEX`, and those where attention_mask is 0
    (padding), are not targets."""
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    targets = labels[:, 1:]  # (B, T-1): the token after each position
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def _check_right_padded(attention_mask: torch.Tensor) -> None:
    """Padding must follow the text: attention is causal and positions count from the row's start, so
    the text's logits are those of the unpadded row only when nothing comes before it."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, time) of 0/1, got shape {tuple(attention_mask.shape)}")
    if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise ValueError("attention_mask has padding before the text; pad on the right (padding_side='right')")


@dataclass
class KVCache:
    """Keys and values of past positions for incremental decoding, preallocated to `max_len`."""

    keys: list[torch.Tensor]  # per layer: (B, K, max_len, D)
    values: list[torch.Tensor]
    length: int = 0  # positions filled so far

    @classmethod
    def empty(cls, config: ModelConfig, batch_size: int, max_len: int, device, dtype) -> KVCache:
        config = config.resolved()
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
        )


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document index of each token (contiguous runs) -> each token's position in its document (B, T)."""
    t = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = (
        torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
    )  # (B, T): where each token's document starts
    return t - first


def document_attention(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) document ids -> the block-diagonal causal mask (B, 1, T, T) bool (True: may attend) and
    each token's position within its document (B, T)."""
    t = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    mask = same & (t[:, None] >= t[None, :])  # causal within the document
    return mask[:, None], document_positions(doc_ids)


def document_block_mask(doc_ids: torch.Tensor):
    """The same block-diagonal causal mask as `document_attention`, as a FlexAttention BlockMask:
    attention computes only the blocks a document touches, on the fast kernels (no dense (B, T, T) mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, k):
        return (q >= k) & (doc_ids[b, q] == doc_ids[b, k])

    B, T = doc_ids.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=doc_ids.device)


@functools.cache
def _flex_kernel(compiled: bool):
    """FlexAttention compiled (one fused kernel, on GPUs) or eager (a reference; CPU inference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def _flex_attention(q, k, v, block_mask, enable_gqa: bool):
    return _flex_kernel(q.device.type == "cuda")(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def _explicit_is_faster(q: torch.Tensor) -> bool:
    """bfloat16 on a CPU: SDPA's CPU flash kernel is slower in bf16 than softmax(q k^T) v written out,
    with its backward and forward only (figures: bench/README.md, from bench/cpu_bf16.py)."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _explicit_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, enable_gqa=False):
    """scaled_dot_product_attention's math, written out: q (B, H, T, D), k/v (B, K, S, D)."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = scores.float().softmax(dim=-1).to(q.dtype)  # (B, H, T, S); the softmax in float32, as SDPA does
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v  # (B, H, T, D)


def project(x: torch.Tensor, *layers: nn.Linear, fuse: bool = True) -> tuple[torch.Tensor, ...]:
    """`layer(x)` for each of `layers` (attention's q, k, v; SwiGLU's gate and up), as one matmul over
    their weights stacked where that costs no memory and every layer is a plain `nn.Linear`: one GEMM of
    the summed width runs faster than several narrow ones (bench/README.md, "Fused projections"), while
    the matrices stay separate parameters for tensor parallelism, float8 and checkpoints.

    Only under autocast, where the matmul keeps the stacked 16-bit copy instead of autocast's copy of
    each weight (in float32 it would keep a stacked float32 copy beside the weights), and only with
    `fuse` (`set_fused_projections`: off where FSDP2 or DeepSpeed gather sharded weights, whose stacked
    copy would outlive the gathered shards until backward). Layer by layer wherever anything has taken
    a layer over (tensor parallelism's DTensor weights, float8's layers, a hook), so what replaced it runs."""
    if not (fuse and torch.is_autocast_enabled(x.device.type) and all(_plain_linear(layer) for layer in layers)):
        return tuple(layer(x) for layer in layers)
    weight = torch.cat([layer.weight for layer in layers])  # (sum of outs, C)
    bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
    return F.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1)


def _plain_linear(layer: nn.Module) -> bool:
    hooks = (layer._forward_pre_hooks, layer._forward_hooks, layer._backward_pre_hooks, layer._backward_hooks)
    return type(layer) is nn.Linear and type(layer.weight) is nn.Parameter and not any(hooks)


def set_fused_projections(model: nn.Module, on: bool) -> None:
    """Whether the blocks may compute their projections as one matmul (`project`)."""
    for module in model.modules():
        if isinstance(module, Attention | MLP):
            module.fuse_projections = on


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        bias = bool(config.bias)
        # q, k, v as separate matrices (as LLaMA): each splits by heads alike, for tensor parallelism
        self.q = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=bias)
        self.k = nn.Linear(config.d_model, kv_dim, bias=bias)
        self.v = nn.Linear(config.d_model, kv_dim, bias=bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=bool(config.bias))
        self.attention_dropout = config.attention_dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.use_rope = config.position_embedding == "rope"
        self.qk_norm = config.qk_norm
        self.fuse_projections = True  # `project`; parallelize turns it off for sharded weights

    def forward(self, x, rope, cache: KVCache | None, layer: int, doc_mask: torch.Tensor | None = None):
        """doc_mask: None (causal), or (B, 1, T, T) bool block-diagonal causal mask from `document_attention`."""
        B, T = x.shape[:2]
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim  # this process's heads (all, unless tensor parallel)
        q, k, v = project(x, self.q, self.k, self.v, fuse=self.fuse_projections)
        if self.use_rope or self.qk_norm:  # q and k become new tensors below: v alone must not keep the
            v = v.contiguous()  # stacked (q, k, v) output of `project` alive for the backward
        q, k = q.view(B, T, H, D), k.view(B, T, K, D)
        if self.qk_norm:
            q, k = F.rms_norm(q, (D,)), F.rms_norm(k, (D,))
        if self.use_rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, K, T, D)
        v = v.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)

        start = 0
        if cache is not None:
            start = cache.length
            cache.keys[layer][:, :, start : start + T] = k
            cache.values[layer][:, :, start : start + T] = v
            k = cache.keys[layer][:, :, : start + T]  # (B, K, start+T, D)
            v = cache.values[layer][:, :, : start + T]

        if doc_mask is not None and not isinstance(doc_mask, torch.Tensor):  # a FlexAttention BlockMask
            y = _flex_attention(q, k, v, doc_mask, enable_gqa=self.n_kv_heads != self.n_heads)  # (B, H, T, D)
            return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, H * D)))
        if doc_mask is not None:  # packed documents: attention stays within each one
            mask, causal = doc_mask, False
        elif start == 0:
            mask, causal = None, True
        elif T == 1:
            mask, causal = None, False  # one new query sees every cached position
        else:  # a chunk after a prefix: query i sees keys up to start + i
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            causal = False
        attend = _explicit_attention if _explicit_is_faster(q) else F.scaled_dot_product_attention
        y = attend(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.attention_dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.resid_dropout(self.proj(y))


class ReLUSquared(nn.Module):
    """relu(x)^2 (Primer; the modded-nanoGPT speedruns): sparse like ReLU, smooth above zero."""

    def forward(self, x):
        return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gated = config.activation == "swiglu"
        bias = bool(config.bias)
        if self.gated:  # SwiGLU: act(gate(x)) * up(x), two matrices (each sharded alike by tensor parallelism)
            self.gate = nn.Linear(config.d_model, config.d_ff, bias=bias)
            self.up = nn.Linear(config.d_model, config.d_ff, bias=bias)
        else:
            self.fc = nn.Linear(config.d_model, config.d_ff, bias=bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=bool(config.bias))
        self.act = {
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU(approximate="tanh"),
            "relu": nn.ReLU(),
            "relu2": ReLUSquared(),
            "silu": nn.SiLU(),
            "swiglu": nn.SiLU(),
        }[config.activation]
        self.dropout = nn.Dropout(config.dropout)
        self.fuse_projections = True  # `project`; parallelize turns it off for sharded weights

    def forward(self, x):
        if self.gated:
            gate, up = project(x, self.gate, self.up, fuse=self.fuse_projections)
            h = self.act(gate) * up  # (B, T, d_ff)
        else:
            h = self.act(self.fc(x))  # (B, T, d_ff)
        return self.dropout(self.proj(h))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.pre_norm = config.pre_norm
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, cache: KVCache | None = None, doc_mask: torch.Tensor | None = None):
        if self.pre_norm:
            x = x + self.attn(self.attn_norm(x), rope, cache, self.layer, doc_mask)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + self.attn(x, rope, cache, self.layer, doc_mask))
        return self.mlp_norm(x + self.mlp(x))


def _padded_rows(module: nn.Embedding | nn.Linear, rows: int) -> nn.Embedding | nn.Linear:
    """`module` (built with the real vocabulary's rows) with `rows` rows. It is built at the real size first
    so the random numbers its constructor draws, and so every weight drawn after it from a seed, are those
    of an unpadded model; `init_weight` fills the new weight."""
    weight = module.weight
    if weight.shape[0] == rows:
        return module
    module.weight = nn.Parameter(weight.new_empty(rows, *weight.shape[1:]))
    if isinstance(module, nn.Embedding):
        module.num_embeddings = rows
    else:
        module.out_features = rows
    return module


class Transformer(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, V).

    A pipeline stage is this model with the parts another stage owns removed: `blocks` holds the
    stage's layers only, and `tok_emb` (with `pos_emb`) is None after the first stage, `norm` and
    `lm_head` None before the last. The forward then starts from the previous stage's hidden states
    (B, T, C) where there is no embedding, and returns its blocks' output where there is no head.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size is not set; build the model after the tokenizer, or set it")
        config = config.resolved()  # every preset value explicit: what model_config.json records
        self.config = config
        self.tok_emb = _padded_rows(nn.Embedding(config.vocab_size, config.d_model), config.padded_vocab_size)
        self.pos_emb = (
            nn.Embedding(config.max_seq_len, config.d_model) if config.position_embedding == "learned" else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = _norm(config) if config.pre_norm else nn.Identity()
        self.lm_head = _padded_rows(nn.Linear(config.d_model, config.vocab_size, bias=False), config.padded_vocab_size)
        self.tie_weights()
        if config.position_embedding == "rope":
            self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.init_buffers()
        if (
            not self.tok_emb.weight.is_meta
        ):  # on the meta device there is nothing to draw (parallelize initialises later)
            self.reset_parameters()

    @classmethod
    def on_meta(cls, config: ModelConfig) -> Transformer:
        """The model on the meta device: shapes, no storage, nothing drawn (parallelize materialises and
        initialises it). The constructors' own default initialisation is skipped too: on the meta device
        it only costs time (a second, to import torch's compiler for meta random ops)."""
        inits = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
        saved = {name: getattr(nn.init, name) for name in inits}
        try:
            for name in inits:
                setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
            with torch.device("meta"):
                return cls(config)
        finally:
            for name, function in saved.items():
                setattr(nn.init, name, function)

    def tie_weights(self) -> None:
        """Share the token embedding with the output head (again after `to_empty`, which unties them)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def init_buffers(self) -> None:
        """Computed (non-learned) tensors; called again after a meta-device model is materialised."""
        if self.config.position_embedding == "rope" and not self.rope_cos.is_meta:
            cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def reset_parameters(self) -> None:
        """GPT-2 initialisation, parameter by parameter in a fixed order (see `init_weight`)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                self.init_weight(name, param)

    def init_weight(self, name: str, tensor: torch.Tensor) -> None:
        """N(0, 0.02) for matrices and embeddings, residual projections scaled by 1/sqrt(2 * n_layers),
        zero biases, unit norm weights. By name, so a sharded model can initialise full tensors too."""
        std = self.config.init_std
        if name in ("tok_emb.weight", "lm_head.weight"):
            self._init_vocab_rows(tensor, std)
        elif name.endswith("bias"):
            nn.init.zeros_(tensor)
        elif "norm" in name:
            nn.init.ones_(tensor)
        elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            if self.config.zero_init_projections:  # each block starts as the identity (modded-nanoGPT)
                nn.init.zeros_(tensor)
            else:
                nn.init.normal_(tensor, mean=0.0, std=std / math.sqrt(2 * self.config.n_layers))
        else:
            nn.init.normal_(tensor, mean=0.0, std=std)

    def _init_vocab_rows(self, tensor: torch.Tensor, std: float) -> None:
        """N(0, std) for the real vocabulary's rows, zeros for the padding rows: the real rows draw the
        same numbers as an unpadded model's, and the padding rows, whose logits every softmax leaves out
        (so they get no gradient), stay zero."""
        vocab = self.config.vocab_size
        nn.init.normal_(tensor[:vocab], mean=0.0, std=std)
        nn.init.zeros_(tensor[vocab:])

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        reduction: str = "sum",
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | CausalLMOutput:
        """Token ids (B, T) -> logits (B, T, V), called the nanoGPT way: `model(idx)`.

        With `targets` (B, T) (the next token at each position, `IGNORE_INDEX` where none counts) it
        returns their float32 negative log-likelihood instead, summed (a scalar) or with
        reduction="none" per position (B, T): the head and the loss run together in chunks
        (`loss.linear_cross_entropy`), so the logits never exist whole. Training and evaluation call this.

        Called the transformers way (`input_ids=`, `attention_mask=` or `labels=` given), it returns a
        `CausalLMOutput` whose loss is `causal_lm_loss` (labels are the inputs, unshifted; padding,
        where attention_mask is 0, is never a target). Padding goes after the text, as our tokenizer
        pads. doc_ids: optional (B, T) document index of each token (packed rows): attention is
        restricted to each document and positions restart at 0 for each one. None: one causal sequence.
        positions: optional (B, T) position of each token in its row, for a caller that holds only some of
        each row's tokens (context parallelism: a share of the positions, in the order its attention
        kernel sees them); None: 0 .. T-1. Attention stays causal by the kernel's own order.
        """
        shaped = input_ids is not None or attention_mask is not None or labels is not None
        if (idx is None) == (input_ids is None):
            raise ValueError("pass the token ids once: model(idx) or model(input_ids=...)")
        ids = idx if input_ids is None else input_ids
        if attention_mask is not None:
            _check_right_padded(attention_mask)
        if positions is not None and (doc_ids is not None or cache is not None):
            raise ValueError("positions= is for rows given in parts; it cannot be combined with doc_ids or a KV cache")
        given = None if positions is None else (None, positions)
        if targets is not None:
            if shaped:
                raise ValueError(
                    "targets= is the nanoGPT-style call model(idx, targets=...); with input_ids use labels="
                )
            return linear_cross_entropy(
                self._hidden(ids, cache, doc_ids, given),
                self.lm_head.weight,
                targets,
                softcap=self.config.logit_softcap,
                reduction=reduction,
                vocab=self.config.vocab_size,
            )
        logits = self._logits(ids, cache, doc_ids, given)
        if not shaped:
            return logits
        loss = causal_lm_loss(logits, labels, attention_mask) if labels is not None else None
        return CausalLMOutput(loss=loss, logits=logits)

    def extend(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None,
        positions: torch.Tensor,
        mask: torch.Tensor,
        select: tuple[torch.Tensor, torch.Tensor] | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) of `input_ids` with each token's position (B, T) and the keys it may see,
        (B, 1, T, S) bool, given by the caller: after `cache` (S = cache.length + T), whose rows hold
        contexts of different lengths padded to cache.length, or alone (S = T). Many continuations of
        many contexts in one batch, none seeing another (evaluation, batched decoding). `select`
        (rows, columns): the logits (N, V) of those positions only (the output head, a large share of
        a small model's work, runs on nothing else). With `targets` (N,), one token per selected position:
        (log p(target) (N,), whether it is the most likely token (N,)) from `loss.token_logprobs`, in
        chunks instead of the (N, V) logits."""
        if int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is beyond max_seq_len={self.config.max_seq_len}")
        if targets is None:
            return self._logits(input_ids, cache, given=(mask, positions), select=select)
        hidden = self._hidden(input_ids, cache, given=(mask, positions), select=select)
        return token_logprobs(
            hidden, self.lm_head.weight, targets, softcap=self.config.logit_softcap, vocab=self.config.vocab_size
        )

    def _logits(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        given: tuple[torch.Tensor | None, torch.Tensor] | None = None,
        select: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The head's logits (B, T, V), or (N, V) of `select`, soft-capped where the config says so: the
        real vocabulary's columns only. The head multiplies its padding rows too (an aligned matmul)
        and their columns are cut from the result, so no padded id is ever sampled or scored. A pipeline
        stage before the last has no head: its hidden states (B, T, C)."""
        hidden = self._hidden(input_ids, cache, doc_ids, given, select)
        if self.lm_head is None:
            return hidden
        logits = real_columns(self.lm_head(hidden), self.config.vocab_size)
        logits = logits.contiguous()  # a plain (.., V) tensor for callers that reshape it with .view
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def _hidden(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        given: tuple[torch.Tensor | None, torch.Tensor] | None = None,
        select: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final norm's output (B, T, C), or (N, C) of `select`: what the head reads."""
        B, T = input_ids.shape[:2]  # a later pipeline stage: the hidden states (B, T, C)
        start = cache.length if cache is not None else 0
        if given is None and start + T > self.config.max_seq_len:
            limit = self.config.max_seq_len
            raise ValueError(
                f"sequence of {start + T} tokens is longer than max_seq_len={limit}; cut the input to {limit} "
                f"tokens (a transformers tokenizer: truncation=True, max_length={limit})"
            )
        doc_mask, positions = given if given is not None else (None, None)
        if doc_ids is not None:
            if cache is not None:
                raise ValueError(
                    "doc_ids (document masking) is for training and evaluation; it cannot be used with a KV cache"
                )
            if self.config.attention_backend == "flex":
                doc_mask, positions = document_block_mask(doc_ids), document_positions(doc_ids)
            else:
                doc_mask, positions = document_attention(doc_ids)  # (B, 1, T, T) bool, (B, T) int64
        if self.tok_emb is None:  # a later pipeline stage
            x = input_ids
        else:
            x = self.tok_emb(input_ids)  # (B, T, C)
            if self.pos_emb is not None:
                if positions is None:
                    x = x + self.pos_emb(torch.arange(start, start + T, device=input_ids.device))  # (T, C) broadcast
                else:
                    x = x + self.pos_emb(positions)  # (B, T, C)
            x = self.drop(x)
        rope = None
        if self.config.position_embedding == "rope":
            if positions is None:
                rope = (
                    self.rope_cos[start : start + T, None],
                    self.rope_sin[start : start + T, None],
                )  # (T, 1, D/2) each
            else:
                rope = (
                    self.rope_cos[positions].unsqueeze(2),
                    self.rope_sin[positions].unsqueeze(2),
                )  # (B, T, 1, D/2) each
        for block in self.blocks:
            x = block(x, rope, cache) if doc_mask is None else block(x, rope, cache, doc_mask)
        if cache is not None:
            cache.length = start + T
        if select is not None:
            x = x[select]  # (N, C): only the positions asked for
        return x if self.norm is None else self.norm(x)
