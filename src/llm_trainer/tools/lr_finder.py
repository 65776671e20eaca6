"""Learning-rate range test (Smith 2017, fastai's `lr_find`): train a *copy* of the model for a few
steps while the learning rate grows exponentially from `start_lr` to `end_lr`, record the loss, stop
once it diverges (an exponential moving average of the loss above `diverge_factor` x its best, or the
loss not finite), and suggest the rate where the loss falls fastest (steepest negative slope against
log lr, before the minimum). The suggestion and the minimum are read from the losses averaged over a
window centred on each step (`centred`): the moving average, which decides online, lags the loss by
about 1 / (1 - beta) steps, decades of learning rate, and its minimum would sit where the loss climbs
again. A curve that never fell by `MIN_FALL` gets no suggestion: its slopes are noise.

Nothing of the real run is touched: the model is deep-copied (the original's weights, gradients and
device stay as they are), the optimizer is a fresh one, the loader's position and the torch / numpy /
Python random states are restored afterwards, and no checkpoint or metrics file is written.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..checkpoint.model_folder import unwrap
from ..config import TrainingConfig
from ..errors import UsageError
from ..logs import Progress
from ..parallel.distributed import DistInfo
from ..parallel.strategies import Parallelism
from ..pipeline import prepare_run
from ..resolve import amp_dtype, resolve_amp
from ..train.batch_size import auto_batch_size
from ..train.batches import as_loader
from ..train.optim import build_optimizer, set_learning_rate
from ..train.plots import check_png_path
from ..train.step import autocast, train_step

MIN_FALL = 0.02  # the share of its starting value the averaged loss must fall by for a suggestion


@dataclass
class LRFinderResult:
    lrs: list[float]
    losses: list[float]  # raw training loss at each lr
    smoothed: list[float]  # bias-corrected exponential moving average of the loss (the online divergence test)
    curve: list[float]  # the loss averaged over a window centred on each step (`centred`): what is read
    suggested_lr: float | None  # steepest descent of `curve`; None: `no_suggestion` says why
    diverged: bool  # stopped because the loss blew up (before reaching end_lr)
    best_lr: float  # lr at the lowest point of `curve` (an upper bound: prefer the suggestion)
    no_suggestion: str | None = None

    def plot(self, path) -> Path:
        from ..train.plots import plot_lr_finder

        return plot_lr_finder(self.lrs, self.losses, self.curve, self.suggested_lr, path)

    def to_dict(self) -> dict:
        return {
            "suggested_lr": self.suggested_lr,
            "no_suggestion": self.no_suggestion,
            "best_lr": self.best_lr,
            "diverged": self.diverged,
            "steps": len(self.lrs),
            "lrs": self.lrs,
            "losses": self.losses,
            "smoothed": self.smoothed,
            "curve": self.curve,
        }


def centred(losses: list[float], half: int) -> list[float]:
    """Each loss averaged with the `half` before and after it (fewer at the ends); a window that holds a
    loss that is not finite is infinite."""
    values = np.asarray(losses, dtype=np.float64)
    values = np.where(np.isfinite(values), values, np.inf)
    return [float(values[max(0, i - half) : i + half + 1].mean()) for i in range(len(values))]


def suggest_lr(lrs: list[float], smoothed: list[float], skip_start: int | None = None) -> float | None:
    """The lr of steepest descent of the smoothed loss (against log lr), searched before its minimum."""
    n = len(smoothed)
    if n < 5:
        return None
    values = np.asarray(smoothed, dtype=np.float64)
    values = np.where(np.isfinite(values), values, np.inf)
    end = int(np.argmin(values)) + 1  # up to and including the minimum
    start = max(1, n // 10) if skip_start is None else skip_start  # the first points are noise
    if end - start < 3:
        start = 0
    if end - start < 3:
        return None
    x = np.log10(np.asarray(lrs[start:end], dtype=np.float64))
    slope = np.gradient(values[start:end], x)
    return float(lrs[start + int(np.argmin(slope))])


def check_range(*, start_lr: float, end_lr: float, num_steps: int) -> None:
    """A range test needs finite rates 0 < start_lr < end_lr and at least two steps (a one-line error
    naming the setting, which is also the flag of `llm-trainer lr-find`)."""
    if not (math.isfinite(start_lr) and math.isfinite(end_lr) and 0 < start_lr < end_lr):
        raise UsageError(
            f"lr-find needs finite rates 0 < start_lr < end_lr, got start_lr={start_lr} and end_lr={end_lr}"
        )
    if num_steps < 2:
        raise UsageError(f"lr-find num_steps must be at least 2, got {num_steps}")


def find_lr(
    model: nn.Module,
    loader,
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    beta: float = 0.98,
    diverge_factor: float = 4.0,
    training: TrainingConfig | None = None,
    device: torch.device | str | None = None,
    accumulation_steps: int | None = None,
    progress: bool = False,
) -> LRFinderResult:
    """Run the range test on a copy of `model` with batches from `loader`; see the module docstring.

    `loader`: our `BatchLoader` (anything with `next_batch()`), or any iterable of batches the
    `Trainer` accepts ((inputs, targets), a dict with input_ids, or token rows); it is cycled.
    `training` supplies the optimizer (type, betas, weight-decay groups), clipping, amp and the
    accumulation steps of the real run (defaults: `TrainingConfig()`). `device` defaults to the
    model's own. `progress`: show the steps as they go (a bar on a terminal, lines in a log).
    """
    check_range(start_lr=start_lr, end_lr=end_lr, num_steps=num_steps)
    training = training or TrainingConfig()
    original = unwrap(model)
    if device is None:
        first = next(original.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    accum = accumulation_steps or training.gradient_accumulation_steps
    batches = as_loader(loader, device)
    saved_position = batches.state_dict() if hasattr(batches, "state_dict") else None
    py_state, np_state = random.getstate(), np.random.get_state()
    cuda_devices = [device] if device.type == "cuda" else []

    with torch.random.fork_rng(devices=cuda_devices):
        work = copy.deepcopy(original).to(device)
        work.train()
        optimizer = build_optimizer(work, training, device)
        dtype = amp_dtype(resolve_amp(training, device))
        parallel = Parallelism(work, work, optimizer, dist=DistInfo(), device=device, amp_dtype=dtype)
        mixed = autocast(device, dtype)
        ratio = (end_lr / start_lr) ** (1.0 / (num_steps - 1))
        lrs, losses, smoothed = [], [], []
        average, best, diverged = 0.0, math.inf, False
        bar = Progress(num_steps, "lr-find", "steps", enabled=progress)
        try:
            for i in range(num_steps):
                lr = start_lr * ratio**i
                set_learning_rate(optimizer, lr)
                micro = [tuple(t.to(device) for t in batches.next_batch()) for _ in range(accum)]
                out = train_step(parallel, micro, autocast=mixed, max_grad_norm=training.max_grad_norm)
                loss = float(out.loss)
                lrs.append(lr)
                losses.append(loss)
                bar.set_postfix(lr=f"{lr:.1e}", loss=f"{loss:.4f}")
                bar.update()
                if not math.isfinite(loss):
                    smoothed.append(math.inf)
                    diverged = True
                    break
                average = beta * average + (1 - beta) * loss
                value = average / (1 - beta ** (i + 1))
                smoothed.append(value)
                best = min(best, value)
                if i > 0 and value > diverge_factor * best:
                    diverged = True
                    break
        finally:
            bar.close()
            del work, optimizer, parallel
            if saved_position is not None:
                batches.load_state_dict(saved_position)
            random.setstate(py_state)
            np.random.set_state(np_state)

    curve = centred(losses, max(1, len(losses) // 25))
    finite = [(v, lr) for v, lr in zip(curve, lrs) if math.isfinite(v)]
    best_lr = min(finite)[1] if finite else lrs[0]
    suggested, why = suggest_lr(lrs, curve), None
    if finite and min(finite)[0] > (1 - MIN_FALL) * finite[0][0]:
        suggested = None
        why = (
            f"the loss did not fall between {lrs[0]:.1e} and {lrs[-1]:.1e} (by less than {MIN_FALL:.0%}): the rates "
            "are too small to train, or too large from the start; widen --start-lr/--end-lr"
        )
    elif suggested is None:
        why = "the loss curve is too short; raise --num-steps or widen --start-lr/--end-lr"
    return LRFinderResult(
        lrs=lrs,
        losses=losses,
        smoothed=smoothed,
        curve=curve,
        suggested_lr=suggested,
        diverged=diverged,
        best_lr=best_lr,
        no_suggestion=why,
    )


def run_lr_finder(experiment, *, start_lr: float, end_lr: float, num_steps: int, plot_path=None) -> LRFinderResult:
    """What `llm-trainer lr-find` does: data, tokenizer and a freshly initialised model exactly as
    `train` would build them, then `find_lr`; writes only the plot (and the shared data cache)."""
    check_range(start_lr=start_lr, end_lr=end_lr, num_steps=num_steps)  # before the data is prepared
    if plot_path is not None:
        check_png_path(plot_path, "the lr-find plot (--output)")
    ready = prepare_run(experiment, pick_batch_size=auto_batch_size, local=True, meta=False)
    run = ready.run
    model = ready.model
    train_loader, _ = ready.loaders()
    result = find_lr(
        model,
        train_loader,
        start_lr=start_lr,
        end_lr=end_lr,
        num_steps=num_steps,
        training=run.training,
        device=run.device,
        progress=run.training.progress_bar,
    )
    if plot_path is not None:
        result.plot(plot_path)
    return result
