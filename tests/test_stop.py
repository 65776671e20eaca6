"""Stopping a run by a signal: the stop checkpoint is written whatever happens to the console."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from conftest import src_env, write_tiny_experiment


@pytest.mark.slow
def test_ctrl_c_through_a_pipe_whose_reader_died_still_saves_and_exits_130(tmp_path):
    """`llm-trainer train ... 2>&1 | tee log`, then Ctrl-C: the terminal's SIGINT ends `tee` too, so every
    later console line meets a closed pipe. The run must still save its stop checkpoint and exit 130."""
    config = write_tiny_experiment(tmp_path, max_steps=1_000_000, logging_steps=1, report_to=["console", "jsonl"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_trainer", "train", "--config", str(config)],
        env=src_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:  # the run is training once it logs a step
            if line.startswith("train step") or "step" in line and "loss" in line:
                break
        proc.stdout.close()  # the reader is gone: writes to the pipe now fail with EPIPE
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
    checkpoints = tmp_path / "run" / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    assert (checkpoints / latest / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_quickstart_stopped_by_sigterm_ends_after_its_checkpoint(tmp_path):
    """`llm-trainer quickstart`, then SIGTERM (a `timeout`, a scheduler): it saves and exits 143 as `train`
    does, rather than going on to evaluate, sample and score the model it was told to stop training."""
    overrides = ["training.max_steps=1000000", "training.logging_steps=1", "training.progress_bar=false"]
    overrides += ["data.max_documents=20", "data.tokenizer_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}"]
    overrides += ["model.d_model=32", "model.n_layers=1", "model.n_heads=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_trainer", "quickstart", *overrides],
        cwd=tmp_path,
        env=src_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in proc.stdout:  # training once it logs a step
            seen.append(line)
            if line.startswith("train step"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
    assert "stopped by SIGTERM" in rest and "sample:" not in rest and "downstream" not in rest, rest
    latest = (tmp_path / "runs" / "quickstart" / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "runs" / "quickstart" / "checkpoints" / latest / "model.safetensors").is_file()
