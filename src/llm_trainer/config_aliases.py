"""Other frameworks' spellings of our config, read into ours where a config is loaded.

Users arrive with a Hugging Face config (`hidden_size`, `num_hidden_layers`, `fp16: true`), a nanoGPT
one (`n_embd`, `block_size`, `max_iters`) or a YAML in the common pretraining-recipe shape (`model:
{type: llama, size: 7B}`, `training.clip_grad_norm`, `use_deepspeed: true`, a `distributed:` section
with `fsdp_config`, `model.gradient_checkpointing`, which is a training setting here). Those keys are
renamed to our fields here, once, for files, dicts and dotted overrides alike, so nothing downstream
knows about them; the two that guides also pass as Python keywords (`TrainingConfig(use_deepspeed=
True)`, `ModelConfig(gradient_checkpointing=True)`) are read by the same rules (`keywords`). Every
problem of a config (unknown keys, with hints that know these spellings too; an alias and its field
both set to different values) is collected, so one error lists them all.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# A spelling maps to our field, or to a function turning its value into (field, value) pairs.
Expand = Callable[[Any], Iterator[tuple[str, Any]]]

MODEL: dict[str, str] = {
    # Hugging Face (LLaMA and GPT-2 configs)
    "type": "architecture",
    "model_type": "architecture",
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "num_hidden_layers": "n_layers",
    "intermediate_size": "d_ff",
    "max_position_embeddings": "max_seq_len",
    "n_positions": "max_seq_len",
    "n_inner": "d_ff",
    "layer_norm_epsilon": "rms_norm_eps",
    "layer_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "initializer_range": "init_std",
    "hidden_dropout_prob": "dropout",
    "dropout_rate": "dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "attn_pdrop": "attention_dropout",
    "pad_vocab_size_multiple": "vocab_pad_multiple",
    # nanoGPT (its `bias` and `dropout` are ours already)
    "n_embd": "d_model",
    "n_head": "n_heads",
    "n_layer": "n_layers",
    "block_size": "max_seq_len",
}


class Fallback:
    """A value a spelling sets only where nothing else sets the field: HF's `bf16: false` means float32
    unless its `fp16: true` (or our `use_amp`) says otherwise, and is then no conflict."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _precision(dtype: str) -> Expand:
    """HF's `fp16: true` / `bf16: true`: mixed precision in that dtype. `false` is float32, as in HF, where
    no other setting turns mixed precision on (`Fallback`), rather than left to `use_amp: auto`."""

    def expand(value: Any) -> Iterator[tuple[str, Any]]:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        if value:
            yield "use_amp", True
            yield "amp_dtype", dtype
        else:
            yield "use_amp", Fallback(False)

    return expand


def _turns_on(field: str, value: Any = True) -> Expand:
    """A switch: `true` sets `field` to `value`; `false` sets nothing (the field keeps what the config says)."""

    def expand(flag: Any) -> Iterator[tuple[str, Any]]:
        if not isinstance(flag, bool):
            raise ValueError(f"must be true or false, got {flag!r}")
        if flag:
            yield field, value

    return expand


def _strategy(field: str) -> Expand:
    """The Hugging Face Trainer's `eval_strategy` / `save_strategy`: `epoch` sets `field` to "epoch",
    `no` to 0 (the run's end only), `steps` leaves it to `field` itself."""

    def expand(value: Any) -> Iterator[tuple[str, Any]]:
        if value not in ("no", "steps", "epoch"):
            raise ValueError(f"must be 'no', 'steps' or 'epoch', got {value!r}")
        if value != "steps":
            yield field, "epoch" if value == "epoch" else 0

    return expand


TRAINING: dict[str, str | Expand] = {
    # Hugging Face TrainingArguments
    "per_device_train_batch_size": "batch_size",
    "num_train_epochs": "num_epochs",
    "lr_scheduler_type": "lr_scheduler",
    "eval_strategy": _strategy("eval_steps"),
    "evaluation_strategy": _strategy("eval_steps"),
    "save_strategy": _strategy("save_steps"),
    "fp16": _precision("float16"),
    "bf16": _precision("bfloat16"),
    # nanoGPT / litgpt / common pretraining recipes
    "clip_grad_norm": "max_grad_norm",
    "grad_clip": "max_grad_norm",
    "gradient_clipping": "max_grad_norm",
    "micro_batch_size": "batch_size",
    "epochs": "num_epochs",
    "max_iters": "max_steps",
    "lr": "learning_rate",
    "warmup_iters": "warmup_steps",
    "eval_interval": "eval_steps",
    "log_interval": "logging_steps",
    "eval_iters": "eval_max_batches",
    "out_dir": "output_dir",
    "beta1": "adam_beta1",
    "beta2": "adam_beta2",
    # a DeepSpeed switch, as trainers without a distributed_strategy spell it
    "use_deepspeed": _turns_on("distributed_strategy", "deepspeed"),
    # early stopping as Keras and PyTorch Lightning's EarlyStopping, and the Hugging Face callback, name it
    "patience": "early_stopping_patience",
    "min_delta": "early_stopping_min_delta",
    "early_stopping_threshold": "early_stopping_min_delta",
    # Megatron-LM's and DeepSpeed's intervals
    "save_interval": "save_steps",
    "steps_per_print": "logging_steps",
    # Megatron-LM's model-parallel sizes
    "tensor_model_parallel_size": "tensor_parallel_degree",
    "pipeline_model_parallel_size": "pipeline_parallel_degree",
    "context_parallel_size": "context_parallel_degree",
}

# Keys that stand in one section but set the field of the same name in another:
# (section, key) -> (the section whose field it sets, how).
ACROSS: dict[tuple[str, str], tuple[str, Expand]] = {
    ("model", "gradient_checkpointing"): ("training", _turns_on("gradient_checkpointing")),
}

# YAML 1.1 reads an unquoted `off` / `no` as false: the string our field means.
YAML_BOOLS: dict[tuple[str, str], dict[bool, str]] = {
    ("data", "quality_filters"): {False: "off"},
    ("data", "deduplication"): {False: "none"},
}

# `model.size`: a named shape; the keys a section sets itself win over it.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "llama": {
        "7B": dict(d_model=4096, n_heads=32, n_layers=32, d_ff=11008),
        "13B": dict(d_model=5120, n_heads=40, n_layers=40, d_ff=13824),
        "70B": dict(d_model=8192, n_heads=64, n_kv_heads=8, n_layers=80, d_ff=28672),
    },
    "gpt2": {
        "124M": dict(d_model=768, n_heads=12, n_layers=12),
        "355M": dict(d_model=1024, n_heads=16, n_layers=24),
        "774M": dict(d_model=1280, n_heads=20, n_layers=36),
        "1.5B": dict(d_model=1600, n_heads=25, n_layers=48),
    },
}
_SIZE_NAMES = {"small": "124M", "medium": "355M", "large": "774M", "xl": "1.5B"}


# -- a `distributed:` section (strategy, fsdp_config, ...), folded into training -------------------------

_SHARDING = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "HYBRID_SHARD": "hybrid_shard"}
_AMP = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def _sharding(value: Any) -> Iterator[tuple[str, Any]]:
    yield "fsdp_sharding", _SHARDING.get(str(value).upper(), value)


def _mixed_precision(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, bool):
        yield "use_amp", value
    elif str(value).lower() in _AMP:
        yield "use_amp", True
        yield "amp_dtype", _AMP[str(value).lower()]
    else:
        yield "use_amp", value  # reported by the type check


def _checkpointing(value: Any) -> Iterator[tuple[str, Any]]:
    yield "gradient_checkpointing", value


FSDP_CONFIG: dict[str, Expand] = {
    "sharding_strategy": _sharding,
    "mixed_precision": _mixed_precision,
    "activation_checkpointing": _checkpointing,
    "checkpoint_activation": _checkpointing,
}
DISTRIBUTED: dict[str, str] = {
    "strategy": "distributed_strategy",
    "backend": "distributed_backend",
    "timeout": "distributed_timeout_s",
    "find_unused_parameters": "ddp_find_unused_parameters",
    "sharding_strategy": "fsdp_sharding",
}
# Our own training fields that may also stand in `distributed:`.
DISTRIBUTED_FIELDS = (
    "distributed_strategy",
    "world_size",
    "distributed_backend",
    "distributed_timeout_s",
    "ddp_find_unused_parameters",
    "fsdp_sharding",
    "use_deepspeed",
    "deepspeed_config",
)

# -- a torchtitan `parallelism:` section, folded into training ---------------------------------------------

# The mesh degrees: torchtitan's `parallelism` keys are our field names (Megatron's sizes are in TRAINING).
PARALLELISM_FIELDS = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "pipeline_parallel_schedule",
    "pipeline_parallel_microbatches",
    "context_parallel_degree",
)
DISTRIBUTED_FIELDS += PARALLELISM_FIELDS

ALIASES: dict[str, Mapping[str, str | Expand]] = {"model": MODEL, "training": TRAINING}
SECTIONS = ("model", "training", "data")
FOLDED = ("distributed", "parallelism")  # sections read into training


class _Fields:
    """The values a section ends up with, and which spelling set each one (for conflicts)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.spelled: dict[str, str] = {}
        self.problems: list[str] = []
        self.fallbacks: set[str] = set()  # fields whose value is a `Fallback`'s, which any other replaces

    def set(self, field: str, value: Any, spelled: str, target: str) -> None:
        if isinstance(value, Fallback):
            if field not in self.values:
                self.values[field], self.spelled[field] = value.value, spelled
                self.fallbacks.add(field)
            return
        if field in self.fallbacks:
            self.fallbacks.discard(field)
            del self.values[field], self.spelled[field]
        if field in self.values and self.values[field] != value:
            self.problems.append(
                f"{self.spelled[field]} ({self.values[field]!r}) and {spelled} ({value!r}) both set "
                f"{target}.{field}; keep one"
            )
            return
        self.values.setdefault(field, value)
        self.spelled.setdefault(field, spelled)


def _section_of(key: str, section: str, others: Mapping[str, list[str]]) -> str | None:
    """`key` as another section spells it (`training.learning_rate`, `training.gradient_clipping (=
    training.max_grad_norm)`): a setting given in the wrong section, such as the lesson's ModelConfig
    that holds the learning rate too. None when no other section has it."""
    for other, fields in others.items():
        target = ALIASES.get(other, {}).get(key)
        if other != section and (key in fields or target is not None):
            return f"{other}.{key}" + (f" (= {other}.{target})" if isinstance(target, str) else "")
    return None


# Keys other trainers take for the W&B project and run name; here they come from W&B's own variables.
WANDB_KEYS = ("project_name", "project", "wandb_project", "run_name", "wandb_run_name")


def wandb_hint(keys: list[str]) -> str:
    """Where the W&B settings among `keys` go instead ('' when there are none)."""
    wandb = [key for key in keys if key in WANDB_KEYS]
    if not wandb:
        return ""
    return (
        "; W&B (training.report_to: [wandb]) takes its project from the WANDB_PROJECT environment variable and "
        f"the run's name from WANDB_NAME: `export WANDB_PROJECT=my-project` instead of {', '.join(wandb)}"
    )


def _hint(section: str, key: str, known: list[str], aliases: Mapping[str, Any], others: Mapping[str, list[str]]) -> str:
    if section == "training" and (wandb := wandb_hint([str(key)])):
        return wandb
    if (elsewhere := _section_of(str(key), section, others)) is not None:
        return f"; it is a setting of another section: {elsewhere}"
    close = difflib.get_close_matches(
        str(key), [k for k in known if not k.startswith("_")] + list(aliases), n=1, cutoff=0.6
    )
    if not close:
        return f"; valid keys: {', '.join(known)}" if len(known) <= 40 else ""
    target = aliases.get(close[0])
    also = f" (= {section}.{target})" if isinstance(target, str) else ""
    return f"; did you mean {section}.{close[0]}{also}?"


def _expand(spelling: str | Expand, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(spelling, str):
        yield spelling, value
    else:
        yield from spelling(value)


def _put(fields: _Fields, target: str, where: str, spelling: str | Expand, value: Any) -> None:
    """`where: value`, spelled as `spelling` says, into the fields of section `target`."""
    try:
        for field, item in _expand(spelling, value):
            fields.set(field, item, where, target)
    except ValueError as exc:
        fields.problems.append(f"{where} {exc}")


def _read_section(
    fields: _Fields,
    section: str,
    values: Mapping[str, Any],
    known: list[str],
    *,
    strict: bool,
    unused: list[str],
    others: Mapping[str, list[str]],
) -> None:
    """Put one section's keys into `fields` under our names; unknown keys go to problems (or `unused`)."""
    aliases = ALIASES.get(section, {})
    for key, value in values.items():
        where = f"{section}.{key}"
        if key in known:
            value = YAML_BOOLS.get((section, key), {}).get(value, value) if isinstance(value, bool) else value
            fields.set(key, value, where, section)
        elif key in aliases:
            _put(fields, section, where, aliases[key], value)
        elif strict and (section, key) in ACROSS:
            fields.problems.append(f"{where} sets {ACROSS[section, key][0]}.{key}; give it in that section")
        elif strict:
            fields.problems.append(f"unknown key {where}{_hint(section, key, known, aliases, others)}")
        else:
            unused.append(key)


def _read_distributed(fields: _Fields, values: Any, known: list[str]) -> None:
    """`distributed: {strategy, fsdp_config: {sharding_strategy, mixed_precision, activation_checkpointing}, ...}`."""
    if not isinstance(values, dict):
        fields.problems.append("section 'distributed' must be a mapping (strategy, fsdp_config, ...)")
        return
    allowed = [k for k in DISTRIBUTED_FIELDS if k in known or k in TRAINING]
    for key, value in values.items():
        where = f"distributed.{key}"
        if key == "fsdp_config":
            if not isinstance(value, dict):
                fields.problems.append(
                    f"{where} must be a mapping (sharding_strategy, mixed_precision, activation_checkpointing)"
                )
                continue
            for name, item in value.items():
                if name not in FSDP_CONFIG:
                    close = difflib.get_close_matches(str(name), list(FSDP_CONFIG), n=1, cutoff=0.6)
                    hint = f"; did you mean {where}.{close[0]}?" if close else f"; known: {', '.join(FSDP_CONFIG)}"
                    fields.problems.append(f"unknown key {where}.{name}{hint}")
                    continue
                for field, mapped in FSDP_CONFIG[name](item):
                    fields.set(field, mapped, f"{where}.{name}", "training")
        elif key in TRAINING and key in allowed:
            _put(fields, "training", where, TRAINING[key], value)
        elif key in allowed or key in DISTRIBUTED:
            field = DISTRIBUTED.get(key, key)
            if field == "distributed_strategy" and isinstance(value, str):
                value = value.lower()
            if field == "fsdp_sharding":
                value = next(_sharding(value))[1]
            fields.set(field, value, where, "training")
        else:
            close = difflib.get_close_matches(str(key), allowed + list(DISTRIBUTED) + ["fsdp_config"], n=1, cutoff=0.6)
            hint = (
                f"; did you mean distributed.{close[0]}?"
                if close
                else "; known: strategy, fsdp_config, " + ", ".join(allowed)
            )
            fields.problems.append(f"unknown key {where}{hint}")


def _read_parallelism(fields: _Fields, values: Any) -> None:
    """`parallelism: {tensor_parallel_degree: 2, ...}` (torchtitan's section): the mesh fields of training."""
    if not isinstance(values, dict):
        fields.problems.append("section 'parallelism' must be a mapping (tensor_parallel_degree, ...)")
        return
    for key, value in values.items():
        where = f"parallelism.{key}"
        if key in PARALLELISM_FIELDS:
            fields.set(key, value, where, "training")
        elif key in TRAINING and TRAINING[key] in PARALLELISM_FIELDS:
            _put(fields, "training", where, TRAINING[key], value)
        else:
            close = difflib.get_close_matches(str(key), list(PARALLELISM_FIELDS), n=1, cutoff=0.6)
            hint = f"; did you mean parallelism.{close[0]}?" if close else "; known: " + ", ".join(PARALLELISM_FIELDS)
            fields.problems.append(f"unknown key {where}{hint}")


def _apply_size(fields: _Fields) -> None:
    """`size: 7B` fills the shape fields the section left unset."""
    if "size" not in fields.values:
        return
    size = fields.values.pop("size")
    fields.spelled.pop("size")
    architecture = fields.values.get("architecture", "gpt2")
    if architecture not in SIZES:  # the architecture is what is wrong; the config check names it
        return
    table = SIZES[architecture]
    name = _SIZE_NAMES.get(str(size).lower(), str(size)).upper()
    shape = next((v for k, v in table.items() if k.upper() == name), None)
    if shape is None:
        fields.problems.append(
            f"model.size {size!r} is not a known {architecture} size; known: {', '.join(table)} "
            "(or set d_model, n_heads, n_layers, d_ff yourself)"
        )
        return
    filled = {field: value for field, value in shape.items() if field not in fields.values}
    fields.values.update(filled)
    for whole, part in (("d_model", "n_heads"), ("n_heads", "n_kv_heads")):  # a preset's half of a pair
        values = fields.values
        if (
            isinstance(values.get(whole), int)
            and isinstance(values.get(part), int)
            and values[part] > 0
            and (whole in filled) != (part in filled)
            and values[whole] % values[part]
        ):
            preset, given = (whole, part) if whole in filled else (part, whole)
            fields.problems.append(
                f"model.size {size!r} sets {preset}={values[preset]}, and {whole} ({values[whole]}) must be a "
                f"multiple of {part} ({values[part]}); with {given} set yourself, set {preset} too"
            )


def _section(
    section: str,
    values: Mapping[str, Any],
    known: list[str],
    *,
    strict: bool,
    unused: list[str],
    others: Mapping[str, list[str]],
) -> _Fields:
    fields = _Fields()
    known = known + (["size"] if section == "model" else [])
    _read_section(fields, section, values, known, strict=strict, unused=unused, others=others)
    if section == "model":
        _apply_size(fields)
    return fields


def canonical_section(
    section: str,
    values: Mapping[str, Any],
    known: list[str],
    *,
    strict: bool = True,
    others: Mapping[str, list[str]] | None = None,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """(values under our field names, problems, unused keys). `strict`: unknown keys are problems,
    else they are returned as unused (a user's own dict holds more than our section). `others`: each
    section's fields, so that a key of another section is named as one."""
    unused: list[str] = []
    fields = _section(section, values, known, strict=strict, unused=unused, others=others or {})
    return fields.values, fields.problems, unused


def canonical_experiment(
    values: Mapping[str, Any], known: Mapping[str, list[str]]
) -> tuple[dict[str, dict], list[str]]:
    """The sections model/training/data under our names, `distributed:` folded into training, and every
    problem of the whole config (unknown sections and keys, conflicts)."""
    problems: list[str] = []
    out: dict[str, dict] = {}
    top_level: dict[str, list[str]] = {}  # settings given without their section: where each one goes
    for key in values:
        if key not in SECTIONS and key not in FOLDED and (where := setting_named(str(key), known)) is not None:
            top_level.setdefault(where.split(".")[0], []).append(str(key))
    if top_level:
        problems.append(
            "settings go under their section, not at the top level of the file: "
            + "; ".join(f"put {', '.join(keys)} under {section}:" for section, keys in top_level.items())
        )
    placed = {key for keys in top_level.values() for key in keys}
    for key in values:
        if key not in SECTIONS and key not in FOLDED and str(key) not in placed:
            close = difflib.get_close_matches(str(key), [*SECTIONS, *FOLDED], n=1, cutoff=0.5)
            hint = (
                f"; did you mean {close[0]}?"
                if close
                else "; sections are model, training, data (and distributed, parallelism)"
            )
            problems.append(f"unknown section {key!r}{hint}")
    own: dict[str, dict] = {}
    across: dict[str, list[tuple[str, Expand, Any]]] = {section: [] for section in SECTIONS}
    for section in SECTIONS:
        given = values.get(section) or {}
        if not isinstance(given, dict):
            problems.append(f"section {section!r} must be a mapping of field: value, got {type(given).__name__}")
            given = {}
        own[section] = {}
        for key, value in given.items():
            if (section, key) in ACROSS:
                target, spelling = ACROSS[section, key]
                across[target].append((f"{section}.{key}", spelling, value))
            else:
                own[section][key] = value
    for section in SECTIONS:
        fields = _section(section, own[section], known[section], strict=True, unused=[], others=known)
        if section == "training" and values.get("distributed") is not None:
            _read_distributed(fields, values["distributed"], known["training"])
        if section == "training" and values.get("parallelism") is not None:
            _read_parallelism(fields, values["parallelism"])
        for where, spelling, value in across[section]:
            _put(fields, section, where, spelling, value)
        problems += fields.problems
        out[section] = fields.values
    return out, problems


def keywords(section: str, given: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """What a config class's keywords in other spellings set (`TrainingConfig(use_deepspeed=True)`,
    `ModelConfig(gradient_checkpointing=True)`): ({section: {field: value}}, problems)."""
    sections: dict[str, _Fields] = {}
    for key, value in given.items():
        target, spelling = ACROSS.get((section, key)) or (section, ALIASES[section][key])
        _put(sections.setdefault(target, _Fields()), target, f"{section}.{key}", spelling, value)
    return {name: fields.values for name, fields in sections.items()}, [
        problem for fields in sections.values() for problem in fields.problems
    ]


def setting_named(key: str, known: Mapping[str, list[str]]) -> str | None:
    """`section.field` that a key without its section names, as a field or in another framework's
    spelling (`max_steps` -> `training.max_steps`, `max_iters` -> `training.max_steps`, `fp16` ->
    `training.fp16`); None when no section has it. `known`: each section's field names."""
    for section, fields in known.items():
        target = ALIASES.get(section, {}).get(key)
        if key in fields or target is not None:
            return f"{section}.{target if isinstance(target, str) else key}"
    return None


def spellings_of(section: str, key: str) -> tuple[str, str]:
    """(section, field) that `section.key` sets: `model.hidden_size` -> (model, d_model),
    `distributed.strategy` -> (training, distributed_strategy), `model.gradient_checkpointing` ->
    (training, gradient_checkpointing); anything else as given."""
    if section == "distributed":
        return "training", DISTRIBUTED.get(key, key)
    if section == "parallelism":
        return spellings_of("training", key)
    if (section, key) in ACROSS:
        return ACROSS[section, key][0], key
    target = ALIASES.get(section, {}).get(key, key)
    return section, target if isinstance(target, str) else key


def set_override(data: dict, section: str, key: str, value: Any) -> None:
    """A dotted override: it replaces the field however the file spelled it (`model.d_model=64` wins
    over the file's `hidden_size: 4096` instead of conflicting with it)."""
    wanted = spellings_of(section, key)
    for other_section, other_values in list(data.items()):
        if isinstance(other_values, dict):
            for other_key in list(other_values):
                if spellings_of(other_section, other_key) == wanted:
                    del other_values[other_key]
    if not isinstance(data.get(section, {}), dict):
        raise ValueError(f"section {section!r} must be a mapping")
    data.setdefault(section, {})[key] = value


def one_message(problems: list[str]) -> str:
    """Every problem in one line."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems: " + " | ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
