"""Tracking backends against their own readers: TensorBoard's EventAccumulator, the W&B offline run
file, MLflow's client; the install hint for a missing package; rank-0-only logging; the MLflow
model-registry backend.

One tiny run logs to every installed backend at once (module fixture); each test then skips cleanly
when its package is not installed.
"""

import importlib.util
import json
import struct
import sys
import time

import pytest

from conftest import write_tiny_experiment
from llm_trainer.errors import UsageError
from llm_trainer.train.metrics import build_loggers, scalar_items

HAVE = {
    name: importlib.util.find_spec(module) is not None
    for name, module in [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")]
}

TRAIN_SCALARS = ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu"]
EVAL_SCALARS = ["eval/loss", "eval/perplexity"]


def tiny_experiment(root, report_to, **training):
    return write_tiny_experiment(root, report_to=report_to, peak_flops=1e12, **training)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A 6-step run logging to jsonl and every installed tracking backend; W&B offline, MLflow local."""
    from llm_trainer.api import train
    from llm_trainer.config_loader import load_experiment

    root = tmp_path_factory.mktemp("tracked")
    report_to = ["jsonl"] + [name for name, ok in HAVE.items() if ok]
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        config = tiny_experiment(root, report_to, mlflow_tracking_uri=str(root / "mlruns"))
        summary = train(load_experiment(config))
    finally:
        mp.undo()
    return root / "run", summary, root / "mlruns"


def test_scalar_names_follow_the_backend_convention():
    assert dict(scalar_items({"step": 3, "loss": 2.0, "lr": 0.1, "epoch": 0, "custom/acc": 0.5})) == {
        "train/loss": 2.0,
        "train/lr": 0.1,
        "train/epoch": 0.0,
        "custom/acc": 0.5,
    }
    assert dict(scalar_items({"step": 3, "val_loss": 2.0, "perplexity": 7.4, "tokens": 10})) == {
        "eval/loss": 2.0,
        "eval/perplexity": 7.4,
        "eval/tokens": 10.0,
    }
    assert dict(
        scalar_items({"kind": "summary", "step": 3, "val_loss": 2.0, "stopped_early": None, "best_val_loss": 1.9})
    ) == {"summary/val_loss": 2.0, "summary/best_val_loss": 1.9}
    # Rows written before rows had a kind are read by their keys.
    assert dict(scalar_items({"event": "train_end", "step": 3, "val_loss": 2.0})) == {"summary/val_loss": 2.0}
    assert dict(scalar_items({"step": 3, "val_loss": 2.0})) == {"eval/loss": 2.0}


def test_every_row_kind_has_one_schema():
    """The loop's rows come from the typed schemas: required fields always present, optional ones only
    when set, and `kind` names the schema."""
    from llm_trainer.train.rows import EvalRow, SummaryRow, TrainRow, row_kind

    train = TrainRow(
        step=2, epoch=0, loss=1.5, lr=1e-3, grad_norm=0.5, tokens_seen=64, skipped_steps=0, tokens_per_s=10.0
    ).as_dict()
    assert train["kind"] == "train" and "mfu" not in train and train["tokens_per_s"] == 10.0
    summary = SummaryRow(
        step=2,
        train_runtime_s=1.0,
        tokens_per_s=64.0,
        tokens_seen=64,
        skipped_steps=0,
        stopped_early=None,
        best_val_loss=None,
        checkpoint=None,
        evaluation_s=0.0,
        checkpoint_s=0.0,
    ).as_dict()
    assert summary["stopped_early"] is None and "val_loss" not in summary  # required-nullable vs optional
    evaluation = EvalRow(step=2, val_loss=2.0, perplexity=7.39, tokens=100).as_dict()
    assert [row_kind(r) for r in (train, evaluation, summary)] == ["train", "eval", "summary"]
    with pytest.raises(TypeError):
        TrainRow(step=2, loss=1.0)  # a row missing required fields cannot be built
    assert row_kind({"kind": "custom", "loss": 1.0}) is None


@pytest.mark.slow  # the module fixture trains with every backend
def test_tensorboard_event_files_hold_the_scalars_and_config(tracked_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, _ = tracked_run
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in TRAIN_SCALARS + EVAL_SCALARS:
        assert tag in scalars, (tag, scalars)
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert acc.Scalars("eval/perplexity")[-1].value == pytest.approx(evals[-1]["perplexity"], rel=1e-5)
    assert all(0 < e.value < 1 for e in acc.Scalars("train/mfu"))
    assert "config/text_summary" in acc.Tags()["tensors"]
    hparams = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams and "_hparams_/experiment" in hparams
    assert b"training.learning_rate" in hparams["_hparams_/session_start_info"]


def _wandb_records(path):
    """Records of a .wandb file (LevelDB-log framing: 7-byte header, 32 KiB blocks, 7-byte record headers)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buffer = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        buffer += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            yield buffer
            buffer = b""
        elif kind == 0 and length == 0:
            continue


@pytest.mark.slow  # the module fixture trains with every backend
def test_wandb_offline_run_holds_the_logged_keys(tracked_run):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    run, _, _ = tracked_run
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((run / "wandb").rglob("*"))
    keys, config_keys = set(), set()
    for raw in _wandb_records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
        elif kind == "config":
            config_keys |= {item.key for item in record.config.update}
        elif kind == "run":
            config_keys |= {item.key for item in record.run.config.update}
    assert set(TRAIN_SCALARS + EVAL_SCALARS) <= keys, keys
    assert {"model", "training", "data"} <= config_keys


def _wandb_history(run_folder) -> list[dict]:
    """Each history row of the one offline W&B run under `run_folder`, as {key: value}."""
    from wandb.proto import wandb_internal_pb2 as pb

    (file,) = sorted(run_folder.glob("offline-run-*/run-*.wandb"))
    rows = []
    for raw in _wandb_records(file):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def test_wandb_keeps_the_steps_a_rewind_replays(tmp_path, monkeypatch):
    """Rewound from step 6 to step 4: the replayed steps 5 and 6 reach W&B with their new values
    (W&B drops a row logged at a step below its own, so they are plotted against train/global_step)."""
    pytest.importorskip("wandb")
    from llm_trainer.train.metrics import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(tmp_path, {})
    for step in range(1, 7):
        logger.log({"kind": "train", "step": step, "loss": 10.0 + step})
    for step in (5, 6):  # after the rewind to step 4
        logger.log({"kind": "train", "step": step, "loss": 1.0 + step})
    logger.close()
    deadline = time.monotonic() + 60  # W&B's service process may still be writing the file when finish returns
    while len(rows := _wandb_history(tmp_path / "wandb")) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [row["train/loss"] for row in rows] == [11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 6.0, 7.0]
    assert [row["train/global_step"] for row in rows] == [1, 2, 3, 4, 5, 6, 5, 6]


@pytest.mark.slow  # the module fixture trains with every backend
def test_mlflow_local_run_holds_the_metrics_and_params(tracked_run):
    pytest.importorskip("mlflow")
    from llm_trainer.train.metrics import mlflow_client

    run, _, mlruns = tracked_run
    client, folder = mlflow_client(str(mlruns))
    assert folder == mlruns.resolve() and (mlruns / "mlflow.db").is_file()
    experiment = client.get_experiment_by_name("llm-trainer")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.status == "FINISHED" and found.data.tags["output_dir"] == str(run.resolve())
    for key in TRAIN_SCALARS + EVAL_SCALARS:
        assert key in found.data.metrics, key
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")] == [2, 4, 6]
    assert float(found.data.params["training.learning_rate"]) == pytest.approx(3e-3)


@pytest.mark.slow  # the module fixture trains with every backend
def test_mlflow_model_registry_backend_round_trip(tracked_run):
    pytest.importorskip("mlflow")
    from llm_trainer.tools.registry import open_registry

    run, _, mlruns = tracked_run
    registry = open_registry(f"mlflow:{mlruns}")
    first = registry.add(run, "tiny-tracked")
    second = registry.add(run, "tiny-tracked", description="again")
    assert (first.version, second.version) == (1, 2)
    assert first.data_fingerprint and first.tokenizer_fingerprint and first.metrics["step"] == 6
    assert [v.version for v in registry.list("tiny-tracked")] == [1, 2]
    registry.promote("tiny-tracked", 1, "production")
    assert registry.get("tiny-tracked", "production").version == 1
    registry.promote("tiny-tracked", 2, "production")
    assert registry.get("tiny-tracked", "production").version == 2
    assert registry.get("tiny-tracked", 1).stage == "archived"
    registry.promote("tiny-tracked", 2, "archived")
    with pytest.raises(UsageError):
        registry.get("tiny-tracked", "production")  # nothing holds production any more
    shown = registry.get("tiny-tracked")
    assert shown.version == 2 and shown.config["model"]["d_model"] == 16 and shown.description == "again"


@pytest.mark.parametrize(
    "backend, modules",
    [
        ("tensorboard", ["torch.utils.tensorboard"]),
        ("wandb", ["wandb"]),
        ("mlflow", ["mlflow", "mlflow.entities", "mlflow.tracking"]),
    ],
)
def test_a_missing_package_is_a_one_line_install_hint(tmp_path, monkeypatch, backend, modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(UsageError) as info:
        build_loggers(["jsonl", backend], tmp_path, {"training": {}}, progress_bar=False)
    message = str(info.value)
    assert "\n" not in message and "pip install 'llm-trainer[tracking]'" in message and backend in message


def test_only_rank_zero_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert build_loggers(["console", "jsonl", "tensorboard", "wandb", "mlflow"], tmp_path, {}, progress_bar=False) == []
    assert not (tmp_path / "metrics.jsonl").exists()
    monkeypatch.setenv("RANK", "0")
    loggers = build_loggers(["console", "jsonl"], tmp_path, {}, progress_bar=False)
    assert len(loggers) == 2
    for logger in loggers:
        logger.close()


def test_report_to_accepts_mlflow_and_a_tracking_uri():
    from llm_trainer.config import TrainingConfig

    config = TrainingConfig(report_to=["console", "mlflow"], mlflow_tracking_uri="sqlite:///x.db")
    assert config.report_to == ["console", "mlflow"]
    with pytest.raises(ValueError):
        TrainingConfig(report_to=["neptune"])


def test_mlflow_uri_resolution(tmp_path, monkeypatch):
    from llm_trainer.train.metrics import resolve_mlflow_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_mlflow_uri("http://tracking:5000") == ("http://tracking:5000", None)
    assert resolve_mlflow_uri("databricks") == ("databricks", None)
    uri, folder = resolve_mlflow_uri(str(tmp_path / "mlruns"))
    assert uri == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}" and folder == tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert resolve_mlflow_uri(None) == ("sqlite:///elsewhere.db", None)
    # a file: URI is that folder (MLflow refuses its file store), unless its opt-out is set
    assert resolve_mlflow_uri((tmp_path / "m b").as_uri()) == (
        f"sqlite:///{tmp_path / 'm b' / 'mlflow.db'}",
        tmp_path / "m b",
    )
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert resolve_mlflow_uri((tmp_path / "m").as_uri()) == ((tmp_path / "m").as_uri(), None)


def test_an_mlflow_file_uri_tracks_the_run(tmp_path, monkeypatch):
    """`training.mlflow_tracking_uri: file:///...` (MLflow's own docs' form) trains and logs, where MLflow
    itself refuses that store: the run is in the SQLite store of that folder."""
    from mlflow.tracking import MlflowClient

    from llm_trainer import cli

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    folder = tmp_path / "mlruns"
    config = tiny_experiment(tmp_path, ["mlflow"], mlflow_tracking_uri=folder.as_uri(), max_steps=2)
    assert cli.main(["train", "--config", str(config)]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("llm-trainer").experiment_id])
    assert run.data.metrics["train/loss"] > 0


def test_an_absolute_sqlite_uri_tracks_the_run_there(tmp_path, monkeypatch):
    """`sqlite:////abs/path.db` (four slashes: SQLAlchemy's absolute path) is a tracker's URI, not a
    store's: its empty first part is no key, so it is taken as it is and the run is in that file. (MLflow
    puts such a store's artifacts in ./mlruns: the test runs in a folder of its own.)"""
    from mlflow.tracking import MlflowClient

    from llm_trainer import cli

    monkeypatch.chdir(tmp_path)

    database = tmp_path / "tracking" / "m.db"
    database.parent.mkdir()
    uri = f"sqlite:///{database}"
    assert uri.startswith("sqlite:////")
    config = tiny_experiment(tmp_path, ["mlflow"], mlflow_tracking_uri=uri, max_steps=2)
    assert cli.main(["train", "--config", str(config)]) == 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("llm-trainer").experiment_id])
    assert run.data.metrics["train/loss"] > 0


@pytest.mark.slow  # a subprocess CLI
def test_wandb_without_a_login_is_one_line_and_leaves_no_run_behind(tmp_path):
    """No W&B key (and online mode): one line naming `wandb login` and offline mode, not wandb's
    traceback; and no metrics.jsonl, which would make the folder refuse the corrected retry. In a fresh
    process: wandb keeps the settings of its first run in a process (this module's runs are offline)."""
    pytest.importorskip("wandb")
    import os
    import subprocess

    from conftest import src_env

    env = {k: v for k, v in src_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_MODE="online")  # no ~/.netrc, no saved login
    code = (
        "import sys; from pathlib import Path\n"
        "from llm_trainer.errors import UsageError\n"
        "from llm_trainer.train.metrics import build_loggers\n"
        "try:\n"
        f"    build_loggers(['wandb'], Path({str(tmp_path / 'run')!r}), {{}}, progress_bar=False,\n"
        f"                  start_over=Path({str(tmp_path / 'started_over')!r}).touch)\n"
        "except UsageError as error:\n"
        "    print(error); sys.exit(2)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    message = done.stdout.strip()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "\n" not in message and "wandb login" in message and "WANDB_MODE=offline" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "started_over").exists()  # --overwrite's removal of an earlier run: not reached
    assert os.environ.get("HOME") != env["HOME"]  # (this process's own settings untouched)


def test_tensorboard_drops_what_a_resume_or_a_rewind_replays(tmp_path):
    """A run killed at step 6 and resumed from its checkpoint at step 3, then rewound to step 4 by a
    spike: TensorBoard shows each step once, with the values of the run that went on, as metrics.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llm_trainer.train.metrics import TensorBoardLogger

    first = TensorBoardLogger(tmp_path, {})
    for step in range(1, 7):
        first.log({"kind": "train", "step": step, "loss": 10.0 + step})
    first.close()
    resumed = TensorBoardLogger(tmp_path, {}, resumed_at=3)
    for step in (4, 5):
        resumed.log({"kind": "train", "step": step, "loss": 1.0 + step})
    resumed.rewound(4)
    resumed.log({"kind": "train", "step": 5, "loss": 0.5})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 11), (2, 12), (3, 13), (4, 5), (5, 0.5)]


@pytest.mark.parametrize(
    "ending, status", [("raises", "FAILED"), ("signal", "KILLED")], ids=["crash", "stopped-by-signal"]
)
def test_an_mlflow_run_ends_with_the_status_of_how_the_training_ended(tmp_path, monkeypatch, ending, status):
    """A run whose step raises ends FAILED in MLflow, one stopped by SIGTERM (checkpoint saved, resumable)
    KILLED; read back with MLflow's own client."""
    pytest.importorskip("mlflow")
    import os
    import signal

    from llm_trainer.api import train
    from llm_trainer.config_loader import load_experiment
    from llm_trainer.train.callbacks import Callback
    from llm_trainer.train.metrics import mlflow_client

    class EndsAtStepTwo(Callback):
        def on_step_end(self, trainer, row):
            if row["step"] >= 2:
                if ending == "raises":
                    raise RuntimeError("a callback failed")
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlruns = tmp_path / "mlruns"
    config = tiny_experiment(tmp_path, ["mlflow"], mlflow_tracking_uri=str(mlruns), logging_steps=1, max_steps=6)
    if ending == "raises":
        with pytest.raises(RuntimeError, match="a callback failed"):
            train(load_experiment(config), callbacks=[EndsAtStepTwo()])
    else:
        assert train(load_experiment(config), callbacks=[EndsAtStepTwo()])["stopped_by_signal"] == "SIGTERM"
    client, _ = mlflow_client(str(mlruns))
    (found,) = client.search_runs([client.get_experiment_by_name("llm-trainer").experiment_id])
    assert found.info.status == status


def test_an_mlflow_server_where_nothing_answers_is_one_line_at_once(tmp_path, capsys):
    """MLflow's client retries each request for minutes, silently: the connection is tried first, and
    a refused one is one line with exit 2, before the run writes anything."""
    from conftest import free_port
    from llm_trainer import cli

    uri = f"http://127.0.0.1:{free_port()}"
    config = tiny_experiment(tmp_path, ["mlflow"], mlflow_tracking_uri=uri, max_steps=2)
    assert cli.main(["train", "--config", str(config)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: MLflow tracking server {uri} cannot be reached (Connection refused)"), last
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
