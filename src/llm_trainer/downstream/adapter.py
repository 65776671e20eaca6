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
        """One forward over the batch's prefixes (into a KV cache), then one per prefix length for the
        continuations longer than one token, each from a copy of its prefix's cache."""
        B, longest = len(prefixes), len(prefixes[0])
        ids = torch.full((B, longest), self.eot_token_id, dtype=torch.long)
        for row, prefix in enumerate(prefixes):
            ids[row, : len(prefix)] = torch.tensor(prefix)
        cache = KVCache.empty(self.model.config, B, longest, self._device, self._dtype)
        logits = self.model(ids.to(self._device), cache=cache)  # (B, longest, V)
        lengths = torch.tensor([len(p) for p in prefixes], device=self._device)
        last = logits[torch.arange(B, device=self._device), lengths - 1].float().log_softmax(-1)  # (B, V)

        longer: dict[int, list[tuple[int, int, list[int]]]] = defaultdict(list)  # prefix length -> rows
        for row, prefix in enumerate(prefixes):
            for index, continuation in by_prefix[prefix]:
                if len(continuation) == 1:
                    token = continuation[0]
                    results[index] = (float(last[row, token]), bool(last[row].argmax() == token))
                else:
                    longer[len(prefix)].append((row, index, continuation))
        for length, rows in longer.items():
            self._score_continuations(cache, last, length, rows, results)

    def _score_continuations(self, cache: KVCache, last, length: int, rows, results) -> None:
        """Continuations after prefixes of `length` tokens: their tokens but the last, after the prefix's
        keys and values; the prefix's last logits score each continuation's first token."""
        n, longest = len(rows), max(len(c) for _, _, c in rows) - 1
        source = torch.tensor([row for row, _, _ in rows], device=self._device)
        fork = KVCache.empty(self.model.config, n, length + longest, self._device, self._dtype)
        for layer in range(len(fork.keys)):
            fork.keys[layer][:, :, :length] = cache.keys[layer][source, :, :length]  # (n, K, length, D)
            fork.values[layer][:, :, :length] = cache.values[layer][source, :, :length]
        fork.length = length
        ids = torch.full((n, longest), self.eot_token_id, dtype=torch.long)
        for j, (_, _, continuation) in enumerate(rows):
            ids[j, : len(continuation) - 1] = torch.tensor(continuation[:-1])
        logprobs = self.model(ids.to(self._device), cache=fork).float().log_softmax(-1)  # (n, longest, V)
        for j, (row, index, continuation) in enumerate(rows):
            steps = torch.cat([last[row : row + 1], logprobs[j, : len(continuation) - 1]])  # (len(cont), V)
            target = torch.tensor(continuation, device=self._device)
            total = float(steps.gather(1, target[:, None]).sum())
            results[index] = (total, bool((steps.argmax(-1) == target).all()))

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
        `max_gen_toks` tokens; the context is left-truncated to leave room for them, as in lm-eval."""
        out = []
        with self.autocast():
            for request in requests:
                context, kwargs = request.args
                kwargs = dict(kwargs or {})
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
                sample = bool(kwargs.pop("do_sample", False))
                temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if sample else 0.0
                ids = self.tok_encode(context) or [self.eot_token_id]
                room = max(1, self.max_length - max_new)
                if len(ids) > room:
                    self.truncated["generate_until"] += 1
                    ids = ids[-room:]
                stops = [s for s in until if s]

                def reached(new: list[int], stops=stops) -> bool:
                    text = self.tokenizer.decode(new)
                    return any(s in text for s in stops)

                new = generate(
                    self.model,
                    ids,
                    max_new_tokens=min(max_new, self.max_length - len(ids)),
                    temperature=temperature,
                    top_k=kwargs.get("top_k"),
                    top_p=kwargs.get("top_p"),
                    seed=1234 if sample else None,
                    eos_token_id=self.eot_token_id,
                    stop=reached if stops else None,
                )
                text = self.tokenizer.decode(new)
                for stop in stops:
                    text = text.split(stop)[0]
                out.append(text)
        return out

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
