"""Model weights on disk: safetensors only, with clean parameter names and shape checks on load.

A model folder holds `model.safetensors` and `model_config.json`; checkpoints, `best_model/` and
`save_model_folder` all write it, so `eval`, `generate` and `export` take any of them, and
`load_model_folder` reads it back (into `Transformer` or a subclass of it). The folder may be anyone's
(`model.init_from`, a downloaded model): its files are read under `files.folder_files`' rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import ModelConfig
from ..errors import UsageError, first_line
from ..files.disk import with_default_mode
from ..files.folder_files import refuse_unreadable
from ..limits import check_model_memory, parse_json
from ..model import Transformer
from .fused_projections import split_fused, split_fused_shapes

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "model_config.json"
MODEL_CLASS = "model_class"  # written instead of the architecture for a model that is not our Transformer
UNPADDED = 1  # vocab_pad_multiple of a model_config.json that does not name one
TRANSFORMERS_CONFIG = "config.json"  # what makes a folder a transformers one (an export); ours never hold it
# Parts that wrappers add to parameter names; they never reach a file. DDP's `module.` is added in front
# only (a model's own submodule may be called `module`); the others stand wherever a wrapper does.
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
_OUTER_WRAPPER_PARTS = _WRAPPER_PARTS | {"module"}


def clean_name(name: str) -> str:
    """A parameter's name without what torch.compile, DDP, FSDP or activation checkpointing added."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in _OUTER_WRAPPER_PARTS:
        parts = parts[1:]
    return ".".join(part for part in parts if part not in _WRAPPER_PARTS)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under torch.compile / DDP wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or not isinstance(inner, nn.Module):
            return model
        model = inner


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors (wherever they live) under clean names, each shared one (tied head) once."""
    state, seen = {}, set()
    for name, tensor in unwrap(model).state_dict().items():
        key = (tensor.data_ptr(), tensor.shape) if tensor.numel() else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        state[clean_name(name)] = tensor.detach()
    return state


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors under clean names, each shared tensor (tied head) stored once."""
    return {name: tensor.to("cpu").contiguous() for name, tensor in model_tensors(model).items()}


def _shape_problems(
    target: nn.Module, shapes: dict[str, tuple[int, ...]], elsewhere: frozenset[str] = frozenset()
) -> list[str]:
    """Every tensor of `target` missing from `shapes` or shaped otherwise, and every unexpected one (not
    `target`'s, nor one of the `elsewhere` names)."""
    expected = {clean_name(k): tuple(v.shape) for k, v in target.state_dict().items()}
    tied = {clean_name(k) for k in expected if k not in shapes and _is_tied(target, k)}
    problems = []
    for name, shape in expected.items():
        if name not in shapes and name not in tied:
            problems.append(f"missing {name} {shape}")
        elif name in shapes and tuple(shapes[name]) != shape:
            problems.append(f"{name}: file has {tuple(shapes[name])}, model has {shape}")
    problems += [f"unexpected {name}" for name in shapes if name not in expected and name not in elsewhere]
    return problems + _unpadded_vocabulary(target, shapes)


def _unpadded_vocabulary(target: nn.Module, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The way out when the file holds exactly the real vocabulary's rows and the model is padded: weights
    written before the vocabulary was padded (a checkpoint resumed with today's default)."""
    config = getattr(target, "config", None)
    if not isinstance(config, ModelConfig) or config.padded_vocab_size == config.vocab_size:
        return []
    rows = shapes.get("tok_emb.weight", (None,))[0]
    if rows != config.vocab_size:
        return []
    return [f"its embedding has {rows} rows, unpadded: set model.vocab_pad_multiple: 1 to load it"]


def _refuse_misfit(problems: list[str], source: str) -> None:
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise UsageError(f"{source} does not fit this model ({shown}); check that model settings match the checkpoint")


def current_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in our model's present layout: fused projections of files written before they were
    separate are cut into their parts (`fused_projections`); any other model's state as it is."""
    config = getattr(unwrap(model), "config", None)
    return split_fused(state, config) if isinstance(config, ModelConfig) else dict(state)


def check_fits(
    model: nn.Module, state: dict[str, torch.Tensor], source: str, elsewhere: frozenset[str] = frozenset()
) -> None:
    """Refuse weights with a list of every missing, unexpected or mis-shaped tensor (sharded ones by their
    whole shape). `state` in the model's present layout (`current_names`). `elsewhere`: the names other
    processes hold where `model` is one part of the whole (a pipeline stage): expected, and checked there."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    _refuse_misfit(_shape_problems(unwrap(model), shapes, elsewhere), source)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load weights (an older file's fused projections cut into parts), refusing with a list of every
    missing, unexpected or mis-shaped tensor."""
    state = current_names(model, state)
    check_fits(model, state, source)
    unwrap(model).load_state_dict(state, strict=False)


def _is_tied(model: nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and getattr(getattr(model, "config", None), "tie_embeddings", False)


def save_model_folder(
    model: nn.Module,
    directory: str | Path,
    extra_metadata: dict | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """model.safetensors (the model's weights, or `state` when given, e.g. gathered from shards) and its config."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = model_state_dict(unwrap(model)) if state is None else _dedupe_tied(state, model)
    save_tensors(tensors, directory / WEIGHTS_NAME)
    write_model_config(model, directory, extra_metadata)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file with the mode of the folder's other files (see `filesystem.with_default_mode`)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    with_default_mode(path)


def write_model_config(model: nn.Module, directory: str | Path, extra_metadata: dict | None = None) -> None:
    """Our architecture; for a user's own model class, its name (so loading it says what it is)."""
    bare = unwrap(model)
    if isinstance(getattr(bare, "config", None), ModelConfig):
        config = bare.config.architecture_dict()
    else:
        config = {MODEL_CLASS: f"{type(bare).__module__}.{type(bare).__qualname__}"}
    (Path(directory) / CONFIG_NAME).write_text(json.dumps({**config, **(extra_metadata or {})}, indent=2))


def _dedupe_tied(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A gathered state lists a tied head separately; files store it once, like `model_state_dict`."""
    return {k: v.contiguous() for k, v in state.items() if not _is_tied(unwrap(model), k)}


def is_transformers_folder(directory: str | Path) -> bool:
    """Whether `directory` is a transformers model folder (an export) rather than one of ours: it holds
    transformers' config.json. A model_config.json beside it is not ours (code written for transformers,
    such as a lesson's `export_model`, writes its own file of that name into the export)."""
    return (Path(directory) / TRANSFORMERS_CONFIG).is_file()


def refuse_transformers_folder(path: str | Path, task: str) -> None:
    """The one-line refusal of a transformers model folder (an export) where a checkpoint of ours is
    needed (`task`: what it was passed for, e.g. "resume from"); nothing when `path` is not one."""
    if is_transformers_folder(path):
        raise UsageError(
            f"{path} is a transformers model folder (an export), not a checkpoint of ours to {task}: pass the "
            "checkpoint, best_model or run folder it was exported from, load it with transformers "
            f"(AutoModelForCausalLM.from_pretrained), or train on from it with model.init_from={path}"
        )


def read_model_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / CONFIG_NAME
    refuse_unreadable(directory, (CONFIG_NAME,))
    if not path.is_file():
        raise UsageError(
            f"{directory} is not a model folder (no {CONFIG_NAME}); pass a checkpoint or best_model folder"
        )
    try:
        values = parse_json(path.read_text(encoding="utf-8"), str(path))
    except UsageError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path} is not valid JSON ({first_line(exc, 120)}); the model folder is corrupt") from None
    if not isinstance(values, dict):
        raise UsageError(
            f"{path} must hold a JSON object of model settings, not {type(values).__name__}; "
            "the model folder is corrupt"
        )
    if MODEL_CLASS in values:
        raise UsageError(
            f"{directory} holds a {values[MODEL_CLASS]} model, not llm-trainer's Transformer: eval, "
            "generate and export need one (build it with llm_trainer.build_model); its weights are in "
            f"{Path(directory) / WEIGHTS_NAME} for your own class's load_state_dict"
        )
    # Only the architecture: a file cannot name a folder to load (init_from) or change how training runs.
    known = {f.name for f in dataclasses.fields(ModelConfig)} - set(ModelConfig.NOT_ARCHITECTURE)
    # Folders written before the vocabulary was padded record no vocab_pad_multiple: exactly vocab_size rows.
    settings = {"vocab_pad_multiple": UNPADDED, **{k: v for k, v in values.items() if k in known}}
    try:
        config = ModelConfig(**settings)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{path}: {exc}; the model folder is corrupt") from None
    if config.vocab_size is not None:  # the whole model is built in this process: weigh it first
        check_model_memory(config.resolved().dimensions(), str(path))
    return config


def load_model_folder(
    directory: str | Path, device: str | torch.device = "cpu", *, cls: type[Transformer] = Transformer
) -> Transformer:
    """The model a folder holds, as an instance of `cls` (Transformer or a subclass taking its
    ModelConfig), on `device`; every tensor's name and shape checked against the file first."""
    directory = Path(directory)
    refuse_unreadable(directory, (WEIGHTS_NAME,))  # the folder may be anyone's (model.init_from)
    config = read_model_config(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise UsageError(f"{directory} has no {WEIGHTS_NAME}; the checkpoint is incomplete")
    try:
        with safe_open(str(weights), framework="pt") as handle:  # the header only: names and shapes
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        shapes = split_fused_shapes(shapes, config)
        with torch.device("meta"):  # a config that does not match the file allocates nothing
            _refuse_misfit(_shape_problems(cls(config), shapes), str(weights))
        state = load_file(str(weights), device=str(device) if str(device) != "cpu" else "cpu")
    except UsageError:
        raise
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
        raise UsageError(
            f"{weights} could not be read ({first_line(exc, 160)}); the file is corrupt or truncated"
        ) from None
    refuse_non_finite(state, str(weights))
    model = cls(config)
    load_model_state(model, state, str(weights))
    return model.to(device)


def refuse_non_finite(state: dict[str, torch.Tensor], where: str) -> None:
    """Weights holding NaN or infinity (a run that diverged, a damaged save that still checksums) make
    every output NaN: refused in one line naming the first such tensor, before they are used. One read
    of each tensor, summed in float64 (a NaN or infinity anywhere makes the sum one)."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not math.isfinite(t.sum(dtype=torch.float64))]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise UsageError(
            f"{where}: the weights of {bad[0]}{more} are not finite (NaN or infinity); the model cannot be used: "
            "take an earlier checkpoint"
        )
