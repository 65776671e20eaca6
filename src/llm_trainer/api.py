"""The full pipeline as functions: setup -> main -> fit.

`prepare_data`, `build_model`, `build_loaders` and `train` are the Python API behind the CLI; each
step can be replaced by the user's own piece (see `Trainer` for bringing your own model or data).
The pieces live in `pipeline`; `build_trainer` and `train` build through `Trainer.from_config` (the
one builder), and `train` adds the run lock.
`load_for_inference` opens any checkpoint, best_model or run folder for eval/generate/export;
`eval_loader` gives `llm-trainer eval` its batches (a file's windows, or the run's validation split).
"""

from __future__ import annotations

from pathlib import Path

from . import launcher
from .checkpoint import remote as remote_checkpoints
from .checkpoint.layout import holds_dcp_shards, read_meta
from .checkpoint.model_folder import (
    load_model_folder,
    load_model_state,
    read_model_config,
    refuse_non_finite,
    refuse_transformers_folder,
)
from .checkpoint.reading import held_checkpoint
from .checkpoint.verify import verify
from .config import DataConfig, ExperimentConfig, TrainingConfig
from .data.prepare import prepare_data
from .errors import TrainingStopped, UsageError, first_line
from .files import buckets
from .files.folder_files import refuse_unreadable
from .model import Transformer
from .parallel import distributed
from .pipeline import build_loaders, build_model, build_rows
from .tokenizer import Tokenizer, say_unseen, warn_unseen
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
    "eval_loader",
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
    the tokenizer into the output folder, and plots at the end of training (`trainer_class.from_config`)."""
    return trainer_class.from_config(config, training, data, callbacks=callbacks)


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
            check_output_folder(t, is_main=is_main)  # before the data is prepared: a refusal comes at once
            trainer = build_trainer(experiment, callbacks=callbacks, trainer_class=trainer_class)
            trainer.output_checked = True
            return trainer.train()
    except (UsageError, TrainingStopped) as error:  # the CLI prints these in one line; each only once
        error.said_by_rank_0 = distributed.said_by_rank_0(
            str(error), follows_rank_0=getattr(error, "follows_rank_0", False)
        )
        raise
    finally:
        distributed.teardown()


def local_checkpoint(path: str | Path) -> str | Path:
    """`path` itself, or for a URL (a checkpoint, best_model, checkpoints or run folder in a store) the
    local copy of the checkpoint it names, downloaded into {data.stream_cache_dir's default}/checkpoints."""
    cache = Path(DataConfig.stream_cache_dir) / "checkpoints"
    return buckets.Location(path).local(lambda url: remote_checkpoints.fetch_for_reading(url, cache))


def load_for_inference(path: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """Model, tokenizer and experiment config from a checkpoint, best_model or run folder (or its URL),
    the checkpoint held against a running training's rotation while it is read (`held_checkpoint`)."""
    path = local_checkpoint(path)
    with held_checkpoint(path) as found:  # a run or checkpoints folder, or `latest`: its newest checkpoint
        if found is None:
            raise UsageError(f"{path} holds no checkpoint; pass a checkpoint or best_model folder")
        return _load_for_inference(found, path, device)


def _load_for_inference(found: Path, path: Path, device: str) -> tuple[Transformer, Tokenizer, dict]:
    """`load_for_inference` of the folder `found` that `path` named."""
    refuse_transformers_folder(found, "read")
    path = found
    if (path / "meta.json").is_file():  # checkpoints and best_model carry checksums: never use a corrupt one
        problem = verify(path)
        if problem:
            raise UsageError(f"{path} is unusable: {problem}")
    refuse_unreadable(path, ("model_config.json", "model.safetensors", "tokenizer.json"))
    if holds_dcp_shards(path):  # an FSDP checkpoint: gather its shards in this one process
        from .checkpoint.sharded import consolidate  # (torch.distributed.checkpoint: a second to import)

        model = Transformer(read_model_config(path))
        state = consolidate(path, model)
        refuse_non_finite(state, str(path))
        load_model_state(model, state, str(path))
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


def _as_eval_flags(message: str) -> str:
    """A data reader's message with its fix in `eval --data`'s terms: the text field is `--text-column`,
    and a bad record is fixed or removed (eval has no data.on_bad_input: it scores the whole file)."""
    for setting, flag in (
        ("set data.text_column", "pass --text-column NAME"),
        (", or set data.on_bad_input: skip", ""),
        (" or set data.invalid_utf8", ""),
    ):
        message = message.replace(setting, flag)
    return message


def _file_tokens(path: Path, tokenizer, text_column: str, clean) -> list[int]:
    """The tokens `eval --data` reads: JSONL and Parquet record by record (the text in `text_column`,
    each document followed by the end-of-text token, as `prepare` lays documents out; one that cleaning
    empties is left out, as `prepare` leaves it out); any other file as one text. Each text is cleaned
    first (`clean`: the run's cleaning), so a CRLF file or decomposed accents score as the same text
    in the prepared split would."""
    from .data.text.sources import SourceStats, file_kind, read_text_file

    kind = file_kind(path, explicit=True)
    if kind is None:
        raise UsageError(f"--data {path} is an archive of files; unpack it and pass one of its files")
    if kind == "text":
        text = clean(read_text_file(path, True, SourceStats(), fix="pass a text file to --data"))
        warn_unseen(tokenizer, text, f"--data {path}")
        return tokenizer.encode(text)
    from .config import DataConfig, SourceConfig
    from .data.text.sources import iter_source

    source = SourceConfig(name="eval", data_files=str(path), text_column=text_column)
    tokens: list[int] = []
    unseen: set[str] = set()
    try:
        for document in iter_source(source, DataConfig(data_files=str(path), text_column=text_column), SourceStats()):
            if text := clean(document.text):
                tokens += [*tokenizer.encode(text), tokenizer.eot_id]
                unseen |= tokenizer.unseen_characters(text)
    except UsageError as exc:
        raise UsageError(_as_eval_flags(str(exc))) from None
    say_unseen(tokenizer, unseen, f"--data {path}")
    return tokens


def eval_loader(
    model: Transformer,
    tokenizer: Tokenizer,
    experiment: dict,
    *,
    batch_size: int,
    data: str | Path | None = None,
    text_column: str | None = None,
    checkpoint: str | Path | None = None,
):
    """What `llm-trainer eval` reads, for a model from `load_for_inference` (with its tokenizer and
    saved experiment config): the windows of the file `data` (`--data`; JSONL and Parquet read from
    `text_column`, else the run's data.text_column), or else the run's own validation split, prepared
    earlier: never prepared here, and fetched from a store only when it lies in the bucket of
    `checkpoint` (the path or URL the model was loaded from). Batches in order, with each source's
    labels for a mixture (`loader.source_labels`)."""
    from .data.batches.loader import BatchLoader, WindowRows
    from .data.batches.source_labels import of_split as source_labels_of

    length = model.config.max_seq_len
    data_file, labels = data, None
    if data_file is not None:
        buckets.Location(str(data_file)).refuse_url(
            f"--data {data_file} is a URL; --data takes a local file: copy it here first"
        )
        path = Path(data_file)
        if not path.is_file():
            what = "is a folder; name one file of text, JSONL or Parquet" if path.is_dir() else "not found"
            raise UsageError(f"--data {path} {what}")
        import numpy as np

        from .data.text.clean import cleaner_of_run

        column = text_column or (experiment.get("data") or {}).get("text_column") or "text"
        tokens = np.asarray(_file_tokens(path, tokenizer, column, cleaner_of_run(experiment)), dtype=np.int64)
        if len(tokens) < 2:
            raise UsageError(f"--data {path} has fewer than two tokens; nothing to evaluate")
        rows = WindowRows(tokens, length, keep_partial=True)
    else:  # the run's validation split, prepared earlier; the checkpoint's config cannot name files or folders to write
        from .config import DataConfig
        from .data.prepare import fetch_validation, find_prepared

        saved, fingerprint = experiment.get("data"), experiment.get("data_fingerprint")
        if not isinstance(saved, dict) or fingerprint is None:
            raise UsageError("this folder has no saved config to find its validation data; pass --data FILE")
        try:
            settings = DataConfig.from_dict(saved, section="data")
        except (TypeError, ValueError) as exc:
            raise UsageError(f"the checkpoint's saved data settings are invalid ({exc}); pass --data FILE") from None
        prepared = find_prepared(
            settings.local_cache_dir, fingerprint
        )  # read only: nothing prepared for a saved config
        if prepared is None and buckets.same_bucket(settings.cache_dir, checkpoint):
            # the validation split, from the store the user named with --checkpoint (never another one: a
            # checkpoint's config may lead eval to read its run's data in that bucket, and nowhere else)
            root = Path(DataConfig.stream_cache_dir) / "validation" / buckets.mirror_name(settings.cache_dir)
            prepared = fetch_validation(settings.cache_dir, fingerprint, root)
        if prepared is None and settings.remote_cache_dir and not buckets.same_bucket(settings.cache_dir, checkpoint):
            raise UsageError(
                f"the run's validation data ({fingerprint}) was prepared in {settings.cache_dir}, and eval reads a "
                "store only for a checkpoint in the same bucket: pass --checkpoint as the run's URL there, or "
                "--data FILE"
            )
        if prepared is None:
            where = settings.cache_dir
            if not settings.remote_cache_dir and not Path(where).is_absolute():  # read from where the command runs
                where = f"{where} (relative to the current folder: {settings.local_cache_dir.absolute()})"
            raise UsageError(
                f"the run's validation data ({fingerprint}) is not prepared in {where}; run the command from "
                "the folder the run trained in, run `llm-trainer prepare` with the run's config, or pass --data FILE"
            )
        if prepared.manifest["splits"]["val"]["tokens"] < 2:
            raise UsageError("the run has no validation split; pass --data FILE")
        if settings.max_length is not None and settings.max_length > length:
            raise UsageError(
                f"the saved data.max_length ({settings.max_length}) exceeds the model's context ({length}); "
                "pass --data FILE"
            )
        try:  # files of a folder the checkpoint pointed at: whatever is wrong with them is one line
            if int(prepared.tokens("val").max()) >= model.config.vocab_size:
                raise UsageError(
                    f"the prepared data in {prepared.directory} holds token ids beyond the model's "
                    "vocabulary; it was prepared with another tokenizer. Pass --data FILE"
                )
            rows = build_rows(prepared, "val", settings, settings.max_length or length, seed=None)
            labels = source_labels_of(rows, prepared)  # a mixture: each source's loss too
        except (ValueError, OSError, IndexError) as exc:
            if isinstance(exc, UsageError):
                raise
            raise UsageError(
                f"the prepared data in {prepared.directory} is unreadable ({first_line(exc, 120)}); pass --data FILE"
            ) from None
    loader = BatchLoader(rows, batch_size, shuffle=False, drop_last=False)
    loader.source_labels = labels
    return loader
