"""llm_trainer's own pipeline, from an experiment config to the pieces a Trainer is built from:

    prepared = prepare_run(experiment, pick_batch_size=auto_batch_size)   # resolve, process group, data, model
    train_loader, val_loader = prepared.loaders()

`prepare_run` is the one place that fixes the order: the training config as the run uses it, the
runtime (device, process group, precision), the data (rank 0 first; the tokenizer comes from it),
the model.init_from model, then the resolved run. `Trainer.from_config` (which `api.train` and
`api.build_trainer` call) and the LR finder both start from it. This module sits below the Trainer
and never imports it, nor anything of `train/`: `batch_size: auto`'s picker (`train.batch_size`)
is passed in by the caller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoint import remote as remote_checkpoints
from .checkpoint.model_folder import CONFIG_NAME, is_transformers_folder, load_model_folder, load_model_state
from .config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
from .config_loader import load_experiment
from .data.batches.loader import BatchLoader, DocumentRows, WindowRows
from .data.batches.source_labels import of_split as source_labels_of
from .data.format import PreparedData
from .data.prepare import prepare_data
from .errors import UsageError
from .files import buckets
from .files.folder_files import refuse_unreadable
from .logs import log, warn
from .model import Transformer
from .parallel import distributed
from .parallel.float8 import check_float8
from .resolve import (
    RUN_SETTINGS,
    ResolvedRun,
    local_runtime,
    resolve_experiment,
    resolve_run,
    seed_everything,
    sequence_length,
    setup_runtime,
)
from .tokenizer import TOKENIZER_FILE, Tokenizer, vocabulary_mismatch


def build_model(config: ModelConfig, *, meta: bool = False) -> Transformer:
    """A freshly initialised model, or one continued from `config.init_from`.

    init_from: one of our model folders (a checkpoint, best_model) or a transformers GPT-2/LLaMA
    folder or hub name. meta=True builds without storage (initialised after sharding, by parallelize).
    """
    if config.init_from:
        return load_init_model(config.init_from)
    if meta:
        return Transformer.on_meta(config)
    return Transformer(config)


def load_init_model(path: str) -> Transformer:
    """The model `model.init_from` names: our model folder, or a transformers folder / hub name."""
    if (Path(path) / CONFIG_NAME).is_file() and not is_transformers_folder(path):
        return load_model_folder(path)
    from .hf.interop import import_from_hf

    model, _ = import_from_hf(path)
    return model


def _running_as_asked(loaded: Transformer, config: ModelConfig) -> Transformer:
    """The model.init_from model, rebuilt around its weights where the run sets how it runs otherwise
    (dropout: `resolve.RUN_SETTINGS`); the model itself where nothing differs."""
    if all(getattr(loaded.config, name) == getattr(config, name) for name in RUN_SETTINGS):
        return loaded
    model = Transformer(dataclasses.replace(loaded.config, **{name: getattr(config, name) for name in RUN_SETTINGS}))
    load_model_state(model, loaded.state_dict(), str(config.init_from))
    return model


def _check_init_vocabulary(init_from: str, tokenizer: Tokenizer) -> None:
    """Refuse a tokenizer whose ids mean other tokens than the init_from model's embedding rows."""
    source = Path(init_from) / TOKENIZER_FILE
    if not source.is_file():
        warn(
            f"model.init_from {init_from} has no {TOKENIZER_FILE}: its vocabulary cannot be checked against this "
            "run's tokenizer; they must number the same tokens alike"
        )
        return
    try:
        wrong, total = vocabulary_mismatch(source.read_text(encoding="utf-8"), tokenizer.to_json())
    except (OSError, UnicodeDecodeError, UsageError) as exc:
        raise UsageError(f"model.init_from: {source} could not be read ({exc})") from None
    if wrong:
        raise UsageError(
            f"model.init_from {init_from} was trained with another vocabulary: {wrong} of this run's {total} tokens "
            f"are missing from it or have other ids, so they would read the wrong embedding rows; train with its "
            f"tokenizer (data.tokenizer: {source})"
        )


UNUSED_ROWS_NOTED = 128  # fewer ids past the tokenizer's than this: a vocabulary rounded up by hand, no warning


def _note_unused_embeddings(run: ResolvedRun, tokenizer: Tokenizer) -> None:
    """One line when model.vocab_size gives the model many ids the tokenizer has no token for: no input
    reads their rows, yet the head predicts them, so the loss starts higher and training spends steps
    pushing them down (generation never draws them: `generate.tokenizer_columns`)."""
    model = run.experiment.model
    unused = model.vocab_size - tokenizer.vocab_size
    if run.vocab_source != "model.vocab_size" or unused < UNUSED_ROWS_NOTED:
        return
    parameters = unused * model.d_model * (1 if model.tie_embeddings else 2)  # input rows, and the head's own
    warn(
        f"model.vocab_size is {model.vocab_size:,} but the tokenizer has {tokenizer.vocab_size:,} tokens: the "
        f"model predicts {unused:,} ids no text has ({parameters / 1e6:.1f}M parameters), so its loss starts near "
        f"ln {model.vocab_size:,} = {math.log(model.vocab_size):.2f} instead of ln {tokenizer.vocab_size:,} = "
        f"{math.log(tokenizer.vocab_size):.2f} "
        "until training pushes them down; remove model.vocab_size to size the model from the tokenizer"
    )


def build_rows(prepared: PreparedData, split: str, data: DataConfig, length: int, seed: int | None):
    """The row layout for a split: greedy windows, first-fit bins, or one document per row.

    With data.document_mask the rows also yield (B, L) document ids: batches are (inputs, targets, doc_ids).
    """
    tokens = prepared.tokens(split)
    eot = prepared.tokenizer.eot_id
    if data.pack_sequences and data.packing_strategy == "greedy":
        return WindowRows(
            tokens, length, seed=seed, keep_partial=seed is None, eot_id=eot if data.document_mask else None
        )
    return DocumentRows(
        tokens, prepared.offsets(split), length, pack=data.pack_sequences, pad_id=eot, document_ids=data.document_mask
    )


def build_loaders(
    experiment: ExperimentConfig, prepared: PreparedData, device: torch.device, rank: int = 0, world_size: int = 1
):
    """Training loader (shuffled, seeded, seekable) and validation loader (in order, everything);
    with several ranks each reads its own part."""
    length = sequence_length(experiment)
    t = experiment.training
    shard = dict(
        rank=rank, world_size=world_size, device=device, ahead=None if t.read_ahead == "auto" else t.read_ahead
    )
    train_ids, val_ids = (partial(prepared.check_ids, split) for split in ("train", "val"))
    train_rows = build_rows(prepared, "train", experiment.data, length, seed=t.seed)
    if isinstance(train_rows, DocumentRows):
        log(
            f"data: {experiment.data.packing_strategy if experiment.data.pack_sequences else 'unpacked'} rows: "
            f"{len(train_rows):,} of {length} tokens, {train_rows.padding_fraction():.1%} padding"
        )
    if experiment.data.curriculum:  # easy rows first, in stages (see data/batches/curriculum.py)
        from .data.batches.curriculum import CurriculumLoader, document_difficulty, row_difficulty

        offsets = prepared.offsets("train")
        difficulty = row_difficulty(
            train_rows, offsets, document_difficulty(offsets, prepared.scores("train"), experiment.data.curriculum_key)
        )
        train_loader = CurriculumLoader(
            train_rows,
            t.batch_size,
            difficulty=difficulty,
            stages=experiment.data.curriculum,
            accumulation=t.gradient_accumulation_steps,
            seed=t.seed,
            check_ids=train_ids,
            **shard,
        )
    else:
        train_loader = BatchLoader(
            train_rows, t.batch_size, shuffle=True, seed=t.seed, drop_last=True, check_ids=train_ids, **shard
        )
    val_loader = None
    if prepared.manifest["splits"]["val"]["tokens"] > 1:
        val_rows = build_rows(prepared, "val", experiment.data, length, seed=None)
        val_loader = BatchLoader(
            val_rows, t.eval_batch_size or t.batch_size, shuffle=False, drop_last=False, check_ids=val_ids, **shard
        )
        val_loader.source_labels = source_labels_of(val_rows, prepared)  # a mixture: each source's loss too
    return train_loader, val_loader


@dataclass(frozen=True)
class PreparedRun:
    """What `prepare_run` returns: the resolved run, its data, and its model (not yet on the device)."""

    run: ResolvedRun
    prepared: PreparedData
    model: nn.Module

    def loaders(self):
        """(train, validation) loaders of this run, each rank reading its own part."""
        run = self.run
        return build_loaders(run.experiment, self.prepared, run.device, run.dist.dp_rank, run.dist.dp_size)


def prepare_run(
    experiment: ExperimentConfig,
    *,
    pick_batch_size: Callable[..., TrainingConfig],
    local: bool = False,
    meta: bool = True,
) -> PreparedRun:
    """Resolve the run and build its data and model, in the one order every entry point uses (see the
    module docstring). `pick_batch_size`: `train.batch_size.auto_batch_size`, for `batch_size: auto`
    (it sits above this module). `local`: this process alone, no process group (the LR finder).
    `meta`: a fresh model is built on the meta device and initialised on the target device by the
    Trainer (after sharding under FSDP): every strategy and world size starts from the same weights
    for a seed."""
    if experiment.model.init_from:  # a URL: read from a local copy, checked as any folder
        models = Path(experiment.data.stream_cache_dir) / "models"
        init_from = buckets.Location(experiment.model.init_from).local(lambda url: buckets.fetch_tree(url, models))
        experiment = _replace_section(experiment, "model", init_from=str(init_from))
    if experiment.model.init_from:  # a folder we may not have written: its tokenizer is read below
        refuse_unreadable(Path(experiment.model.init_from), (TOKENIZER_FILE,))
    if experiment.model.init_from and experiment.data.tokenizer == "bpe":
        tokenizer_file = Path(experiment.model.init_from) / TOKENIZER_FILE
        if tokenizer_file.is_file():  # continued pretraining keeps the model's own tokenizer
            experiment = _replace_section(experiment, "data", tokenizer=str(tokenizer_file))
    experiment.data.check_source()  # on every rank, before any process waits for rank 0 to prepare
    experiment = resolve_experiment(experiment)
    runtime = local_runtime(experiment.training) if local else setup_runtime(experiment.training)
    if experiment.training.float8:  # before the data is prepared: minutes, for a run that cannot start
        check_float8(runtime.device)
    if not runtime.dist.is_main:  # rank 0 prepares the data; the others then reuse its cache
        distributed.wait_for_main("which prepares the data")
    if runtime.dist.is_main and (remote := experiment.training.remote_checkpoint_dir):  # before the data is prepared
        training = experiment.training
        remote_checkpoints.check_target(
            remote, resuming=bool(training.resume_from_checkpoint), overwrite=training.overwrite_output_dir
        )
    prepared = prepare_data(experiment.data)
    if runtime.dist.is_main:
        distributed.barrier()
    loaded = load_init_model(experiment.model.init_from) if experiment.model.init_from else None
    if loaded is not None:
        _check_init_vocabulary(experiment.model.init_from, prepared.tokenizer)
    run = resolve_run(
        experiment,
        prepared.tokenizer,
        runtime,
        model_config=loaded.config if loaded else None,
        pick_batch_size=pick_batch_size,
    )
    if loaded is not None:
        model = _running_as_asked(loaded, run.experiment.model)
    else:
        _note_unused_embeddings(run, prepared.tokenizer)
        seed_everything(run.training.seed)  # a model built with storage is initialised here, from the run's seed
        model = build_model(run.experiment.model, meta=meta)
    prepared.tokenizer.model_max_length = model.config.max_seq_len  # where its transformers copy truncates
    return PreparedRun(run=run, prepared=prepared, model=model)


def experiment_from(config, training: TrainingConfig | None = None, data: DataConfig | None = None) -> ExperimentConfig:
    """An ExperimentConfig from one, from a config file's path, or from the three section configs."""
    if isinstance(config, ExperimentConfig):
        return config
    if isinstance(config, (str, Path)):
        return load_experiment(config)
    if isinstance(config, ModelConfig) and data is not None:
        return ExperimentConfig(model=config, training=training or TrainingConfig(), data=data)
    raise UsageError(
        "pass an ExperimentConfig, a config file, or model_config, training_config and data_config "
        "(the data config says where the text comes from)"
    )


def _replace_section(experiment: ExperimentConfig, section: str, **changes) -> ExperimentConfig:
    return dataclasses.replace(experiment, **{section: dataclasses.replace(getattr(experiment, section), **changes)})
