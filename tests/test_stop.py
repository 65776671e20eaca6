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
