"""`llm-trainer status RUN`: a run's state read from its folder (local, or a URL output_dir in a local S3
server), against the files a real tiny training run wrote, and a live run that holds the lock."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import src_env, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.errors import UsageError
from llm_trainer.tools.status import format_status, run_status
from test_object_storage import s3_server  # noqa: F401  (the local S3 server fixture)

pytestmark = pytest.mark.slow  # each test trains a tiny run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny run trained to its end (6 steps, checkpoints at 3 and 6), as `train` leaves it."""
    root = tmp_path_factory.mktemp("status")
    config = write_tiny_experiment(root, save_steps=3)
    assert cli.main(["train", "--config", str(config)]) == 0
    return root / "run"


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_status_of_a_finished_run_matches_its_files(finished_run, capsys):
    rows = _rows(finished_run)
    train = [r for r in rows if r["kind"] == "train"]
    status = run_status(str(finished_run))
    assert status["state"] == "finished" and status["lock"] == {"held": False, "pid": None, "where": "the run folder"}
    assert (status["step"], status["total_steps"], status["tokens_seen"]) == (6, 6, rows[-1]["tokens_seen"])
    assert status["last_losses"] == [[r["step"], r["loss"]] for r in train]
    assert status["tokens_per_s"] == train[-1]["tokens_per_s"] and status["eta_s"] is None
    assert status["last_eval"] == {"step": 6, "val_loss": rows[-1]["val_loss"]}
    assert status["checkpoint"]["name"] == "checkpoint-00000006" and status["checkpoint"]["step"] == 6
    assert status["alerts"] == 0
    capsys.readouterr()
    assert cli.main(["status", str(finished_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6
    assert cli.main(["status", str(finished_run)]) == 0
    text = capsys.readouterr().out
    assert "finished" in text and "checkpoint-00000006 (step 6)" in text and "6 / 6 (100.0%)" in text
    assert max(len(line) for line in text.splitlines()) <= 100  # one screen, no wrapping over ssh


def test_status_skips_a_line_being_written_and_an_incomplete_checkpoint(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    resumed = {**[r for r in _rows(run) if r["kind"] == "train"][-1], "step": 8}  # a resume that then crashed
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps(resumed) + '\n{"kind": "train", "step": 10, "lo')  # its last row cut short
    newest = run / "checkpoints" / "checkpoint-00000006" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated after its meta.json was written
    status = run_status(str(run))
    assert status["state"].startswith("not running (interrupted")  # the last whole row is no summary
    assert status["step"] == 8
    assert status["checkpoint"]["name"] == "checkpoint-00000003"
    assert "checkpoint-00000006: model.safetensors is 100 bytes" in status["checkpoint"]["skipped"][0]
    assert "skipped checkpoint-00000006" in format_status(status)


def test_status_without_latest_names_the_newest_checkpoint_and_passes_over_odd_rows(finished_run, tmp_path, capsys):
    """No `latest` pointer: the checkpoint shown is the newest whole one, the one a resume takes; an eval
    row whose val_loss is no number and a line of bytes that are not UTF-8 are passed over, by status,
    plot and the registry alike."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    (run / "checkpoints" / "latest").unlink()
    with open(run / "metrics.jsonl", "ab") as handle:
        handle.write(b'{"kind": "eval", "step": 7, "val_loss": "3.0"}\n\xff\xfe garbage {\n')
    status = run_status(str(run))
    assert status["checkpoint"]["name"] == "checkpoint-00000006"
    assert status["last_eval"]["step"] == 6
    capsys.readouterr()
    assert cli.main(["status", str(run)]) == 0
    assert cli.main(["plot", str(run), "--output", str(tmp_path / "plots")]) == 0
    assert cli.main(["registry", "add", str(run), "--name", "m", "--db", str(tmp_path / "r.db")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("")  # no rows: no blank figures
    assert cli.main(["plot", str(run), "--output", str(tmp_path / "none")]) == 2
    assert "holds no training or evaluation rows yet" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_status_names_the_checkpoint_a_resume_takes_and_shows_no_none(finished_run, tmp_path, capsys):
    """`latest` one save behind (a run killed between its last checkpoint and the pointer): the newer whole
    checkpoint is the one shown, as resume and eval take it. A run that logged nothing yet is at step 0;
    a row whose step is no number (another program's file) is no row of the run's."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    (run / "checkpoints" / "latest").write_text("checkpoint-00000003")
    assert run_status(str(run))["checkpoint"]["name"] == "checkpoint-00000006"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(run / "config.yaml", fresh / "config.yaml")
    (fresh / "metrics.jsonl").write_text('{"kind": "train", "step": "x", "loss": 1.0}\n')
    status = run_status(str(fresh))
    assert (status["step"], status["tokens_seen"], status["last_losses"]) == (0, 0, [])
    text = format_status(status)
    assert "None" not in text and "step       0 / 6 (0.0%)" in text
    with pytest.raises(
        UsageError, match=rf"is a run's checkpoints folder; pass the run's output_dir: {re.escape(str(run))}$"
    ):
        run_status(str(run / "checkpoints"))


def test_status_of_a_folder_without_a_run_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path / "nowhere")]) == 2
    assert cli.main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not found" in err[0] and "holds no run" in err[1]
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_status_of_a_live_run_names_the_process_holding_the_lock(tmp_path):
    config = write_tiny_experiment(tmp_path, max_steps=100_000, save_steps=20, eval_steps=0, logging_steps=5)
    env = {**src_env(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_trainer", "train", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = tmp_path / "run"
    try:
        deadline = time.monotonic() + 120
        while not ((run / "checkpoints" / "latest").exists() and (run / "metrics.jsonl").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never saved a checkpoint"
            time.sleep(0.2)
        status = run_status(str(run))
        assert status["state"] == "running" and status["lock"]["held"] and status["lock"]["pid"] == proc.pid
        assert status["total_steps"] == 100_000 and status["eta_s"] > 0
        assert status["checkpoint"]["name"].startswith("checkpoint-")
        shown = subprocess.run(
            [sys.executable, "-m", "llm_trainer", "status", str(run)], env=env, capture_output=True, text=True
        )
        assert shown.returncode == 0 and f"held by PID {proc.pid}" in shown.stdout
        assert proc.poll() is None  # the probe did not disturb the run
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status = run_status(str(run))
    assert status["state"] == "stopped by SIGTERM" and not status["lock"]["held"]


@pytest.fixture
def bucket_run(finished_run, s3_server):  # noqa: F811
    """The finished run's files in a bucket of the local S3 server, as a URL output_dir holds them."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    bucket = "t-status-url"
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    for path in sorted(finished_run.rglob("*")):
        if path.is_file() and path.name != ".lock" and "plots" not in path.parts:
            fs.put_file(str(path), f"{bucket}/runs/x/{path.relative_to(finished_run).as_posix()}")
    return f"s3://{bucket}/runs/x"


def test_status_of_a_url_run_reads_the_store(bucket_run, finished_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the staging folder whose lock is probed: run_staging/ here, none
    status, local = run_status(bucket_run), run_status(str(finished_run))
    for key in ("state", "step", "total_steps", "tokens_seen", "last_losses", "last_eval", "alerts"):
        assert status[key] == local[key], key
    assert status["checkpoint"]["name"] == "checkpoint-00000006" and status["checkpoint"]["total_steps"] == 6
    assert status["lock"] == {"held": False, "pid": None, "where": "this machine's staging folder"}
    assert list(tmp_path.iterdir()) == []  # read only: no staging folder made


def test_status_of_a_missing_bucket_is_one_line_exit_2(s3_server, capsys):  # noqa: F811
    assert cli.main(["status", "s3://no-such-bucket-for-status/runs/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-bucket-for-status" in err[0] and "does not exist" in err[0]


def test_status_into_a_pipe_its_reader_closed_ends_without_a_traceback(finished_run):
    """`llm-trainer status RUN | head -1`: the reader leaves before the screen is written; the command
    ends quietly, as a process ended by SIGPIPE (141), not with Python's BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_trainer", "status", str(finished_run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=src_env(),
    )
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_status_and_the_registry_find_checkpoints_in_a_checkpoint_dir_of_its_own(tmp_path, capsys):
    """training.checkpoint_dir elsewhere (as config.yaml records it): status shows its newest checkpoint,
    and the registry takes the model from there, by the same rule."""
    from llm_trainer.tools.registry import collect_run_info

    outside = tmp_path / "elsewhere"
    config = write_tiny_experiment(tmp_path, save_steps=3, checkpoint_dir=str(outside))
    assert cli.main(["train", "--config", str(config)]) == 0
    status = run_status(str(tmp_path / "run"))
    assert status["checkpoint"]["name"] == "checkpoint-00000006" and status["checkpoint"]["step"] == 6
    assert collect_run_info(tmp_path / "run")["model_path"] == str((outside / "best_model").resolve())


def test_a_crash_the_run_was_resumed_after_is_not_its_state(finished_run, tmp_path):
    """metrics.jsonl keeps an earlier attempt's `crashed` alert: once the resumed run trains on (and
    finishes, or is killed), that crash is history, not the run's state."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    crash = json.dumps({"kind": "alert", "step": 2, "event": "crashed", "message": "boom", "time": 0.0})
    (run / "metrics.jsonl").write_text("\n".join([*lines[:2], crash, *lines[2:]]) + "\n")
    assert run_status(str(run))["state"] == "finished"
    (run / "metrics.jsonl").write_text("\n".join([*lines[:2], crash, *lines[2:-1]]) + "\n")  # then killed
    assert run_status(str(run))["state"].startswith("not running (interrupted")
    (run / "metrics.jsonl").write_text("\n".join([*lines, crash]) + "\n")  # the last thing it did: crash
    assert run_status(str(run))["state"] == "crashed: boom"
    # killed before its first checkpoint: no resume to advise
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    state = run_status(str(run))["state"]
    assert state.startswith("not running (interrupted before its first checkpoint: nothing to resume"), state
