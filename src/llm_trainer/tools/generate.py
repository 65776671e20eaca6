"""Text generation: temperature, top-k and nucleus (top-p) sampling, with or without a KV cache."""

from __future__ import annotations

import torch

from ..model import KVCache, Transformer


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
) -> list[int]:
    """The new token ids (not the prompt). Without a cache the context is cropped to max_seq_len."""
    model.eval()
    device = next(model.parameters()).device
    ids = prompt_ids.flatten().tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token (e.g. the end-of-text id)")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    max_len = model.config.max_seq_len
    cache = None
    new: list[int] = []
    if use_cache:
        ids = ids[-max_len:]
        room = max_len - len(ids)
        if room < max_new_tokens:  # the cache holds max_seq_len positions; leave room for the new tokens
            ids = ids[-max(1, max_len - max_new_tokens):]
        cache = KVCache.empty(model.config, 1, max_len, device, next(model.parameters()).dtype)
        logits = model(torch.tensor([ids], device=device), cache=cache)[0, -1]  # (V,)
    for _ in range(max_new_tokens):
        if not use_cache:
            context = (ids + new)[-max_len:]
            logits = model(torch.tensor([context], device=device))[0, -1]
        token = _sample(logits, temperature, top_k, top_p, generator)
        new.append(token)
        if token == eos_token_id:
            break
        if use_cache:
            if cache.length >= max_len:
                break
            logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]
    return new
