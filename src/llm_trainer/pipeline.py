"""The full pipeline as functions: setup -> main -> fit.

`build_model`, `prepare_data`, `build_loaders` and `train` are the Python API behind the CLI; each
step can be replaced by the user's own piece (see `Trainer` for bringing your own model or data).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .config import DataConfig, ExperimentConfig, ModelConfig
from .data.loader import BatchLoader, DocumentRows, WindowRows
from .data.prepare import PreparedData, prepare_data
from .errors import UsageError
from .logs import log
from .model import Transformer
from .model_files import load_model_folder
from .tokenizer import Tokenizer
from .trainer import Trainer, resolve_device, seed_everything

__all__ = ["build_model", "prepare_data", "build_loaders", "train", "load_for_inference"]


def build_model(config: ModelConfig) -> Transformer:
    """A freshly initialised model, or one continued from `config.init_from` (a transformers folder)."""
    if config.init_from:
        from .hf_interop import import_from_hf

        model, _ = import_from_hf(config.init_from)
        return model
    return Transformer(config)


def sequence_length(experiment: ExperimentConfig) -> int:
    length = experiment.data.max_length or experiment.model.max_seq_len
    if length > experiment.model.max_seq_len:
        raise UsageError(
            f"data.max_length ({length}) is longer than model.max_seq_len ({experiment.model.max_seq_len}); "
            "lower data.max_length or raise model.max_seq_len"
        )
    return length


def build_rows(prepared: PreparedData, split: str, data: DataConfig, length: int, seed: int | None):
    """The row layout for a split: greedy windows, first-fit bins, or one document per row."""
    tokens = prepared.tokens(split)
    if data.pack_sequences and data.packing_strategy == "greedy":
        return WindowRows(tokens, length, seed=seed, keep_partial=seed is None)
    return DocumentRows(tokens, prepared.offsets(split), length, pack=data.pack_sequences, pad_id=prepared.tokenizer.eot_id)


def build_loaders(experiment: ExperimentConfig, prepared: PreparedData, device: torch.device):
    """Training loader (shuffled, seeded, seekable) and validation loader (in order, everything)."""
    length = sequence_length(experiment)
    t = experiment.training
    train_rows = build_rows(prepared, "train", experiment.data, length, seed=t.seed)
    train_loader = BatchLoader(train_rows, t.batch_size, shuffle=True, seed=t.seed, drop_last=True, device=device)
    val_loader = None
    if prepared.manifest["splits"]["val"]["tokens"] > 1:
        val_rows = build_rows(prepared, "val", experiment.data, length, seed=None)
        val_loader = BatchLoader(val_rows, t.batch_size, shuffle=False, drop_last=False, device=device)
    return train_loader, val_loader


def _fit_model_config(experiment: ExperimentConfig, tokenizer: Tokenizer) -> ExperimentConfig:
    """Fill vocab_size from the tokenizer; refuse a vocabulary smaller than the tokenizer's."""
    vocab = experiment.model.vocab_size
    if vocab is None:
        vocab = tokenizer.vocab_size
    elif vocab < tokenizer.vocab_size:
        raise UsageError(
            f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size}); "
            "remove model.vocab_size to take it from the tokenizer"
        )
    return dataclasses.replace(experiment, model=dataclasses.replace(experiment.model, vocab_size=vocab))


def train(experiment: ExperimentConfig, callbacks=()) -> dict:
    """prepare -> build model -> fit; writes config.yaml, the tokenizer, metrics and checkpoints."""
    if experiment.model.init_from and experiment.data.tokenizer == "bpe":
        tokenizer_file = Path(experiment.model.init_from) / "tokenizer.json"
        if tokenizer_file.is_file():  # continued pretraining keeps the model's own tokenizer
            experiment = dataclasses.replace(experiment, data=dataclasses.replace(experiment.data, tokenizer=str(tokenizer_file)))
    sequence_length(experiment)
    prepared = prepare_data(experiment.data)
    experiment = _fit_model_config(experiment, prepared.tokenizer)
    seed_everything(experiment.training.seed)  # the initial weights depend on the seed alone
    model = build_model(experiment.model)
    if experiment.model.init_from:
        experiment = dataclasses.replace(experiment, model=model.config)

    device = resolve_device(experiment.training.device)
    train_loader, val_loader = build_loaders(experiment, prepared, device)
    output = Path(experiment.training.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    experiment.save(output / "config.yaml")
    prepared.tokenizer.save(output)
    trainer = Trainer(
        model,
        experiment.training,
        train_dataloader=train_loader,
        val_dataloader=val_loader,
        tokenizer=prepared.tokenizer,
        callbacks=callbacks,
        experiment_config={**experiment.to_dict(), "data_fingerprint": prepared.manifest["fingerprint"]},
    )
    return trainer.train()


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """Model, tokenizer and experiment config from a checkpoint, best_model or run folder."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"checkpoint {path} not found; pass a checkpoint, best_model or output folder")
    if not (path / "model_config.json").is_file():  # a run or checkpoints folder: take its newest checkpoint
        from .checkpoint import resolve_checkpoint

        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = resolve_checkpoint("latest", root)
        if found is None:
            raise UsageError(f"{path} holds no checkpoint; pass a checkpoint or best_model folder")
        path = found
    model = load_model_folder(path, device=device)
    tokenizer = Tokenizer.load(path)
    meta_file = path / "meta.json"
    experiment = json.loads(meta_file.read_text()).get("config", {}) if meta_file.is_file() else {}
    return model, tokenizer, experiment
