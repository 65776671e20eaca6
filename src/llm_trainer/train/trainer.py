"""The training loop.

`Trainer.__init__` is setup: where it runs, the model wrapped for its backend (`parallelize`), the
loaders, the checkpointer. `Trainer.train` is the loop, top to bottom: set the learning rate, one
`train_step` over the micro-batches, log, evaluate, checkpoint. It never asks which backend runs:
the `Parallelism` object and the `Checkpointer` answer for it. Everything a resumed run needs (the
`TrainState` counters, the loader's position, optimizer, RNGs) goes into every checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..checkpoint.checkpointer import Checkpointer
from ..config import TrainingConfig
from ..errors import TrainingStopped, UsageError
from ..logs import is_main_process, log
from ..parallel.distributed import all_reduce_
from ..parallel.parallelize import parallelize
from ..resolve import ResolvedRun, activation_checkpointing, seed_everything, setup_runtime, token_anchors
from .batches import as_loader
from .callbacks import Callback
from .evaluate import evaluate
from .flops import flops_per_token, peak_flops
from .metrics import build_loggers, close_loggers
from .optim import build_optimizer, learning_rate_at, set_learning_rate
from .rows import EvalRow, SummaryRow, TrainRow
from .run_lock import lock_run_folders
from .speed import PhaseTimer, SpeedMonitor
from .state import TrainState
from .step import NonFiniteSteps, autocast, train_step
from .stop import StopControl

__all__ = ["Callback", "Trainer", "TrainState", "TrainingStopped"]


class Trainer:
    """Trains any `nn.Module` that returns logits (or an object with `.logits` or `.loss`) on any
    iterable of batches; `llm_trainer.train` builds everything from an experiment config instead.

    `run`: the resolved run (`llm_trainer.resolve`) when the caller has one; otherwise the Trainer
    resolves the device, process group and precision from `config` itself.
    """

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
        run: ResolvedRun | None = None,
    ):
        runtime = run.runtime if run is not None else setup_runtime(config)
        seq_len = run.seq_len if run else getattr(getattr(train_dataloader, "rows", None), "length", None)  # our loaders know it
        if run is None:
            config = token_anchors(config, seq_len, runtime.dist.world_size)
        self.config = config
        self.dist, self.device, self.amp_dtype = runtime.dist, runtime.device, runtime.amp_dtype
        seed_everything(config.seed)  # before parallelize: a meta-device model is initialised there
        self.tokenizer = tokenizer
        self.callbacks = list(callbacks)
        self.experiment_config = experiment_config or (run.experiment.to_dict() if run else {"training": config.to_dict()})
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = config.resolved_checkpoint_dir

        checkpointing = run.activation_checkpointing if run else activation_checkpointing(config, getattr(model, "config", None))
        self.parallel = parallelize(
            model, config=config, dist=self.dist, device=self.device, amp_dtype=self.amp_dtype,
            activation_checkpointing=checkpointing,
            build_optimizer=lambda module: build_optimizer(module, config, self.device),
        )
        self.raw_model = model  # the bare module (sharded in place under FSDP): state dicts, evaluation
        self.model = self.parallel.forward  # what the step calls
        self.optimizer = self.parallel.optimizer
        self.autocast = autocast(self.device, self.amp_dtype)

        self.train_loader = as_loader(train_dataloader, self.device)
        self.val_loader = as_loader(val_dataloader, self.device) if val_dataloader is not None else None
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
        self.bad_steps = NonFiniteSteps(self.device)  # renewed by train() from the (resumed) state
        self.time_to_target_s: float | None = None  # seconds into train() when target_val_loss was reached
        self.speed = SpeedMonitor(config.speed_window_size, _flops_per_token(model, seq_len),
                                  config.peak_flops or _peak_flops(self.device, self.amp_dtype), self.device)
        self.stop = StopControl(self.dist.world_size)
        self.checkpointer = Checkpointer(
            self.checkpoint_dir, parallel=self.parallel, loader=self.train_loader, state=self.state,
            schedule={"name": config.lr_scheduler, "total_steps": self.total_steps}, config=self.experiment_config,
            tokenizer_json=self._tokenizer_json(), keep_last=config.save_total_limit,
            background=config.async_checkpoint, periodic=bool(config.save_steps), on_saved=self._on_saved,
        )
        self.loggers = []

    # -- the loop ---------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """The loop, holding the output folder's lock: one run per folder."""
        with lock_run_folders(self.output_dir, self.checkpoint_dir, self.dist.is_main):
            return self._train()

    def _train(self) -> dict[str, Any]:
        cfg, state, accum = self.config, self.state, self.config.gradient_accumulation_steps
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume_from_checkpoint:
            self.checkpointer.load(cfg.resume_from_checkpoint)
        self.bad_steps = NonFiniteSteps(self.device, state.skipped_steps, state.consecutive_bad_steps)
        self.loggers = build_loggers(cfg.report_to, self.output_dir, self.experiment_config, cfg.progress_bar,
                                     resumed_at=state.step if cfg.resume_from_checkpoint else None)
        tokens_at_start, start_step = state.tokens_seen, state.step
        self._log_start()
        for cb in self.callbacks:
            cb.on_train_begin(self)
        progress = self._progress_bar()
        self.model.train()
        started = self._started = time.perf_counter()
        timer = PhaseTimer()
        last_saved, final_eval = None, None

        try:
            with self.checkpointer, self.stop.signals_handled():
                while state.step < self.total_steps and not self.stop.requested:
                    lr = learning_rate_at(state.step, cfg, self.total_steps)
                    set_learning_rate(self.optimizer, lr)
                    self.speed.start_step()
                    micro = [self.speed.timed_batch(self.train_loader) for _ in range(accum)]
                    out = train_step(self.parallel, micro, autocast=self.autocast, max_grad_norm=cfg.max_grad_norm,
                                     share=self.stop.flag(self.device) if self.dist.world_size > 1 else None)
                    self.bad_steps.add(out.finite)
                    state.step += 1
                    state.tokens_seen += out.tokens
                    self.speed.end_step(out.tokens, out.samples)
                    if progress is not None:
                        progress.update(1)

                    # Log: the only place values leave the device (on CPU, where reads are free, check every step).
                    log_now = state.step % cfg.logging_steps == 0 or state.step == self.total_steps
                    if log_now or self.device.type == "cpu":
                        self._read_bad_steps()
                        self.stop.poll(out.shared)
                    if log_now:
                        row = TrainRow(step=state.step, epoch=self.train_loader.epoch, loss=float(out.loss), lr=lr,
                                       grad_norm=float(out.grad_norm), tokens_seen=state.tokens_seen,
                                       skipped_steps=state.skipped_steps, **self.speed.metrics()).as_dict()
                        self._log_metrics(row)
                        if progress is not None:
                            progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:,.0f}")
                        for cb in self.callbacks:
                            cb.on_step_end(self, row)

                    # Evaluate; track the best model; early stopping.
                    at_end = state.step == self.total_steps
                    if self.val_loader is not None and (at_end or (cfg.eval_steps and state.step % cfg.eval_steps == 0)):
                        with timer.count("evaluation"):
                            final_eval = self._evaluate_and_track()

                    # Checkpoint periodically (in the background), at the end and when a signal asked us to stop.
                    self.checkpointer.poll()
                    self.stop.poll()  # one process: a signal that came during logging/evaluation counts now
                    stopping = at_end or self.stop.stopping
                    if stopping or (cfg.save_steps and state.step % cfg.save_steps == 0):
                        self._read_bad_steps()
                        with timer.count("checkpoint"):
                            last_saved = self.checkpointer.save(background=not stopping)
                    self.stop.end_step()

            self._read_bad_steps()
            if self.val_loader is not None and final_eval is None and state.step > start_step:
                with timer.count("evaluation"):
                    final_eval = self._evaluate_and_track()
            elapsed = time.perf_counter() - started
            summary = SummaryRow(
                step=state.step, train_runtime_s=elapsed,
                tokens_per_s=(state.tokens_seen - tokens_at_start) / max(elapsed, 1e-9),
                tokens_seen=state.tokens_seen, skipped_steps=state.skipped_steps, stopped_early=self.stop.reason,
                best_val_loss=state.best_val_loss, checkpoint=str(last_saved) if last_saved else None,
                evaluation_s=timer.seconds["evaluation"], checkpoint_s=timer.seconds["checkpoint"],
                val_loss=final_eval["val_loss"] if final_eval else None,
                perplexity=final_eval["perplexity"] if final_eval else None, time_to_target_s=self.time_to_target_s,
            ).as_dict()
            self._log_metrics(summary)
            self._log_end(summary)
            for cb in self.callbacks:
                cb.on_train_end(self, summary)
            return summary
        finally:  # also when a callback or a stop raises: logs flushed, bar closed
            if progress is not None:
                progress.close()
            close_loggers(self.loggers)
            self.loggers = []

    # -- pieces of the loop -----------------------------------------------------------------------

    def _read_bad_steps(self) -> None:
        """Copy the device-side non-finite counters into the state; stop after too many in a row."""
        state = self.state
        state.skipped_steps, state.consecutive_bad_steps, longest = self.bad_steps.read()
        if longest >= self.config.max_consecutive_bad_steps:
            state.consecutive_bad_steps = max(state.consecutive_bad_steps, longest)
            raise TrainingStopped(
                f"stopping: {state.consecutive_bad_steps} steps in a row had a non-finite loss or gradient (step "
                f"{state.step}); the weights were not updated by them and the last checkpoint in {self.checkpoint_dir} "
                f"is untouched. Lower training.learning_rate, enable clipping (max_grad_norm) or use bfloat16 instead of float16"
            )

    def evaluate(self, *, full: bool = False) -> dict:
        """Validation loss over the first `eval_max_batches` batches, or all of them (`full`, or no cap)."""
        if self.val_loader is None:
            raise UsageError("no validation data: pass val_dataloader or set data.validation_split")
        return evaluate(self.raw_model, self.val_loader, autocast=self.autocast, reduce=all_reduce_,
                        max_batches=None if full else self.config.eval_max_batches)

    def _evaluate_and_track(self) -> dict:
        cfg, state = self.config, self.state
        metrics = self.evaluate()
        target = cfg.target_val_loss
        whole = cfg.eval_max_batches is None or metrics["batches"] < cfg.eval_max_batches  # the split ended first
        if target is not None and not whole and metrics["val_loss"] <= target * 1.01:
            metrics, whole = self.evaluate(full=True), True  # within 1% of the target on a part: the whole split decides
        improved = state.best_val_loss is None or metrics["val_loss"] < state.best_val_loss - cfg.early_stopping_min_delta
        if improved:
            state.best_val_loss, state.best_step, state.evals_without_improvement = metrics["val_loss"], state.step, 0
            self.checkpointer.save_best(metrics)
        else:
            state.evals_without_improvement += 1
            if cfg.early_stopping_patience and state.evals_without_improvement >= cfg.early_stopping_patience:
                self.stop.request(
                    f"early stopping: val_loss did not improve by {cfg.early_stopping_min_delta} for "
                    f"{state.evals_without_improvement} evaluations (best {state.best_val_loss:.4f} at step {state.best_step})"
                )
        if target is not None and whole and metrics["val_loss"] <= target:
            self.time_to_target_s = time.perf_counter() - self._started
            self.stop.request(f"target reached: val_loss {metrics['val_loss']:.4f} <= {target} at step {state.step}, "
                              f"{self.time_to_target_s:.1f}s after training started")
        self._log_metrics(EvalRow(step=state.step, **metrics).as_dict())
        for cb in self.callbacks:
            cb.on_evaluate(self, metrics)
        return metrics

    def save_checkpoint(self, background: bool = False) -> Path:
        """Save the current state now (every rank calls it); see `Checkpointer.save`."""
        self._read_bad_steps()
        return self.checkpointer.save(background=background)

    def _on_saved(self, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_save(self, path)

    def _tokenizer_json(self) -> str | None:
        return self.tokenizer.to_json() if self.tokenizer is not None and hasattr(self.tokenizer, "to_json") else None

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
        n_params = sum(p.numel() for p in self.parallel.params)
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
        if self.stop.signal is not None:
            log(f"stopped by {self.stop.signal}; resume with training.resume_from_checkpoint=latest")
        elif summary["stopped_early"]:
            log(summary["stopped_early"])


def _flops_per_token(model: nn.Module, seq_len: int | None) -> float | None:
    """Training FLOPs per token for our architecture (None for other models: MFU is then not shown)."""
    config = getattr(model, "config", None)
    length = seq_len or getattr(config, "max_seq_len", None)
    if config is None or not hasattr(config, "n_layers") or length is None:
        return None
    try:
        return flops_per_token(config, length)
    except ValueError:  # a model config we cannot count (e.g. a user's own architecture)
        return None


def _peak_flops(device: torch.device, amp_dtype: torch.dtype | None) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), amp_dtype or torch.float32)
