"""Loss spikes: a step whose training loss (or gradient norm) is far above its recent history.

The rule is robust to the history's own outliers: over the last `loss_spike_window` accepted steps,
a value is a spike when

    (value - median) / sigma > loss_spike_zscore,   sigma = max(1.4826 * MAD, 1% of |median|)

(1.4826 MAD is the standard deviation of normal data; the 1% floor keeps a flat history from calling
noise a spike). No step is called one before `loss_spike_warmup` values are in the window. Every finite
value enters the window, spikes too: a lone spike hardly moves the median and the MAD, while a lasting
change of level becomes the new normal within half a window instead of being refused for ever (with
`skip`, refusing every step of a new level would stall the run).

The window lives on the device and the decision is made there, inside the step (`train_step(reject=)`):
with `on_loss_spike` skip or rewind a spike's update is never applied, like a non-finite step's, with
no host sync. The host reads what happened (`read`) where the loop already reads the device.
`rewind` then goes back to the last checkpoint before the spike and has the loader pass over the
global sample range read since it (`BatchLoader.skip`, saved with the loader's position), so a
resumed run skips it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.find import resolve_checkpoint
from ..config import TrainingConfig
from ..data.batches.loader import merged_ranges
from ..errors import UsageError
from ..logs import log

_MAD_TO_SIGMA = 1.4826
_RELATIVE_FLOOR = 0.01


class _Window:
    """The last `size` accepted values of one metric, as a ring buffer on the device."""

    def __init__(self, size: int, device: torch.device, history: list[float]):
        history = [float(v) for v in history][-size:]
        self.values = torch.full((size,), math.nan, dtype=torch.float32, device=device)
        if history:
            self.values[: len(history)] = torch.tensor(history, dtype=torch.float32)
        self.count = torch.tensor(len(history), dtype=torch.int64, device=device)  # values ever accepted

    def limit(self, zscore: float, warmup: int) -> torch.Tensor:
        """The value above which the next step is a spike (+inf during the warm-up)."""
        median = self.values.nanmedian()
        sigma = torch.maximum(_MAD_TO_SIGMA * (self.values - median).abs().nanmedian(), _RELATIVE_FLOOR * median.abs())
        ready = self.count >= warmup
        return torch.where(ready, median + zscore * sigma, torch.full_like(median, math.inf))

    def add(self, value: torch.Tensor, accept: torch.Tensor) -> None:
        slot = (self.count % len(self.values)).reshape(1)
        kept = torch.where(accept, value.float(), self.values[slot])
        self.values.index_copy_(0, slot, kept.reshape(1))
        self.count += accept.to(torch.int64)

    def history(self) -> list[float]:
        """Oldest first (one host sync)."""
        count, size = int(self.count), len(self.values)
        if count < size:
            return self.values[:count].tolist()
        return torch.roll(self.values, -(count % size)).tolist()


@dataclass
class Spike:
    step: int
    metric: str
    value: float
    limit: float


class SpikeMonitor:
    """Watches each step's loss and/or gradient norm; `check` is `train_step`'s `reject`."""

    def __init__(self, config: TrainingConfig, device: torch.device, history: dict | None):
        self.policy = config.on_loss_spike
        self.zscore, self.warmup = config.loss_spike_zscore, config.loss_spike_warmup
        metrics = ("loss", "grad_norm") if config.loss_spike_metric == "either" else (config.loss_spike_metric,)
        history = history or {}
        self.windows = {m: _Window(config.loss_spike_window, device, history.get(m, [])) for m in metrics}
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, its rows of `check`) not read yet

    @property
    def blocks(self) -> bool:
        """Whether a spike's update is withheld (skip, rewind) rather than only reported (warn)."""
        return self.policy in ("skip", "rewind")

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """Whether this step (about to be applied) is a spike that must not be: a device bool, no sync."""
        nan = torch.full_like(loss, math.nan)
        values = {"loss": loss.detach().float(), "grad_norm": nan if grad_norm is None else grad_norm.detach().float()}
        limits = {metric: window.limit(self.zscore, self.warmup) for metric, window in self.windows.items()}
        over = {metric: torch.isfinite(values[metric]) & (values[metric] > limits[metric]) for metric in self.windows}
        spike = torch.stack(list(over.values())).any()
        for metric, window in self.windows.items():
            window.add(values[metric], torch.isfinite(values[metric]))
        # per metric: (over its limit, value, limit), read by the host later
        self._pending.append((step, torch.stack([torch.stack([over[m].float(), values[m], limits[m]]) for m in over])))
        return spike if self.blocks else torch.zeros_like(spike)

    def read(self) -> list[Spike]:
        """The spikes since the last read, each logged (one host sync)."""
        if not self._pending:
            return []
        steps = [step for step, _ in self._pending]
        table = torch.stack([rows for _, rows in self._pending]).tolist()
        self._pending = []
        found = []
        for step, rows in zip(steps, table):
            hits = [
                Spike(step, metric, value, limit) for metric, (over, value, limit) in zip(self.windows, rows) if over
            ]
            if hits:
                found.append(hits[0])
        what = {"warn": "applied", "skip": "not applied", "rewind": "not applied"}[self.policy]
        for spike in found:
            log(
                f"loss spike at step {spike.step}: {spike.metric} {spike.value:.4g} above {spike.limit:.4g} "
                f"(median + {self.zscore:g} robust sigmas of the last {len(self.windows[spike.metric].values)} steps); "
                f"the step was {what} (training.on_loss_spike={self.policy})"
            )
        return found

    def history(self) -> dict:
        """The windows, for the checkpoint (one host sync)."""
        return {metric: window.history() for metric, window in self.windows.items()}


def check_rewindable(config: TrainingConfig, loader) -> None:
    """rewind needs a loader that can pass over a sample range (ours)."""
    if config.on_loss_spike == "rewind" and not hasattr(loader, "skip"):
        raise UsageError(
            "training.on_loss_spike=rewind needs a loader that can skip a data range (llm_trainer's BatchLoader, "
            "which build_loaders makes); with your own DataLoader use on_loss_spike=skip"
        )


def rewind(checkpointer, state, loader, spike: Spike, max_rewinds: int) -> Path | None:
    """Go back to the latest checkpoint (saved before `spike`: the loop reads spikes before every save)
    and pass over the samples read since it. Returns the checkpoint, or None when the run goes on from
    here instead (no checkpoint yet, or max_rewinds used up: the spike's step was skipped)."""
    if state.rewinds >= max_rewinds:
        log(f"loss spike at step {spike.step}: training.max_rewinds={max_rewinds} used up; going on without rewinding")
        return None
    checkpointer.wait_everywhere()  # every rank reads the checkpoint rank 0 may still be writing
    path = resolve_checkpoint("latest", checkpointer.root)
    if path is None:
        log(f"loss spike at step {spike.step}: no checkpoint to rewind to yet; going on without rewinding")
        return None
    end, skip = loader.samples, list(loader.skip)
    rewinds, spikes = state.rewinds + 1, state.loss_spikes
    checkpointer.load(str(path))
    start = loader.samples
    loader.skip = merged_ranges([*skip, (start, end)])
    state.rewinds, state.loss_spikes = rewinds, spikes
    log(
        f"loss spike at step {spike.step}: rewound to {path.name} (step {state.step}); the samples "
        f"[{start}, {end}) (global sample index) are skipped (rewind {rewinds} of at most {max_rewinds})"
    )
    return path
