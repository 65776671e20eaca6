"""Metric backends behind one small interface: `log(row)` and `close()`, and the `MetricsTracker` that
holds them for a run.

`console` lines and `jsonl` (metrics.jsonl, what `llm-trainer plot`, the registry and sweeps read) are
always written; `training.report_to` adds `tensorboard`, `wandb`, `mlflow` (naming console or jsonl
there is allowed and changes nothing). Only rank 0 builds loggers; other ranks get none. The optional
backends import their package only when chosen; a missing package is a one-line `UsageError` naming
the extra to install.

Rows are flat dicts of the kinds in `rows` (train, eval, summary, custom). The tracking backends name their
values (`scalar_items`):

    training row   key        -> train/<key>      (train/loss, train/lr, train/grad_norm, train/mfu, ...)
    eval row       val_loss   -> eval/loss, perplexity -> eval/perplexity, other -> eval/<key>
    summary row    key        -> summary/<key>
    custom row     key        -> key (`metrics_tracker.update({"custom/accuracy": x}, step)`)
    any row        a key with "/" (e.g. custom/accuracy from a Trainer subclass) is kept as it is

TensorBoard writes to `{checkpoint_dir}/logs` when training.checkpoint_dir is set (so that
`tensorboard --logdir ./checkpoints/logs` finds it beside the checkpoints), else to `{output_dir}/tensorboard`.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import torch

from ..config import SOURCE_LOSS, TrainingConfig
from ..errors import UsageError, first_line
from ..files.atomic import write_text
from ..files.disk import no_follow
from ..logs import is_main_process, log, warn
from .rows import custom_row, row_kind

INSTALL_HINT = "pip install 'llm-trainer[tracking]'"


class MetricLogger(Protocol):
    """A backend. One that records how a run ended (a tracker's run status) also has
    `record_outcome(outcome)`, called before `close()` with one of `OUTCOMES`."""

    def log(self, row: dict) -> None: ...

    def close(self) -> None: ...


OUTCOMES = ("finished", "failed", "stopped")  # ran to its end; raised; stopped early by a signal (resumable)


def scalar_items(row: dict) -> list[tuple[str, float]]:
    """The numeric values of a row under their backend names (see the module docstring)."""
    if row.get("kind") == "alert":  # words, not a series: metrics.jsonl and the alert's destinations hold it
        return []
    kind = row_kind(row) or ("train" if "kind" not in row else None)
    items = []
    for key, value in row.items():
        if key in ("step", "event", "kind") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "/" in key or kind is None:  # a custom row's names are the user's
            name = key
        elif kind == "eval":
            name = {"val_loss": "eval/loss", "perplexity": "eval/perplexity"}.get(key, f"eval/{key}")
        else:
            name = f"{kind}/{key}"
        items.append((name, float(value)))
    return items


# other trainers' names for the series a run logs, read as ours by `LoggedSeries`
SERIES_ALIASES = {
    "loss": "train/loss",
    "train_loss": "train/loss",
    "lr": "train/lr",
    "learning_rate": "train/lr",
    "grad_norm": "train/grad_norm",
    "val_loss": "eval/loss",
    "eval_loss": "eval/loss",
    "perplexity": "eval/perplexity",
}


class LoggedSeries(dict):
    """What a run has logged: each value's backend name (`scalar_items`) -> [(step, value), ...] in the
    order logged. Other trainers' names for ours (`SERIES_ALIASES`: val_loss, learning_rate) are read
    as ours; a name never logged is a KeyError that lists those that were."""

    def __missing__(self, name: str) -> list[tuple[int, float]]:
        ours = SERIES_ALIASES.get(name)
        if ours is not None and super().__contains__(ours):
            return self[ours]
        raise KeyError(f"{name!r} was not logged by this run; its series: {', '.join(sorted(self)) or 'none yet'}")

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or super().__contains__(SERIES_ALIASES.get(name, name))  # type: ignore[arg-type]

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default


def logged_series(rows: list[dict]) -> LoggedSeries:
    """The series of metrics.jsonl's rows (`read_rows`); its non-finite values, written as text, are floats again."""
    series = LoggedSeries()
    for row in rows:
        step = row.get("step")
        if type(step) is not int:
            continue
        values = {k: float(v) if v in _NON_FINITE else v for k, v in row.items()}
        for name, value in scalar_items(values):
            series.setdefault(name, []).append((step, value))
    return series


def flatten_config(config: dict, prefix: str = "") -> dict[str, object]:
    """{"training": {"learning_rate": 3e-4}} -> {"training.learning_rate": 3e-4}; lists/None become text."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


class JsonlLogger:
    """metrics.jsonl: one JSON object per line, flushed each row so a crash loses nothing logged.

    The file reads as one run. A line cut short by a kill is dropped before the next row is appended
    (it would swallow it), and a run resumed at step S drops the rows the interrupted run logged
    after S (they are logged again, as the steps are replayed) and its summary rows (a new one comes
    at the end). Opened without following a symlink planted in its place.
    """

    def __init__(self, directory: Path, resumed_at: int | None = None):
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "metrics.jsonl"
        if path.is_symlink():
            raise UsageError(f"{path} is a symlink; refusing to write the run's metrics through it (remove it)")
        _clean(path, resumed_at)
        self.path = path
        self.handle = open(path, "a", encoding="utf-8", opener=no_follow)

    def rewound(self, step: int) -> None:
        """The run went back to step `step` (a loss-spike rewind): drop the rows logged after it, as a resume does."""
        self.handle.close()
        _clean(self.path, step)
        self.handle = open(self.path, "a", encoding="utf-8", opener=no_follow)

    def log(self, row: dict) -> None:
        if os.fstat(self.handle.fileno()).st_nlink == 0:  # removed while open: rows would go nowhere
            self._removed()
        self.handle.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        self.handle.flush()

    def _removed(self) -> None:
        """metrics.jsonl was deleted under the run (its folder removed by hand, a cleanup job): said once,
        and the rows from here on go into a new metrics.jsonl at the same place (the checkpoints are
        written where they were, so a resume works from the next save)."""
        self.handle.close()
        warn(
            f"{self.path} was removed while the run was writing it (its folder deleted?): the rows logged "
            "before are lost; the next rows go into a new file there"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a", encoding="utf-8", opener=no_follow)

    def close(self) -> None:
        self.handle.close()


def _replayed(line: str, resumed_at: int | None) -> bool:
    """Whether a row belongs to the part of the run a resume at `resumed_at` replays (or to its end)."""
    if resumed_at is None:
        return False
    try:
        row = json.loads(line)
    except ValueError:
        return False  # not ours to judge
    if not isinstance(row, dict):
        return False
    step = row.get("step")
    if row.get("kind") == "alert":  # what happened stays, whatever part of the run is replayed
        return False
    return row_kind(row) == "summary" or (isinstance(step, int) and step > resumed_at)


def _clean(path: Path, resumed_at: int | None) -> None:
    """Drop a torn last line and, on a resume, the rows of the steps it replays (see JsonlLogger)."""
    if path.is_symlink() or not path.is_file():
        return
    text = path.read_bytes().decode("utf-8", errors="replace")
    complete = text if text.endswith("\n") or not text else text[: text.rfind("\n") + 1]
    kept = "".join(line for line in complete.splitlines(keepends=True) if not _replayed(line, resumed_at))
    if kept != text:
        dropped = len(text.splitlines()) - len(kept.splitlines())
        write_text(path, kept)
        log(
            f"metrics: {path} continues from step {resumed_at}: dropped {dropped} row(s) logged after it"
            if resumed_at is not None
            else f"metrics: dropped the last line of {path}, cut short by an interrupted run"
        )


class ConsoleLogger:
    """Evaluation results and (without a progress bar) training rows as plain lines."""

    def __init__(self, show_train_rows: bool):
        self.show_train_rows = show_train_rows

    def log(self, row: dict) -> None:
        kind = row_kind(row)
        if kind == "eval":
            log(
                f"eval  step {row['step']:>7}  val_loss {row['val_loss']:.4f}  perplexity {row['perplexity']:.2f}  "
                f"({coverage(row)}){by_source(row)}"
            )
        elif kind == "train" and self.show_train_rows:  # the end-of-run summary is printed by the trainer itself
            log(
                f"train step {row['step']:>7}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                f"grad_norm {row.get('grad_norm', float('nan')):.3f}  {row.get('tokens_per_s', 0):,.0f} tok/s"
            )

    def close(self) -> None:
        pass


def by_source(row: dict) -> str:
    """`  sources: a 2.1012, b 3.4001` for an evaluation of several sources, else ''."""
    losses = [(found.group(1), value) for key, value in row.items() if (found := SOURCE_LOSS.fullmatch(key))]
    return "  sources: " + ", ".join(f"{name} {loss:.4f}" for name, loss in losses) if losses else ""


def coverage(row: dict) -> str:
    """What an evaluation covered, in words: `all 12 batches, 3,072 tokens` or `first 4 of 12 batches, ...`."""
    done, total = row.get("batches"), row.get("batches_total")
    tokens = f"{row['tokens']:,} tokens"
    if done is None:
        return tokens
    if total is not None and done < total:
        return f"first {done} of {total} batches, {tokens}: training.eval_max_batches"
    return f"all {done} {'batch' if done == 1 else 'batches'}, {tokens}"


class TensorBoardLogger:
    """Scalars (train/loss, eval/perplexity, ...), the config as text and hparams, in `directory`."""

    def __init__(self, directory: Path, config: dict, resumed_at: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError(f"report_to tensorboard needs tensorboard: {INSTALL_HINT}") from None
        self.directory, self._writer_class = directory, SummaryWriter
        # a resumed run: TensorBoard drops what the interrupted run logged after step `resumed_at`
        self.writer = SummaryWriter(str(directory), purge_step=None if resumed_at is None else resumed_at + 1)
        log(f"tensorboard: writing to {directory} (view: tensorboard --logdir {directory})")
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
        self._write_hparams(config)

    def _write_hparams(self, config: dict) -> None:
        """The flattened config in TensorBoard's HPARAMS tab, in this same run (no extra sub-run)."""
        try:
            from torch.utils.tensorboard.summary import hparams
        except ImportError:  # pragma: no cover - part of torch
            return
        values = {k: v for k, v in flatten_config(config).items()}
        metrics = {"eval/loss": 0.0, "eval/perplexity": 0.0, "train/loss": 0.0}  # names only
        try:
            experiment, start, self._hparams_end = hparams(values, metrics)
        except Exception as exc:  # hparams are a convenience; never fail a run for them
            warn(f"tensorboard: config not written as hparams ({exc})")
            self._hparams_end = None
            return
        writer = self.writer._get_file_writer()
        writer.add_summary(experiment)
        writer.add_summary(start)

    def log(self, row: dict) -> None:
        for name, value in scalar_items(row):
            self.writer.add_scalar(name, value, row["step"])

    def histograms(self, step: int, histograms: dict[str, dict]) -> None:
        """Histograms given as TensorBoard's raw fields (`train.layer_stats`)."""
        for name, fields in histograms.items():
            self.writer.add_histogram_raw(name, global_step=step, **fields)

    def rewound(self, step: int) -> None:
        """The run went back to `step`: what was logged after it is dropped when TensorBoard reads the run."""
        self.writer.close()
        self.writer = self._writer_class(str(self.directory), purge_step=step + 1)

    def close(self) -> None:
        if getattr(self, "_hparams_end", None) is not None:
            self.writer._get_file_writer().add_summary(self._hparams_end)
        self.writer.close()


STEP_AXIS = "train/global_step"  # W&B's x-axis for every series (WandbLogger)


class WandbLogger:
    """Weights & Biases; honours WANDB_MODE=offline (and WANDB_PROJECT), so no network is needed unless wanted.

    The run lives in `{output_dir}/wandb/`; the end-of-run row goes to the run summary. Every series
    is plotted against `train/global_step` (the training step, as the Hugging Face Trainer's W&B
    callback names it), not W&B's own step: W&B drops a row whose step is below one already logged,
    so a rewind's replayed steps, or a resume into a W&B run given by WANDB_RUN_ID, would be lost.
    A replayed step shows both values, as in MLflow; metrics.jsonl and TensorBoard keep the later.
    """

    def __init__(self, directory: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise UsageError(f"report_to wandb needs wandb: {INSTALL_HINT}") from None
        directory.mkdir(parents=True, exist_ok=True)
        self.exit_code = 0  # until `record_outcome` says otherwise
        try:
            self.run = wandb.init(
                dir=str(directory),
                config=config,
                project=os.environ.get("WANDB_PROJECT", "llm-trainer"),
                name=os.environ.get("WANDB_NAME") or directory.resolve().name,
            )
        except wandb.Error as error:  # no login, no network, a refused key
            raise UsageError(
                f"report_to wandb could not start a W&B run ({first_line(error)}); run `wandb login` (or set WANDB_API_KEY), "
                "or set WANDB_MODE=offline to log locally and `wandb sync` later"
            ) from None
        self.run.define_metric(STEP_AXIS)
        self.run.define_metric("*", step_metric=STEP_AXIS)

    def histograms(self, step: int, histograms: dict[str, dict]) -> None:
        """Histograms given as TensorBoard's raw fields (`train.layer_stats`), as W&B histograms."""
        import numpy as np
        import wandb

        values = {}
        for name, fields in histograms.items():
            edges = np.asarray([fields["min"], *fields["bucket_limits"]])
            values[name] = wandb.Histogram(np_histogram=(np.asarray(fields["bucket_counts"]), edges))
        self.run.log({**values, STEP_AXIS: step})

    def log(self, row: dict) -> None:
        values = dict(scalar_items(row))
        if row_kind(row) == "summary":
            self.run.summary.update(values)
        elif values:
            self.run.log({**values, STEP_AXIS: row["step"]})

    def record_outcome(self, outcome: str) -> None:
        self.exit_code = 1 if outcome == "failed" else 0

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)


def resolve_mlflow_uri(configured: str | None, create: bool = True) -> tuple[str, Path | None]:
    """(tracking URI, local folder or None). A URI with a scheme (http://, sqlite:///, databricks) is used
    as given; a plain folder, the default `./mlruns`, and a `file:` URI (which MLflow's file store, in
    maintenance, refuses unless MLFLOW_ALLOW_FILE_STORE=true) become `sqlite:///{folder}/mlflow.db` with
    artifacts in `{folder}/artifacts`."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
    if uri.startswith("file:") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        # MLflow refuses its file store unless that is set: the folder is kept as a plain folder is
        uri = unquote(urlsplit(uri).path) or "."
    if uri == "databricks" or re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri):
        return uri, None
    folder = Path(uri).expanduser().resolve()
    if create:  # a reader (a registry listing) creates nothing
        folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", folder


MLFLOW_CONNECT_S = 5.0  # a connection to an MLflow server: one that runs answers at once


def mlflow_client(configured: str | None):
    """An `MlflowClient` for the configured tracking URI, and the local folder (None for a remote URI)."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UsageError(f"mlflow is not installed: {INSTALL_HINT}") from None
    uri, folder = resolve_mlflow_uri(configured)
    _check_reachable(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri), folder


def _check_reachable(uri: str) -> None:
    """An MLflow server where nothing answers is one line at once: MLflow's client retries each request
    with backoff for minutes, with no word. A connection to its host is tried once (not through a proxy
    the environment names, whose connections are not ours to predict)."""
    parts = urlsplit(uri)
    proxied = any(os.environ.get(name) for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"))
    if parts.scheme not in ("http", "https") or not parts.hostname or proxied:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=MLFLOW_CONNECT_S).close()
    except OSError as exc:
        raise UsageError(
            f"MLflow tracking server {uri} cannot be reached ({exc.strerror or type(exc).__name__}); start it, fix "
            "training.mlflow_tracking_uri (or MLFLOW_TRACKING_URI), or leave mlflow out of training.report_to"
        ) from None


class MLflowLogger:
    """MLflow through its client API (no global active run, so several runs in one process are fine).

    Tracking URI: `training.mlflow_tracking_uri`, else $MLFLOW_TRACKING_URI, else `./mlruns`
    (see `resolve_mlflow_uri`); experiment: $MLFLOW_EXPERIMENT_NAME or "llm-trainer"; the run is named
    after the output folder. The config goes in as params (flattened) and as `config.json`.
    """

    def __init__(self, directory: Path, config: dict):
        try:
            from mlflow.entities import Param
        except ImportError:
            raise UsageError(f"report_to mlflow needs mlflow: {INSTALL_HINT}") from None
        self.client, folder = mlflow_client((config.get("training") or {}).get("mlflow_tracking_uri"))
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "llm-trainer")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            location = (folder / "artifacts").as_uri() if folder is not None else None
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        run = self.client.create_run(
            experiment_id, run_name=directory.resolve().name, tags={"output_dir": str(directory.resolve())}
        )
        self.run_id = run.info.run_id
        self.status = "FINISHED"  # until `record_outcome` says otherwise
        params = [Param(k, str(v)[:500]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        try:
            self.client.log_text(self.run_id, json.dumps(config, indent=2, default=str), "config.json")
        except Exception as exc:  # an artifact store we cannot reach must not stop training
            warn(f"mlflow: config.json not stored as an artifact ({exc})")

    def log(self, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, int(row["step"])) for name, value in scalar_items(row)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def record_outcome(self, outcome: str) -> None:
        self.status = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}[outcome]

    def close(self) -> None:
        self.client.set_terminated(self.run_id, self.status)


def tensorboard_dir(training: TrainingConfig) -> Path:
    """`{checkpoint_dir}/logs` when checkpoint_dir is set (the logs beside the checkpoints); else
    `{output_dir}/tensorboard`."""
    if training.checkpoint_dir:
        return training.resolved_checkpoint_dir / "logs"
    return training.local_output_dir / "tensorboard"


def build_loggers(
    report_to: list[str],
    output_dir: Path,
    config: dict,
    progress_bar: bool,
    tensorboard_dir: Path | None = None,
    resumed_at: int | None = None,
    start_over: Callable[[], object] | None = None,
) -> list[MetricLogger]:
    """Console and metrics.jsonl, then the backends `report_to` adds, in order; [] on ranks other than 0.
    `resumed_at`: the step a resumed run continues from (metrics.jsonl drops what was logged after it).
    `start_over`: what removes an earlier run's files (`--overwrite`), called once the services that may
    refuse to start (W&B, MLflow) have started and before anything writes into the run's files."""
    if not is_main_process():
        return []
    output_dir = Path(output_dir)
    names = list(dict.fromkeys(["console", "jsonl", *report_to]))  # each backend once, in this order
    built: dict[str, MetricLogger] = {}
    try:
        # the tracker services start first: one that cannot (no W&B login) leaves the folder as it was:
        # no metrics.jsonl behind (which would make it hold a run), an earlier run not yet removed
        order = sorted(names, key=lambda n: (n not in ("wandb", "mlflow"), n in ("console", "jsonl")))
        for name in order:
            if start_over is not None and name not in ("wandb", "mlflow"):
                start_over()
                start_over = None
            if name == "console":
                built[name] = ConsoleLogger(show_train_rows=not progress_bar)
            elif name == "jsonl":
                built[name] = JsonlLogger(output_dir, resumed_at)
            elif name == "tensorboard":
                built[name] = TensorBoardLogger(tensorboard_dir or output_dir / "tensorboard", config, resumed_at)
            elif name == "wandb":
                built[name] = WandbLogger(output_dir, config)
            elif name == "mlflow":
                built[name] = MLflowLogger(output_dir, config)
            else:
                raise UsageError(f"unknown report_to backend {name!r}; use console, jsonl, tensorboard, wandb, mlflow")
    except BaseException:
        close_loggers(list(built.values()))
        raise
    return [built[name] for name in names]


class MetricsTracker:
    """The run's backends as one object. The loop logs its rows with `log(row)`; a user's own values go
    through `update(values, step)` (in a Trainer subclass: `self.metrics_tracker.update(custom_metrics,
    self.current_step)`) as a row of kind "custom"."""

    def __init__(self) -> None:
        self.loggers: list[MetricLogger] = []

    def open(
        self,
        report_to: list[str],
        output_dir: Path,
        config: dict,
        *,
        progress_bar: bool,
        tensorboard_dir: Path | None = None,
        resumed_at: int | None = None,
        start_over: Callable[[], object] | None = None,
    ) -> None:
        self.close()
        self.loggers = build_loggers(
            report_to, output_dir, config, progress_bar, tensorboard_dir, resumed_at, start_over=start_over
        )

    def log(self, row: dict) -> None:
        with torch.profiler.record_function("logging"):  # a named range in a profiler trace
            for logger in self.loggers:
                logger.log(row)

    def rewound(self, step: int) -> None:
        """The run went back to `step`: metrics.jsonl and TensorBoard drop what was logged after it (W&B and
        MLflow cannot: they keep it)."""
        for logger in self.loggers:
            if hasattr(logger, "rewound"):
                logger.rewound(step)

    def histograms(self, step: int, histograms: dict[str, dict]) -> None:
        """To the backends that draw histograms (TensorBoard, W&B); the others take none."""
        for logger in self.loggers:
            if hasattr(logger, "histograms"):
                logger.histograms(step, histograms)

    def update(self, values: dict, step: int) -> None:
        """Log `values` ({"custom/metric": number}) at `step` to every backend."""
        self.log(custom_row(step, values))

    def close(self, outcome: str = "finished") -> None:
        """Close every backend; those that record how a run ended are told `outcome` (`OUTCOMES`)."""
        loggers, self.loggers = self.loggers, []
        close_loggers(loggers, outcome)


def close_loggers(loggers: list[MetricLogger], outcome: str = "finished") -> None:
    """Close each logger; one that fails to close is reported, not raised, so the others still close."""
    assert outcome in OUTCOMES, outcome
    for logger in loggers:
        try:
            if hasattr(logger, "record_outcome"):
                logger.record_outcome(outcome)
            logger.close()
        except Exception as exc:
            warn(f"closing {type(logger).__name__} failed: {exc}")


_NON_FINITE = ("nan", "inf", "-inf")  # how `_jsonable` writes non-finite floats


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
