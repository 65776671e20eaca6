"""Evaluation: token-weighted mean negative log-likelihood and perplexity over a loader."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from ..data.batches.loader import IGNORE_INDEX
from ..errors import UsageError
from ..logs import Progress, warn
from ..model import Transformer


def read_output(output) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) of what a model of the user's returned: logits (B, T, V) as a tensor, or an object
    or mapping with `logits` (a transformers `ModelOutput` is both), or with only a mean `loss`. The
    Trainer computes the loss from logits itself (it passes no labels), so a `loss` beside them is not
    used, and said once. Anything else is refused in one line naming what is taken."""
    if isinstance(output, torch.Tensor):
        return output, None
    field = output.get if isinstance(output, Mapping) else (lambda name: getattr(output, name, None))
    logits, loss = field("logits"), field("loss")
    if logits is None and loss is None:
        raise UsageError(
            f"the model returned {type(output).__name__}: the Trainer takes its logits (batch, positions, "
            "vocabulary) as a tensor, or an object or dict with `logits` (or with only a mean `loss`)"
        )
    if logits is not None and loss is not None:
        _say_loss_unused()
    return logits, loss


@functools.cache
def _say_loss_unused() -> None:
    warn(
        "the model returns both logits and a loss: the Trainer trains on the cross-entropy of the logits "
        "against its next-token targets (it passes the model no labels), so the model's own loss is not "
        "used; to train on a loss of your own, return it alone (an object or dict with only `loss`)"
    )


def computes_loss(model: torch.nn.Module) -> bool:
    """Whether `model`, under any wrapper (DDP, DeepSpeed, `torch.compile`), is our Transformer, whose
    `targets=` forward computes head and loss together in chunks (`loss.linear_cross_entropy`)."""
    seen = 0
    while not isinstance(model, Transformer) and seen < 8:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return False
        model, seen = inner, seen + 1
    return isinstance(model, Transformer)


def batch_nll(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    reduction: str = "sum",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed negative log-likelihood of one batch (reduction="none": per position, 0 where ignored);
    `doc_ids` (B, T) restricts attention to each document; `positions` (B, T): each token's position in
    its row, where the batch holds a share of each row's tokens (context parallelism; our model only).

    Our Transformer computes it inside its forward (so a compiled model compiles the loss too, and the
    logits never exist whole); other models may return logits, objects with `.logits`, or objects with
    only a mean `.loss` (summed reduction only).
    """
    documents = {} if doc_ids is None else {"doc_ids": doc_ids}
    if computes_loss(model):
        parts = {} if positions is None else {"positions": positions}
        return model(inputs, targets=targets, reduction=reduction, **documents, **parts)
    assert positions is None, "only our Transformer takes a share of each row's positions"
    logits, loss = read_output(model(inputs, **documents))
    if logits is None:
        if reduction == "none":
            raise UsageError(
                "the model returns only a mean loss, and a loss per target token (each source's loss of a "
                "mixture) needs its logits: return them too"
            )
        return loss * (targets != IGNORE_INDEX).sum()
    if reduction == "none":
        return _per_token_nll(logits, targets)
    return summed_nll(logits, targets)


def _per_token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) (B, T) in float32 from logits (B, T, V), 0 where the target is ignored."""
    per_token = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return per_token.reshape(targets.shape)


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of -log p(target) over non-ignored targets; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable,
    *,
    autocast=None,
    max_batches: int | None = None,
    reduce=None,
    progress: bool = False,
    sources=None,
    nll=None,
    screen: int | None = None,
) -> dict:
    """{"val_loss", "perplexity", "tokens", "batches", "batches_total"} with every target token weighted
    equally; `batches` of `batches_total` (None when the loader has no length) say what was covered.

    `screen`: also "screen_val_loss", the loss over the first `screen` batches alone (the batches an
    evaluation capped at `screen` covers), when this one covered more: what compares with those.

    `reduce` (an in-place all-reduce) sums the totals over ranks when each rank evaluated its part.
    `progress`: show how far it has come (a bar on a terminal, lines in a log; see `logs.Progress`).
    `sources` (`data.batches.source_labels.SourceLabels` of this loader): also "source_losses", {source: val_loss}
    over the target tokens of each source's documents, from the same forward passes.
    `nll(inputs, targets)`: a batch's summed loss where the model is not called whole (a pipeline's
    stages: `Pipeline.eval_nll`); `sources` are then not split out.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (summed nll, target count)
    screened = None  # the totals after the first `screen` batches
    total_batches = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    shown = total_batches if max_batches is None or total_batches is None else min(total_batches, max_batches)
    done = 0
    labels = iter(sources.for_loader(batches)) if sources is not None and nll is None else None
    by_source = torch.zeros(len(sources.names) if sources is not None else 0, 2, dtype=torch.float64, device=device)
    with Progress(shown, "eval", "batches", enabled=progress, leave=False) as bar:
        for i, (inputs, targets, *doc_ids) in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
                if nll is not None:
                    loss = nll(inputs, targets)
                elif labels is None:
                    loss = batch_nll(model, inputs, targets, *doc_ids)
                else:
                    loss = _nll_by_source(model, inputs, targets, doc_ids, next(labels), by_source)
            totals[0] += loss.double()
            totals[1] += (targets != IGNORE_INDEX).sum()
            done += 1
            if done == screen:
                screened = totals.clone()
            bar.update()
    model.train(was_training)
    if reduce is not None:
        reduce(totals)
        if sources is not None:
            reduce(by_source)
    total, count = totals.tolist()
    if count == 0:
        raise ValueError("the evaluation data has no target tokens")
    loss = total / count
    out = {
        "val_loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "tokens": int(count),
        "batches": done,
        "batches_total": total_batches,
        **(_source_losses(by_source, sources.names) if sources is not None else {}),
    }
    if screen is not None and done > screen:
        assert screened is not None
        if reduce is not None:  # every rank evaluates the same number of batches: all took this branch
            reduce(screened)
        part, part_count = screened.tolist()
        out["screen_val_loss"] = part / max(part_count, 1.0)
    return out


def _nll_by_source(model, inputs, targets, doc_ids, labels, by_source: torch.Tensor) -> torch.Tensor:
    """`batch_nll`, adding each target token's loss and count to its source's row of `by_source` (one
    cross-entropy: the summed loss is the sum of the per-token ones)."""
    per_token = batch_nll(model, inputs, targets, *doc_ids, reduction="none").flatten()
    source = torch.from_numpy(labels).to(targets.device).flatten()
    keep = (targets.flatten() != IGNORE_INDEX) & (source >= 0)
    by_source[:, 0].index_add_(0, source[keep], per_token[keep].double())
    by_source[:, 1].index_add_(0, source[keep], torch.ones_like(per_token[keep], dtype=torch.float64))
    return per_token.sum()


def _source_losses(by_source: torch.Tensor, names: list[str]) -> dict:
    """{"source_losses": {name: mean loss}} for the sources that had target tokens."""
    sums = by_source.tolist()
    return {"source_losses": {name: total / count for name, (total, count) in zip(names, sums) if count > 0}}
