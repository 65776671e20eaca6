"""The run, resolved once: every value that depends on more than one config section, or on the
machine, is decided here and read from here, in one frozen `ResolvedRun` the Trainer always receives.

Two ways to get one:

* `pipeline.prepare_run(experiment, pick_batch_size=...)`: llm_trainer's own pipeline
  (`Trainer.from_config`, which the CLI, `train` and `build_trainer` call; the LR finder). It runs
  `resolve_experiment` (training config as the run uses it), `setup_runtime`, prepares the data for
  the tokenizer, then `resolve_run`.
* `resolve_for_model(model, training, train_dataloader=...)`: a bring-your-own model and loaders
  (what `Trainer(model, config, ...)` does when it is given no run).

`run.experiment` is the experiment as trained: the model's presets filled in and `vocab_size` taken
from the tokenizer. `run.training`, `run.seq_len`, `run.device`, `run.dist`, `run.amp_dtype` and
`run.activation_checkpointing` are the only answers to those questions; nothing downstream
recomputes them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import launcher
from .config import ExperimentConfig, ModelConfig, TrainingConfig, with_carried
from .errors import UsageError
from .logs import warn
from .parallel import distributed
from .parallel.distributed import DistInfo
from .parallel.mesh import resolve_layout


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA, then MPS, then CPU; an explicit device must exist here."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)  # (TrainingConfig allows cpu, cuda[:N] and mps)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"training.device={name} but CUDA is not available here; use device: auto or cpu")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError(f"training.device={name} but MPS (Apple's GPU) is not available here; use device: auto or cpu")
    return device


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), as torch detects it."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def amp_dtype(training: TrainingConfig) -> torch.dtype | None:
    """The autocast dtype, or None when training in float32 (`training` with use_amp decided)."""
    assert training.use_amp != "auto", "use_amp=auto is decided by resolve_amp first"
    if not training.use_amp:
        return None
    return torch.bfloat16 if training.amp_dtype == "bfloat16" else torch.float16


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sequence_length(experiment: ExperimentConfig) -> int:
    """Tokens per training row: data.max_length, else the model's context; never longer than the context."""
    length = experiment.data.max_length or experiment.model.max_seq_len
    if length > experiment.model.max_seq_len:
        raise UsageError(
            f"data.max_length ({length}) is longer than model.max_seq_len ({experiment.model.max_seq_len}); "
            "lower data.max_length or raise model.max_seq_len"
        )
    return length


def vocab_size(experiment: ExperimentConfig, tokenizer=None) -> tuple[int, str]:
    """(the model's vocabulary size, where it came from).

    With the tokenizer: its size, or model.vocab_size when that is set and large enough. Without one
    (an estimate before any data is prepared): model.vocab_size, else what the tokenizer settings imply.
    """
    set_size = experiment.model.vocab_size
    if tokenizer is not None:
        if set_size is None:
            return tokenizer.vocab_size, "the tokenizer"
        if set_size < tokenizer.vocab_size:
            raise UsageError(
                f"model.vocab_size ({set_size}) is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size}); "
                "remove model.vocab_size to take it from the tokenizer"
            )
        return set_size, "model.vocab_size"
    if set_size is not None:
        return set_size, "model.vocab_size"
    kind = experiment.data.tokenizer
    if kind == "bpe":
        return experiment.data.tokenizer_vocab_size, "data.tokenizer_vocab_size"
    if kind == "char":
        return 256, "assumed for the char tokenizer (set model.vocab_size for the exact count)"
    from .tokenizer import Tokenizer

    return Tokenizer.load(kind).vocab_size, kind


def token_anchors(training: TrainingConfig, seq_len: int | None, world_size: int) -> TrainingConfig:
    """`total_batch_tokens` and `max_tokens` turned into the gradient_accumulation_steps and max_steps
    the loop counts in (the anchors themselves are cleared: the returned config is in steps)."""
    if training.total_batch_tokens is None and training.max_tokens is None:
        return training
    if seq_len is None:
        raise UsageError(
            "training.max_tokens / total_batch_tokens need the sequence length; use llm_trainer.train, "
            "or loaders of fixed-length rows, or set max_steps and gradient_accumulation_steps"
        )
    per_micro_step = training.batch_size * seq_len * world_size
    accumulation = training.gradient_accumulation_steps
    if training.total_batch_tokens is not None:
        accumulation, rest = divmod(training.total_batch_tokens, per_micro_step)
        if rest or accumulation == 0:
            raise UsageError(
                f"training.total_batch_tokens ({training.total_batch_tokens:,}) must be a multiple of batch_size x "
                f"sequence length x processes = {training.batch_size} x {seq_len} x {world_size} = {per_micro_step:,}"
            )
    max_steps = training.max_steps
    if training.max_tokens is not None:
        max_steps = -(-training.max_tokens // (per_micro_step * accumulation))
    return dataclasses.replace(
        training,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        total_batch_tokens=None,
        max_tokens=None,
    )


def resolve_training(training: TrainingConfig) -> TrainingConfig:
    """The training config as the run uses it: under DeepSpeed, the file's own batch sizes, clipping,
    precision, optimizer and schedule folded in (`deepspeed_engine.merge_into_training`), before the
    optimizer, the schedule or the loaders are built from it."""
    device = resolve_device(training.device)
    if training.distributed_strategy == "deepspeed" and training.deepspeed_config is not None:
        from .parallel.deepspeed_engine import merge_into_training

        # before use_amp=auto is decided: a DeepSpeed file's bf16/fp16 section decides the precision
        training = merge_into_training(training, launcher.world_size(), device)
    return resolve_amp(training, device)


def resolve_amp(training: TrainingConfig, device: torch.device) -> TrainingConfig:
    """`use_amp: auto` decided for `device`: bf16 autocast where it computes bf16 natively, else float32.
    An `amp_dtype: float16` asked for beside it is float16 autocast on any device: auto chooses for the
    bf16 default only, and a dtype the user named is never replaced by another."""
    if training.use_amp != "auto":
        return training
    if training.amp_dtype == "float16":
        return dataclasses.replace(training, use_amp=True)
    return dataclasses.replace(training, use_amp=native_bf16(device), amp_dtype="bfloat16")


def recorded_amp_dtype(recorded_training: object, device: torch.device) -> torch.dtype | None:
    """The autocast dtype a run recorded in its checkpoint (its `training` section) asks for on `device`,
    so that `eval` measures a model in the precision its run evaluated it in. A missing or malformed
    value counts as the default."""
    fields = recorded_training if isinstance(recorded_training, dict) else {}
    use_amp = fields.get("use_amp", TrainingConfig.use_amp)
    dtype = fields.get("amp_dtype", TrainingConfig.amp_dtype)
    training = TrainingConfig(
        use_amp=use_amp if use_amp in (True, False, "auto") else TrainingConfig.use_amp,
        amp_dtype=dtype if dtype in ("bfloat16", "float16") else TrainingConfig.amp_dtype,
    )
    return amp_dtype(resolve_amp(training, device))


def native_bf16(device: torch.device) -> bool:
    """bf16 autocast trains faster than float32 here: a CUDA GPU with bf16, or a CPU with AVX512-BF16/AMX
    (measured in bench/cpu_bf16.py; figures in bench/README.md)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_computes_bf16()


def activation_checkpointing(training: TrainingConfig) -> bool:
    """training.gradient_checkpointing (a config's model.gradient_checkpointing: true is read as it)."""
    return training.gradient_checkpointing


@dataclass(frozen=True)
class Runtime:
    """Where and how this process trains."""

    device: torch.device
    dist: DistInfo
    amp_dtype: torch.dtype | None  # autocast dtype; None: float32


def setup_runtime(training: TrainingConfig) -> Runtime:
    """Pick the device and open the process group (under a launcher); once per process."""
    dist, device = distributed.setup(training, resolve_device(training.device))
    return Runtime(device=device, dist=dist, amp_dtype=amp_dtype(training))


def local_runtime(training: TrainingConfig) -> Runtime:
    """This process alone (no process group), e.g. for the LR finder."""
    return Runtime(device=resolve_device(training.device), dist=DistInfo(), amp_dtype=amp_dtype(training))


@dataclass(frozen=True)
class ResolvedRun:
    """Everything the Trainer reads about the run, decided once (see the module docstring)."""

    training: TrainingConfig  # use_amp decided, a DeepSpeed file folded in, token anchors turned into steps
    runtime: Runtime
    seq_len: int | None  # tokens per row; None: a user's loader that does not say
    activation_checkpointing: bool
    experiment: ExperimentConfig | None = None  # llm_trainer's pipeline: the model resolved (presets, vocab_size)
    vocab_source: str | None = None  # where vocab_size came from (with `experiment`)

    def __post_init__(self):
        assert self.experiment is None or self.experiment.training is self.training, "one training config"

    @property
    def vocab_size(self) -> int | None:
        return self.experiment.model.vocab_size if self.experiment is not None else None

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def dist(self) -> DistInfo:
        return self.runtime.dist

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return self.runtime.amp_dtype

    def config_dict(self) -> dict:
        """The run's configuration as checkpoints record it: the experiment, or the training section alone."""
        if self.experiment is not None:
            return self.experiment.to_dict()
        return {"training": self.training.to_dict()}


def resolve_experiment(experiment: ExperimentConfig) -> ExperimentConfig:
    """The experiment with its training config as the run uses it (`resolve_training`); a sequence length
    longer than the model's context fails here, before any data is prepared."""
    experiment = dataclasses.replace(experiment, training=resolve_training(experiment.training))
    seq_len = sequence_length(experiment)
    check_layout(experiment.training, experiment.model, seq_len, document_mask=experiment.data.document_mask)
    return experiment


def check_layout(
    training: TrainingConfig, model: ModelConfig | None, seq_len: int | None, *, document_mask: bool = False
) -> None:
    """The device mesh's degrees against the launcher's world size, the model and the rows, before the
    process group opens or anything is allocated (`mesh.resolve_layout`)."""
    device_type = resolve_device(training.device).type
    resolve_layout(
        training,
        launcher.world_size(),
        model=model,
        seq_len=seq_len,
        device_type=device_type,
        document_mask=document_mask,
    )


RUN_SETTINGS = ("dropout", "attention_dropout", "attention_backend")  # how a model runs, not what it is
INIT_SETTINGS = ("init_std", "zero_init_projections")  # how a fresh model's weights are drawn


def _init_from_model(asked: ModelConfig, loaded: ModelConfig) -> ModelConfig:
    """The model section of a run that starts from model.init_from: the folder's architecture, with the
    settings of how it runs (dropout) that the run's own section sets (those it leaves at their
    defaults keep the folder's). What else the section sets and the folder differs in cannot apply to
    weights already shaped, which one warning names."""
    defaults = ModelConfig()
    given = {
        f.name: getattr(asked, f.name)
        for f in dataclasses.fields(ModelConfig)
        if f.name != "init_from" and getattr(asked, f.name) != getattr(defaults, f.name)
    }
    runs = {name: value for name, value in given.items() if name in RUN_SETTINGS}
    resolved = loaded.resolved()
    unused = [
        f"model.{name}={value!r}"
        for name, value in given.items()
        if name not in (*RUN_SETTINGS, *INIT_SETTINGS) and getattr(resolved, name) != value
    ]
    if unused:
        warn(
            f"model.init_from {asked.init_from}: the model is the folder's, so {', '.join(unused)} here "
            f"{'does' if len(unused) == 1 else 'do'} not apply (its model_config.json says otherwise); "
            "dropout, attention_dropout and attention_backend do"
        )
    return dataclasses.replace(loaded, init_from=asked.init_from, **runs)


def resolve_run(
    experiment: ExperimentConfig,
    tokenizer,
    runtime: Runtime,
    model_config: ModelConfig | None = None,
    pick_batch_size: Callable[..., TrainingConfig] | None = None,
) -> ResolvedRun:
    """Fix everything that depends on the tokenizer and the machine (`experiment` from
    `resolve_experiment`). `model_config`: the architecture of the model loaded with model.init_from,
    which replaces the experiment's model section. `pick_batch_size`: `train.batch_size.auto_batch_size`,
    given by the caller (the estimator sits above this module), for `training.batch_size: auto`."""
    model = experiment.model if model_config is None else _init_from_model(experiment.model, model_config)
    experiment = dataclasses.replace(experiment, model=model)
    seq_len = sequence_length(experiment)
    size, source = vocab_size(experiment, tokenizer)
    if model_config is not None:
        source = f"model.init_from ({experiment.model.init_from})"
    model = dataclasses.replace(model.resolved(), vocab_size=size)
    training = experiment.training
    if training.batch_size == "auto":  # before the loaders and the accumulation are made from it
        assert pick_batch_size is not None, "batch_size auto: the caller passes the estimator's picker"
        training = pick_batch_size(model, training, seq_len, runtime.dist.dp_size, runtime.device)
    training = token_anchors(training, seq_len, runtime.dist.dp_size)
    experiment = dataclasses.replace(experiment, model=model, training=training)
    return ResolvedRun(
        training=training,
        runtime=runtime,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing(training),
        experiment=experiment,
        vocab_source=source,
    )


def resolve_for_model(model, training: TrainingConfig, *, train_dataloader=None) -> ResolvedRun:
    """The run of a bring-your-own model and loaders: the training config as the run uses it, the
    device and process group, and run lengths in tokens turned into steps from the rows' length
    (which llm_trainer's loaders know; a user's loader without it cannot use token anchors)."""
    model_config = getattr(model, "config", None)
    if isinstance(model_config, ModelConfig):  # a training setting given to it, applied as ExperimentConfig does
        training = with_carried(training, "training", model_config)
    training = resolve_training(training)
    if training.batch_size == "auto":
        raise UsageError(
            "training.batch_size auto sizes llm_trainer's own loaders (llm_trainer.train or Trainer.from_config); "
            "with a model and loaders of your own, give batch_size as a number"
        )
    seq_len = getattr(getattr(train_dataloader, "rows", None), "length", None)
    check_layout(training, model_config if isinstance(model_config, ModelConfig) else None, seq_len)
    runtime = setup_runtime(training)
    training = token_anchors(training, seq_len, runtime.dist.world_size)
    return ResolvedRun(
        training=training,
        runtime=runtime,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing(training),
    )
