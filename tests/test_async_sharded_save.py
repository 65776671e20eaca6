"""Sharded (FSDP2) checkpoints saved in the background with `dcp.async_save`: 2 CPU processes with gloo.

The loop stops only for DCP's copy of each rank's shards into host memory; DCP's thread writes them,
and rank 0's writer thread then writes meta.json, renames the folder into place and replaces `latest`.
A background save must give the checkpoint a synchronous one gives, resume to the uninterrupted run's
losses, lose nothing but itself to a kill -9, and stop the run with the synchronous save's error.

Writes are paused or failed inside DCP's writer (`SafeWriter.write_data`) by a runner that patches it
in each rank, then runs the real CLI under torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import test_distributed as distributed
from conftest import once_per_session, src_env
from test_distributed import _free_port, _initial_weights
from warm_launch import torchrun

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available"),
    pytest.mark.slow,  # several processes per test: the full tier only
]

# test_distributed's experiment under FSDP2, saving every 2 steps (so a kill can fall between saves)
EXPERIMENT = {
    **distributed.EXPERIMENT,
    "training": {
        **distributed.EXPERIMENT["training"],
        "batch_size": 4,
        "save_steps": 2,
        "distributed_strategy": "fsdp",
    },
}

# Each rank's DCP writer, paused (until the process is killed) or failing with a full disk, while it
# writes the shards of one checkpoint; the real CLI otherwise.
RUNNER = r"""
import errno, json, os, sys, time
from llm_trainer.checkpoint import sharded
from llm_trainer.cli import main

plan = json.loads(os.environ.get("ASYNC_SAVE_PLAN") or "{}")
write_data = sharded.SafeWriter.write_data
if plan.get("pid_dir"):  # torchrun starts each rank in a session of its own: the test kills them by id
    with open(os.path.join(plan["pid_dir"], f"rank{os.environ['RANK']}.pid"), "w") as handle:
        handle.write(str(os.getpid()))


def planned_write_data(self, *args, **kwargs):
    if plan and plan["folder"] in str(self.path) and int(os.environ["RANK"]) == plan["rank"]:
        if plan["action"] == "pause":
            with open(plan["ready_file"], "w") as handle:
                handle.write("paused")
            while True:
                time.sleep(0.1)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write_data(self, *args, **kwargs)


sharded.SafeWriter.write_data = planned_write_data
sys.exit(main(sys.argv[1:]))
"""


def _command(*overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={_free_port()}",
        "runner.py",
        "train",
        "--config",
        "exp.yaml",
        *overrides,
    ]


def _env(plan: dict | None = None) -> dict:
    return {**src_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ASYNC_SAVE_PLAN": json.dumps(plan or {})}


def _torchrun(workdir: Path, *overrides: str, plan: dict | None = None, check: bool = True):
    """The runner under torchrun, its ranks started warm (`warm_launch`)."""
    result = torchrun(workdir, ["train", "--config", "exp.yaml", *overrides], _env(plan), script="runner.py")
    if check:
        assert result.returncode == 0, [line for line in result.stderr.splitlines() if "error" in line.lower()][-5:]
    return result


def _rows(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


def _losses(run: Path) -> list[float]:
    return [row["loss"] for row in _rows(run, "train")]


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _only_checkpoint(workdir: Path, run: str, step: int, into: str) -> None:
    target = workdir / into / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(workdir / run / "checkpoints" / f"checkpoint-{step:08d}", target / f"checkpoint-{step:08d}")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """The corpus, a shared initial model (FSDP builds on the meta device), and two uninterrupted runs:
    `background` (the default: periodic saves in the background) and `synchronous`; built once per
    session (xdist workers included), each test then writing runs of its own names beside them."""
    return once_per_session(tmp_path_factory, "async_save", _uninterrupted_runs)


def _uninterrupted_runs(root: Path) -> None:
    (root / "corpus.txt").write_text(distributed.CORPUS)
    (root / "runner.py").write_text(RUNNER)
    (root / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    _initial_weights(root)
    data = yaml.safe_load((root / "exp.yaml").read_text())
    data["model"]["init_from"] = str(root / "init")
    (root / "exp.yaml").write_text(yaml.safe_dump(data))
    _torchrun(root, "training.output_dir=background")
    _torchrun(root, "training.output_dir=synchronous", "training.async_checkpoint=false")


def _dcp_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor a sharded checkpoint's DCP files hold (model and optimizer), read whole in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from llm_trainer.checkpoint.sharded import SafePlanner, SafeReader

    reader = SafeReader(str(checkpoint / "sharded"))
    records = reader.read_metadata().state_dict_metadata
    state = {
        fqn: torch.empty(tuple(record.size), dtype=record.properties.dtype)
        for fqn, record in records.items()
        if isinstance(record, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=True)
    return state


def _meta(checkpoint: Path) -> dict:
    meta = json.loads((checkpoint / "meta.json").read_text())
    for varying in ("created", "meta_sha256"):
        meta.pop(varying)
    meta["files"] = sorted(meta["files"])  # DCP's .metadata records a random save id: names only
    meta["config"]["training"].pop("output_dir")
    meta["config"]["training"].pop("async_checkpoint")
    return meta


def test_a_background_sharded_save_equals_the_synchronous_one_and_resumes(workdir):
    background, synchronous = workdir / "background", workdir / "synchronous"
    assert _losses(background) == _losses(synchronous)
    from llm_trainer.checkpoint.verify import verify

    for step in (2, 4, 6):
        ours, theirs = (run / "checkpoints" / f"checkpoint-{step:08d}" for run in (background, synchronous))
        assert verify(ours) is None
        assert _meta(ours) == _meta(theirs)
        files = json.loads((theirs / "meta.json").read_text())["files"]
        for name in (n for n in files if not n.startswith(("sharded/__", "sharded/.metadata"))):  # not DCP's
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        tensors, expected = _dcp_tensors(ours), _dcp_tensors(theirs)
        assert tensors.keys() == expected.keys() and any(k.startswith("optimizer.") for k in tensors)
        for fqn, tensor in expected.items():
            assert torch.equal(tensors[fqn], tensor), fqn
    assert _latest(background) == "checkpoint-00000006"
    assert not [p for p in (background / "checkpoints").iterdir() if p.name.startswith(".")]

    # The loop's stop for its saves is measured (the copy into host memory, for a background save).
    for run in (background, synchronous):
        (summary,) = _rows(run, "summary")
        assert summary["checkpoint_s"] > 0

    # The background checkpoint of step 4 resumes to the uninterrupted run's losses.
    _only_checkpoint(workdir, "background", 4, "resumed")
    _torchrun(workdir, "training.output_dir=resumed", "training.resume_from_checkpoint=latest")
    assert _losses(workdir / "resumed") == pytest.approx(_losses(background)[4:], rel=1e-6)


def test_kill9_while_the_shards_are_written_leaves_latest_at_the_previous_checkpoint(workdir):
    """Rank 1's DCP write of step 4 is held: training goes on past it (the save is in the background),
    the final save waits for it, and a kill -9 of every process loses only that checkpoint."""
    run = workdir / "killed"
    ready = workdir / "killed.ready"
    pids = workdir / "killed.pids"
    pids.mkdir()
    plan = {
        "folder": ".staging-checkpoint-00000004",
        "rank": 1,
        "action": "pause",
        "ready_file": str(ready),
        "pid_dir": str(pids),
    }
    job = subprocess.Popen(
        _command("training.output_dir=killed"),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(plan),
    )
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and len(_rows(run, "train")) >= 5) and job.poll() is None:
            assert time.monotonic() < deadline, "the run never trained past its held save"
            time.sleep(0.05)
        assert job.poll() is None, job.stderr.read()[-3000:]
        assert (run / "checkpoints" / ".staging-checkpoint-00000004").is_dir()
        assert not (run / "checkpoints" / "checkpoint-00000004").exists()
    finally:  # every rank, then the launcher: as a machine that dies
        for pid_file in pids.glob("rank*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.kill()
        job.wait(timeout=30)
        job.stderr.close()
    from llm_trainer.checkpoint.verify import verify

    assert _latest(run) == "checkpoint-00000002"
    assert verify(run / "checkpoints" / "checkpoint-00000002") is None
    assert _losses(run)[:5] == _losses(workdir / "background")[:5]

    _torchrun(workdir, "training.output_dir=killed", "training.resume_from_checkpoint=latest")
    assert _losses(run)[-4:] == pytest.approx(_losses(workdir / "background")[2:], rel=1e-6)
    assert _latest(run) == "checkpoint-00000006"
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_shard_write_ends_the_run_in_one_line_and_keeps_latest(workdir, background):
    """Rank 1's disk fills while it writes the shards of step 4: every rank stops with the error a
    synchronous save gives, and `latest` still names step 2's complete checkpoint."""
    name = f"full_{background}"
    plan = {"folder": ".staging-checkpoint-00000004", "rank": 1, "action": "fail"}
    result = _torchrun(
        workdir,
        f"training.output_dir={name}",
        f"training.async_checkpoint={str(background).lower()}",
        plan=plan,
        check=False,
    )
    assert result.returncode != 0
    errors = {line for line in result.stderr.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, result.stderr[-3000:]
    (error,) = errors
    assert "disk full while saving checkpoint-00000004" in error and "`latest` are intact" in error
    run = workdir / name
    assert _latest(run) == "checkpoint-00000002"
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("checkpoint-")] == [
        "checkpoint-00000002"
    ]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
