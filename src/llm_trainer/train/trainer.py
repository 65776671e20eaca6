"""The training loop.

`Trainer.__init__` is setup: the resolved run (where it runs, in what precision), the model wrapped
for its backend (`parallelize`), the checkpointer, the loaders when given. `Trainer.train` is the loop, top to bottom: set the learning rate, one
`train_step` over the micro-batches, log, evaluate, checkpoint. It never asks which backend runs:
the `Parallelism` object and the `Checkpointer` answer for it. Everything a resumed run needs (the
`TrainState` counters, the loader's position, optimizer, RNGs) goes into every checkpoint.

Two ways in: ours, `Trainer(model, config, train_dataloader=..., val_dataloader=...).train()`, and the
Hugging Face style, `Trainer(model=..., tokenizer=..., config={...})` then `.train(train_dataloader=..., val_dataloader=..., num_epochs=...)` (`config` a dict or a
`TrainingConfig`). `Trainer.from_config(model_config, training_config, data_config)` builds the whole
pipeline (prepare, vocabulary, model, loaders) for a subclass.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .. import config_aliases
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.train_state import TrainState
from ..config import ExperimentConfig, TrainingConfig
from ..downstream import during_training as downstream
from ..errors import TrainingStopped, UsageError, first_line
from ..logs import Progress, log, shows_progress_bar, warn, warnings_once
from ..parallel import attention_kernel
from ..parallel.distributed import DistInfo, all_reduce_, barrier, finish, peer_lost
from ..parallel.parallelize import parallelize
from ..pipeline import experiment_from, prepare_run
from ..resolve import ResolvedRun, native_bf16, resolve_for_model, seed_everything
from ..tokenizer import tokenizer_json
from .alerts import Alerter, StallWatchdog, ThroughputWatch, check_destinations
from .batch_size import auto_batch_size
from .batches import as_loader
from .callbacks import Callback
from .evaluate import evaluate
from .flops import flops_per_token, peak_flops
from .layer_stats import LayerStats
from .metrics import LoggedSeries, MetricsTracker, logged_series, tensorboard_dir
from .optim import build_optimizer, learning_rate_at, set_learning_rate
from .output_folder import (
    METRICS_FILE,
    RunFilesAtStart,
    check_output_folder,
    clear_run_files,
    fetch_run_files,
    finished_at,
    finished_run,
    upload_run_files,
)
from .plots import PlotsAtEnd
from .profiling import StepProfiler, out_of_memory
from .rows import EvalRow, SummaryRow, TrainRow, downstream_row, read_rows_of
from .run_lock import lock_run_folders
from .speed import PhaseTimer, SpeedMonitor
from .spikes import SpikeMonitor, check_rewindable, rewind
from .step import NonFiniteSteps, autocast, train_step
from .stop import StopControl

__all__ = ["Callback", "Trainer", "TrainState", "TrainingStopped"]


@dataclasses.dataclass(frozen=True)
class Every:
    """When a periodic evaluation or save is due: every `steps` steps counted from `first` (the step
    that a train() call's epochs start after); never when `steps` is 0."""

    steps: int
    first: int = 0

    @classmethod
    def of(cls, setting: int | str | None, steps_per_epoch: int, first: int) -> Every:
        """From `eval_steps` / `save_steps`: a count of steps, "epoch" (each epoch's end), or 0 / None."""
        return cls(steps_per_epoch, first) if setting == "epoch" else cls(setting or 0)

    def due(self, step: int) -> bool:
        return self.steps > 0 and (step - self.first) % self.steps == 0


class Trainer:
    """Trains any `nn.Module` that returns logits (or an object or dict with `logits`, or only `loss`:
    `evaluate.read_output`) on any iterable of batches; `llm_trainer.train` builds everything from an
    experiment config instead.

    `config`: a `TrainingConfig`, or a dict of its fields (other frameworks' names too; keys it does
    not know are listed once and kept out). `run`: a `ResolvedRun` (`llm_trainer.resolve`), as the
    pipeline passes it (with `config`, if given, its own training config); without one the Trainer
    resolves it from `config` with `resolve_for_model`. The data may come here or to `train()`.

    `model` is the user's module as given (the one to save, evaluate or inspect); what the step calls
    (wrapped for DDP, compiled, or DeepSpeed's engine) is `parallel.wrapped` (see `Parallelism`).

    For subclasses: `_log_metrics(row)` sees every row the backends get; `self.metrics_tracker.update(
    {"custom/x": value}, self.current_step)` logs values of your own to the same backends.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainingConfig | Mapping[str, Any] | None = None,
        *,
        train_dataloader=None,
        val_dataloader=None,
        tokenizer=None,
        callbacks: Iterable[Callback] = (),
        experiment_config: dict | None = None,
        run: ResolvedRun | None = None,
    ):
        if run is None:
            run = resolve_for_model(model, _training_config(config), train_dataloader=train_dataloader)
        elif config is not None and _training_config(config) != run.training:
            raise UsageError("config differs from the resolved run's training config; pass the run alone")
        self.run = run
        self.config = config = run.training
        check_destinations(config.alerts)  # a run without the alerts it asked for would not know until its first
        self.dist, self.device, self.amp_dtype = run.dist, run.device, run.amp_dtype
        seed_everything(config.seed)  # before parallelize: a meta-device model is initialised there
        self.tokenizer = tokenizer
        self.callbacks = list(callbacks)
        self.experiment_config = experiment_config or run.config_dict()
        self.output_dir = config.local_output_dir  # a URL output_dir: its local staging folder
        self.checkpoint_dir = config.resolved_checkpoint_dir
        self._run_files_uploaded: dict | None = None  # a URL output_dir: the record of the last upload
        # Whether the output folder was checked for an earlier run (`train.output_folder`): by the first
        # train(), or by `api.train` before it prepared the data.
        self.output_checked = False
        self._trained = False  # a train() call of this Trainer has ended: a later one trains on from there

        # the SDPA kernel the run is held to: checked before anything is sharded or compiled
        document_mask = run.experiment is not None and run.experiment.data.document_mask
        self.attention = attention_kernel.choose(
            config.sdpa_backend, model, self.device, self.amp_dtype, document_mask=document_mask
        )
        self.parallel = parallelize(
            model,
            config=config,
            dist=self.dist,
            device=self.device,
            amp_dtype=self.amp_dtype,
            activation_checkpointing=run.activation_checkpointing,
            build_optimizer=lambda module: build_optimizer(module, config, self.device),
        )
        self.model = model  # the user's model, as given (sharded in place under FSDP); see `Parallelism`
        downstream.check_supported(self)
        self.optimizer = self.parallel.optimizer
        self.autocast = autocast(self.device, self.amp_dtype)
        self.state = TrainState()
        self.bad_steps = NonFiniteSteps(self.device)  # renewed by train() from the (resumed) state
        self.spikes: SpikeMonitor | None = None  # training.on_loss_spike's monitor, made by train()
        self.time_to_target_s: float | None = None  # seconds into train() when target_val_loss was reached
        self._part_to_whole: float | None = None  # whole-split / screened-part validation loss, last measured
        self.stop = StopControl(self.dist.world_size)
        # Whether the loop reads its device counters (non-finite steps, spikes, a stop signal's flag)
        # after every step: on a CPU a read costs nothing; elsewhere it waits for the device, so only
        # logging steps read (values leave the device nowhere else).
        self.reads_every_step = self.device.type == "cpu"
        self.metrics_tracker = MetricsTracker()  # the run's metric backends (opened by train())
        self.alerts = Alerter(  # training.alerts: rank 0 tells people of anomalies and the run's end
            config.alerts,
            enabled=self.dist.is_main,
            run_name=str(config.output_dir).rstrip("/").rsplit("/", 1)[-1],
            write_row=self.metrics_tracker.log,
            use_wandb="wandb" in config.report_to,
        )
        self.checkpointer = Checkpointer(
            self.checkpoint_dir,
            parallel=self.parallel,
            loader=None,  # attached with the data: checkpoints record its position
            state=self.state,
            schedule={"name": config.lr_scheduler, "total_steps": config.max_steps},
            config=self.experiment_config,
            tokenizer_json=self._tokenizer_json(),
            keep_last=config.save_total_limit,
            background=config.async_checkpoint,
            periodic=bool(config.save_steps),
            on_saved=self._on_saved,
            remote=config.remote_checkpoint_dir,
            barrier=barrier,
        )
        self.total_steps: int | None = config.max_steps  # with the data: from the epochs when max_steps is unset
        self.train_loader = self.val_loader = None
        self._sources = (None, None)  # the data as given, attached again by each train()
        if train_dataloader is not None:
            self._attach_data(train_dataloader, val_dataloader)

    @classmethod
    def from_config(cls, model_config, training_config=None, data_config=None, *, callbacks: Iterable[Callback] = ()):
        """The one way from a config to a Trainer (`api.train`, `api.build_trainer` and the CLI come
        here): `pipeline.prepare_run` (resolve, data, vocabulary, model), then this (sub)class with the
        loaders. Takes the three configs, an `ExperimentConfig`, or a config file's path. The run
        writes its config.yaml and tokenizer into the output folder as the loop starts, and its plots
        when it ends."""
        experiment = experiment_from(model_config, training_config, data_config)
        check_destinations(experiment.training.alerts)  # before the data is prepared, which may take hours
        ready = prepare_run(experiment, pick_batch_size=auto_batch_size)
        run, tokenizer = ready.run, ready.prepared.tokenizer
        train_loader, val_loader = ready.loaders()
        output = run.training.local_output_dir
        return cls(
            ready.model,
            run.training,
            train_dataloader=train_loader,
            val_dataloader=val_loader,
            tokenizer=tokenizer,
            callbacks=[RunFilesAtStart(output, run.experiment, tokenizer), *callbacks, PlotsAtEnd(output)],
            run=run,
            experiment_config={**run.config_dict(), "data_fingerprint": ready.prepared.manifest["fingerprint"]},
        )

    @property
    def current_step(self) -> int:
        """Optimizer steps taken so far (the name Hugging Face-style subclasses read)."""
        return self.state.step

    @property
    def metrics(self) -> LoggedSeries:
        """Every value the run has logged, by its tracking name (train/loss, train/lr, eval/loss,
        eval/perplexity, custom/...), each a list of (step, value); other trainers' names (val_loss,
        learning_rate) are read as ours. Read from the run's metrics.jsonl, so a resumed run's earlier
        steps are in it too; only the main process writes that file (the others get no series)."""
        return logged_series(read_rows_of(self.output_dir / METRICS_FILE))

    @property
    def loggers(self) -> list:
        return self.metrics_tracker.loggers

    @loggers.setter
    def loggers(self, value: list) -> None:
        self.metrics_tracker.loggers = value

    @property
    def raw_model(self) -> nn.Module:
        """The same module as `model` (the name other training loops use for the unwrapped model)."""
        return self.model

    def _attach_data(self, train_dataloader, val_dataloader, *, more: bool = False) -> None:
        """The loaders, and what depends on them: the run's length in steps, the loader whose position
        checkpoints record. `more`: a later train() call, whose epochs come after the steps already taken."""
        config = self.config
        self._sources = (train_dataloader, val_dataloader)
        self.train_loader = as_loader(train_dataloader, self.device, self.dist.dp_size)
        self.val_loader = as_loader(val_dataloader, self.device) if val_dataloader is not None else None
        loader_world = getattr(self.train_loader, "world_size", self.dist.dp_size)
        if loader_world != self.dist.dp_size:
            raise UsageError(
                f"the training loader is split for {loader_world} process(es) but {self.dist.dp_size} data-parallel "
                "ranks are running; "
                "build it with rank and world_size from the environment (llm_trainer.build_loaders does)"
            )
        per_epoch = self.train_loader.batches_per_epoch() // config.gradient_accumulation_steps
        if config.max_steps is None and per_epoch == 0:
            raise UsageError(
                f"one epoch has {self.train_loader.batches_per_epoch()} batches, fewer than "
                f"gradient_accumulation_steps={config.gradient_accumulation_steps}; set training.max_steps or use more data"
            )
        first = self.state.step if more else 0  # the step this call's epochs start after
        if config.max_steps is not None:
            self.total_steps = config.max_steps
        else:
            self.total_steps = first + per_epoch * config.num_epochs
        if per_epoch == 0 and "epoch" in (config.eval_steps, config.save_steps):
            raise UsageError(
                f"training.eval_steps/save_steps 'epoch': one epoch has {self.train_loader.batches_per_epoch()} "
                f"batches, fewer than one step of {config.gradient_accumulation_steps}; give them a number of steps"
            )
        self.eval_every, self.save_every = (
            Every.of(setting, per_epoch, first) for setting in (config.eval_steps, config.save_steps)
        )
        if hasattr(self.train_loader, "accumulation"):  # our loaders: epochs of whole steps, the global batch saved
            self.train_loader.accumulation = config.gradient_accumulation_steps
        self.checkpointer.loader = self.train_loader
        self.checkpointer.schedule = {"name": config.lr_scheduler, "total_steps": self.total_steps}

    def _warn_of_a_long_warmup(self) -> None:
        """Said once per train() call: the warmup reaches the peak rate at its last step (the rate of step
        s, counted from 0, is learning_rate * (s + 1) / warmup_steps), so only a longer one never does."""
        config = self.config
        if config.lr_scheduler != "constant" and config.warmup_steps > self.total_steps > 0:
            warn(
                f"training.warmup_steps ({config.warmup_steps:,}) reaches past the run's last step "
                f"({self.total_steps:,}): the learning rate never gets to training.learning_rate "
                f"({config.learning_rate:g}); lower warmup_steps (a few percent of the steps is usual)"
            )

    def _speed_monitor(self) -> SpeedMonitor:
        """Throughput and MFU of this train() call, per model replica (a replica's tensor-parallel ranks
        share its tokens: their peak is the devices' together); FLOPs per token from the rows' length."""
        seq_len = self.run.seq_len or getattr(getattr(self.train_loader, "rows", None), "length", None)
        config = self.config
        peak = config.peak_flops or _peak_flops(self.device, self.amp_dtype)
        per_replica = self.dist.world_size // self.dist.dp_size
        return SpeedMonitor(
            config.speed_window_size,
            _flops_per_token(self.model, seq_len),
            peak * per_replica if peak else peak,
            self.device,
        )

    # -- the loop ---------------------------------------------------------------------------------

    def train(self, train_dataloader=None, val_dataloader=None, num_epochs: int | None = None) -> dict[str, Any]:
        """Run the loop, holding the output folder's lock (one run per folder); returns the summary row.
        The arguments are the Hugging Face style's: data given here (and `num_epochs`) replace what the
        constructor was given.

        The first call refuses a folder that holds an earlier run, as `llm-trainer train` does, unless the
        run resumes it or starts over (`train.output_folder`). A later call of the same Trainer trains
        on, in the same run: `num_epochs` more epochs of the data it is given (stages of a curriculum),
        the schedule following the run's new length as a resume with another length does; or, with
        training.max_steps set, on to that step (raised on `trainer.config` in between)."""
        train_source = train_dataloader if train_dataloader is not None else self._sources[0]
        if train_source is None:
            raise UsageError("no training data: pass train_dataloader to Trainer(...) or to train()")
        if num_epochs is not None:
            self.config = dataclasses.replace(self.config, num_epochs=num_epochs)
        val_source = val_dataloader if val_dataloader is not None else self._sources[1]
        self._attach_data(train_source, val_source, more=self._trained)  # the length from the config as it is now
        self._warn_of_a_long_warmup()
        if self._trained and self.state.step >= self.total_steps:
            raise UsageError(
                f"this Trainer has trained to its last step ({self.state.step:,}); to train on, pass the data and "
                "num_epochs to train() (with training.max_steps unset), or raise training.max_steps"
            )
        with (
            lock_run_folders(self.output_dir, self.checkpoint_dir, self.dist.is_main),
            warnings_once(),
            self.attention.hold(),
        ):
            if not self.output_checked:
                check_output_folder(self.config, is_main=self.dist.is_main)
                self.output_checked = True
            summary = self._loop()  # (a library's per-step warning prints once, not every step)
        self._trained = True
        finish()  # every rank is done with the process groups, and the process can exit cleanly
        return summary

    def _loop(self) -> dict[str, Any]:
        cfg, state, accum = self.config, self.state, self.config.gradient_accumulation_steps
        self.output_dir.mkdir(parents=True, exist_ok=True)
        resuming = bool(cfg.resume_from_checkpoint) and not self._trained  # (a later call goes on from memory)
        if resuming and cfg.remote_output_dir and self.dist.is_main:
            fetch_run_files(cfg)  # metrics.jsonl as the store holds it, on a machine without a copy
        if resuming:
            self.checkpointer.load(cfg.resume_from_checkpoint, url=cfg.resume_url)
            if state.step >= self.total_steps and finished_at(cfg) == state.step:  # its summary stays as it is
                raise finished_run(cfg, state.step)
            resumed = self.checkpointer.resumed_from
            elsewhere = resumed is not None and resumed.parent.resolve() != self.checkpointer.root.resolve()
            if state.step >= self.total_steps and elsewhere:
                raise UsageError(  # another run's last checkpoint: nothing to train, and no run here to end
                    f"{resumed} is at step {state.step:,}, this run's last step: there is nothing to train; raise "
                    f"training.max_steps above {state.step:,} to train on from it"
                )
        self.bad_steps = NonFiniteSteps(self.device, state.skipped_steps, state.consecutive_bad_steps)
        self.spikes = self._spike_monitor()
        self.profiler = StepProfiler(cfg, self.output_dir, self.device, self.dist.rank, self.total_steps)
        show_bar = self._shows_progress_bar()
        self.metrics_tracker.open(
            cfg.report_to,
            self.output_dir,
            self.experiment_config,
            progress_bar=show_bar,
            tensorboard_dir=tensorboard_dir(cfg),
            resumed_at=state.step if resuming else None,
            start_over=functools.partial(clear_run_files, cfg)
            if cfg.overwrite_output_dir and not self._trained
            else None,
        )
        tokens_at_start, start_step = state.tokens_seen, state.step
        self._log_start()
        for cb in self.callbacks:
            cb.on_train_begin(self)
        progress = self._progress_bar() if show_bar else None
        self.speed = self._speed_monitor()
        self.parallel.wrapped.train()
        started = self._started = time.perf_counter()
        timer = PhaseTimer(monitor=self.speed)  # evaluation and checkpoints are not training time
        last_saved, final_eval, ended, crash = None, None, False, None
        watchdog, speed_watch = StallWatchdog(self.alerts), ThroughputWatch(self.alerts)
        drawn = any(backend in cfg.report_to for backend in ("tensorboard", "wandb"))  # histograms too
        layers = LayerStats(self.model, cfg.layer_stats_steps, histograms=drawn)  # training.layer_stats_steps

        try:
            with self.checkpointer, self.stop.signals_handled(), self.profiler:
                while state.step < self.total_steps and not self.stop.requested:
                    self.profiler.begin_step(state.step + 1)
                    lr = learning_rate_at(state.step, cfg, self.total_steps)
                    set_learning_rate(self.optimizer, lr)
                    self.speed.start_step()
                    micro = [self.speed.timed_batch(self.train_loader) for _ in range(accum)]
                    layers_due = layers.due(state.step + 1)
                    out = train_step(
                        self.parallel,
                        micro,
                        autocast=self.autocast,
                        max_grad_norm=cfg.max_grad_norm,
                        share=self.stop.flag(self.device) if self.dist.world_size > 1 else None,
                        reject=functools.partial(self.spikes.check, state.step + 1) if self.spikes else None,
                        inspect=layers.before_step if layers_due else None,
                    )
                    self.bad_steps.add(out.finite)
                    state.step += 1
                    state.tokens_seen += out.tokens * self.dist.dp_size  # all replicas': the same at any world size
                    self.speed.end_step(out.tokens, out.samples)
                    watchdog.beat(state.step)
                    if layers_due and (layer_row := layers.after_step(state.step)) is not None:
                        self._log_metrics(layer_row)
                        if drawn:  # (every rank: FSDP2 reduces the counts)
                            histograms = layers.histograms(state.step)
                            with self.alerts.rows_lock:
                                self.metrics_tracker.histograms(state.step, histograms)
                    if progress is not None:
                        progress.update(1)

                    # Log: the only place values leave the device (see `reads_every_step`).
                    log_now = state.step % cfg.logging_steps == 0 or state.step == self.total_steps
                    if log_now or self.reads_every_step:
                        self._read_bad_steps()
                        self.stop.poll(out.shared)
                        if self._act_on_spikes():  # rewound: the loop goes on from the checkpoint's step
                            continue
                    if log_now:
                        loss, grad_norm = float(out.loss), float(out.grad_norm)  # (a GPU's queued work done)
                        row = TrainRow(
                            step=state.step,
                            epoch=self.train_loader.epoch,
                            loss=loss,
                            lr=lr,
                            grad_norm=grad_norm,
                            tokens_seen=state.tokens_seen,
                            skipped_steps=state.skipped_steps,
                            **self._spike_counters(),
                            **self.speed.metrics(),  # this step's time up to the read above
                        ).as_dict()
                        self._log_metrics(row)
                        speed_watch.check(row)
                        if progress is not None:
                            progress.set_postfix(
                                loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:,.0f}"
                            )
                        for cb in self.callbacks:
                            cb.on_step_end(self, row)

                    # Evaluate; track the best model; early stopping.
                    at_end = state.step == self.total_steps
                    if self.val_loader is not None and (at_end or self.eval_every.due(state.step)):
                        with timer.count("evaluation"):  # the run's last evaluation covers the whole split
                            final_eval = self._evaluate_and_track(full=at_end)

                    # Checkpoint periodically (in the background), at the end and when a signal asked us to stop.
                    with self.alerts.on_failure("checkpoint_failed", "a checkpoint save failed", lambda: state.step):
                        self.checkpointer.poll()  # (a background save's error surfaces here)
                    self.stop.poll()  # one process: a signal that came during logging/evaluation counts now
                    stopping = at_end or self.stop.stopping
                    if stopping or self.save_every.due(state.step):
                        self._read_bad_steps()
                        if self._act_on_spikes():  # never a checkpoint after an unread spike
                            continue
                        with timer.count("checkpoint"):
                            with self.alerts.on_failure(
                                "checkpoint_failed", "a checkpoint save failed", lambda: state.step
                            ):
                                last_saved = self.checkpointer.save(background=not stopping)
                        self.alerts.check_disk(self.checkpoint_dir, state.step)
                    self.stop.end_step()

            if self.stop.signal is not None and state.step >= self.total_steps:  # it came as the run ended
                log(
                    f"{self.stop.signal} came as the run reached its last step, with its checkpoint: the run is complete"
                )
                self.stop.signal = self.stop.reason = None
            self._read_bad_steps()
            # the end of a run that did not evaluate yet evaluates once; not a run a signal stops (time is short)
            if self.val_loader is not None and final_eval is None and state.step > start_step and not self.stop.signal:
                with timer.count("evaluation"):
                    final_eval = self._evaluate_and_track(full=True)
            # a run killed after its last checkpoint, ended now (not a resume a signal stopped before its first step)
            finishing = resuming and state.step == start_step and state.step >= self.total_steps
            if finishing and self.val_loader is not None and final_eval is None:
                final_eval = self.evaluate(full=True)  # its summary's, as logged (and tracked) before the kill
            if finishing and last_saved is None:
                last_saved = self.checkpointer.resumed_from
            elapsed = time.perf_counter() - started
            summary = SummaryRow(
                step=state.step,
                train_runtime_s=elapsed,
                tokens_per_s=(state.tokens_seen - tokens_at_start) / self.dist.dp_size / max(elapsed, 1e-9),
                tokens_seen=state.tokens_seen,
                skipped_steps=state.skipped_steps,
                stopped_early=self.stop.reason,
                best_val_loss=state.best_val_loss,
                checkpoint=str(last_saved) if last_saved else None,
                evaluation_s=timer.seconds["evaluation"],
                checkpoint_s=timer.seconds["checkpoint"],
                val_loss=final_eval["val_loss"] if final_eval else None,
                perplexity=final_eval["perplexity"] if final_eval else None,
                time_to_target_s=self.time_to_target_s,
                stopped_by_signal=self.stop.signal,
                **self._spike_counters(),
            ).as_dict()
            self._alert_end(summary)
            self._log_metrics(summary)
            self._log_end(summary)
            for cb in self.callbacks:
                cb.on_train_end(self, summary)
            ended = True
            return summary
        except torch.OutOfMemoryError as error:
            crash = out_of_memory(error, self.profiler, cfg)
            raise crash from None
        except RuntimeError as error:
            crash = error
            if (reason := peer_lost(error)) is None:
                raise
            crash = TrainingStopped(
                f"rank {self.dist.rank} stops at step {state.step + 1}: a collective with the other processes "
                f"failed ({reason}): another process ended or stopped answering, and its own output says why; "
                f"nothing saved in {cfg.remote_checkpoint_dir or self.checkpoint_dir} is touched, and "
                "training.resume_from_checkpoint=latest goes on from its latest checkpoint once every process can run"
            )
            raise crash from None
        except BaseException as error:
            crash = error
            raise
        finally:  # also when a callback or a stop raises: logs flushed, bar closed
            watchdog.close()
            if crash is not None:
                self.alerts.raise_alert("crashed", first_line(crash, 300), state.step)
            self.alerts.close(timeout=15)  # the run's end delivered (or given up) before the process exits
            if progress is not None:
                progress.close()
            self.metrics_tracker.close("failed" if crash is not None else "stopped" if self.stop.signal else "finished")
            if ended:  # the run's files as they end, logs closed
                self._upload_run_files()

    # -- pieces of the loop -----------------------------------------------------------------------

    def _read_bad_steps(self) -> None:
        """Copy the device-side non-finite counters into the state; stop after too many in a row."""
        state = self.state
        before = state.skipped_steps
        state.skipped_steps, state.consecutive_bad_steps, longest = self.bad_steps.read()
        if state.skipped_steps > before:
            self.alerts.raise_alert(
                "non_finite",
                f"{state.skipped_steps - before} step(s) with a non-finite loss or gradient skipped "
                f"({state.skipped_steps} in all)",
                state.step,
            )
        if longest >= self.config.max_consecutive_bad_steps:
            state.consecutive_bad_steps = max(state.consecutive_bad_steps, longest)
            fixes = ["Lower training.learning_rate"]  # and what this run can change besides
            if not self.config.max_grad_norm:
                fixes.append("enable clipping (training.max_grad_norm)")
            if self.amp_dtype == torch.float16:
                fixes.append("use bfloat16 instead of float16 (training.amp_dtype)")
            raise TrainingStopped(
                f"stopping: {state.consecutive_bad_steps} steps in a row had a non-finite loss or gradient (step "
                f"{state.step}); the weights were not updated by them and the last checkpoint in {self.checkpoint_dir} "
                f"is untouched. {', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}"
            )

    def _spike_monitor(self) -> SpikeMonitor | None:
        """The loss-spike monitor of training.on_loss_spike (None when off), from the (resumed) state."""
        if self.config.on_loss_spike == "off":
            return None
        check_rewindable(self.config, self.train_loader)
        return SpikeMonitor(self.config, self.device, self.state.spike_history)

    def _act_on_spikes(self) -> bool:
        """Read the spikes since the last read and act on them (training.on_loss_spike); keep the monitor's
        window in the state a checkpoint saves. True when the run went back to a checkpoint."""
        if self.spikes is None:
            return False
        spikes = self.spikes.read()
        self.state.loss_spikes += len(spikes)
        if spikes and self.config.on_loss_spike == "rewind":
            path = rewind(self.checkpointer, self.state, self.train_loader, spikes[0], self.config.max_rewinds)
            if path is not None:
                state = self.state
                self.bad_steps = NonFiniteSteps(self.device, state.skipped_steps, state.consecutive_bad_steps)
                self.spikes = self._spike_monitor()
                with self.alerts.rows_lock:  # (metrics.jsonl is reopened; the watchdog's thread may log)
                    self.metrics_tracker.rewound(state.step)
                self._alert_spike(spikes[0], "rewind", f"rewound to {path.name} (rewind {state.rewinds})")
                return True
            if self.state.rewinds >= self.config.max_rewinds:
                self._alert_spike(spikes[0], "max_rewinds", f"training.max_rewinds={self.config.max_rewinds} used up")
        for spike in spikes:
            self._alert_spike(spike, "loss_spike", f"training.on_loss_spike={self.config.on_loss_spike}")
        self.state.spike_history = self.spikes.history()
        return False

    def _alert_spike(self, spike, event: str, what: str) -> None:
        self.alerts.raise_alert(
            event,
            f"loss spike at step {spike.step}: {spike.metric} {spike.value:.4g} above {spike.limit:.4g}; {what}",
            spike.step,
        )

    def _alert_end(self, summary: dict) -> None:
        """The run's end as an alert (before the summary row, which ends metrics.jsonl)."""
        why = summary.get("stopped_early")
        if summary.get("stopped_by_signal"):
            event, text = (
                "stopped",
                f"stopped by {summary['stopped_by_signal']}; resume with resume_from_checkpoint=latest",
            )
        elif why:
            event, text = "finished", f"stopped early: {why}"
        else:
            event, text = "finished", f"finished {summary['step']} steps in {summary['train_runtime_s']:.0f} s"
        if summary.get("best_val_loss") is not None:
            text += f"; best val_loss {summary['best_val_loss']:.4f}"
        self.alerts.raise_alert(event, text, summary["step"])

    def _spike_counters(self) -> dict:
        if self.spikes is None:
            return {}
        return {"loss_spikes": self.state.loss_spikes, "rewinds": self.state.rewinds}

    def evaluate(self, dataloader=None, *, full: bool = False) -> dict:
        """val_loss and perplexity over the first `eval_max_batches` validation batches (all when unset,
        or with `full`); or over all of `dataloader` (a test set, any batches `train` takes), as the
        Hugging Face style's `trainer.evaluate(test_loader)`."""
        loader = self.val_loader if dataloader is None else as_loader(dataloader, self.device)
        if loader is None:
            raise UsageError("no validation data: pass val_dataloader or set data.validation_split")
        whole = full or dataloader is not None  # every batch of it
        return evaluate(
            self.model,
            loader,
            autocast=self.autocast,
            reduce=self._sum_over_replicas,
            max_batches=None if whole else self.config.eval_max_batches,
            progress=self.config.progress_bar,
            sources=getattr(loader, "source_labels", None),  # per-source losses of a mixture
            nll=self.parallel.eval_nll if self.parallel.pipelined else None,  # the stages, not the model whole
            screen=self.config.eval_max_batches if full and dataloader is None else None,
        )

    def _sum_over_replicas(self, totals: torch.Tensor) -> torch.Tensor:
        """Sums over the data-parallel replicas: the ranks of one replica (tensor parallel) read the same
        rows, so each is counted once."""
        all_reduce_(totals)
        per_replica = self.dist.world_size // self.dist.dp_size
        return totals.div_(per_replica) if per_replica > 1 else totals

    def _towards_target(self, metrics: dict, target: float) -> tuple[dict, bool]:
        """(the evaluation to report, whether it covers the whole validation split: only that one decides
        that target_val_loss is reached). An evaluation of part of the split calls for the whole one when
        it predicts the target: its loss times the whole / part ratio of the last whole evaluation (before
        there is one: within 1% of the target)."""
        if self.config.eval_max_batches is None or metrics.get("batches") == metrics.get("batches_total"):
            return metrics, True
        part = metrics["val_loss"]
        predicted = part * self._part_to_whole if self._part_to_whole is not None else part / 1.01
        if predicted > target:
            return metrics, False
        whole = self.evaluate(full=True)
        self._part_to_whole = whole["val_loss"] / part
        return whole, True

    def _evaluate_and_track(self, full: bool = False) -> dict:
        """Evaluate (`full`: the whole split whatever eval_max_batches says), with the downstream tasks when
        due; best_model follows metric_for_best_model (the lowest val_loss by default); early stopping's patience counts evaluations that did not beat the last counted
        improvement by more than min_delta."""
        cfg, state = self.config, self.state
        # (a subclass's own evaluate() that takes no arguments is called as it is)
        metrics = (
            self.evaluate(full=True)
            if full and "full" in inspect.signature(self.evaluate).parameters
            else self.evaluate()
        )
        target = cfg.target_val_loss
        if target is not None:
            metrics, whole = self._towards_target(metrics, target)
        # What the best model and early stopping compare: the loss over the batches every evaluation covers
        # (a whole-split evaluation's first eval_max_batches), so that a whole split's value never meets a part's.
        loss = metrics.pop("screen_val_loss", metrics["val_loss"])
        over = "" if loss == metrics["val_loss"] else f" (its first {cfg.eval_max_batches} batches, as the others)"
        scores = downstream.run_during_training(self, state.step) if downstream.is_due(cfg, state.step, full) else {}
        if scores:
            self._log_metrics(downstream_row(state.step, scores))
        if downstream.follows_loss(cfg):
            if state.best_val_loss is None or loss < state.best_val_loss:
                state.best_val_loss, state.best_step = loss, state.step
                self.checkpointer.save_best(metrics)
        else:  # best_model/ follows a source's loss or a downstream metric; best_val_loss stays the lowest loss
            state.best_val_loss = loss if state.best_val_loss is None else min(loss, state.best_val_loss)
            sources = getattr(getattr(self.val_loader, "source_labels", None), "names", None)
            value = downstream.metric_value(cfg, scores, metrics, sources)
            sign = 1 if downstream.greater_is_better(cfg) else -1
            if value is not None and (state.best_metric is None or sign * value > sign * state.best_metric):
                state.best_metric, state.best_step = value, state.step
                self.checkpointer.save_best({**metrics, cfg.metric_for_best_model: value})
        reference = state.patience_reference if state.patience_reference is not None else state.best_val_loss
        reasons = []  # why to stop, said after the evaluation that decided it
        if state.patience_reference is None or loss < reference - cfg.early_stopping_min_delta:
            state.patience_reference, state.evals_without_improvement = loss, 0
        else:
            state.evals_without_improvement += 1
            by = f" by more than {cfg.early_stopping_min_delta}" if cfg.early_stopping_min_delta else ""
            self.alerts.raise_alert(
                "eval_worse",
                f"val_loss{over} {loss:.4f} did not improve on {reference:.4f}{by} ({state.evals_without_improvement} "
                "evaluation(s) in a row)",
                state.step,
            )
            if cfg.early_stopping_patience and state.evals_without_improvement >= cfg.early_stopping_patience:
                reasons.append(
                    f"early stopping: val_loss did not improve by more than {cfg.early_stopping_min_delta} for "
                    f"{state.evals_without_improvement} evaluations (best {state.best_val_loss:.4f} at step {state.best_step})"
                )
                self.alerts.raise_alert("early_stop", reasons[-1], state.step)  # its own kind, before "finished"
        if target is not None and whole and metrics["val_loss"] <= target:
            self.time_to_target_s = time.perf_counter() - self._started
            reasons.append(
                f"target reached: val_loss {metrics['val_loss']:.4f} <= {target} at step {state.step}, "
                f"{self.time_to_target_s:.1f}s after training started"
            )
        self._log_metrics(EvalRow(step=state.step, **metrics).as_dict())
        for reason in reasons:
            self.stop.request(reason)
        for cb in self.callbacks:
            cb.on_evaluate(self, metrics)
        return metrics

    def save_checkpoint(self, *given: Any, background: bool = False) -> Path:
        """Save the current state now (every rank calls it) as checkpoint-<step>; see `Checkpointer.save`.
        Positional arguments (the epoch and loss other trainers' `save_checkpoint(epoch, val_loss)` take)
        are refused in one line: the checkpoint records the step, the data position and the state itself."""
        if given:
            raise UsageError(
                f"Trainer.save_checkpoint() takes no positional arguments (got {len(given)}): it saves the run as it "
                "is now, as checkpoint-<step>, with its own step, data position and metrics; call save_checkpoint() "
                "(or save_checkpoint(background=True))"
            )
        if self.train_loader is None:
            raise UsageError(
                "save_checkpoint needs the training data (a checkpoint records the loader's position): "
                "pass train_dataloader to Trainer(...) or to train() first"
            )
        self._read_bad_steps()
        self._act_on_spikes()
        return self.checkpointer.save(background=background)

    def _on_saved(self, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_save(self, path)
        self._upload_run_files()

    def _upload_run_files(self) -> None:
        """A URL output_dir: the run's files beside the checkpoint just uploaded (see `train.output_folder`)."""
        if self.config.remote_output_dir and self.dist.is_main:
            self._run_files_uploaded = upload_run_files(self.config, self._run_files_uploaded)

    def _tokenizer_json(self) -> str | None:
        """The tokenizer as tokenizer.json (`tokenizer.tokenizer_json`); None: the checkpoint then has no
        tokenizer, and generate/export say so."""
        return tokenizer_json(self.tokenizer)

    # -- output -----------------------------------------------------------------------------------

    def _log_metrics(self, row: dict) -> None:
        """Send one row (train, eval or summary) to every backend; override to add metrics (e.g.
        `custom/...`), calling `super()._log_metrics(row)`."""
        with self.alerts.rows_lock:  # (the stall watchdog's thread logs its alert rows too)
            self.metrics_tracker.log(row)

    def _shows_progress_bar(self) -> bool:
        """A bar on a terminal only (see `logs.shows_progress_bar`); without one, the console logger
        prints the training rows as lines."""
        return shows_progress_bar(self.config.progress_bar)

    def _progress_bar(self) -> Progress:
        return Progress(self.total_steps, "train", "step", initial=self.state.step, bar=True, lines=False)

    def _log_start(self) -> None:
        n_params = self.parallel.parameter_count()
        cfg = self.config
        world = self.dist.world_size
        rows = getattr(self.train_loader, "batch_size", None) or cfg.batch_size  # a user's DataLoader decides
        effective = rows * cfg.gradient_accumulation_steps * self.dist.dp_size
        replicas = (  # tensor-parallel ranks of one replica read the same rows
            f"{world} process(es)"
            if self.dist.dp_size == world
            else f"{self.dist.dp_size} replica(s) of {world} processes"
        )
        log(
            f"train: {n_params:,} parameters on {self.device}, {self.total_steps} steps, effective batch {effective} "
            f"= {rows} x {cfg.gradient_accumulation_steps} accumulation x {replicas}"
            f"{' (' + self.dist.strategy + ')' if self.dist.strategy != DistInfo.strategy else ''}, "
            f"lr {cfg.learning_rate:g} ({cfg.lr_scheduler}), "
            f"{'amp ' + cfg.amp_dtype if cfg.use_amp else 'float32'}{', compiled' if cfg.compile else ''}, "
            f"{self.attention.describe()}{', batches read ahead' if getattr(self.train_loader, 'reads_ahead', False) else ''}"
        )
        if not cfg.use_amp and native_bf16(self.device):
            log(
                f"note: this {self.device.type.upper()} computes bfloat16 natively; training.use_amp=auto (bf16 autocast) "
                "trains faster here (measurements: bench/README.md)"
            )

    def _log_end(self, summary: dict) -> None:
        parts = [
            f"{summary['step']} steps",
            f"{summary['train_runtime_s']:.1f}s",
            f"{summary['tokens_per_s']:,.0f} tok/s",
        ]
        if "val_loss" in summary:
            parts.append(f"val_loss {summary['val_loss']:.4f} (perplexity {summary['perplexity']:.2f})")
        if summary["skipped_steps"]:
            parts.append(f"{summary['skipped_steps']} non-finite steps skipped")
        log("done: " + ", ".join(parts))
        if self.stop.signal is not None:  # (early stopping and a reached target said so after their evaluation)
            log(f"stopped by {self.stop.signal}; resume with training.resume_from_checkpoint=latest")


def _training_config(config: TrainingConfig | Mapping[str, Any] | None) -> TrainingConfig:
    """A TrainingConfig from what the caller gave: ours, a dict of its fields (e.g. a user's whole
    experiment dict: other keys are listed once, not refused), a whole experiment (an ExperimentConfig,
    its `__dict__`, a dict of sections: its training section, the others named once as not used), or
    None for the defaults."""
    if config is None:
        return TrainingConfig()
    if isinstance(config, TrainingConfig):
        return config
    sections = config.__dict__ if isinstance(config, ExperimentConfig) else config
    if isinstance(sections, Mapping) and isinstance(sections.get("training"), (TrainingConfig, Mapping)):
        others = ", ".join(str(key) for key in sections if key != "training")
        if others:
            log(
                f"config: an experiment's sections; the Trainer takes its training section ({others}: not used, "
                "the model and the data are the ones given to the Trainer; Trainer.from_config builds them from a config)"
            )
        return _training_config(sections["training"])
    if not isinstance(config, Mapping):
        raise UsageError(f"config must be a TrainingConfig or a dict of its fields, got {type(config).__name__}")
    known = [f.name for f in dataclasses.fields(TrainingConfig)]
    values, problems, unused = config_aliases.canonical_section("training", dict(config), known, strict=False)
    if problems:
        raise UsageError(config_aliases.one_message(problems))
    if unused:
        names = ", ".join(map(str, unused))
        are = "is not a TrainingConfig field" if len(unused) == 1 else "are not TrainingConfig fields"
        hint = config_aliases.wandb_hint([str(key) for key in unused])
        log(f"config: {names} {are}; the Trainer does not use {'it' if len(unused) == 1 else 'them'}{hint}")
    try:
        return TrainingConfig(**values)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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
