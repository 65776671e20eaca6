"""The output head and the next-token cross-entropy, computed together in chunks of positions.

The head's logits are the largest tensor of a step (B x T x V; at GPT-2's 50,257-token vocabulary they
dwarf every activation), and a float32 copy of them for the softmax, plus its gradient, doubles that.
`linear_cross_entropy` never holds more than one chunk of them: for each chunk of positions it computes
the logits, their log-sum-exp and the targets' logits, and, when a gradient is wanted, the gradients
of the hidden states and of the head's weight right there (a loss is a scalar, so its gradient is
known before backward asks; backward only scales them). This is the fused linear cross-entropy of
Liger-Kernel and cut-cross-entropy written in plain torch ops, so it runs on every device and under
`torch.compile`, which fuses each chunk's softmax into few kernels.

One function serves training and evaluation (through the model's `targets=` forward), the LR finder
(it trains through the same step) and any scoring that needs log-probabilities of given tokens
(`token_logprobs`).

A head padded past the real vocabulary (`model.vocab_pad_multiple`: rows rounded up so the matmuls'
shapes are aligned) is multiplied whole, padding rows included, and `vocab` names the real columns:
the rest are left out of every softmax, so losses, log-probabilities and argmaxes are those of the
unpadded head and the padding rows get zero gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target with this id leaves the loss (padding); torch's and transformers' convention

# Float32 logits one chunk may hold (128 MiB): large enough that each chunk's matmul keeps the device
# busy, small enough that the chunk, its softmax and its gradient stay a small share of the step's memory.
CHUNK_LOGITS = 1 << 25
# Below this many logits in all (4 MiB in float32, e.g. a character vocabulary) they are smaller than
# the step's activations, and autograd through F.cross_entropy's fused kernels is faster than the
# chunked gradient's extra elementwise passes, so they are computed whole.
SMALL_LOGITS = 1 << 20
# Chunks a compiled graph holds at most: the compiler traces the chunk loop once per chunk, so the
# compile time grows with their count (and so with the batch); past this many the chunks grow instead,
# up to 8 times `CHUNK_LOGITS` logits each (1 GiB in float32), past which their count grows again.
COMPILED_MAX_CHUNKS = 16
COMPILED_CHUNK_LOGITS = 8 * CHUNK_LOGITS


def chunk_rows(rows: int, vocab: int, budget: int | None = None, *, compiled: bool = False) -> int:
    """Positions per chunk: as many as fit `budget` logits (`CHUNK_LOGITS`), spread evenly so the last
    chunk is not a sliver (equal chunks compile to one kernel shape); `compiled` (the loop is being
    traced by torch.compile): at most `COMPILED_MAX_CHUNKS` chunks of up to `COMPILED_CHUNK_LOGITS`."""
    budget = budget or CHUNK_LOGITS
    per_chunk = max(1, budget // max(vocab, 1))
    chunks = max(1, math.ceil(rows / per_chunk))
    if compiled:
        fewest = math.ceil(rows / max(1, COMPILED_CHUNK_LOGITS // max(vocab, 1)))
        chunks = min(chunks, max(COMPILED_MAX_CHUNKS, fewest))
    return max(1, math.ceil(rows / chunks))


def _capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logits after the optional soft cap c * tanh(z / c), and the tanh (its derivative's input)."""
    logits = logits.float()
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return softcap * tanh, tanh


def real_columns(logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """The logits of the real vocabulary's `vocab` ids (all of them when None): a view, the padding
    columns past it cut off after the aligned matmul that computed them."""
    return logits if vocab is None or vocab == logits.shape[-1] else logits[..., :vocab]


def _check_vocab(weight: torch.Tensor, vocab: int | None) -> None:
    if vocab is not None and not 0 < vocab <= weight.shape[0]:
        raise ValueError(f"vocab must be 1 to the head's {weight.shape[0]} rows, got {vocab}")


def _chunk_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None,
    reduction: str,
    vocab: int | None,
) -> torch.Tensor:
    """-log p(target) in float32 for one chunk of positions, summed or (n,) with 0 where ignored."""
    logits, _ = _capped(real_columns(F.linear(hidden, weight), vocab), softcap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T` whose gradients are computed chunk by chunk in the
    forward (so no chunk's logits outlive it) and only scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, rows, vocab):  # type: ignore[override]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start : start + rows], targets[start : start + rows]
            raw = F.linear(h, weight)  # (n, V), in autocast's dtype where autocast is on
            dtype = raw.dtype
            logits, tanh = _capped(raw, softcap)
            if vocab < logits.shape[1]:  # padding columns: out of the softmax, so zero in its gradient
                logits[:, vocab:] = -math.inf
            valid = (t != IGNORE_INDEX)[:, None]
            safe = t.clamp(min=0)[:, None]
            logprobs = torch.log_softmax(logits, -1)
            del raw, logits  # the chunk's one remaining V-wide buffer is the log-softmax, turned gradient
            total = total - (logprobs.gather(1, safe) * valid).sum()
            # d nll / d logits: the softmax, minus one at the target; in place, one chunk-sized buffer
            grad = logprobs.exp_()
            grad.scatter_add_(1, safe, -torch.ones_like(safe, dtype=grad.dtype)).mul_(valid)
            if tanh is not None:
                grad.mul_(tanh.square_().neg_().add_(1))  # d (c tanh(z / c)) / dz = 1 - tanh^2
            grad = grad.to(dtype)  # the matmuls in the forward's precision, as autograd would run them
            grad_hidden[start : start + rows] = (grad @ weight.to(dtype)).to(hidden.dtype)
            grad_weight += (grad.t() @ h.to(dtype)).float()
            del logprobs, grad, tanh  # before the next chunk's logits: one chunk's buffers at a time
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output.to(grad_hidden.dtype), grad_weight * grad_output, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float | None = None,
    reduction: str = "sum",
    rows: int | None = None,
    vocab: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of the head `hidden @ weight.T` (optionally soft-capped) against `targets`, in
    float32, without ever holding all the logits.

    hidden (..., C), weight (V, C), targets (...) with `IGNORE_INDEX` where nothing is scored.
    reduction "sum": the summed loss (a scalar; what training divides by the step's target count);
    "none": the loss per position (...), 0 where ignored. `rows`: positions per chunk (default: as
    many as `CHUNK_LOGITS` logits). `vocab`: the real vocabulary, the first `vocab` rows of a padded
    `weight` (default: all of them); the padding rows are multiplied but never part of the softmax.
    Equals `F.cross_entropy(F.linear(hidden, weight[:vocab]).float(), ...)`.
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    _check_vocab(weight, vocab)
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    rows = rows or chunk_rows(hidden.shape[0], weight.shape[0], compiled=torch.compiler.is_compiling())
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if reduction == "sum" and wants_grad and hidden.shape[0] * weight.shape[0] > SMALL_LOGITS:
        return _FusedLinearCrossEntropy.apply(hidden, weight, targets, softcap, rows, vocab or weight.shape[0])
    parts = [
        _chunk_nll(hidden[start : start + rows], weight, targets[start : start + rows], softcap, reduction, vocab)
        for start in range(0, hidden.shape[0], rows)
    ]
    return sum(parts[1:], parts[0]) if reduction == "sum" else torch.cat(parts).reshape(shape)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float | None = None,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), whether the target is the most likely token) per position, float32 and bool,
    chunk by chunk: what scoring continuations needs (a log-likelihood and a greedy match) without
    the positions' full log-softmax. hidden (N, C), weight (V, C), targets (N,), none ignored; `vocab`
    as in `linear_cross_entropy`."""
    _check_vocab(weight, vocab)
    rows = chunk_rows(hidden.shape[0], weight.shape[0], compiled=torch.compiler.is_compiling())
    logprobs, greedy = [], []
    for start in range(0, hidden.shape[0], rows):
        logits, _ = _capped(real_columns(F.linear(hidden[start : start + rows], weight), vocab), softcap)
        t = targets[start : start + rows, None]
        logprobs.append((logits.gather(1, t) - logits.logsumexp(-1, keepdim=True)).squeeze(1))
        greedy.append(logits.argmax(-1) == t.squeeze(1))
    return torch.cat(logprobs), torch.cat(greedy)
