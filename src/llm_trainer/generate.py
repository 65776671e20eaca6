"""Text generation: temperature, top-k and nucleus (top-p) sampling, with or without a KV cache.

Past the model's context the window slides: each new token is sampled from the last `max_seq_len`
tokens (positions restart at the window's start, as in training), with or without the cache. A
prompt longer than the context is read from its last `max_seq_len` tokens; both are said on stderr.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .errors import UsageError
from .logs import warn
from .model import KVCache, Transformer


def check_sampling(*, max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse settings that would sample nonsense or fail deep inside (a NaN temperature, top_p 2)."""
    if max_new_tokens < 0:
        raise UsageError(f"--max_new_tokens must be >= 0, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top_k must be at least 1, got {top_k}")
    if top_p is not None and not (0 < top_p <= 1):
        raise UsageError(f"--top_p must be in (0, 1], got {top_p}")


def tokenizer_columns(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """logits (..., V) with the ids from `vocab_size` up at -inf: a model may have more rows than its
    tokenizer has tokens (`model.vocab_size` set larger), and an id no token has is never generated."""
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    masked = logits.clone()
    masked[..., vocab_size:] = float("-inf")
    return masked


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator) -> int:
    """One token id from logits (V,); temperature 0 is greedy."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    stop: Callable[[list[int]], bool] | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """The new token ids (not the prompt). The context is the last max_seq_len tokens; the KV cache
    serves until the window first slides, then every token is computed from its window. `stop`, given
    the new ids after each token, ends generation when it returns True (stop strings). `vocab_size`:
    the tokenizer's, where the model has more rows than it has tokens (`tokenizer_columns`)."""
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    model.eval()
    device = next(model.parameters()).device
    ids = prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token (e.g. the end-of-text id)")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    max_len = model.config.max_seq_len
    if len(ids) > max_len:
        warn(
            f"generate: the prompt has {len(ids)} tokens, more than the model's context ({max_len}); "
            f"it reads the last {max_len}"
        )
    if len(ids[-max_len:]) + max_new_tokens > max_len:
        warn(f"generate: past {max_len} tokens the context window slides (each new token sees the last {max_len})")
    cache = KVCache.empty(model.config, 1, max_len, device, next(model.parameters()).dtype) if use_cache else None
    new: list[int] = []
    logits = None
    for _ in range(max_new_tokens):
        context = (ids + new)[-max_len:]
        if cache is None or len(ids) + len(new) > max_len:  # no cache, or the window moved: every position changed
            logits = model(torch.tensor([context], device=device))[0, -1]
        elif logits is None:  # the prompt, into the cache
            logits = model(torch.tensor([context], device=device), cache=cache)[0, -1]
        else:
            logits = model(torch.tensor([[new[-1]]], device=device), cache=cache)[0, -1]
        token = _sample(tokenizer_columns(logits, vocab_size), temperature, top_k, top_p, generator)
        new.append(token)
        if token == eos_token_id or (stop is not None and stop(new)):
            break
    return new


def without_cut_character(tokenizer, ids: list[int]) -> str:
    """The text of `ids`, a continuation a token limit ended, without a character the limit cut in two:
    byte-level tokens hold parts of a character, and the bytes of its first part alone decode as one
    U+FFFD. Where the last one to three tokens decode as one U+FFFD after whole text, they are that
    part, and are left out."""
    text = tokenizer.decode(ids)
    if not text.endswith("\ufffd"):
        return text
    for k in range(1, min(3, len(ids)) + 1):
        head = tokenizer.decode(ids[:-k])
        if text == head + "\ufffd":
            return head
    return text
