"""The full pipeline as functions: setup -> main -> fit.

`prepare_data`, `build_model`, `build_loaders` and `train` are the Python API behind the CLI; each
step can be replaced by the user's own piece (see `Trainer` for bringing your own model or data).
The pieces live in `pipeline`; this module adds the default Trainer class and the run lock.
`load_for_inference` opens any checkpoint, best_model or run folder for eval/generate/export.
"""

from __future__ import annotations

from pathlib import Path

from . import pipeline
from .checkpoint import remote as remote_checkpoints
from .checkpoint.find import find_checkpoint
from .checkpoint.layout import holds_dcp_shards, read_meta
from .checkpoint.model_folder import is_transformers_folder, load_model_folder, load_model_state, read_model_config
from .checkpoint.verify import verify
from .config import DataConfig, ExperimentConfig, TrainingConfig
from .data.prepare import prepare_data
from .errors import UsageError
from .files import buckets
from .files.folder_files import refuse_unreadable
from .model import Transformer
from .parallel import distributed, launcher
from .pipeline import build_loaders, build_model, build_rows
from .tokenizer import Tokenizer
from .train.output_folder import check_output_folder
from .train.run_lock import lock_run_folders
from .train.trainer import Trainer

__all__ = [
    "build_model",
    "build_rows",
    "prepare_data",
    "build_loaders",
    "build_trainer",
    "train",
    "load_for_inference",
]


def build_trainer(
    config,
    training: TrainingConfig | None = None,
    data: DataConfig | None = None,
    *,
    callbacks=(),
    trainer_class: type[Trainer] = Trainer,
) -> Trainer:
    """prepare -> resolve -> build model -> `trainer_class(...)`, ready to `.train()`; writes config.yaml and
    the tokenizer into the output folder, and plots at the end of training (`Trainer.from_config` is this)."""
    return pipeline.build_trainer(config, training, data, trainer_class=trainer_class, callbacks=callbacks)


def train(experiment: ExperimentConfig, callbacks=(), trainer_class: type[Trainer] = Trainer) -> dict:
    """prepare -> resolve -> build model -> fit; writes config.yaml, the tokenizer, metrics, checkpoints
    and plots. `trainer_class`: a Trainer subclass (e.g. one that overrides `_log_metrics`).

    The output folder's lock is taken first: a second run into the same folder, or a folder that cannot
    be written, fails before any data is prepared; so does a folder that holds an earlier run, unless
    this one resumes it or starts over (`train.output_folder`)."""
    try:
        t = experiment.training
        is_main = launcher.is_main_process()
        with lock_run_folders(t.local_output_dir, t.resolved_checkpoint_dir, is_main):
            check_output_folder(t, is_main=is_main)
            return build_trainer(experiment, callbacks=callbacks, trainer_class=trainer_class).train()
    finally:
        distributed.teardown()


def local_checkpoint(path: str | Path) -> str | Path:
    """`path` itself, or for a URL (a checkpoint, best_model, checkpoints or run folder in a store) the
    local copy of the checkpoint it names, downloaded into {data.stream_cache_dir's default}/checkpoints."""
    if not buckets.is_url(str(path)):
        return path
    return remote_checkpoints.fetch_for_reading(str(path), Path(DataConfig.stream_cache_dir) / "checkpoints")


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """Model, tokenizer and experiment config from a checkpoint, best_model or run folder (or its URL)."""
    path = local_checkpoint(path)
    found = find_checkpoint(path)  # a run or checkpoints folder, or `latest`: its newest checkpoint
    if found is None:
        raise UsageError(f"{path} holds no checkpoint; pass a checkpoint or best_model folder")
    if is_transformers_folder(found):
        raise UsageError(
            f"{path} is a transformers model folder (an export), not a checkpoint of ours: pass the checkpoint, "
            f"best_model or run folder it was exported from, load it with transformers "
            f"(AutoModelForCausalLM.from_pretrained), or train on from it with model.init_from={path}"
        )
    path = found
    if (path / "meta.json").is_file():  # checkpoints and best_model carry checksums: never use a corrupt one
        problem = verify(path)
        if problem:
            raise UsageError(f"{path} is unusable: {problem}")
    refuse_unreadable(path, ("model_config.json", "model.safetensors", "tokenizer.json"))
    if holds_dcp_shards(path):  # an FSDP checkpoint: gather its shards in this one process
        from .checkpoint.sharded import consolidate  # (torch.distributed.checkpoint: a second to import)

        model = Transformer(read_model_config(path))
        load_model_state(model, consolidate(path, model), str(path))
        model = model.to(device)
    else:
        model = load_model_folder(path, device=device)
    if not (path / "tokenizer.json").is_file():
        raise UsageError(
            f"{path} has no tokenizer.json: the Trainer that saved it was given no tokenizer it could save "
            "(pass tokenizer= llm-trainer's Tokenizer, a tokenizers.Tokenizer or a transformers fast "
            "tokenizer), or copy your tokenizer.json into it"
        )
    tokenizer = Tokenizer.load(path)
    tokenizer.model_max_length = model.config.max_seq_len  # where its transformers copy truncates
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UsageError(
            f"{path / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
            f"{model.config.vocab_size}; the folder holds another model's tokenizer"
        )
    experiment = (read_meta(path) or {}).get("config")  # a folder from elsewhere: any shape at all
    experiment = experiment if isinstance(experiment, dict) else {}
    return model, tokenizer, experiment
