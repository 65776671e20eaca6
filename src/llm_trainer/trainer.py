"""The training loop.

`Trainer.__init__` is setup (device, precision, wrapping, optimizer, loggers); `Trainer.train` is
the loop, top to bottom: set the learning rate, run the micro-batches, clip, step or skip, log,
evaluate, checkpoint. Everything a step needs to be resumed exactly lives in `TrainState`, the
loader's position, the optimizer and the RNGs, and all of it goes into every checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn as nn

from . import checkpoint as ckpt
from .background_save import BackgroundWriter, HostSnapshot
from .config import TrainingConfig
from .data.loader import IGNORE_INDEX
from .errors import UsageError
from .evaluate import batch_nll, evaluate
from .logs import is_main_process, log
from .metrics import build_loggers
from .model_files import load_model_state, model_tensors
from .optim import build_optimizer, learning_rate_at
from . import distributed
from .distributed import all_reduce_
from .parallelize import parallelize
from . import deepspeed_engine
from .sharded_checkpoint import full_model_state, load_sharded, save_sharded
from .speed import SpeedMonitor


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps); the message says what to do."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (including skipped ones)
    tokens_seen: int = 0  # input tokens consumed
    best_val_loss: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient was not finite
    consecutive_bad_steps: int = 0


class Callback:
    """Hooks into the loop; override any of them. `trainer` gives access to state, model, optimizer."""

    def on_train_begin(self, trainer: "Trainer") -> None: ...
    def on_step_end(self, trainer: "Trainer", row: dict) -> None: ...
    def on_evaluate(self, trainer: "Trainer", metrics: dict) -> None: ...
    def on_save(self, trainer: "Trainer", path: Path) -> None: ...
    def on_train_end(self, trainer: "Trainer", metrics: dict) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"training.device={name} but CUDA is not available here; use device: auto or cpu")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _IterableBatches:
    """Adapts any iterable of batches (e.g. a torch DataLoader) to the loader interface the loop uses.

    Accepted batches: (inputs, targets) already aligned; a dict with `input_ids` (and optional
    `labels`, Hugging Face style, shifted here); or a tensor of token rows (shifted here).
    """

    def __init__(self, iterable: Iterable, device: torch.device):
        self.iterable, self.device = iterable, device
        self.epoch, self.position, self._it = 0, 0, None

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def batches_per_epoch(self) -> int:
        return len(self)

    def _convert(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, dict):
            ids = batch["input_ids"]
            labels = batch.get("labels", ids)
            x, y = ids[:, :-1], labels[:, 1:]
        elif isinstance(batch, (tuple, list)):
            if len(batch) > 2:  # (inputs, targets, doc_ids)
                return tuple(t.to(self.device, non_blocking=True) for t in batch[:3])
            x, y = batch[0], batch[1]
        else:
            x, y = batch[:, :-1], batch[:, 1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def next_batch(self):
        if self._it is None:
            self._it = iter(self.iterable)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.position, self._it = self.epoch + 1, 0, iter(self.iterable)
            batch = next(self._it)
        self.position += 1
        return self._convert(batch)

    def __iter__(self):
        return (self._convert(b) for b in self.iterable)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Generic iterables cannot seek: skip forward to the saved position (slower, same data)."""
        self.epoch, self._it = state["epoch"], iter(self.iterable)
        for _ in range(state["position"]):
            next(self._it)
        self.position = state["position"]


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        config: TrainingConfig,
        *,
        train_dataloader,
        val_dataloader=None,
        tokenizer=None,
        callbacks: Iterable[Callback] = (),
        experiment_config: dict | None = None,
    ):
        self.config = config
        self.dist, self.device = distributed.setup(config, resolve_device(config.device))
        seed_everything(config.seed)
        self.tokenizer = tokenizer
        self.callbacks = list(callbacks)
        self.experiment_config = experiment_config or {"training": config.to_dict()}
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = config.resolved_checkpoint_dir

        model_config = getattr(model, "config", None)
        wrapped = parallelize(
            model, config=config, dist=self.dist, device=self.device,
            gradient_checkpointing=bool(getattr(model_config, "gradient_checkpointing", False)),
        )
        self.raw_model = model  # the bare module (sharded in place under FSDP): state dicts, evaluation
        self.model, self._ddp = wrapped.model, wrapped.ddp  # what the step calls
        self.sharded = wrapped.fsdp
        if self.dist.world_size > 1:  # same initial weights everywhere, different dropout per rank
            torch.manual_seed(config.seed + self.dist.rank)
        self.optimizer = build_optimizer(self.raw_model, config, self.device)
        self.engine = None  # DeepSpeed's engine: it takes our model and optimizer, so it comes last
        if self.dist.strategy == "deepspeed":
            self.model = self.engine = deepspeed_engine.wrap(self.raw_model, self.optimizer, config,
                                                             self.dist.world_size, self.device)
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]

        # Mixed precision: autocast for bf16/fp16; a GradScaler only for fp16 on CUDA.
        amp_dtype = torch.bfloat16 if config.amp_dtype == "bfloat16" else torch.float16
        self.autocast = torch.autocast(self.device.type, dtype=amp_dtype, enabled=config.use_amp)
        self.scaler = torch.amp.GradScaler(  # (DeepSpeed scales fp16 losses itself)
            self.device.type,
            enabled=config.use_amp and amp_dtype == torch.float16 and self.device.type == "cuda" and self.engine is None,
        )

        self.train_loader = self._as_loader(train_dataloader)
        self.val_loader = self._as_loader(val_dataloader) if val_dataloader is not None else None
        loader_world = getattr(self.train_loader, "world_size", self.dist.world_size)
        if loader_world != self.dist.world_size:
            raise UsageError(
                f"the training loader is split for {loader_world} process(es) but {self.dist.world_size} are running; "
                "build it with rank and world_size from the environment (llm_trainer.build_loaders does)"
            )
        per_epoch = self.train_loader.batches_per_epoch() // config.gradient_accumulation_steps
        if config.max_steps is None and per_epoch == 0:
            raise UsageError(
                f"one epoch has {self.train_loader.batches_per_epoch()} batches, fewer than "
                f"gradient_accumulation_steps={config.gradient_accumulation_steps}; set training.max_steps or use more data"
            )
        self.total_steps = config.max_steps if config.max_steps is not None else per_epoch * config.num_epochs
        self.state = TrainState()
        self.speed = SpeedMonitor(config.speed_window_size, _flops_per_token(self.raw_model, self.train_loader),
                                  config.peak_flops or _peak_flops(self.device, config), self.device)
        # Non-finite steps are counted on the device and read at logging steps (no per-step host sync).
        self._bad_total = torch.zeros((), dtype=torch.int64, device=self.device)
        self._bad_run = torch.zeros((), dtype=torch.int64, device=self.device)
        self._bad_run_max = torch.zeros((), dtype=torch.int64, device=self.device)
        self._skipped_before, self._tokens_at_start = 0, 0  # counts at the start of this train() (set there)
        self._stop_reason: str | None = None
        self._signal_received: str | None = None  # set by the handler on this process
        self._signal: str | None = None  # acted on: the same step on every rank
        self._writer: BackgroundWriter | None = None  # rank 0's checkpoint writer thread, while train() runs
        self._snapshot = HostSnapshot()  # host buffers for background saves, reused from one save to the next
        self._buffers_reserved = False
        self.loggers = []

    def _as_loader(self, loader):
        return loader if hasattr(loader, "next_batch") else _IterableBatches(loader, self.device)

    # -- the loop ---------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume_from_checkpoint:
            self._resume(cfg.resume_from_checkpoint)
        state, accum = self.state, cfg.gradient_accumulation_steps
        self.loggers = build_loggers(cfg.report_to, self.output_dir, self.experiment_config, cfg.progress_bar)
        self._log_start()
        for cb in self.callbacks:
            cb.on_train_begin(self)
        progress = self._progress_bar()
        if self.dist.is_main:
            ckpt.remove_staging(self.checkpoint_dir)  # no rank writes there before the first save's barrier
        if cfg.async_checkpoint and self.dist.is_main and not self.sharded:  # FSDP shards are written by every rank
            self._writer, self._buffers_reserved = BackgroundWriter(), False
        self.model.train()
        started = time.perf_counter()
        start_step, last_saved = state.step, None
        final_eval: dict | None = None

        try:
            with self._signals_handled():
                while state.step < self.total_steps and self._stop_reason is None:
                    step = state.step
                    lr = learning_rate_at(step, cfg, self.total_steps)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr

                    # Forward/backward over the micro-batches. Each micro-batch's summed loss is divided by
                    # the target tokens of the whole step, so k micro-batches of b rows equal one batch of k*b.
                    self.speed.start_step()
                    micro = [self.speed.timed_batch(self.train_loader) for _ in range(accum)]
                    n_targets = sum((batch[1] != IGNORE_INDEX).sum() for batch in micro).float()  # device tensor: no sync
                    n_targets = all_reduce_(n_targets).clamp(min=1)  # over all ranks: DDP then averages exactly
                    loss_sum = torch.zeros((), device=self.device)
                    for i, (inputs, targets, *doc_ids) in enumerate(micro):  # doc_ids with data.document_mask
                        with self._no_sync(last=i == accum - 1), self.autocast:
                            nll = batch_nll(self.model, inputs, targets, *doc_ids)
                        self._backward(nll * self.dist.world_size / n_targets)
                        loss_sum += nll.detach().float()
                    if self.dist.world_size > 1:  # one small collective: global loss and whether any rank got a signal
                        shared = all_reduce_(torch.stack([loss_sum, torch.tensor(float(self._signal_received is not None), device=self.device)]))
                        loss_sum, signal_seen = shared[0], shared[1]

                    # Clip, then step only if loss and gradients are finite (a bad step never reaches the weights).
                    self.scaler.unscale_(self.optimizer)
                    grad_norm = self._clip_gradients()  # None under DeepSpeed, which clips inside its step
                    finite = torch.isfinite(loss_sum)
                    if grad_norm is not None and not self.scaler.is_enabled():  # fp16 scaling: overflows are routine
                        finite = finite & torch.isfinite(grad_norm)
                    self._optimizer_step(finite)
                    if grad_norm is None:
                        norm = self.engine.get_global_grad_norm()  # DeepSpeed's, computed in its step
                        grad_norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32)
                    self.scaler.update()
                    state.step += 1
                    step_tokens = sum(batch[0].numel() for batch in micro)
                    state.tokens_seen += step_tokens
                    self.speed.end_step(step_tokens, sum(len(batch[0]) for batch in micro))
                    if progress is not None:
                        progress.update(1)

                    # Log: the only place values leave the device (on CPU, where reads are free, check every step).
                    log_now = state.step % cfg.logging_steps == 0 or state.step == self.total_steps
                    if self.dist.world_size == 1:
                        self._signal = self._signal_received
                    if log_now or self.device.type == "cpu":
                        self._read_bad_steps()
                        if self.dist.world_size > 1 and self._signal is None and bool(signal_seen):
                            self._signal = self._signal_received or "a signal on another rank"  # all ranks stop together
                    if log_now:
                        row = {
                            "step": state.step,
                            "epoch": self.train_loader.epoch,
                            "loss": float(loss_sum / n_targets),
                            "lr": lr,
                            "grad_norm": float(grad_norm),
                            "tokens_seen": state.tokens_seen,
                            **self.speed.metrics(),
                            "skipped_steps": state.skipped_steps,
                        }
                        self._log_metrics(row)
                        if progress is not None:
                            progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:,.0f}")
                        for cb in self.callbacks:
                            cb.on_step_end(self, row)

                    # Evaluate; track the best model; early stopping.
                    at_end = state.step == self.total_steps
                    if self.val_loader is not None and (at_end or (cfg.eval_steps and state.step % cfg.eval_steps == 0)):
                        final_eval = self._evaluate_and_track()

                    # Checkpoint periodically (in the background), at the end and when a signal asked us to stop.
                    self._report_background_save()
                    if self.dist.world_size == 1:
                        self._signal = self._signal_received  # one that came during logging/evaluation counts now
                    stopping = at_end or self._signal is not None or self._stop_reason is not None
                    if stopping or (cfg.save_steps and state.step % cfg.save_steps == 0):
                        last_saved = self.save_checkpoint(background=not stopping)
                    if self._signal is not None:
                        self._stop_reason = f"received {self._signal}"

            self._read_bad_steps()
            if self.val_loader is not None and final_eval is None and state.step > start_step:
                final_eval = self._evaluate_and_track()
            elapsed = time.perf_counter() - started
            summary = {
                "event": "train_end",
                "step": state.step,
                "train_runtime_s": elapsed,
                "tokens_per_s": (state.tokens_seen - self._tokens_at_start) / max(elapsed, 1e-9),
                "tokens_seen": state.tokens_seen,
                "skipped_steps": state.skipped_steps,
                "stopped_early": self._stop_reason,
                "best_val_loss": state.best_val_loss,
                "checkpoint": str(last_saved) if last_saved else None,
                **({"val_loss": final_eval["val_loss"], "perplexity": final_eval["perplexity"]} if final_eval else {}),
            }
            self._log_metrics(summary)
            self._log_end(summary)
            for cb in self.callbacks:
                cb.on_train_end(self, summary)
            if "jsonl" in cfg.report_to and is_main_process():
                from .plots import plot_runs  # warns, never raises: a plot must not fail a finished run

                plot_runs([self.output_dir], self.output_dir / "plots")
            return summary
        finally:  # also when a callback or a stop raises: a checkpoint being written finished, logs flushed, bar closed
            self._stop_writer()
            if progress is not None:
                progress.close()
            for logger in self.loggers:
                logger.close()
            self.loggers = []

    # -- pieces of a step ---------------------------------------------------------------------------

    def _backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:  # DeepSpeed reduces (and partitions) the gradients; the loss is scaled already
            self.engine.backward(loss, scale_wrt_gas=False)
        else:
            self.scaler.scale(loss).backward()

    def _optimizer_step(self, finite: torch.Tensor) -> None:
        """Apply the update only where `finite`, then clear the gradients. Fused Adam/AdamW skip on the
        device, with no host sync."""
        bad = (~finite).to(torch.int64)
        self._bad_total += bad
        self._bad_run = (self._bad_run + 1) * bad
        self._bad_run_max = torch.maximum(self._bad_run_max, self._bad_run)
        if self.engine is not None:  # DeepSpeed steps our fused optimizer on its partitions: skipped where bad
            self.optimizer.grad_scale, self.optimizer.found_inf = None, bad.float()
            try:
                self.engine.step()  # also clears the gradients (its buffers stay allocated)
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            return
        if self.scaler.is_enabled():  # fp16: the scaler skips steps whose gradients overflowed
            self.scaler.step(self.optimizer)
        elif self.optimizer.defaults.get("fused"):
            self.optimizer.grad_scale, self.optimizer.found_inf = None, bad.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        elif bool(finite):  # other optimizers: one host sync
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _read_bad_steps(self) -> None:
        """Copy the device-side non-finite counters into the state; stop after too many in a row."""
        state = self.state
        state.skipped_steps = self._skipped_before + int(self._bad_total)
        state.consecutive_bad_steps = int(self._bad_run)
        if int(self._bad_run_max) >= self.config.max_consecutive_bad_steps:
            state.consecutive_bad_steps = max(state.consecutive_bad_steps, int(self._bad_run_max))
            self._fail_on_bad_steps()

    def _clip_gradients(self) -> torch.Tensor | None:
        if self.engine is not None:
            return None
        if self.config.max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor

    @contextlib.contextmanager
    def _no_sync(self, last: bool):
        """Skip the gradient reduction on all but the last micro-batch (DDP no_sync, FSDP2's switch)."""
        if last or not self.dist.enabled or self.engine is not None:  # DeepSpeed: reduces at step(), or per bucket
            yield
        elif self._ddp is not None:
            with self._ddp.no_sync():
                yield
        else:
            self.raw_model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.raw_model.set_requires_gradient_sync(True)

    def _fail_on_bad_steps(self) -> None:
        n = self.state.consecutive_bad_steps
        raise TrainingStopped(
            f"stopping: {n} steps in a row had a non-finite loss or gradient (step {self.state.step}); the weights "
            f"were not updated by them and the last checkpoint in {self.checkpoint_dir} is untouched. Lower "
            f"training.learning_rate, enable clipping (max_grad_norm) or use bfloat16 instead of float16"
        )

    # -- evaluation -------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        if self.val_loader is None:
            raise UsageError("no validation data: pass val_dataloader or set data.validation_split")
        return evaluate(self.raw_model, self.val_loader, autocast=self.autocast, max_batches=self.config.eval_max_batches,
                        reduce=all_reduce_)

    def _evaluate_and_track(self) -> dict:
        cfg, state = self.config, self.state
        metrics = self.evaluate()
        improved = state.best_val_loss is None or metrics["val_loss"] < state.best_val_loss - cfg.early_stopping_min_delta
        if improved:
            state.best_val_loss, state.best_step, state.evals_without_improvement = metrics["val_loss"], state.step, 0
            weights = self._gathered_weights()
            if self.dist.is_main:
                ckpt.save_best_model(
                    self.checkpoint_dir, self.raw_model, tokenizer_json=self._tokenizer_json(),
                    config=self.experiment_config, metrics={**metrics, "step": state.step}, state=weights,
                )
        else:
            state.evals_without_improvement += 1
            if cfg.early_stopping_patience and state.evals_without_improvement >= cfg.early_stopping_patience:
                self._stop_reason = (
                    f"early stopping: val_loss did not improve by {cfg.early_stopping_min_delta} for "
                    f"{state.evals_without_improvement} evaluations (best {state.best_val_loss:.4f} at step {state.best_step})"
                )
                log(self._stop_reason)
        self._log_metrics({"step": state.step, **metrics})
        for cb in self.callbacks:
            cb.on_evaluate(self, metrics)
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------

    def _tokenizer_json(self) -> str | None:
        return self.tokenizer.to_json() if self.tokenizer is not None and hasattr(self.tokenizer, "to_json") else None

    def save_checkpoint(self, background: bool = False) -> Path:
        """Every rank calls this at the same step; rank 0 writes the checkpoint folder. With several
        ranks, each first writes its RNG state (and under FSDP its model and optimizer shards, through
        torch.distributed.checkpoint) into a staging folder that becomes the checkpoint's `sharded/`.

        `background` (inside train(), with training.async_checkpoint): rank 0 copies the state and
        its writer thread writes the folder while training goes on; `on_save` runs once it is complete."""
        self._finish_background_save()  # one write at a time, in step order
        self._read_bad_steps()
        rng_tensors = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng_tensors["cuda"] = torch.cuda.get_rng_state_all()
        path = self.checkpoint_dir / f"{ckpt.PREFIX}{self.state.step:08d}"
        staging, weights = None, None
        if self.dist.world_size > 1 or self.engine is not None:
            staging = self.checkpoint_dir / f".staging-{path.name}"
            if self.dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            distributed.barrier()
            torch.save(rng_tensors, staging / f"rng-rank{self.dist.rank}.pt")
            if self.sharded:
                save_sharded(self.raw_model, self.optimizer, staging)
            if self.engine is not None:
                deepspeed_engine.save(self.engine, staging, self.dist.is_main)
                weights = self._gathered_weights()  # ZeRO-3: for the checkpoint's model folder
            distributed.barrier()
        background = background and self._writer is not None
        if self.dist.is_main:
            write = self._checkpoint_job(rng_tensors, staging, snapshot=background, weights=weights)
            if background:
                self._writer.submit(write)
            else:
                path = write()
        distributed.barrier()
        if not background:
            self._after_save(path)
        return path

    def _after_save(self, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_save(self, path)

    def _report_background_save(self) -> None:
        """At a step boundary: `on_save` for a background write that has completed (errors raised here).
        After the first step, when the optimizer state exists, the writer thread first allocates the
        host buffers of background saves, so that the first save stalls no longer than later ones."""
        if self._writer is None:
            return
        if not self._buffers_reserved:
            self._buffers_reserved = True
            if self.config.save_steps:
                self._writer.submit(self._snapshot.reserve(self._snapshot_source()))
            return
        if (path := self._writer.finished()) is not None:
            self._after_save(path)

    def _finish_background_save(self) -> None:
        if self._writer is not None and (path := self._writer.wait()) is not None:
            self._after_save(path)

    def _stop_writer(self) -> None:
        """End of train(): a write still in flight (only when train() raised) is completed, never abandoned."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.wait()
        except Exception as exc:  # train() is already raising its own error; do not hide it
            log(f"warning: the checkpoint being written in the background failed: {exc}")
        finally:
            writer.close()

    def _gathered_weights(self) -> dict[str, torch.Tensor] | None:
        """Full weights, copied, when this rank holds only a part of them (FSDP, ZeRO-3): a collective.
        None when the module itself has them whole."""
        if self.sharded:
            return full_model_state(self.raw_model)
        return deepspeed_engine.full_model_state(self.engine) if self.engine is not None else None

    def _snapshot_source(self) -> tuple:
        """The live tensors a checkpoint holds: the module's own weights (None where they are gathered
        from shards instead: FSDP, ZeRO-3) and the optimizer state (references; None where DCP shards
        or DeepSpeed's files hold it)."""
        gathered = self.sharded or (self.engine is not None and deepspeed_engine.zero_stage(self.engine) == 3)
        optimizer_state = None if self.sharded or self.engine is not None else self.optimizer.state_dict()
        return (None if gathered else model_tensors(self.raw_model), optimizer_state)

    def _checkpoint_job(self, rng_tensors: dict, staging: Path | None, snapshot: bool,
                        weights: dict[str, torch.Tensor] | None = None) -> Callable[[], Path]:
        """The write of this step's checkpoint, as a function. Everything it needs is read now;
        `snapshot` copies the tensors too, so the write may run while training changes them.
        `weights`: the full model gathered from its shards (a copy already)."""
        np_state = np.random.get_state()
        train_state = {
            **dataclasses.asdict(self.state),
            "epoch": self.train_loader.epoch,
            "data": self.train_loader.state_dict(),
            "schedule": {"name": self.config.lr_scheduler, "total_steps": self.total_steps},
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "rng": {
                "python": _listify(random.getstate()),
                "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            },
        }
        train_state = json.loads(json.dumps(train_state))  # plain data, detached from the live loader
        source = self._snapshot_source()
        optimizer_state, model_state = source[1], weights  # model_state None: the write reads the live model
        if snapshot:
            copied, optimizer_state = self._snapshot.take(source)
            model_state = weights if weights is not None else copied
        step, tokenizer_json = self.state.step, self._tokenizer_json()
        best = f"{ckpt.PREFIX}{self.state.best_step:08d}" if self.state.best_step is not None else None

        def write() -> Path:
            path = ckpt.save_checkpoint(
                self.checkpoint_dir, step,
                model=self.raw_model,
                model_state=model_state,
                optimizer_state=optimizer_state,
                train_state=train_state,
                rng_tensors=rng_tensors,
                config=self.experiment_config,
                tokenizer_json=tokenizer_json,
                sharded_dir=staging,
                extra_meta={"world_size": self.dist.world_size, "strategy": self.dist.strategy},
            )
            ckpt.rotate(self.checkpoint_dir, self.config.save_total_limit, protect={path.name, best} - {None})
            return path

        return write

    def _resume(self, spec: str) -> None:
        path = ckpt.resolve_checkpoint(spec, self.checkpoint_dir)
        if path is None:
            log(f"resume: no checkpoint in {self.checkpoint_dir} yet; starting from step 0")
            return
        parts = ckpt.load_checkpoint(path, map_location=self.device)
        if self.engine is not None:  # DeepSpeed's files hold model and optimizer (every rank reads its part)
            deepspeed_engine.load(self.engine, parts["sharded"] or path / ckpt.SHARDED_DIR)
        elif parts["meta"].get("kind") == "deepspeed_checkpoint":
            raise UsageError(f"{path} was saved with distributed_strategy deepspeed; resume it with that strategy "
                             "(its model folder also works as model.init_from for a fresh run)")
        elif parts["model"] is None:  # sharded (FSDP): each rank reads its part, at any world size
            if not self.sharded:
                raise UsageError(f"{path} is a sharded FSDP checkpoint; resume it with distributed_strategy: fsdp, "
                                 "or turn it into a model folder with `llm-trainer consolidate`")
            load_sharded(self.raw_model, self.optimizer, parts["sharded"])
        else:
            load_model_state(self.raw_model, parts["model"], str(path))
            try:
                self.optimizer.load_state_dict(parts["optimizer"])
            except (ValueError, KeyError) as exc:
                raise UsageError(f"optimizer state in {path} does not match this model/optimizer: {exc}") from None
        saved = parts["train_state"]
        fields = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in saved.items() if k in fields})
        if saved["schedule"]["total_steps"] != self.total_steps:
            log(f"resume: the run length changed ({saved['schedule']['total_steps']} -> {self.total_steps} steps); the schedule follows the new length")
        try:
            self.train_loader.load_state_dict(saved["data"])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if saved.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(saved["scaler"])
        rng = parts["rng"]
        own = parts["sharded"] / f"rng-rank{self.dist.rank}.pt" if parts["sharded"] is not None else None
        if own is not None and own.is_file():  # each rank continues its own dropout stream
            rng = torch.load(own, map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        random.setstate(_tuplify(saved["rng"]["python"]))
        kind, keys, *rest = saved["rng"]["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        log(f"resume: continuing from {path} (step {self.state.step}, {self.state.tokens_seen:,} tokens seen)")

    # -- signals ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals_handled(self):
        """SIGTERM/SIGINT: finish the current step, save a checkpoint, stop. A second Ctrl-C aborts."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._signal_received is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._signal_received = signal.Signals(signum).name
            log(f"{self._signal_received}: saving a checkpoint at the end of this step, then stopping")

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    # -- output -----------------------------------------------------------------------------------

    def _log_metrics(self, row: dict) -> None:
        """Send one row to every backend; override to add metrics (e.g. `custom/...`)."""
        for logger in self.loggers:
            logger.log(row)

    def _progress_bar(self):
        if not self.config.progress_bar or not is_main_process():
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5)

    def _log_start(self) -> None:
        self._tokens_at_start = self.state.tokens_seen
        self._skipped_before = self.state.skipped_steps
        self._bad_run.fill_(self.state.consecutive_bad_steps)
        n_params = sum(p.numel() for p in self.params)
        cfg = self.config
        world = self.dist.world_size
        effective = cfg.batch_size * cfg.gradient_accumulation_steps * world
        log(
            f"train: {n_params:,} parameters on {self.device}, {self.total_steps} steps, effective batch {effective} "
            f"= {cfg.batch_size} x {cfg.gradient_accumulation_steps} accumulation x {world} process(es)"
            f"{' (' + self.dist.strategy + ')' if world > 1 else ''}, lr {cfg.learning_rate:g} ({cfg.lr_scheduler}), "
            f"{'amp ' + cfg.amp_dtype if cfg.use_amp else 'float32'}{', compiled' if cfg.compile else ''}"
        )

    def _log_end(self, summary: dict) -> None:
        parts = [f"{summary['step']} steps", f"{summary['train_runtime_s']:.1f}s", f"{summary['tokens_per_s']:,.0f} tok/s"]
        if "val_loss" in summary:
            parts.append(f"val_loss {summary['val_loss']:.4f} (perplexity {summary['perplexity']:.2f})")
        if summary["skipped_steps"]:
            parts.append(f"{summary['skipped_steps']} non-finite steps skipped")
        log("done: " + ", ".join(parts))
        if self._signal is not None:
            log(f"stopped by {self._signal}; resume with training.resume_from_checkpoint=latest")
        elif summary["stopped_early"]:
            log(summary["stopped_early"])


def _flops_per_token(model: nn.Module, loader) -> float | None:
    """Training FLOPs per token for our architecture (None for other models: MFU is then not shown)."""
    config = getattr(model, "config", None)
    length = getattr(getattr(loader, "rows", None), "length", None) or getattr(config, "max_seq_len", None)
    if config is None or not hasattr(config, "n_layers") or length is None:
        return None
    from .estimate import flops_per_token

    try:
        return flops_per_token(config, length)
    except ValueError:  # a model config we cannot count (e.g. a user's own architecture)
        return None


def _peak_flops(device: torch.device, config: TrainingConfig) -> float | None:
    if device.type != "cuda":
        return None
    from .estimate import peak_flops

    dtype = (torch.bfloat16 if config.amp_dtype == "bfloat16" else torch.float16) if config.use_amp else torch.float32
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def _listify(value):
    return [_listify(v) for v in value] if isinstance(value, (list, tuple)) else value


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value
