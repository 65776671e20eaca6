"""One optimizer step: forward and backward over the micro-batches, clip, then update only if finite.

Shared by the Trainer and the LR finder, so both train exactly the same way on every backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch

from ..data.batches.loader import IGNORE_INDEX
from ..parallel.distributed import all_reduce_
from ..parallel.strategies import Parallelism
from .evaluate import batch_nll

Batch = tuple[torch.Tensor, ...]  # (inputs (B, T), targets (B, T)[, doc_ids (B, T)])


def autocast(device: torch.device, amp_dtype: torch.dtype | None) -> torch.autocast:
    """Mixed precision for the forward: `amp_dtype` (bf16/fp16), or off (float32) when None."""
    return torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None)


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss per target token over the whole step, all ranks (device scalar)
    grad_norm: torch.Tensor  # total norm before clipping (device scalar; nan if the backend does not report it)
    finite: torch.Tensor  # whether the update was applied (device bool)
    shared: torch.Tensor | None  # `share`, summed over ranks
    tokens: int  # input tokens of this rank's micro-batches
    samples: int  # their rows


def train_step(
    parallel: Parallelism,
    micro_batches: Sequence[Batch],
    *,
    autocast: ContextManager,
    max_grad_norm: float | None,
    share: torch.Tensor | None = None,
    reject: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    inspect: Callable[[float], None] | None = None,
) -> StepResult:
    """Forward/backward each micro-batch, clip, step where finite. No host sync.

    Each micro-batch's summed loss is divided by the target tokens of the whole step on all ranks, so
    k micro-batches of b rows equal one batch of k*b, and DDP's average over ranks is exact (counted
    as computed: context-parallel ranks each count their share of the rows, and their gradients add up). `share`
    (small float values, e.g. "this rank got a signal") rides along in the one collective of the loss.
    `reject(loss, grad_norm)`: a device bool that withholds a finite step too (a loss spike).
    `inspect(scale)`: called with the step's gradients complete, before clipping and the update (layer
    stats); `scale` is the loss scale they still carry.
    """
    world = parallel.dist.world_size
    device = parallel.device
    loss_sum = torch.zeros((), device=device)
    last = len(micro_batches) - 1
    # (inputs, targets, keywords: doc_ids with data.document_mask, positions under context parallelism)
    with parallel.rows_as_computed(micro_batches) as parts:
        n_targets = sum((targets != IGNORE_INDEX).sum() for _, targets, _ in parts).float()  # device tensor: no sync
        n_targets = all_reduce_(n_targets).clamp(min=1)
        for i, (inputs, targets, keywords) in enumerate(parts):
            with torch.profiler.record_function("forward_backward"):
                if parallel.pipelined:  # the schedule's forward and backward over the stages
                    nll = parallel.forward_backward(inputs, targets, world / n_targets, autocast)
                else:
                    with parallel.no_sync(last=i == last), autocast:
                        nll = batch_nll(parallel.wrapped, inputs, targets, **keywords)
                    parallel.backward(nll * world / n_targets)
            loss_sum += nll.detach().float()
    shared = None
    if world > 1:  # the global loss decides the step on every rank alike
        values = (
            loss_sum.reshape(1)
            if share is None
            else torch.cat([loss_sum.reshape(1), share.to(device).float().reshape(-1)])
        )
        values = all_reduce_(values)
        loss_sum, shared = values[0], (values[1:] if share is not None else None)
    elif share is not None:
        shared = share.float().reshape(-1)

    # Clip, then step only if loss and gradients are finite (a bad step never reaches the weights).
    if inspect is not None:
        parallel.at_gradients(inspect)
    with torch.profiler.record_function("optimizer"):
        grad_norm = parallel.clip(max_grad_norm)  # None where the backend clips inside its step
        finite = torch.isfinite(loss_sum)
        if grad_norm is not None and not parallel.scaler.is_enabled():  # fp16 scaling: overflows are routine
            finite = finite & torch.isfinite(grad_norm)
        apply = finite if reject is None else finite & ~reject(loss_sum / n_targets, grad_norm)
        reported = parallel.step(apply)
    if grad_norm is None:
        grad_norm = reported
    return StepResult(
        loss=loss_sum / n_targets,
        grad_norm=grad_norm,
        finite=finite,
        shared=shared,
        tokens=sum(batch[0].numel() for batch in micro_batches),
        samples=sum(len(batch[0]) for batch in micro_batches),
    )


class NonFiniteSteps:
    """Counts steps skipped for a non-finite loss or gradient, on the device (read only at logging)."""

    def __init__(self, device: torch.device, already_skipped: int = 0, running: int = 0):
        self.before = already_skipped
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        self.run = torch.full((), running, dtype=torch.int64, device=device)  # bad steps in a row now
        self.longest = torch.zeros((), dtype=torch.int64, device=device)  # the longest such run since the start

    def add(self, finite: torch.Tensor) -> None:
        bad = (~finite).to(torch.int64)
        self.total += bad
        self.run = (self.run + 1) * bad
        self.longest = torch.maximum(self.longest, self.run)

    def read(self) -> tuple[int, int, int]:
        """(skipped steps in the whole run, bad steps in a row now, the longest run): one host sync."""
        return self.before + int(self.total), int(self.run), int(self.longest)
