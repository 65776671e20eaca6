"""Our model as an lm-evaluation-harness model (`lm_eval.api.model.LM`), run directly: no export.

Requests are tokenized as lm-eval's own `hf` backend tokenizes them (`TemplateLM`: the context's
trailing spaces move to the continuation, an empty context becomes end-of-text), and what exceeds the
context is cut from the left as that backend cuts it, so the log-likelihoods are the same numbers.
What differs is how they are computed:

- a context shared by several continuations (every answer of a multiple-choice question) runs once;
  its keys and values are copied into a KV cache from which each continuation goes on. Continuations of
  one token need no further pass: the context's last logits score them.
- contexts are batched by length, longest first, each batch padded on the right to its own longest
  (padding after a causal row changes nothing before it);
- generation is greedy (or sampled, as the request asks) through `tools.generate`, with its KV cache,
  stopping at the request's stop strings or its `max_gen_toks`.

Under several processes lm-eval gives each rank its share of the requests and gathers the scores on
rank 0 through `all_gather` / `gather_object` below (torch.distributed).
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..errors import UsageError
from ..model import KVCache, Transformer
from ..tools.generate import generate

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's default


def _mask(prefix: torch.Tensor, cached: int, T: int) -> torch.Tensor:
    """(n, 1, T, cached + T) bool: new token t of row i sees the first prefix[i] cached keys (its own
    context; the rest of the `cached` are other rows' padding) and new tokens 0..t."""
    keys = torch.arange(cached + T, device=prefix.device)  # (S,)
    new = torch.arange(T, device=prefix.device)  # (T,)
    own_prefix = keys[None, None, :] < prefix[:, None, None]  # (n, 1, S)
    own_new = (keys[None, :] >= cached) & (keys[None, :] - cached <= new[:, None])  # (T, S)
    return (own_prefix | own_new[None])[:, None]  # (n, 1, T, S)


def _cut(text: str, stops) -> str:
    """The text before its first stop string, as lm-eval's hf backend cuts it."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


class LLMTrainerLM(TemplateLM):
    """`model` (ours, unwrapped: every rank holds the whole model) and the tokenizer it was trained with."""

    def __init__(self, model: Transformer, tokenizer, *, batch_size: int = 16, autocast=None):
        super().__init__()
        if batch_size < 1:
            raise UsageError(f"--batch_size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.autocast = autocast or contextlib.nullcontext
        self.max_length = model.config.max_seq_len
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self._rank, self._world_size = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._rank, self._world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.truncated: Counter[str] = Counter()  # requests cut from the left, per request type

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    # -- log-likelihoods ------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, kind: str = "loglikelihood"):
        """[(strings, context ids, continuation ids)] -> [(sum of the continuation's log-probabilities,
        whether each of its tokens is the likeliest)], in order."""
        L = self.max_length
        by_prefix: dict[tuple[int, ...], list[tuple[int, list[int]]]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if len(continuation) > L:
                raise UsageError(
                    f"a continuation of {len(continuation)} tokens is longer than the model's context ({L})"
                )
            whole = (context + continuation)[-(L + 1) :]  # what lm-eval's hf backend feeds, plus the last target
            if len(context) + len(continuation) > L + 1:
                self.truncated[kind] += 1
            by_prefix[tuple(whole[: len(whole) - len(continuation)])].append((i, continuation))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        prefixes = sorted(by_prefix, key=len, reverse=True)  # longest first: each batch pads to its first
        with torch.no_grad(), self.autocast():
            for start in range(0, len(prefixes), self.batch_size):
                batch = prefixes[start : start + self.batch_size]
                self._score_batch(batch, by_prefix, results)
        return results

    def _score_batch(self, prefixes, by_prefix, results) -> None:
        """One forward over the batch's prefixes (into a KV cache), then one over every continuation
        longer than one token, each after its own prefix's keys and values."""
        B, longest = len(prefixes), len(prefixes[0])
        ids = torch.full((B, longest), self.eot_token_id, dtype=torch.long)
        for row, prefix in enumerate(prefixes):
            ids[row, : len(prefix)] = torch.tensor(prefix)
        cache = KVCache.empty(self.model.config, B, longest, self._device, self._dtype)
        logits = self.model(ids.to(self._device), cache=cache)  # (B, longest, V)
        lengths = torch.tensor([len(p) for p in prefixes], device=self._device)
        last = logits[torch.arange(B, device=self._device), lengths - 1].float().log_softmax(-1)  # (B, V)

        longer = []  # (row of its prefix, request index, continuation)
        for row, prefix in enumerate(prefixes):
            for index, continuation in by_prefix[prefix]:
                if len(continuation) == 1:
                    token = continuation[0]
                    results[index] = (float(last[row, token]), bool(last[row].argmax() == token))
                else:
                    longer.append((row, index, continuation))
        longer.sort(key=lambda item: len(item[2]))  # chunks of similar lengths: little padding
        for start in range(0, len(longer), 4 * self.batch_size):
            self._score_continuations(cache, last, lengths, longer[start : start + 4 * self.batch_size], results)

    def _score_continuations(self, cache: KVCache, last, lengths, rows, results) -> None:
        """Continuations (their tokens but the last) after their prefixes' cached keys and values, in
        one forward: each row sees its own prefix and its own earlier tokens, at its own positions; the
        prefix's last logits score each continuation's first token."""
        n, T = len(rows), max(len(c) for _, _, c in rows) - 1
        source = torch.tensor([row for row, _, _ in rows], device=self._device)
        fork = self._fork(cache, source, T)
        ids = torch.full((n, T), self.eot_token_id, dtype=torch.long)
        for j, (_, _, continuation) in enumerate(rows):
            ids[j, : len(continuation) - 1] = torch.tensor(continuation[:-1])
        prefix = lengths[source]  # (n,)
        # (n, T); a shorter continuation's padding may run past the context: clamped, it only feeds itself
        positions = (prefix[:, None] + torch.arange(T, device=self._device)).clamp(max=self.max_length - 1)
        logprobs = self.model.extend(ids.to(self._device), fork, positions, _mask(prefix, cache.length, T))
        logprobs = logprobs.float().log_softmax(-1)  # (n, T, V)
        for j, (row, index, continuation) in enumerate(rows):
            steps = torch.cat([last[row : row + 1], logprobs[j, : len(continuation) - 1]])  # (len(cont), V)
            target = torch.tensor(continuation, device=self._device)
            total = float(steps.gather(1, target[:, None]).sum())
            results[index] = (total, bool((steps.argmax(-1) == target).all()))

    def _fork(self, cache: KVCache, source: torch.Tensor, extra: int) -> KVCache:
        """A cache of rows `source` of `cache` (their prefixes, padding included), with room for `extra`
        more positions."""
        fork = KVCache.empty(self.model.config, len(source), cache.length + extra, self._device, self._dtype)
        for layer in range(len(fork.keys)):
            fork.keys[layer][:, :, : cache.length] = cache.keys[layer][source, :, : cache.length]  # (n, K, L, D)
            fork.values[layer][:, :, : cache.length] = cache.values[layer][source, :, : cache.length]
        fork.length = cache.length
        return fork

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, in windows of the model's context as lm-eval's hf backend cuts
        them (each window after the first sees one token of the one before)."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append(((None, None), context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, kind="loglikelihood_rolling")):
            totals[owner] += logprob
        return totals

    # -- generation -----------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation up to (not including) its first stop string, at most
        `max_gen_toks` tokens; the context is left-truncated to leave room for them, as in lm-eval.
        Greedy requests go in batches of the same settings, longest first; sampled ones one by one."""
        out: list[str | None] = [None] * len(requests)
        greedy: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        with torch.no_grad(), self.autocast():
            for i, request in enumerate(requests):
                context, kwargs = request.args
                kwargs = dict(kwargs or {})
                until = kwargs.pop("until", None) or []
                stops = tuple(s for s in ([until] if isinstance(until, str) else until) if s)
                max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
                ids = self.tok_encode(context) or [self.eot_token_id]
                room = max(1, self.max_length - max_new)
                if len(ids) > room:
                    self.truncated["generate_until"] += 1
                    ids = ids[-room:]
                max_new = min(max_new, self.max_length - len(ids))
                if kwargs.pop("do_sample", False) and float(kwargs.get("temperature", 1.0) or 0) > 0:
                    new = generate(
                        self.model,
                        ids,
                        max_new_tokens=max_new,
                        temperature=float(kwargs.get("temperature", 1.0)),
                        top_k=kwargs.get("top_k"),
                        top_p=kwargs.get("top_p"),
                        seed=1234,
                        eos_token_id=self.eot_token_id,
                        stop=lambda new, stops=stops: any(s in self.tokenizer.decode(new) for s in stops),
                    )
                    out[i] = _cut(self.tokenizer.decode(new), stops)
                else:
                    greedy[(stops, max_new)].append((i, ids))
            for (stops, max_new), items in greedy.items():
                items.sort(key=lambda item: len(item[1]), reverse=True)
                for start in range(0, len(items), self.batch_size):
                    batch = items[start : start + self.batch_size]
                    texts = self._greedy([ids for _, ids in batch], stops, max_new)
                    for (i, _), text in zip(batch, texts):
                        out[i] = text
        return out

    def _greedy(self, prompts: list[list[int]], stops: tuple[str, ...], max_new: int) -> list[str]:
        """Greedy continuations of prompts of different lengths, decoded together: each row's new tokens
        go after the longest prompt's end in the cache, at the row's own positions, seeing only its own
        prompt; a row is done at end-of-text or a stop string, the batch when every row is."""
        B, longest = len(prompts), len(prompts[0])
        ids = torch.full((B, longest), self.eot_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
        lengths = torch.tensor([len(p) for p in prompts], device=self._device)
        cache = KVCache.empty(self.model.config, B, longest + max_new, self._device, self._dtype)
        logits = self.model(ids.to(self._device), cache=cache)[torch.arange(B), lengths - 1]  # (B, V)
        cache_start = cache.length
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(max_new):
            tokens = logits.argmax(-1)  # (B,)
            for row in range(B):
                if done[row]:
                    continue
                token = int(tokens[row])
                if token == self.eot_token_id:
                    done[row] = True
                    continue
                new[row].append(token)
                if any(s in self.tokenizer.decode(new[row]) for s in stops):
                    done[row] = True
            if all(done) or step == max_new - 1:
                break
            positions = (lengths[:, None] + step).clamp(max=self.max_length - 1)  # (B, 1); done rows: clamped
            mask = _mask(lengths, cache_start, step + 1)[:, :, -1:]  # (B, 1, 1, cache_start + step + 1)
            logits = self.model.extend(tokens[:, None], cache, positions, mask)[:, -1]  # (B, V)
        return [_cut(self.tokenizer.decode(tokens), stops) for tokens in new]

    # -- several processes ----------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        gathered = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self._world_size > 1:
            torch.distributed.barrier()
