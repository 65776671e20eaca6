"""Typed configuration: `ModelConfig`, `TrainingConfig`, `DataConfig` and the experiment that holds all three.

Every config is a keyword-only dataclass validated on construction: a wrong type or an out-of-range
value raises `ValueError` naming the field. Experiment files (YAML or JSON) with sections `model:`,
`training:`, `data:` are read by `config_loader.load_experiment`, which also applies dotted
command-line overrides (`training.learning_rate=3e-4`); other frameworks' names are `config_aliases`'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import yaml

from . import config_aliases
from .errors import UsageError
from .files.atomic import write_text
from .files.buckets import check_url_shape, is_url, join, mirror_name
from .limits import MAX_EXECUTOR_TASKS, MAX_SPIKE_WINDOW, check_model_dimensions

# ----------------------------------------------------------------------------------------------
# Generic validation: the declared type of each field is the schema.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false", type(None): "null"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _conforms(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        return isinstance(value, (list, tuple)) and all(_conforms(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _path_value(value: str, where: str) -> str:
    """A string setting as a path setting reads it: a file:// URL as the local path it names
    (`file:///data/x` -> `/data/x`); one of another machine (`file://host/x`) is refused, as is a URL
    of another shape than meant (`buckets.check_url_shape`). Any other value as it is."""
    if not value.startswith("file://"):
        check_url_shape(value, where)
        return value
    parts = urlsplit(value)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{where} {value!r} names a file on the machine {parts.netloc!r}; give a path of this one")
    return unquote(parts.path)


# The losses `training.metric_for_best_model` may name, as evaluation rows name them: the validation
# loss (HF spells it eval_loss or loss), or one source's in a mixture. Any other metric is a score.
LOSS_NAMES = ("val_loss", "eval_loss", "loss")
SOURCE_LOSS = re.compile(r"eval/(.+)/loss")


def is_loss_metric(metric: str) -> bool:
    """Whether `metric` is a loss (better lower), not a downstream score."""
    return metric in LOSS_NAMES or SOURCE_LOSS.fullmatch(metric) is not None


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A config class's fields and their declared types, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


class _Validated:
    """Mixin: type-check every field against its annotation, then run the class's own checks.

    A class may also take keywords in other frameworks' spellings (`SPELLINGS`, declared as `InitVar`s
    in that order, so not fields): `config_aliases` says what they set. Its own fields are set here;
    settings of another section are kept in `for_other_sections` for `ExperimentConfig` to apply.
    """

    UNBOUNDED: tuple[str, ...] = ()  # float fields where +inf means "no limit" (every other one must be finite)
    SECTION = ""  # the section config_aliases knows the class by
    SPELLINGS: tuple[str, ...] = ()

    def __post_init__(self, *spelled: Any) -> None:
        self.for_other_sections = self._read_spellings(dict(zip(self.SPELLINGS, spelled)))
        self._coerce()
        for name in _field_types(type(self)):
            object.__setattr__(self, name, self._checked_value(name, getattr(self, name)))
        self._check()
        object.__setattr__(self, "_built", True)

    _built = False  # set once constructed: from then on each assignment is checked (`__setattr__`)

    def _checked_value(self, name: str, value: Any) -> Any:
        """`value` for field `name` as stored (an int as a float where the field takes numbers, a tuple as
        a list, a file:// URL as its local path), or a ValueError naming the field when its type does not
        match."""
        tp = _field_types(type(self))[name]
        section = type(self).__name__
        if isinstance(value, str):
            value = _path_value(value, f"{section}.{name}")
        elif isinstance(value, (list, tuple)):
            value = [_path_value(v, f"{section}.{name}") if isinstance(v, str) else v for v in value]
        if not _conforms(value, tp):
            raise ValueError(f"{section}.{name} must be {_type_name(tp)}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value) and not (value > 0 and name in self.UNBOUNDED):
            raise ValueError(f"{section}.{name} must be a finite number, got {value}")
        takes_float = tp is float or (
            typing.get_origin(tp) in (typing.Union, types.UnionType) and float in typing.get_args(tp)
        )
        if takes_float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return list(value) if isinstance(value, tuple) else value

    def __setattr__(self, name: str, value: Any) -> None:
        """Once constructed, a field's new value is type-checked as the constructor checks it, and a name
        that is no field is refused as the constructor refuses it, with the same hint (`config.num_layers
        = 6` would otherwise be kept beside n_layers and never read). The checks across fields run where
        the config is used (`resolved()`, a run's resolution), since fields are set one after another."""
        if not self._built or name == "for_other_sections":
            object.__setattr__(self, name, value)
        elif name in _field_types(type(self)):
            object.__setattr__(self, name, self._checked_value(name, value))
        elif hasattr(type(self), name):
            object.__setattr__(self, name, value)  # a read-only alias's property refuses it with its own line
        else:
            raise ValueError(self._unknown_attribute(name, value))

    def _unknown_attribute(self, name: str, value: Any) -> str:
        cls = type(self).__name__
        values, problems, _ = config_aliases.canonical_section(
            self.SECTION or cls, {name: value}, list(_field_types(type(self))), others=ExperimentConfig.known_fields()
        )
        if problems:
            return f"{cls}: {config_aliases.one_message(problems)}"
        settings = ", ".join(f"{key}={item!r}" for key, item in values.items())
        return f"{cls}.{name} is another framework's name, read by the constructor and config files; set {settings}"

    def _read_spellings(self, given: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Set what the keywords in other spellings set in this section (a field set to something else
        too is an error); return what they set in other sections."""
        given = {key: value for key, value in given.items() if value is not None}
        if not given:
            return {}
        sections, problems = config_aliases.keywords(self.SECTION, given)
        if problems:
            raise ValueError(config_aliases.one_message(problems))
        defaults = {f.name: f.default for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        for name, value in sections.pop(self.SECTION, {}).items():
            current = getattr(self, name)
            _require(
                current in (value, defaults[name]),
                f"{type(self).__name__}: {', '.join(given)} sets {name}={value!r}, but {name}={current!r} was given",
            )
            setattr(self, name, value)
        for key, value in given.items():
            if config_aliases.spellings_of(self.SECTION, key)[0] != self.SECTION:
                # where `dataclasses.replace` reads an InitVar: a copy of this config carries it too
                object.__setattr__(self, key, value)
        return sections

    def _value_of(self, name: str) -> Any:
        """The value field `name` stands for (ModelConfig: a preset's where the field is unset)."""
        return getattr(self, name)

    def _coerce(self) -> None:
        """Turn nested mappings into their typed configs before the type check (overridden where needed)."""

    def _check(self) -> None:  # pragma: no cover - overridden
        pass

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, section: str | None = None):
        """Build from a plain mapping; an unknown key names the closest valid one."""
        section = section or cls.__name__
        if not isinstance(values, dict):
            raise ValueError(f"section {section!r} must be a mapping of field: value, got {type(values).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        values, problems, _ = config_aliases.canonical_section(  # other frameworks' names
            section, values, known, others=ExperimentConfig.known_fields()
        )
        if problems:
            raise ValueError(config_aliases.one_message(problems))
        return cls(**values)


def _keywords_as_in_files(cls: type) -> type:
    """Let the constructor take every spelling a config file may use (`ModelConfig(hidden_size=768,
    num_hidden_layers=12)`, `TrainingConfig(lr=1e-3)`), read by `config_aliases` as a file's keys are,
    so Python and YAML accept the same names and a wrong one is the same one-line ValueError naming the
    closest valid key, instead of a bare TypeError. Keywords the dataclass takes skip the alias pass."""
    init = cls.__init__
    own = [f.name for f in dataclasses.fields(cls)]
    accepted = {*own, *cls.SPELLINGS}

    @functools.wraps(init)
    def __init__(self, *args: Any, **given: Any) -> None:
        if not given.keys() <= accepted:
            spelled = {key: value for key, value in given.items() if key in cls.SPELLINGS}
            values, problems, _ = config_aliases.canonical_section(
                cls.SECTION or cls.__name__,
                {key: value for key, value in given.items() if key not in spelled},
                own,
                others=ExperimentConfig.known_fields(),
            )
            if problems:
                raise ValueError(f"{cls.__name__}: {config_aliases.one_message(problems)}")
            given = {**values, **spelled}
        init(self, *args, **given)

    cls.__init__ = __init__
    return cls


def _other_name_of(cls_name: str, field_name: str) -> property:
    """A read-only attribute that gives `field_name`'s value under another framework's name, so code
    written for a transformers config reads ours (`model.config.hidden_size`, `config.gradient_clipping`)."""

    def get(self: _Validated) -> Any:
        return self._value_of(field_name)

    def refuse(self: _Validated, value: Any) -> None:
        raise AttributeError(f"this name is read-only: it reads {cls_name}.{field_name}; set {field_name} instead")

    return property(get, refuse, doc=f"{cls_name}.{field_name}, under the name other frameworks give it.")


def _names_read_back(cls: type) -> type:
    """Give `cls` the names of its section's alias table (`config_aliases`) as read-only attributes."""
    for name, field_name in config_aliases.ALIASES.get(cls.SECTION, {}).items():
        if isinstance(field_name, str) and not hasattr(cls, name):
            setattr(cls, name, _other_name_of(cls.__name__, field_name))
    return cls


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# Model

ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    # GPT-2: LayerNorm, GELU MLP, learned absolute positions, biases, tied head.
    "gpt2": dict(norm="layernorm", activation="gelu", position_embedding="learned", bias=True, tie_embeddings=True),
    # LLaMA: RMSNorm, SwiGLU MLP, rotary positions, no biases, untied head.
    "llama": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False, tie_embeddings=False),
}


MAX_VOCAB_PAD_MULTIPLE = 65536  # alignment wants 64 to 256; more only adds rows nothing reads
BYTE_BPE_MIN_VOCAB = 257  # byte-level BPE: its 256 byte tokens and end-of-text


@_names_read_back
@_keywords_as_in_files
@dataclass(kw_only=True)
class ModelConfig(_Validated):
    """The decoder-only transformer. Fields left as None take the `architecture` preset's value.

    The fields keep what was asked for, so `dataclasses.replace(config, architecture="gpt2")` gives
    GPT-2's norm and activation; `resolved()` fills every None and is what a model is built from and
    what a model folder records.
    """

    architecture: Literal["gpt2", "llama"] = "gpt2"
    vocab_size: int | None = None  # set from the tokenizer when None
    # Embedding and head rows rounded up to a multiple of this (aligned matmuls); the head multiplies the
    # extra rows but their logits are masked out of every softmax, so they are never scored, sampled
    # or exported and get no gradient. 1: exactly vocab_size rows.
    vocab_pad_multiple: int = 128
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    n_layers: int = 4
    d_ff: int | None = None  # None: 4*d_model (gelu/relu/silu) or LLaMA's 8/3*d_model rounded to 256 (swiglu)
    max_seq_len: int = 512
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation: Literal["gelu", "gelu_tanh", "relu", "relu2", "silu", "swiglu"] | None = None  # relu2: ReLU squared
    norm: Literal["layernorm", "rmsnorm"] | None = None
    position_embedding: Literal["learned", "rope"] | None = None
    bias: bool | None = None
    tie_embeddings: bool | None = None
    pre_norm: bool = True
    rms_norm_eps: float = 1e-5  # epsilon of RMSNorm and LayerNorm alike
    rope_theta: float = 10000.0
    init_std: float = 0.02
    qk_norm: bool = False  # RMS-normalise queries and keys per head (no weights) before attention
    zero_init_projections: bool = False  # attention and MLP output projections start at zero
    logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    # Not the architecture (a model folder does not record them):
    attention_backend: Literal["sdpa", "flex"] = "sdpa"  # flex: FlexAttention block masks for data.document_mask (GPU)
    init_from: str | None = None  # a transformers GPT-2/LLaMA folder or one of our model folders to start from
    # Not kept: read as training.gradient_checkpointing (see config_aliases.ACROSS).
    gradient_checkpointing: InitVar[bool | None] = None

    SECTION = "model"
    SPELLINGS = ("gradient_checkpointing",)
    NOT_ARCHITECTURE = ("attention_backend", "init_from")

    def _filled(self) -> dict[str, Any]:
        """The value each preset-dependent field takes: the one set, else the architecture's."""
        values = {
            name: default if getattr(self, name) is None else getattr(self, name)
            for name, default in ARCHITECTURE_DEFAULTS[self.architecture].items()
        }
        values["n_kv_heads"] = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if self.d_ff is not None:
            values["d_ff"] = self.d_ff
        elif values["activation"] == "swiglu":
            hidden = int(8 * self.d_model / 3)
            values["d_ff"] = 256 * ((hidden + 255) // 256) if self.d_model >= 256 else hidden
        else:
            values["d_ff"] = 4 * self.d_model
        return values

    def _value_of(self, name: str) -> Any:
        return self._filled().get(name, getattr(self, name))

    def resolved(self) -> ModelConfig:
        """Every preset-dependent field set explicitly (another section's settings given to this one kept,
        as by any `dataclasses.replace`)."""
        return dataclasses.replace(self, **self._filled())

    def architecture_dict(self) -> dict[str, Any]:
        """The resolved architecture as plain data: what `model_config.json` holds."""
        return {k: v for k, v in self.resolved().to_dict().items() if k not in self.NOT_ARCHITECTURE}

    def _check(self) -> None:
        filled = self._filled()
        for name in ("d_model", "n_heads", "n_layers", "max_seq_len"):
            _require(getattr(self, name) > 0, f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("d_ff", "n_kv_heads"):
            _require(filled[name] > 0, f"ModelConfig.{name} must be positive, got {filled[name]}")
        _require(
            self.vocab_size is None or self.vocab_size > 0,
            f"ModelConfig.vocab_size must be positive, got {self.vocab_size}",
        )
        _require(
            1 <= self.vocab_pad_multiple <= MAX_VOCAB_PAD_MULTIPLE,
            f"ModelConfig.vocab_pad_multiple must be 1 (no padding) to {MAX_VOCAB_PAD_MULTIPLE:,}, "
            f"got {self.vocab_pad_multiple}",
        )
        _require(
            self.d_model % self.n_heads == 0,
            f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        _require(
            self.n_heads % filled["n_kv_heads"] == 0,
            f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({filled['n_kv_heads']})",
        )
        if filled["position_embedding"] == "rope":
            _require(self.head_dim % 2 == 0, f"RoPE needs an even head size, got d_model/n_heads = {self.head_dim}")
        for name in ("dropout", "attention_dropout"):
            _require(
                0.0 <= getattr(self, name) < 1.0, f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)}"
            )
        _require(self.rms_norm_eps > 0, "ModelConfig.rms_norm_eps must be positive")
        _require(self.init_std > 0, "ModelConfig.init_std must be positive")
        _require(
            self.logit_softcap is None or self.logit_softcap > 0, "ModelConfig.logit_softcap must be positive or null"
        )
        check_model_dimensions(self.dimensions())  # before anything is built: a limit no real model reaches

    def dimensions(self) -> dict[str, int]:
        """The sizes that decide how large the model is (vocab_size 0 while unset; padded rows counted)."""
        filled = self._filled()
        return {
            "vocab_size": self.padded_vocab_size,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "d_ff": filled["d_ff"],
            "n_heads": self.n_heads,
            "n_kv_heads": filled["n_kv_heads"],
            "max_seq_len": self.max_seq_len,
        }

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and head: vocab_size rounded up to vocab_pad_multiple (0 while unset)."""
        multiple = self.vocab_pad_multiple
        return -(-(self.vocab_size or 0) // multiple) * multiple


# ----------------------------------------------------------------------------------------------
# Training

MAX_LEARNING_RATE = 1e3  # far above any rate a range test (lr-find) suggests


@_names_read_back
@_keywords_as_in_files
@dataclass(kw_only=True)
class TrainingConfig(_Validated):
    """The optimisation run: batch, optimiser, schedule, precision, evaluation, checkpoints, logging."""

    batch_size: int | Literal["auto"] = 8  # auto: the largest micro-batch that fits, total_batch_tokens kept
    gradient_accumulation_steps: int = 1
    num_epochs: int = 1
    max_steps: int | None = None  # optimizer steps; overrides num_epochs when set
    max_tokens: int | None = None  # the run's length in tokens instead: max_steps = ceil(max_tokens / tokens per step)
    total_batch_tokens: int | None = None  # tokens per optimizer step: sets gradient_accumulation_steps
    learning_rate: float = 3e-4
    min_lr: float = 0.0  # floor reached at the end of cosine/linear/wsd decay
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup", "wsd"] = "cosine"
    warmup_steps: int = 0
    wsd_decay_ratio: float = 0.2  # fraction of the run spent decaying under `wsd`
    optimizer: Literal["adamw", "adam", "sgd", "muon"] = "adamw"  # muon: Muon for hidden matrices, AdamW for the rest
    muon_learning_rate: float = (
        0.02  # peak lr of Muon's matrices (optimizer: muon); the schedule scales it as learning_rate
    )
    muon_momentum: float = 0.95
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    sgd_momentum: float = 0.9
    max_grad_norm: float | None = 1.0  # None or 0 disables clipping
    use_amp: bool | Literal["auto"] = (
        "auto"  # bf16 autocast where the device computes bf16 natively (GPUs since Ampere, CPUs with AVX-512 BF16 or AMX), else float32
    )
    amp_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    compile: bool = False
    gradient_checkpointing: bool = False  # recompute each block's activations in backward
    # The blocks' linear layers in float8 through torchao (parallel/float8.py): CUDA compute capability 8.9+
    float8: bool = False
    # Which of them: auto, those large enough to run faster in float8 (torchao's measured sizes); all, every one
    float8_layers: Literal["auto", "all"] = "auto"
    # The SDPA kernel the run is held to (parallel/attention_kernel.py); auto: by device, named in the run header
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    device: str = "auto"  # auto: CUDA, then MPS, then CPU
    device_memory: float | None = None  # GiB one process may use, for batch_size auto; None: the free memory
    seed: int = 42
    output_dir: str = "output"  # a folder, or a URL (s3://, gs://, ...): written in staging_dir, then uploaded
    checkpoint_dir: str | None = None  # default: {output_dir}/checkpoints; a URL: uploaded there after each save
    staging_dir: str = "run_staging"  # a URL output_dir: the run is written in {staging_dir}/<the URL's name> first
    save_steps: int | Literal["epoch"] | None = 500  # None or 0: only the final checkpoint; epoch: at each epoch's end
    save_total_limit: int | None = 3  # checkpoints kept in rotation (latest and best_model always); None: all
    async_checkpoint: bool = True  # periodic saves: copy the state, write it from a background thread
    # the coming batches read and copied to the GPU on a worker thread during the step; auto: on a GPU
    read_ahead: bool | Literal["auto"] = "auto"
    eval_steps: int | Literal["epoch"] | None = 500  # None or 0: only at the end; epoch: at each epoch's end
    eval_max_batches: int | None = None  # None: the whole validation set
    eval_batch_size: int | None = None  # rows per evaluation batch; None: batch_size
    target_val_loss: float | None = None  # stop once the full validation loss reaches this (time-to-target runs)
    logging_steps: int = 10
    report_to: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["console", "jsonl"]
    )
    mlflow_tracking_uri: str | None = (
        None  # report_to mlflow: a URI or a folder; None: $MLFLOW_TRACKING_URI or ./mlruns
    )
    progress_bar: bool = True
    speed_window_size: int = 20  # steps averaged by the speed monitor (tokens/s, step time, MFU)
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU; None: looked up for known GPUs
    resume_from_checkpoint: str | None = None  # a checkpoint folder, or "latest"
    overwrite_output_dir: bool = False  # start over in an output_dir that holds a run (see train/output_folder.py)
    # Multi-process (under torchrun): rank and world size come from the launcher's environment.
    distributed_strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = (
        "auto"  # auto: ddp when world size > 1 (fsdp when data_parallel_shard_degree is given)
    )
    world_size: int | None = None  # when set, must equal the launcher's WORLD_SIZE
    distributed_backend: Literal["nccl", "gloo"] | None = None  # None: nccl on CUDA, gloo on CPU
    distributed_timeout_s: int = 1800  # a rank that stops answering fails the job after this long
    ddp_find_unused_parameters: bool = False
    fsdp_sharding: Literal["full_shard", "shard_grad_op", "hybrid_shard"] = "full_shard"
    deepspeed_config: str | dict | None = None  # a DeepSpeed JSON path or inline dict ("auto" values filled from here)
    # The device mesh (parallel/mesh.py): the degrees multiply to the world size. None (or -1, torchtitan's
    # spelling) for a data-parallel degree: the processes the others leave, replicated or sharded as
    # distributed_strategy says. A torchtitan `parallelism:` section and Megatron's names are read as these.
    data_parallel_replicate_degree: int | None = None  # >1 with sharding: fsdp_sharding hybrid_shard (HSDP)
    data_parallel_shard_degree: int | None = None  # >1: distributed_strategy fsdp
    tensor_parallel_degree: int = 1  # DTensor tensor parallelism, with sequence parallelism on norms and dropout
    pipeline_parallel_degree: int = 1  # stages, split by layer
    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"  # a torch.distributed.pipelining schedule
    pipeline_parallel_microbatches: int | None = None  # micro-batches per batch_size rows; None: one per stage
    context_parallel_degree: int = 1  # sequence split across ranks in attention (ring attention, CUDA SDPA)
    early_stopping_patience: int | None = None  # evaluations without improvement before stopping
    early_stopping_min_delta: float = 0.0
    max_consecutive_bad_steps: int = 5  # non-finite loss/grad steps in a row before the run stops
    # Loss spikes (train/spikes.py): a step far above the median of its recent history, by a robust z-score.
    on_loss_spike: Literal["off", "warn", "skip", "rewind"] = "off"  # skip: not applied; rewind: to the last checkpoint
    loss_spike_metric: Literal["loss", "grad_norm", "either"] = "loss"  # what is watched
    loss_spike_window: int = 100  # past steps the median and MAD are taken over
    loss_spike_warmup: int = 20  # steps of history needed before a step can be called a spike
    loss_spike_zscore: float = 6.0  # (value - median) / (1.4826 MAD) above this is a spike
    max_rewinds: int = 3  # on_loss_spike: rewind goes back at most this often, then skips
    # Profiling (train/profiling.py): [first, last] optimizer steps traced into {output_dir}/profile.
    profile_steps: list[int] | None = None
    memory_snapshot: bool = False  # CUDA: the allocator's history over profile_steps, as a pickle beside the trace
    # Downstream evaluation through lm-eval (pip install 'llm-trainer[eval]'), beside the validation loss.
    eval_tasks: list[str] | str | None = None  # lm-eval task names or task YAML paths ("a,b" or a list)
    eval_tasks_steps: int | None = None  # None: at every evaluation; N: every N steps, and at the end
    eval_tasks_limit: int | None = None  # items per task; None: all
    trust_task_code: bool = False  # let eval_tasks files run the Python they name (lm-eval's `!function`)
    metric_for_best_model: str = (
        "val_loss"  # or eval/<source>/loss, or downstream/<task>/<metric> (e.g. downstream/llmt_choice/acc)
    )
    greater_is_better: bool | None = None  # None: False for val_loss, True for a downstream metric
    alerts: AlertsConfig | None = None  # who is told of anomalies and the run's end (train/alerts.py); None: no one
    layer_stats_steps: int | None = None  # every N steps: per-layer gradient/weight/update norms (train/layer_stats.py)
    # Not kept: read as distributed_strategy: deepspeed (see config_aliases.TRAINING).
    use_deepspeed: InitVar[bool | None] = None

    SECTION = "training"
    SPELLINGS = ("use_deepspeed",)

    def _coerce(self) -> None:
        if isinstance(self.alerts, dict):
            self.alerts = AlertsConfig.from_dict(self.alerts, section="TrainingConfig.alerts")
        if isinstance(self.report_to, str):  # `report_to: tensorboard` or "tensorboard,wandb", as transformers takes it
            names = [name.strip() for name in self.report_to.split(",") if name.strip()]
            self.report_to = [] if names == ["none"] else names  # transformers' "none": no tracker beyond ours
        if self.deepspeed_config is not None and self.distributed_strategy == "auto":
            self.distributed_strategy = "deepspeed"  # as the HF Trainer's `deepspeed=ds.json` turns it on

    def _check(self) -> None:
        _require(
            self.deepspeed_config is None or self.distributed_strategy == "deepspeed",
            f"TrainingConfig.deepspeed_config is read under distributed_strategy deepspeed, and this run's is "
            f"{self.distributed_strategy}; set distributed_strategy: deepspeed (or auto), or remove deepspeed_config",
        )
        _require(
            self.batch_size == "auto" or self.batch_size > 0,
            f"TrainingConfig.batch_size must be positive or auto, got {self.batch_size}",
        )
        _require(
            self.batch_size != "auto" or self.total_batch_tokens is not None,
            "TrainingConfig: batch_size auto keeps the global batch, which total_batch_tokens sets; "
            "set total_batch_tokens, or a number for batch_size",
        )
        _require(
            self.device_memory is None or (math.isfinite(self.device_memory) and self.device_memory > 0),
            f"TrainingConfig.device_memory must be a positive number of GiB, got {self.device_memory}",
        )
        for name in (
            "gradient_accumulation_steps",
            "num_epochs",
            "logging_steps",
            "max_consecutive_bad_steps",
            "speed_window_size",
        ):
            _require(getattr(self, name) > 0, f"TrainingConfig.{name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_steps",
            "save_total_limit",
            "eval_max_batches",
            "early_stopping_patience",
            "max_tokens",
            "total_batch_tokens",
            "eval_batch_size",
            "layer_stats_steps",
            "target_val_loss",  # a loss is never below 0: a target at or under it is never reached
        ):
            value = getattr(self, name)
            _require(value is None or value > 0, f"TrainingConfig.{name} must be positive or null, got {value}")
        _require(
            not (self.early_stopping_patience and self.eval_steps == 0),
            "TrainingConfig.early_stopping_patience counts evaluations, but eval_steps is 0 (one evaluation, at the "
            "end): set training.eval_steps",
        )
        for name in ("save_steps", "eval_steps", "warmup_steps"):
            value = getattr(self, name)
            _require(value in (None, "epoch") or value >= 0, f"TrainingConfig.{name} must be >= 0, got {value}")
        _check_seed(self.seed, "TrainingConfig.seed")
        _require(self.learning_rate > 0, f"TrainingConfig.learning_rate must be positive, got {self.learning_rate}")
        for name in ("learning_rate", "muon_learning_rate"):
            value = getattr(self, name)
            _require(
                value <= MAX_LEARNING_RATE,
                f"TrainingConfig.{name} must be at most {MAX_LEARNING_RATE:g}, got {value:g}",
            )
        _require(
            0 <= self.min_lr <= self.learning_rate,
            f"TrainingConfig.min_lr ({self.min_lr}) must be between 0 and TrainingConfig.learning_rate "
            f"({self.learning_rate}); set training.min_lr with it (e.g. training.min_lr=0)",
        )
        _require(0 < self.wsd_decay_ratio <= 1, "TrainingConfig.wsd_decay_ratio must be in (0, 1]")
        _require(self.weight_decay >= 0, "TrainingConfig.weight_decay must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            _require(
                0 <= getattr(self, name) < 1, f"TrainingConfig.{name} must be in [0, 1), got {getattr(self, name)}"
            )
        _require(self.adam_epsilon > 0, "TrainingConfig.adam_epsilon must be positive")
        _require(self.muon_learning_rate > 0, "TrainingConfig.muon_learning_rate must be positive")
        _require(
            not (self.max_steps is not None and self.max_tokens is not None),
            "TrainingConfig: set max_steps or max_tokens, not both",
        )
        _require(
            not (self.total_batch_tokens is not None and self.gradient_accumulation_steps != 1),
            "TrainingConfig: total_batch_tokens sets gradient_accumulation_steps; remove one of them",
        )
        _require(0 <= self.muon_momentum < 1, "TrainingConfig.muon_momentum must be in [0, 1)")
        _require(self.max_grad_norm is None or self.max_grad_norm >= 0, "TrainingConfig.max_grad_norm must be >= 0")
        _require(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
            f"TrainingConfig.device must be auto, cpu, cuda[:N] or mps, got {self.device!r}",
        )
        _require(self.early_stopping_min_delta >= 0, "TrainingConfig.early_stopping_min_delta must be >= 0")
        _require(self.peak_flops is None or self.peak_flops > 0, "TrainingConfig.peak_flops must be positive")
        _require(self.world_size is None or self.world_size > 0, "TrainingConfig.world_size must be positive")
        _require(self.distributed_timeout_s > 0, "TrainingConfig.distributed_timeout_s must be positive")
        for name in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
            _require(getattr(self, name) >= 1, f"TrainingConfig.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("data_parallel_replicate_degree", "data_parallel_shard_degree"):
            value = getattr(self, name)
            _require(
                value is None or value == -1 or value >= 1,
                f"TrainingConfig.{name} must be at least 1, or -1/null for the processes the other degrees leave, "
                f"got {value}",
            )
        _require(
            self.pipeline_parallel_microbatches is None or self.pipeline_parallel_microbatches >= 1,
            "TrainingConfig.pipeline_parallel_microbatches must be positive or null",
        )
        for name in ("eval_tasks_steps", "eval_tasks_limit"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"TrainingConfig.{name} must be positive or null, got {value}")
        metric = self.metric_for_best_model
        _require(
            is_loss_metric(metric) or (metric.startswith("downstream/") and metric.count("/") >= 2),
            "TrainingConfig.metric_for_best_model must be val_loss, eval/<source>/loss (one source of data.sources) "
            f"or downstream/<task>/<metric>, got {metric!r}",
        )
        _require(
            not (is_loss_metric(metric) and self.greater_is_better),
            f"TrainingConfig.greater_is_better is true, but metric_for_best_model {metric} is a loss, which is "
            "better lower; remove greater_is_better (or set it false)",
        )
        _require(
            not metric.startswith("downstream/") or bool(self.eval_tasks),
            f"TrainingConfig.metric_for_best_model {metric} needs training.eval_tasks (the task it names)",
        )
        self._check_health()

    def _check_health(self) -> None:
        for name in ("loss_spike_window", "loss_spike_warmup", "max_rewinds"):
            _require(getattr(self, name) >= 1, f"TrainingConfig.{name} must be at least 1, got {getattr(self, name)}")
        _require(
            self.loss_spike_window <= MAX_SPIKE_WINDOW,
            f"TrainingConfig.loss_spike_window ({self.loss_spike_window:,}) is over the limit of {MAX_SPIKE_WINDOW:,} "
            "steps (the window is kept on the device and sorted every step); use a window of a few hundred steps",
        )
        _require(
            self.loss_spike_warmup <= self.loss_spike_window,
            f"TrainingConfig.loss_spike_warmup ({self.loss_spike_warmup}) must be at most loss_spike_window "
            f"({self.loss_spike_window})",
        )
        _require(self.loss_spike_zscore > 0, "TrainingConfig.loss_spike_zscore must be positive")
        _require(
            self.on_loss_spike != "rewind" or bool(self.save_steps),
            "TrainingConfig.on_loss_spike=rewind goes back to the last checkpoint, but save_steps is "
            f"{self.save_steps} (no periodic checkpoints); set training.save_steps (e.g. 100) or use on_loss_spike=skip",
        )
        steps = self.profile_steps
        if steps is not None:
            _require(
                len(steps) == 2 and 1 <= steps[0] <= steps[1],
                f"TrainingConfig.profile_steps must be [first, last] optimizer steps with 1 <= first <= last, got {steps}",
            )
            _require(
                self.max_steps is None or steps[1] <= self.max_steps,
                f"TrainingConfig.profile_steps {steps} ends after the run's last step (max_steps={self.max_steps}); "
                "choose steps within the run",
            )

    # Where the run's files go: the one rule, read by the Trainer, the output-folder checks and the CLI.
    # A URL output_dir or checkpoint_dir is written in a local folder first and uploaded from there.

    @property
    def remote_output_dir(self) -> str | None:
        """The URL the run's files (metrics.jsonl, config.yaml, ...) are uploaded to, or None."""
        return self.output_dir if is_url(self.output_dir) else None

    @property
    def local_output_dir(self) -> Path:
        """The local folder the run writes in: output_dir, or, for a URL output_dir, its own folder in
        staging_dir (named after the URL, so that a resume on this machine finds it again)."""
        if self.remote_output_dir:
            return Path(self.staging_dir) / mirror_name(self.output_dir)
        return Path(self.output_dir)

    @property
    def resolved_checkpoint_dir(self) -> Path:
        """The local checkpoint folder. With a URL checkpoint_dir (or output_dir), checkpoints are
        written here first ({local_output_dir}/checkpoints), then uploaded (see `remote_checkpoint_dir`)."""
        if self.checkpoint_dir and not is_url(self.checkpoint_dir):
            return Path(self.checkpoint_dir)
        return self.local_output_dir / "checkpoints"

    @property
    def remote_checkpoint_dir(self) -> str | None:
        """The URL checkpoints are uploaded to ({output_dir}/checkpoints for a URL output_dir), or None."""
        if is_url(self.checkpoint_dir):
            return self.checkpoint_dir
        if self.remote_output_dir and not self.checkpoint_dir:
            return join(self.output_dir, "checkpoints")
        return None

    @property
    def resume_url(self) -> str | None:
        """The URL a resume reads its checkpoint from: resume_from_checkpoint when it is one, or for
        `latest` the remote_checkpoint_dir; None when it resumes from local folders alone."""
        if self.resume_from_checkpoint == "latest":
            return self.remote_checkpoint_dir
        return self.resume_from_checkpoint if is_url(self.resume_from_checkpoint) else None


@dataclass(kw_only=True)
class AlertsConfig(_Validated):
    """`training.alerts`: where alerts go and what raises them (see train/alerts.py). Secrets are never
    here: the webhook's URL and the SMTP server's credentials are read from the environment."""

    webhook_env: str | None = None  # the environment variable holding the webhook URL (Slack, Teams, Discord)
    email_to: list[str] | None = None  # addresses; the server from LLMT_SMTP_HOST/PORT/USER/PASSWORD/FROM
    wandb: bool = True  # wandb.alert too, when report_to has wandb
    min_interval_s: float = 600.0  # one alert of a kind per this many seconds (the run's end always goes)
    stall_factor: float = 10.0  # a stall: no step for this many times the median step time ...
    stall_min_s: float = 300.0  # ... and at least this long; 0 turns the watchdog off
    throughput_fraction: float = 0.5  # tokens/s below this fraction of the run's median ...
    throughput_windows: int = 3  # ... for this many logged windows in a row
    data_wait_fraction: float = 0.5  # the step's share spent waiting for data above this (1 turns it off)
    disk_free_fraction: float = 0.05  # after each checkpoint: the checkpoint disk's free share below this (0: off)
    retries: int = 4  # tries of each destination per alert, with backoff doubling from backoff_s
    backoff_s: float = 1.0
    timeout_s: float = 10.0  # of one try

    SECTION = "alerts"

    def _check(self) -> None:
        name = self.webhook_env
        _require(
            name is None or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None,
            "TrainingConfig.alerts.webhook_env must name an environment variable (e.g. LLMT_WEBHOOK_URL); put the "
            "URL itself in that variable, never in the config (the value given is not repeated here)",
        )
        for field_name in ("min_interval_s", "stall_factor", "stall_min_s", "backoff_s", "timeout_s"):
            _require(getattr(self, field_name) >= 0, f"TrainingConfig.alerts.{field_name} must be >= 0")
        for field_name in ("throughput_fraction", "data_wait_fraction", "disk_free_fraction"):
            value = getattr(self, field_name)
            _require(0 <= value <= 1, f"TrainingConfig.alerts.{field_name} must be within [0, 1], got {value}")
        _require(self.throughput_windows >= 1, "TrainingConfig.alerts.throughput_windows must be >= 1")
        _require(self.retries >= 1, "TrainingConfig.alerts.retries must be >= 1")
        _require(self.timeout_s > 0, "TrainingConfig.alerts.timeout_s must be > 0")


# ----------------------------------------------------------------------------------------------
# Data


@_keywords_as_in_files
@dataclass(kw_only=True)
class SourceConfig(_Validated):
    """One source of a weighted mixture (`data.sources`); unset fields take DataConfig's top-level values."""

    name: str
    data_files: list[str] | str | None = None
    dataset_name: str | None = None
    dataset_config: str | None = None
    dataset_split: str | None = None
    text_column: str | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    streaming: bool | None = None
    weight: float = 1.0
    max_documents: int | None = None

    def _check(self) -> None:
        where = f"data source {self.name!r}"
        _require(bool(self.name), f"each of DataConfig.sources needs a name, got {self.name!r}")
        _check_data_files(self.data_files, f"{where}: data_files")
        _require(
            self.data_files is not None or self.dataset_name is not None, f"{where} needs data_files or dataset_name"
        )
        _require(self.weight > 0, f"{where}: weight must be positive")
        _require(self.max_documents is None or self.max_documents > 0, f"{where}: max_documents must be positive")


@_keywords_as_in_files
@dataclass(kw_only=True)
class CurriculumStage(_Validated):
    """Until optimizer step `until_step`, draw only rows whose difficulty is at most `max_difficulty`."""

    until_step: int
    max_difficulty: float

    UNBOUNDED = ("max_difficulty",)

    def _check(self) -> None:
        _require(self.until_step > 0, f"a curriculum stage's until_step must be positive, got {self.until_step}")


SOURCES_EXAMPLE = (
    "in YAML: `sources: [{name: web, data_files: 'web/*.jsonl', weight: 3}, {name: code, data_files: code/}]` "
    "under data: (one source needs no list: data.data_files: corpus/)"
)


def _typed_list(values: Any, cls: type, field_name: str) -> Any:
    """Mappings in a list field become `cls` (their errors named after the field); anything else is left
    for the type check to report."""
    if not isinstance(values, (list, tuple)):
        return values
    out = []
    for i, value in enumerate(values):
        if isinstance(value, dict):
            name = value.get("name") if cls is SourceConfig else None
            try:
                value = cls.from_dict(value, section=f"DataConfig.{field_name}[{i}]")
            except TypeError as exc:  # a required key is missing
                raise ValueError(
                    f"DataConfig.{field_name}[{i}]" + (f" ({name!r})" if name else "") + f" is incomplete: {exc}"
                ) from None
        out.append(value)
    return out


def _check_seed(seed: int, where: str) -> None:
    """A seed the random generators take (NumPy's: 0 to 2**32 - 1)."""
    _require(0 <= seed < 2**32, f"{where} must be from 0 to {2**32 - 1:,}, got {seed:,}")


def _check_data_files(value: list[str] | str | None, where: str) -> None:
    """Each name in data_files is a file, folder or glob: an empty one would be the working folder, read whole."""
    names = [value] if isinstance(value, str) else value or []
    _require(
        all(not isinstance(name, str) or name.strip() for name in names),
        f"{where} holds an empty name ({value!r}); name files, folders or globs (the working folder is ./)",
    )


@_keywords_as_in_files
@dataclass(kw_only=True)
class DataConfig(_Validated):
    """Where the text comes from and how it becomes fixed-length token sequences.

    The stages of `prepare` in order: sources (a weighted mixture) -> cleaning -> quality filters ->
    deduplication -> split -> tokenization into shards; loader-time settings (packing, document mask,
    curriculum) come last. See `llm_trainer.data` for each stage.
    """

    dataset_name: str | None = None  # "python-stdlib" (built in), a HF datasets name, or a local dataset path
    dataset_config: str | None = None
    dataset_split: str = "train"
    validation_split: str | float = 0.1  # a split name, or the held-out fraction of documents
    data_files: list[str] | str | None = None  # files, folders or globs (.txt/.md/.py/..., .jsonl[.gz|.zst], .parquet)
    text_column: str = "text"
    max_documents: int | None = None
    max_length: int | None = None  # tokens per training sequence; None: model.max_seq_len
    min_length: int = 0  # documents shorter than this many characters are dropped
    pack_sequences: bool = True
    packing_strategy: Literal["greedy", "first_fit"] = "greedy"
    preprocessing_num_workers: int = 1
    tokenizer: str = "bpe"  # "bpe" (trained here), "char", or a path to tokenizer.json / a tokenizer folder
    tokenizer_vocab_size: int = 8192
    tokenizer_train_max_chars: int = 50_000_000  # BPE trains on at most this much text
    # the regex that cuts text before BPE: "unicode" (ours: combining marks stay in their words), or "gpt2" /
    # "llama3" (those models' own, which llama.cpp's converter reproduces); see llm_trainer.tokenizer
    tokenizer_pre_split: Literal["unicode", "gpt2", "llama3"] = "unicode"
    normalize_whitespace: bool = True  # strip trailing spaces and collapse blank-line runs; indentation is kept
    cache_dir: str = "data_cache"  # a folder, or a URL (s3://, gs://, ...): prepared there from a local copy
    # where files read from URLs are kept locally (data files, prepared data), and its size in bytes;
    # the least recently used entries are evicted first
    stream_cache_dir: str = "stream_cache"
    stream_cache_limit: int = 50 * 2**30

    # -- sources: several at once, with weights ----------------------------------------------------
    # A mixture: a list of {name, data_files | dataset_name, weight, dataset_config, dataset_split,
    # text_column, include, exclude, streaming, max_documents}; unset keys take the values above.
    # Replaces data_files/dataset_name (which form one source named "data" when this is null).
    sources: list[SourceConfig] | None = None
    mixture_stopping: Literal["first_exhausted", "all_exhausted"] = (
        "all_exhausted"  # when one source runs out: stop, or go on with the rest
    )
    seed: int = 0  # seeds the mixture's draw (prepare); the loader's order follows training.seed
    include: list[str] | None = None  # globs a file found in a folder must match, e.g. ["*.py"] ("*" spans folders)
    exclude: list[str] | None = None  # globs that leave out files found in folders, e.g. ["tests/*", "*.min.js"]
    streaming: bool = False  # read Hugging Face datasets as a stream instead of downloading them first
    on_bad_input: Literal["error", "skip", "skip_in_folders"] = (
        "skip_in_folders"  # skip_in_folders: skip+count bad files found in folders/globs, error on named ones
    )

    # -- cleaning ----------------------------------------------------------------------------------
    corpus_type: Literal["prose", "code"] = "prose"  # code: whitespace inside lines is never touched
    unicode_normalization: Literal["NFC", "NFKC", "none"] = "NFC"
    remove_control_chars: bool = True  # C0/C1 control characters other than tab and newline
    collapse_spaces: bool = False  # prose only: runs of spaces/tabs after a line's indentation become one space
    invalid_utf8: Literal["bad_input", "replace", "drop"] = "bad_input"  # bad_input: handled as on_bad_input says
    remove_boilerplate: bool = False  # drop whole lines matching boilerplate_patterns
    boilerplate_patterns: list[str] | None = None  # regexes for whole lines; None: a built-in English list

    # -- quality filters (each counted in data_report.json) -----------------------------------------
    # A preset fills the thresholds left null below; "off" applies only the ones set explicitly.
    # Off by default: the presets would drop the short documents of small experiments.
    quality_filters: Literal["off", "prose", "code"] = "off"
    max_chars: int | None = None  # longer documents are dropped; longer plain-text files are cut at blank lines instead
    min_words: int | None = None
    max_words: int | None = None
    min_alpha_fraction: float | None = None  # letters / non-whitespace characters
    min_mean_word_length: float | None = None
    max_mean_word_length: float | None = None
    max_repeated_line_fraction: float | None = None  # non-blank lines that repeat an earlier line
    max_duplicate_ngram_fraction: float | None = None  # word n-grams that repeat an earlier one
    duplicate_ngram_size: int = 5  # n of the n-grams above
    min_char_entropy: float | None = None  # Shannon entropy of the character distribution, bits per character

    # -- deduplication, across all sources ---------------------------------------------------------
    deduplication: Literal["none", "exact", "near"] = "exact"  # near: exact + MinHash/LSH near-duplicates
    deduplication_threshold: float = (
        0.8  # Jaccard similarity of word shingles above which a document is a near-duplicate
    )
    minhash_num_perm: int = 128
    minhash_shingle_words: int = 5

    # -- output and loading ------------------------------------------------------------------------
    shard_tokens: int = 32 * 2**20  # tokens per shard: the unit an interrupted prepare resumes from
    progress_bar: bool = True  # a progress bar on stderr while preparing (terminals only)
    document_mask: bool = False  # attention stays within each document; positions restart per document
    curriculum: list[CurriculumStage] | None = (
        None  # stages [{until_step: N, max_difficulty: X}, ...] in optimizer steps
    )
    curriculum_key: str = "length"  # "length" (tokens of a document) or a numeric column of the sources

    # -- where prepare runs (llm_trainer.data.prepare.cluster): null in this process; local, slurm or ray as a
    # datatrove pipeline of executor_tasks tasks over the input files (pip install -e ".[cluster]")
    executor: Literal["local", "slurm", "ray"] | None = None
    executor_tasks: int = 1  # tasks of the per-file stage; the result is the same for any number
    executor_workers: int = -1  # tasks running at once; -1: local: the CPU count, slurm/ray: all
    executor_logs: str | None = None  # task logs and completion markers; null: {cache_dir}/.{fingerprint}.tasks
    executor_partition: str | None = None  # slurm partition (null: the cluster's default)
    executor_time: str = "24:00:00"  # slurm time limit per task
    executor_cpus_per_task: int = 1  # slurm / ray CPUs per task
    executor_mem_per_cpu_gb: float = 2.0  # slurm / ray memory per CPU
    executor_env_command: str | None = None  # slurm: shell command run before each task (e.g. activating a venv)
    executor_address: str | None = None  # ray: the cluster to join (null: RAY_ADDRESS, else a local one)

    @property
    def remote_cache_dir(self) -> str | None:
        """The URL the prepared folders are kept in (each downloaded, or prepared and uploaded), or None."""
        return self.cache_dir if is_url(self.cache_dir) else None

    @property
    def local_cache_dir(self) -> Path:
        """Where this machine keeps the prepared folders: cache_dir, or for a URL cache_dir its local
        mirror under stream_cache_dir."""
        if self.remote_cache_dir:
            return Path(self.stream_cache_dir) / "prepared" / mirror_name(self.cache_dir)
        return Path(self.cache_dir)

    def check_source(self) -> None:
        """Where the data is read (prepare, train), not on construction: a config is often built in pieces,
        and an estimate needs no data."""
        if self.dataset_name is None and self.data_files is None and not self.sources:
            raise UsageError(
                "the config names no training data: add data.data_files (files, folders or globs), e.g. "
                "`data: {data_files: [corpus/]}` in the YAML or data.data_files=corpus/ on the command line; "
                "or data.dataset_name (python-stdlib is built in, or a Hugging Face dataset), or a data.sources list"
            )

    def _check(self) -> None:
        _check_data_files(self.data_files, "DataConfig.data_files")
        _require(
            not (self.sources and (self.dataset_name is not None or self.data_files is not None)),
            "DataConfig: set either data.sources or data.data_files/dataset_name, not both",
        )
        if isinstance(self.validation_split, float):
            _require(
                0.0 <= self.validation_split < 1.0,
                f"DataConfig.validation_split as a fraction must be in [0, 1), got {self.validation_split}",
            )
        _require(self.max_length is None or self.max_length > 1, "DataConfig.max_length must be at least 2")
        _require(self.min_length >= 0, "DataConfig.min_length must be >= 0")
        _require(self.max_documents is None or self.max_documents > 0, "DataConfig.max_documents must be positive")
        _require(self.preprocessing_num_workers >= 1, "DataConfig.preprocessing_num_workers must be >= 1")
        _require(self.tokenizer_vocab_size >= 64, "DataConfig.tokenizer_vocab_size must be at least 64")
        _require(
            self.tokenizer != "bpe" or self.tokenizer_vocab_size >= BYTE_BPE_MIN_VOCAB,
            f"DataConfig.tokenizer_vocab_size must be at least {BYTE_BPE_MIN_VOCAB} for byte-level BPE (a token for "
            f"each of the 256 bytes, and end-of-text), got {self.tokenizer_vocab_size}",
        )
        _require(self.tokenizer_train_max_chars > 0, "DataConfig.tokenizer_train_max_chars must be positive")
        _check_seed(self.seed, "DataConfig.seed")
        _require(bool(self.tokenizer), "DataConfig.tokenizer must be bpe, char or a path")
        names = [source.name for source in self.sources or []]
        _require(len(set(names)) == len(names), f"DataConfig.sources names must be unique, got {names}")
        _require(
            not (self.collapse_spaces and self.corpus_type == "code"),
            "DataConfig.collapse_spaces would change code; it needs corpus_type: prose",
        )
        for name in ("boilerplate_patterns", "include", "exclude"):
            values = getattr(self, name) or []
            _require(all(v for v in values), f"DataConfig.{name} must not hold empty strings")
        for pattern in self.boilerplate_patterns or []:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"DataConfig.boilerplate_patterns: {pattern!r} is not a valid regex ({exc})") from None
        for name in (
            "max_chars",
            "min_words",
            "max_words",
            "duplicate_ngram_size",
            "minhash_shingle_words",
            "shard_tokens",
        ):
            value = getattr(self, name)
            _require(value is None or value > 0, f"DataConfig.{name} must be positive, got {value}")
        for name in ("min_alpha_fraction", "max_repeated_line_fraction", "max_duplicate_ngram_fraction"):
            value = getattr(self, name)
            _require(value is None or 0.0 <= value <= 1.0, f"DataConfig.{name} must be in [0, 1], got {value}")
        for name in ("min_mean_word_length", "max_mean_word_length", "min_char_entropy"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"DataConfig.{name} must be >= 0, got {value}")
        for low, high in (
            ("min_words", "max_words"),
            ("min_mean_word_length", "max_mean_word_length"),
            ("min_length", "max_chars"),
        ):
            a, b = getattr(self, low), getattr(self, high)
            _require(a is None or b is None or a <= b, f"DataConfig.{low} ({a}) must not exceed {high} ({b})")
        _require(0.0 < self.deduplication_threshold <= 1.0, "DataConfig.deduplication_threshold must be in (0, 1]")
        _require(8 <= self.minhash_num_perm <= 1024, "DataConfig.minhash_num_perm must be between 8 and 1024")
        _require(bool(self.curriculum_key), "DataConfig.curriculum_key must be length or a column name")
        _require(self.executor_tasks >= 1, "DataConfig.executor_tasks must be >= 1")
        _require(
            self.executor_tasks <= MAX_EXECUTOR_TASKS,
            f"DataConfig.executor_tasks ({self.executor_tasks:,}) is over the limit of {MAX_EXECUTOR_TASKS:,} "
            "(each task has its own log, completion marker and part folder, and a task never has less than "
            "one input file); use at most as many tasks as files",
        )
        _require(
            not is_url(self.executor_logs),
            f"DataConfig.executor_logs must be a local folder every task can reach (a shared file system on "
            f"Slurm and Ray), got {self.executor_logs}",
        )
        _require(
            self.executor_mem_per_cpu_gb > 0,
            f"DataConfig.executor_mem_per_cpu_gb must be above 0, got {self.executor_mem_per_cpu_gb}",
        )
        _require(
            self.executor_workers == -1 or self.executor_workers >= 1, "DataConfig.executor_workers must be -1 or >= 1"
        )
        _require(self.executor_cpus_per_task >= 1, "DataConfig.executor_cpus_per_task must be >= 1")
        steps = [stage.until_step for stage in self.curriculum or []]
        for i in range(1, len(steps)):
            _require(
                steps[i] > steps[i - 1],
                f"DataConfig.curriculum[{i}].until_step must be above the previous "
                f"stage's ({steps[i - 1]}), got {steps[i]}",
            )

    def _coerce(self) -> None:
        for name in ("include", "exclude"):  # one pattern given alone: a list of it
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])
        if self.sources is not None and (
            not isinstance(self.sources, (list, tuple))
            or not all(isinstance(source, (dict, SourceConfig)) for source in self.sources)
        ):
            if isinstance(self.sources, (list, tuple)) and all(isinstance(s, str) for s in self.sources):
                raise ValueError(
                    f"DataConfig.sources takes one mapping per source of a weighted mixture (name, data_files, "
                    f"weight), got paths {self.sources!r}; files of one corpus go in data.data_files: "
                    f"{list(self.sources)!r}, or {SOURCES_EXAMPLE}"
                )
            raise ValueError(f"DataConfig.sources must be a list of sources, got {self.sources!r}; {SOURCES_EXAMPLE}")
        self.sources = _typed_list(self.sources, SourceConfig, "sources")
        self.curriculum = _typed_list(self.curriculum, CurriculumStage, "curriculum")


# ----------------------------------------------------------------------------------------------
# Experiment = model + training + data


def with_carried(section: Any, name: str, *givers: Any) -> Any:
    """`section` (the config section called `name`) with the settings each of `givers` was given for it in
    another section's spelling (`for_other_sections`, e.g. `ModelConfig(gradient_checkpointing=True)`)."""
    for giver in givers:
        values = getattr(giver, "for_other_sections", {}).get(name) or {}
        if any(getattr(section, key) != value for key, value in values.items()):  # (applied once: the same object)
            section = dataclasses.replace(section, **values)
    return section


@dataclass(kw_only=True)
class ExperimentConfig:
    model: ModelConfig
    training: TrainingConfig
    data: DataConfig

    SECTIONS = ("model", "training", "data")

    def __post_init__(self) -> None:
        """A section's keyword that sets another section's field (`ModelConfig(gradient_checkpointing=True)`)
        takes effect here, where the sections meet."""
        givers = (self.model, self.training, self.data)
        for name in self.SECTIONS:
            setattr(self, name, with_carried(getattr(self, name), name, *givers))

    def __setattr__(self, name: str, value: Any) -> None:
        """Only the three sections are attributes (a setting given here would be kept and never read), each
        of its class: the dataclass's constructor sets them through here too."""
        if name not in self.SECTIONS:
            where = config_aliases.setting_named(name, self.known_fields())
            raise ValueError(
                f"ExperimentConfig has the sections {', '.join(self.SECTIONS)} only; "
                + (f"{name} is {where}: set it there" if where else f"{name} is no setting of any of them")
            )
        cls = {"model": ModelConfig, "training": TrainingConfig, "data": DataConfig}[name]
        if isinstance(value, dict):  # a mapping of the section's fields, read as a config file's section is
            value = cls.from_dict(value, section=name)
        elif not isinstance(value, cls):
            raise ValueError(
                f"ExperimentConfig.{name} must be a {cls.__name__} (or a mapping of its fields), got {type(value).__name__}"
            )
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "training": self.training.to_dict(), "data": self.data.to_dict()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ExperimentConfig:
        if not isinstance(values, dict):
            raise ValueError("an experiment config must be a mapping with sections model:, training:, data:")
        values, problems = config_aliases.canonical_experiment(values, cls.known_fields())  # every problem at once
        if problems:
            raise ValueError(config_aliases.one_message(problems))
        # Under our names already: built directly, so the alias pass runs once per config.
        return cls(
            model=ModelConfig(**values["model"]),
            training=TrainingConfig(**values["training"]),
            data=DataConfig(**values["data"]),
        )

    def save(self, path: str | Path) -> None:
        write_text(Path(path), yaml.safe_dump(self.to_dict(), sort_keys=False))

    @staticmethod
    def known_fields() -> dict[str, list[str]]:
        """Each section's field names."""
        return {
            name: [f.name for f in dataclasses.fields(section)]
            for name, section in (("model", ModelConfig), ("training", TrainingConfig), ("data", DataConfig))
        }
