"""Multi-process training for real: 2 CPU processes under torchrun with gloo.

Each comparison runs the same experiment once with 2 ranks of batch b and once in one process with
batch 2b; the per-step losses and final weights must agree (the data each rank reads is disjoint and
together equals the single process's batch).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

EXPERIMENT = {
    "model": {"architecture": "llama", "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "n_layers": 2, "max_seq_len": 32},
    "training": {"batch_size": 8, "max_steps": 6, "learning_rate": 3e-3, "warmup_steps": 2, "logging_steps": 1,
                 "eval_steps": 3, "save_steps": 3, "device": "cpu", "progress_bar": False, "report_to": ["jsonl"]},
    "data": {"data_files": ["corpus.txt"], "tokenizer": "char", "max_length": 32},
}


@pytest.fixture
def workdir(tmp_path):
    lines = [f"the {w} sat on the mat number {i % 7}.\n" for i, w in enumerate(["cat", "dog", "bird", "fox"] * 120)]
    (tmp_path / "corpus.txt").write_text("".join(lines))
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    return tmp_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(workdir, *overrides, nproc=2, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master-port={_free_port()}",
           "-m", "llm_trainer", "train", "--config", "exp.yaml", *overrides]
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300, env=_env())
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _single(workdir, *overrides, check=True):
    result = subprocess.run([sys.executable, "-m", "llm_trainer", "train", "--config", "exp.yaml", *overrides],
                            cwd=workdir, capture_output=True, text=True, timeout=300, env=_env())
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ([r["loss"] for r in rows if "lr" in r], [r["val_loss"] for r in rows if "val_loss" in r and "event" not in r])


def _assert_same_run(a: Path, b: Path, rel=1e-5):
    (train_a, val_a), (train_b, val_b) = _losses(a), _losses(b)
    assert len(train_a) == len(train_b) == EXPERIMENT["training"]["max_steps"]
    assert train_a == pytest.approx(train_b, rel=rel)
    assert val_a == pytest.approx(val_b, rel=rel)


def _initial_weights(workdir) -> str:
    """A model folder both runs start from (FSDP builds on the meta device, so init must be shared)."""
    subprocess.run([sys.executable, "-m", "llm_trainer", "prepare", "--config", "exp.yaml"], cwd=workdir, check=True,
                   capture_output=True, env=_env())
    from llm_trainer.config import ModelConfig
    from llm_trainer.model import Transformer

    (manifest,) = (workdir / "data_cache").glob("*/manifest.json")
    vocab = json.loads(manifest.read_text())["vocab_size"]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**EXPERIMENT["model"], "vocab_size": vocab}))
    model.save_pretrained(workdir / "init")
    return str(workdir / "init")


def test_ddp_equals_one_process_with_twice_the_batch(workdir):
    _single(workdir, "training.output_dir=single")
    result = _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=4", "training.distributed_strategy=ddp")
    assert "effective batch 8 = 4 x 1 accumulation x 2 process(es) (ddp)" in result.stderr
    _assert_same_run(workdir / "single", workdir / "ddp")
    a = load_file(workdir / "single/checkpoints/checkpoint-00000006/model.safetensors")
    b = load_file(workdir / "ddp/checkpoints/checkpoint-00000006/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    # Only rank 0 wrote logs: one row per step, not two.
    assert len(_losses(workdir / "ddp")[0]) == 6


def test_ddp_with_gradient_accumulation(workdir):
    _single(workdir, "training.output_dir=single")
    _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=2", "training.gradient_accumulation_steps=2")
    _assert_same_run(workdir / "single", workdir / "ddp")


def test_fsdp_equals_one_process_and_its_sharded_checkpoint_resumes(workdir):
    init = _initial_weights(workdir)
    _single(workdir, "training.output_dir=single", f"model.init_from={init}")
    _torchrun(workdir, "training.output_dir=fsdp", "training.batch_size=4", "training.distributed_strategy=fsdp",
              f"model.init_from={init}")
    _assert_same_run(workdir / "single", workdir / "fsdp")

    # Resume the sharded checkpoint of step 3 at world size 2: steps 4-6 are the same.
    checkpoints = workdir / "fsdp" / "checkpoints"
    resumed = workdir / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(checkpoints / "checkpoint-00000003"), str(resumed)], check=True)
    _torchrun(workdir, "training.output_dir=resumed", "training.batch_size=4", "training.distributed_strategy=fsdp",
              f"model.init_from={init}", "training.resume_from_checkpoint=latest")
    full, part = _losses(workdir / "fsdp")[0], _losses(workdir / "resumed")[0]
    assert part == pytest.approx(full[3:], rel=1e-6)

    # A sharded checkpoint loads at world size 1: eval gives the loss the run reported at step 6.
    result = subprocess.run([sys.executable, "-m", "llm_trainer", "eval", "--checkpoint", str(checkpoints / "checkpoint-00000006"),
                             "--json"], cwd=workdir, capture_output=True, text=True, env=_env())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss"] == pytest.approx(_losses(workdir / "fsdp")[1][-1], rel=1e-5)


def test_resume_at_another_world_size_is_refused(workdir):
    _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=4")
    result = _single(workdir, "training.output_dir=ddp", "training.resume_from_checkpoint=latest", "training.max_steps=9",
                     check=False)
    assert result.returncode == 2 and "world size 2" in result.stderr and "Traceback" not in result.stderr


def test_world_size_must_match_the_launcher(workdir):
    result = _single(workdir, "training.world_size=2", check=False)
    assert result.returncode == 2 and "launcher started 1 process" in result.stderr


def test_a_dead_rank_fails_the_job_instead_of_hanging(workdir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}",
           "-m", "llm_trainer", "train", "--config", "exp.yaml", "training.output_dir=run", "training.batch_size=4",
           "training.max_steps=100000", "training.save_steps=0", "training.eval_steps=0", "training.distributed_timeout_s=30"]
    job = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        metrics = workdir / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.is_file() and metrics.read_text()) and time.time() < deadline:
            time.sleep(0.5)
        assert metrics.is_file(), "training never started"
        rank1 = [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_rank(pid, "1")]
        assert rank1
        os.kill(int(rank1[0]), signal.SIGKILL)
        assert job.wait(timeout=120) != 0
    finally:
        if job.poll() is None:
            job.kill()


def _is_rank(pid: str, rank: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return f"RANK={rank}".encode() in environ and b"llm_trainer" in cmdline and b"torch.distributed.run" not in cmdline
