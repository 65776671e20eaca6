"""Our model as an lm-evaluation-harness model (`lm_eval.api.model.LM`), run directly: no export.

Requests are tokenized as lm-eval's own `hf` backend tokenizes them (`TemplateLM`: the context's
trailing spaces move to the continuation, an empty context becomes end-of-text), and what exceeds the
context is cut from the left as that backend cuts it (a generation's settings read by lm-eval's own
`normalize_gen_kwargs`, so `max_new_tokens` is `max_gen_toks` there and here), so the log-likelihoods
and greedy generations are the same.
What differs is how they are computed:

- a context shared by several continuations (every answer of a multiple-choice question) is computed
  once: one row holds the context followed by every continuation, each continuation at the positions
  right after the context and attending to the context's keys and values and its own tokens only
  (`Transformer.extend`, given positions and mask). Continuations of one token need no tokens of their
  own: the context's last logits score them.
- rows are batched by length, longest first, each batch padded on the right to its own longest
  (padding is masked out);
- generation is greedy (or sampled, as the request asks) through `llm_trainer.generate`, with its KV cache,
  stopping at the request's stop strings or its `max_gen_toks`.

Under several processes lm-eval is shown one process: every rank receives every request, exactly as one
process builds them (few-shot examples included), computes its share of the batches and ends with every
result (`lockstep.Lockstep`: the split, forwards in step for sharded models, the gather).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict
from collections.abc import Callable

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..errors import UsageError
from ..generate import generate, tokenizer_columns
from ..model import KVCache, Transformer
from .lockstep import Lockstep

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
    """`model` (ours, unwrapped; under FSDP2 or ZeRO-3 each rank holds its shards) and the tokenizer it was
    trained with. lm-eval sees rank 0 of 1 on every rank (see the module docstring)."""

    def __init__(self, model: Transformer, tokenizer, *, batch_size: int = 16, autocast=None):
        super().__init__()
        if batch_size < 1:
            raise UsageError(f"--batch_size must be at least 1, got {batch_size}")
        self.model = Lockstep(model)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.autocast = autocast or contextlib.nullcontext
        self.max_length = model.config.max_seq_len
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self.requests: Counter[str] = Counter()  # requests seen, per request type (rolling: windows)
        self.truncated: Counter[str] = Counter()  # requests cut from the left, per request type
        self.empty: Counter[str] = Counter()  # requests whose continuation has no tokens of its own
        self.no_room = 0  # generation requests whose max_gen_toks leaves no room for the prompt
        self.unseen: set[str] = set()  # pieces of the tasks' text the tokenizer reads as its unknown token

    def cut_summary(self) -> str | None:
        """One line on the requests longer than the context and cut from the left, or None if none was."""
        cut = [f"{count} of {self.requests[kind]} {kind}" for kind, count in sorted((+self.truncated).items())]
        if not cut:
            return None
        return (
            f"{', '.join(cut)} requests do not fit in the model's context ({self.max_length} tokens; a "
            "generation's prompt with room for its max_gen_toks new tokens) and were cut from the left (their "
            "oldest tokens dropped), as lm-eval's hf backend cuts them"
        )

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if hasattr(self.tokenizer, "unseen_characters"):  # ours: what it cannot read is said once, at the end
            self.unseen |= self.tokenizer.unseen_characters(string)
        return self.tokenizer.encode(string)

    # -- log-likelihoods ------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, kind: str = "loglikelihood"):
        """[(strings, context ids, continuation ids)] -> [(sum of the continuation's log-probabilities,
        whether each of its tokens is the likeliest)], in order."""
        L = self.max_length
        self.requests[kind] += len(requests)
        results_empty: list[int] = []
        by_prefix: dict[tuple[int, ...], list[tuple[int, list[int]]]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if len(continuation) > L:
                raise UsageError(
                    f"a continuation of {len(continuation)} tokens is longer than the model's context ({L})"
                )
            if not continuation:  # the context's tokens already hold it: the probability of nothing more is 1
                results_empty.append(i)
                continue
            whole = (context + continuation)[-(L + 1) :]  # what lm-eval's hf backend feeds, plus the last target
            if len(context) + len(continuation) > L + 1:
                self.truncated[kind] += 1
            by_prefix[tuple(whole[: len(whole) - len(continuation)])].append((i, continuation))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for i in results_empty:
            results[i] = (0.0, True)
        self.empty[kind] += len(results_empty)

        def row_length(prefix) -> int:  # the prefix, then every continuation but its last token
            return len(prefix) + sum(len(continuation) - 1 for _, continuation in by_prefix[prefix])

        prefixes = sorted(by_prefix, key=row_length, reverse=True)  # longest first: each batch pads to its first
        batches = [prefixes[start : start + self.batch_size] for start in range(0, len(prefixes), self.batch_size)]
        with torch.no_grad(), self.autocast(), self.model.together():
            for batch in self.model.mine(batches):
                self._score_batch(batch, by_prefix, results)
        return self.model.gather(results)

    def _score_batch(self, prefixes, by_prefix, results) -> None:
        """One forward for the batch: each row is a prefix followed by the tokens of all its
        continuations (each but its last), every continuation at the positions right after the prefix
        and seeing only the prefix and itself. The prefix's keys and values are computed once and
        serve each continuation; the prefix's last logits score every continuation's first token."""
        rows, groups, positions, picks = [], [], [], []  # picks: (row, position in row, target, request)
        for row, prefix in enumerate(prefixes):
            tokens, group, where = list(prefix), [0] * len(prefix), list(range(len(prefix)))
            for j, (index, continuation) in enumerate(by_prefix[prefix], start=1):
                fed = continuation[:-1]
                steps = [len(prefix) - 1, *range(len(tokens), len(tokens) + len(fed))]
                picks += [(row, step, target, index) for step, target in zip(steps, continuation)]
                tokens += fed
                group += [j] * len(fed)
                where += range(len(prefix), len(prefix) + len(fed))
            rows.append(tokens)
            groups.append(group)
            positions.append(where)
        B, T = len(rows), len(rows[0])  # the batch's longest row comes first
        ids = torch.full((B, T), self.eot_token_id, dtype=torch.long)
        group = torch.full((B, T), -1, dtype=torch.long)  # -1: padding
        where = torch.zeros((B, T), dtype=torch.long)
        for row, (tokens, g, w) in enumerate(zip(rows, groups, positions)):
            ids[row, : len(tokens)], group[row, : len(g)], where[row, : len(w)] = (
                torch.tensor(tokens),
                torch.tensor(g),
                torch.tensor(w),
            )
        causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)
        sees = (group[:, None, :] == group[:, :, None]) | (group[:, None, :] == 0)  # (B, T query, T key)
        mask = (sees & causal)[:, None].to(self._device)  # (B, 1, T, T)
        row_i, step_i, target, owner = (torch.tensor(column, device=self._device) for column in zip(*picks))
        logits = self.model.extend(ids.to(self._device), None, where.to(self._device), mask, select=(row_i, step_i))
        logprobs = logits.float().log_softmax(-1)  # (N, V): only the positions scored
        token_logprob = logprobs.gather(1, target[:, None]).squeeze(1)  # (N,)
        missed = (logprobs.argmax(-1) != target).float()  # (N,)
        requests = sorted(set(owner.tolist()))
        slot = {index: k for k, index in enumerate(requests)}
        local = torch.tensor([slot[i] for i in owner.tolist()], device=self._device)
        totals = torch.zeros(len(requests), device=self._device, dtype=torch.float64)
        totals = totals.index_add(0, local, token_logprob.double())
        misses = torch.zeros(len(requests), device=self._device).index_add(0, local, missed)
        for index, total, miss in zip(requests, totals.tolist(), misses.tolist()):
            results[index] = (total, miss == 0)

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
        units: list[tuple[list[int], Callable[[], list[str]]]] = []  # (requests, computing their texts)
        greedy: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        self.requests["generate_until"] += len(requests)
        for i, request in enumerate(requests):
            context, kwargs = request.args
            # lm-eval's own reading of the settings: `max_new_tokens`, `max_tokens`, `max_completion_tokens`
            # mean `max_gen_toks`; a temperature above 0 without `do_sample` samples
            kwargs = dict(normalize_gen_kwargs(dict(kwargs or {}), DEFAULT_MAX_GEN_TOKS))
            stops = tuple(s for s in kwargs.pop("until") if s)
            max_new = int(kwargs.pop("max_gen_toks"))
            ids = self.tok_encode(context) or [self.eot_token_id]
            room = max(1, self.max_length - max_new)  # the hf backend's context: max_length - max_gen_toks
            if max_new >= self.max_length:  # the hf backend refuses these; the prompt keeps its last token
                self.no_room += 1
            if len(ids) > room:
                self.truncated["generate_until"] += 1
                ids = ids[-room:]
            max_new = min(max_new, self.max_length - len(ids))
            if kwargs.pop("do_sample") and float(kwargs.get("temperature") or 0) > 0:
                units.append(([i], functools.partial(self._sampled, ids, stops, max_new, kwargs)))
            else:
                greedy[(stops, max_new)].append((i, ids))
        for (stops, max_new), items in greedy.items():
            items.sort(key=lambda item: len(item[1]), reverse=True)
            for start in range(0, len(items), self.batch_size):
                batch = items[start : start + self.batch_size]
                prompts = [ids for _, ids in batch]
                units.append(([i for i, _ in batch], functools.partial(self._greedy, prompts, stops, max_new)))
        out: list[str | None] = [None] * len(requests)
        with torch.no_grad(), self.autocast(), self.model.together():
            for indices, texts in self.model.mine(units):
                for i, text in zip(indices, texts()):
                    out[i] = text
        return self.model.gather(out)

    def _sampled(self, ids: list[int], stops: tuple[str, ...], max_new: int, kwargs: dict) -> list[str]:
        """One sampled continuation (a fixed seed: the same text whichever rank draws it)."""
        new = generate(
            self.model,
            ids,
            max_new_tokens=max_new,
            temperature=float(kwargs.get("temperature", 1.0)),
            top_k=kwargs.get("top_k"),
            top_p=kwargs.get("top_p"),
            seed=1234,
            eos_token_id=self.eot_token_id,
            stop=lambda new: any(s in self.tokenizer.decode(new) for s in stops),
            vocab_size=self.tokenizer.vocab_size,
        )
        return [_cut(self.tokenizer.decode(new), stops)]

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
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self._device).tril()[None, None]  # (1,1,T,T)
        where = torch.arange(longest, device=self._device).expand(B, longest)  # (B, T)
        rows = torch.arange(B, device=self._device)
        logits = self.model.extend(ids.to(self._device), cache, where, causal, select=(rows, lengths - 1))  # (B, V)
        cache_start = cache.length
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(max_new):
            tokens = tokenizer_columns(logits, self.tokenizer.vocab_size).argmax(-1)  # (B,)
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
            logits = self.model.extend(tokens[:, None], cache, positions, mask, select=(rows, rows * 0))  # (B, V)
        return [_cut(self.tokenizer.decode(tokens), stops) for tokens in new]
