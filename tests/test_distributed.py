"""Multi-process training for real: 2 CPU processes under torchrun with gloo.

Each comparison runs the same experiment once with 2 ranks of batch b and once in one process with
batch 2b; the per-step losses and final weights must agree (the data each rank reads is disjoint and
together equals the single process's batch).
"""

import hashlib
import json
import os
import shutil
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

from conftest import cli_in_process, needs_deepspeed, once_per_session, src_env
from warm_launch import python, torchrun

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available"),
    pytest.mark.slow,  # several processes per test: the full tier only
]

EXPERIMENT = {
    "model": {"architecture": "llama", "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "n_layers": 2, "max_seq_len": 32},
    "training": {
        "batch_size": 8,
        "max_steps": 6,
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "logging_steps": 1,
        "eval_steps": 3,
        "save_steps": 3,
        "device": "cpu",
        "use_amp": False,  # DeepSpeed's bf16 keeps bf16 weights (not autocast): runs equal one process in float32
        "progress_bar": False,
        "report_to": ["jsonl"],
    },
    "data": {"data_files": ["corpus.txt"], "tokenizer": "char", "max_length": 32},
}


CORPUS = "".join(f"the {w} sat on the mat number {i % 7}.\n" for i, w in enumerate(["cat", "dog", "bird", "fox"] * 120))


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    return tmp_path


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    return References(tmp_path_factory)


class References:
    """The one-process runs that several tests compare their multi-process runs with, each trained once
    per session (xdist workers included) and copied into the test's folder. A test that uses one runs
    its own experiments on the same prepared data: its exp.yaml names the shared corpus and data cache
    by absolute path (the prepared data's fingerprint holds the corpus's path)."""

    def __init__(self, factory):
        self.factory = factory

    def _data(self) -> Path:
        def build(folder: Path) -> None:
            (folder / "corpus.txt").write_text(CORPUS)
            data = {
                **EXPERIMENT["data"],
                "data_files": [str(folder / "corpus.txt")],
                "cache_dir": str(folder / "cache"),
            }
            (folder / "exp.yaml").write_text(yaml.safe_dump({**EXPERIMENT, "data": data}))
            _prepare(folder)

        return once_per_session(self.factory, "distributed-data", build)

    def single(self, workdir: Path, model=(), run=(), init=False) -> str | None:
        """`workdir/single`: one process's run of the experiment with the `model` overrides
        (`model.KEY=VALUE`, written into exp.yaml as `_initial_weights` does) and the `run` overrides,
        from the shared initial weights when `init` (then their folder is returned). `workdir/exp.yaml`
        becomes that run's experiment."""
        data = self._data()
        key = hashlib.sha256(json.dumps([list(model), list(run), init]).encode()).hexdigest()[:16]

        def build(folder: Path) -> None:
            shutil.copy(data / "exp.yaml", folder / "exp.yaml")
            start = (f"model.init_from={_initial_weights(folder, model)}",) if init else ()
            assert init or not model, "model overrides are written into exp.yaml with the initial weights"
            _single(folder, "training.output_dir=single", *start, *run)

        folder = once_per_session(self.factory, f"distributed-single-{key}", build)
        shutil.copy(folder / "exp.yaml", workdir / "exp.yaml")
        shutil.copytree(folder / "single", workdir / "single", symlinks=True)
        return str(folder / "init") if init else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    """A child's environment without the launcher variables an in-process test may have left behind."""
    return {**src_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(workdir, *overrides, nproc=2, check=True):
    """`torchrun --nproc_per_node=NPROC -m llm_trainer train --config exp.yaml OVERRIDES` in `workdir`,
    its ranks started warm (`warm_launch`)."""
    result = torchrun(workdir, ["train", "--config", "exp.yaml", *overrides], _env(), nproc=nproc)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _single(workdir, *overrides, check=True):
    """One process's `train` of `workdir/exp.yaml` with `overrides`: in this process, computing with one
    thread as the ranks do (`cli_in_process`); under DeepSpeed, which keeps its process group for the
    life of its process, in a process of its own (started warm: `warm_launch`)."""
    argv = ["train", "--config", "exp.yaml", *overrides]
    if any("deepspeed" in override for override in overrides):
        result = python(workdir, argv, _env())
    else:
        result = cli_in_process(argv, workdir, threads=1)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _refused_resume(workdir, *overrides) -> str:
    """One process resuming the run's latest checkpoint (to step 9) with `overrides`: refused as a usage
    error (exit 2, no traceback); its stderr."""
    result = _single(workdir, *overrides, "training.resume_from_checkpoint=latest", "training.max_steps=9", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr


def _losses(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ([r["loss"] for r in rows if r["kind"] == "train"], [r["val_loss"] for r in rows if r["kind"] == "eval"])


def _train_rows(run_dir: Path, key: str) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["kind"] == "train"]


def _assert_same_run(a: Path, b: Path, rel=1e-5, grad_norms: bool = False):
    """The same training and validation losses (and, with `grad_norms`, gradient norms) in both runs."""
    (train_a, val_a), (train_b, val_b) = _losses(a), _losses(b)
    assert len(train_a) == len(train_b) == EXPERIMENT["training"]["max_steps"]
    assert train_a == pytest.approx(train_b, rel=rel)
    assert val_a == pytest.approx(val_b, rel=rel)
    if grad_norms:
        assert _train_rows(b, "grad_norm") == pytest.approx(_train_rows(a, "grad_norm"), rel=rel)


def _assert_resumed(workdir: Path, *runs: str, rel: float = 1e-5) -> None:
    """Each of `runs`, started from step 3's checkpoint (`_interrupted_at`), logs the training losses of
    steps 4-6 and the evaluations after step 3 of `workdir/single`, the run that never stopped."""
    train, val = _losses(workdir / "single")
    for run in runs:
        resumed_train, resumed_val = _losses(workdir / run)
        assert resumed_train == pytest.approx(train[3:], rel=rel), run
        assert resumed_val == pytest.approx(val[1:], rel=rel), run


def _initial_weights(workdir, overrides=()) -> str:
    """A model folder the compared runs start from (FSDP builds on the meta device, so init must be
    shared), for the experiment in `workdir/exp.yaml` with `overrides` (`model.KEY=VALUE`) written into
    it first, so the runs build the same architecture. The data is prepared once: model settings leave it
    as it is."""
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.config import ModelConfig
    from llm_trainer.model import Transformer

    path = workdir / "exp.yaml"
    experiment = yaml.safe_load(path.read_text())
    for override in overrides:
        key, value = override.split("=")
        experiment["model"][key.split(".")[1]] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(experiment))
    cache = workdir / experiment["data"].get("cache_dir", "data_cache")
    if not list(cache.glob("*/manifest.json")):
        _prepare(workdir)
    (manifest,) = cache.glob("*/manifest.json")
    vocab = json.loads(manifest.read_text())["vocab_size"]
    torch.manual_seed(0)
    save_model_folder(Transformer(ModelConfig(**{**experiment["model"], "vocab_size": vocab})), workdir / "init")
    return str(workdir / "init")


def _prepare(workdir) -> None:
    result = cli_in_process(["prepare", "--config", "exp.yaml"], workdir)
    assert result.returncode == 0, result.stderr[-3000:]


def _interrupted_at(workdir, run: str, step: int, into: str) -> None:
    """Run `into` starts as a run killed after step `step` of `run`: that checkpoint alone in its folder."""
    resumed = workdir / into / "checkpoints"
    resumed.mkdir(parents=True)
    subprocess.run(
        ["cp", "-r", str(workdir / run / "checkpoints" / f"checkpoint-{step:08d}"), str(resumed)], check=True
    )


def _resume(workdir, run: str, into: str, *overrides: str, nproc: int = 1) -> None:
    """Run `into`: `run` as if killed after step 3 (`_interrupted_at`), resumed to its end by `nproc`
    processes with the experiment's `overrides` (`_assert_resumed` compares it)."""
    _interrupted_at(workdir, run, 3, into)
    args = (f"training.output_dir={into}", *overrides, "training.resume_from_checkpoint=latest")
    if nproc == 1:
        _single(workdir, *args)
    else:
        _torchrun(workdir, *args, nproc=nproc)


def test_ddp_equals_one_process_with_twice_the_batch(workdir, references):
    references.single(workdir)
    result = _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=4", "training.distributed_strategy=ddp")
    assert "effective batch 8 = 4 x 1 accumulation x 2 process(es) (ddp)" in result.stderr
    _assert_same_run(workdir / "single", workdir / "ddp")
    a = load_file(workdir / "single/checkpoints/checkpoint-00000006/model.safetensors")
    b = load_file(workdir / "ddp/checkpoints/checkpoint-00000006/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    # Only rank 0 wrote logs: one row per step, not two.
    assert len(_losses(workdir / "ddp")[0]) == 6


# A rank's view of its start, printed before it trains.
PROBE = r"""
import json, os, sys
preloaded = "torch._dynamo" in sys.modules
import torch
from llm_trainer.cli import main

seen = {"environment": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv, "threads": torch.get_num_threads()}
print("probe", json.dumps({**seen, "preloaded": preloaded}), flush=True)
sys.exit(main(sys.argv[1:]))
"""


def test_the_warm_launcher_starts_the_ranks_the_torchrun_command_starts(workdir):
    """Most torchrun jobs of these tests start their ranks warm (`warm_launch`), with torch imported
    already. A rank started so sees what a rank of the `torchrun` command sees, its whole environment
    (the agent's variables included), working directory, arguments and thread count, and trains the
    same run."""
    (workdir / "probe.py").write_text(PROBE)
    args = ["train", "--config", "exp.yaml", "training.batch_size=4", "training.save_steps=0"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}"]
    by_command = subprocess.run(
        [*launcher, "probe.py", *args, "training.output_dir=command"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    warm = torchrun(workdir, [*args, "training.output_dir=warm"], _env(), script="probe.py")
    assert by_command.returncode == 0, by_command.stderr[-3000:]
    assert warm.returncode == 0, warm.stderr[-3000:]

    def probes(result) -> dict:
        seen = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("probe ")]
        return {probe["environment"]["RANK"]: probe for probe in seen}

    started, warmed = probes(by_command), probes(warm)
    assert sorted(started) == sorted(warmed) == ["0", "1"]
    per_launch = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a free port; a file in a temporary folder
    for rank in ("0", "1"):
        environment, warm_environment = started[rank].pop("environment"), warmed[rank].pop("environment")
        assert {k: v for k, v in warm_environment.items() if k not in per_launch} == {
            k: v for k, v in environment.items() if k not in per_launch
        }
        assert per_launch <= set(environment) & set(warm_environment)
        assert Path(warm_environment["TORCHELASTIC_ERROR_FILE"]).parts[-3:] == ("attempt_0", rank, "error.json")
        assert (started[rank].pop("preloaded"), warmed[rank].pop("preloaded")) == (False, True)
        assert warmed[rank]["argv"].pop() == "training.output_dir=warm"
        assert started[rank]["argv"].pop() == "training.output_dir=command"
        assert warmed[rank] == started[rank]  # working directory, the rest of sys.argv, threads
    assert _losses(workdir / "warm") == _losses(workdir / "command")


@pytest.mark.parametrize(
    "options",
    [
        ["training.optimizer=muon"],
        [
            "training.optimizer=muon",
            "model.architecture=llama",
            "model.activation=relu2",
            "model.qk_norm=true",
            "model.zero_init_projections=true",
            "model.logit_softcap=15",
        ],
    ],
    ids=["muon", "muon-and-block-options"],
)
def test_ddp_with_muon_equals_one_process(workdir, options):
    """Muon orthogonalizes the all-reduced gradient on every rank alike, and the block options are the
    model's own: the same run as one process (to 1e-4: gradients summed in another order, then
    orthogonalized in bf16)."""
    _single(workdir, "training.output_dir=single", *options)
    _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=4", *options)
    _assert_same_run(workdir / "single", workdir / "ddp", rel=1e-4)


def test_ddp_with_gradient_accumulation(workdir, references):
    references.single(workdir)
    _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=2", "training.gradient_accumulation_steps=2")
    _assert_same_run(workdir / "single", workdir / "ddp")


def test_fsdp_equals_one_process_and_its_sharded_checkpoint_resumes(workdir, references):
    init = references.single(workdir, init=True)
    _torchrun(
        workdir,
        "training.output_dir=fsdp",
        "training.batch_size=4",
        "training.distributed_strategy=fsdp",
        f"model.init_from={init}",
    )
    _assert_same_run(workdir / "single", workdir / "fsdp")

    # Resume the sharded checkpoint of step 3 at world size 2: steps 4-6 are the same.
    checkpoints = workdir / "fsdp" / "checkpoints"
    resumed = workdir / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(checkpoints / "checkpoint-00000003"), str(resumed)], check=True)
    _torchrun(
        workdir,
        "training.output_dir=resumed",
        "training.batch_size=4",
        "training.distributed_strategy=fsdp",
        f"model.init_from={init}",
        "training.resume_from_checkpoint=latest",
    )
    full, part = _losses(workdir / "fsdp")[0], _losses(workdir / "resumed")[0]
    assert part == pytest.approx(full[3:], rel=1e-6)

    # A sharded checkpoint loads at world size 1: eval gives the loss the run reported at step 6.
    result = cli_in_process(["eval", "--checkpoint", checkpoints / "checkpoint-00000006", "--json"], workdir, threads=1)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss"] == pytest.approx(_losses(workdir / "fsdp")[1][-1], rel=1e-5)


def test_fsdp_checkpoints_resume_at_another_world_size(workdir, references):
    """FSDP's shards of step 3 (2 processes) resume in one process, each tensor read whole (batch 2 x 4
    accumulation), and one process's whole checkpoint of step 3 resumes under FSDP on 2 processes,
    each rank taking its shards (model and optimizer): steps 4-6 equal the uninterrupted run."""
    init = references.single(workdir, init=True)
    fsdp = ("training.batch_size=4", "training.distributed_strategy=fsdp", f"model.init_from={init}")
    _torchrun(workdir, "training.output_dir=fsdp", *fsdp)
    accumulation = ("training.batch_size=2", "training.gradient_accumulation_steps=4")
    _resume(workdir, "fsdp", "two_to_one", *accumulation, f"model.init_from={init}")
    _resume(workdir, "single", "one_to_two", *fsdp, nproc=2)
    _assert_resumed(workdir, "two_to_one", "one_to_two")


def test_fsdp_shard_grad_op_and_bf16_mixed_precision(workdir, references):
    """shard_grad_op trains like one process; under use_amp, FSDP2 computes in bf16 (params cast per
    block, gradients reduced in fp32) close to one process's autocast, and keeps fp32 master weights."""
    init = references.single(workdir, init=True)
    fsdp = ("training.batch_size=4", "training.distributed_strategy=fsdp", f"model.init_from={init}")
    _torchrun(workdir, "training.output_dir=sgo", *fsdp, "training.fsdp_sharding=shard_grad_op")
    _assert_same_run(workdir / "single", workdir / "sgo")

    _single(workdir, "training.output_dir=single_amp", f"model.init_from={init}", "training.use_amp=true")
    _torchrun(workdir, "training.output_dir=fsdp_amp", *fsdp, "training.use_amp=true")
    (fp32, _), (amp, _), (fsdp_amp, _) = (_losses(workdir / name) for name in ("single", "single_amp", "fsdp_amp"))
    assert fsdp_amp == pytest.approx(amp, rel=2e-3) and fsdp_amp != fp32  # bf16 arithmetic, not fp32
    weights = load_file(workdir / "fsdp_amp/checkpoints/best_model/model.safetensors")  # gathered from the shards
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_resume_at_another_world_size_equals_the_uninterrupted_run(workdir, references):
    """With the global batch kept at 8: step 3 of 2 processes (4 x 1 accumulation) resumes in one
    process (4 x 2 accumulation), and step 3 of one process (8 x 1) on 2 processes (4 x 1); steps 4-6
    and the evaluation at step 6 equal the run that was not interrupted. Another global batch is refused."""
    references.single(workdir)
    _torchrun(workdir, "training.output_dir=ddp", "training.batch_size=4")
    _resume(workdir, "ddp", "two_to_one", "training.batch_size=4", "training.gradient_accumulation_steps=2")
    _resume(workdir, "single", "one_to_two", "training.batch_size=4", nproc=2)
    _assert_resumed(workdir, "two_to_one", "one_to_two")
    for run in ("two_to_one", "one_to_two"):
        assert _train_rows(workdir / run, "tokens_seen") == _train_rows(workdir / "single", "tokens_seen")[3:]

    refused = _refused_resume(workdir, "training.output_dir=ddp", "training.batch_size=4")
    assert "a global batch of 8 samples per step, this run has 4" in refused
    assert "set training.gradient_accumulation_steps=2" in refused


def test_world_size_must_match_the_launcher(workdir, monkeypatch, capsys):
    """The same one-line error path as the resume test above, in process (no launcher: one process)."""
    from llm_trainer.cli import main

    monkeypatch.chdir(workdir)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "--config", "exp.yaml", "training.world_size=2"]) == 2
    err = capsys.readouterr().err
    assert "launcher started 1 process" in err and "Traceback" not in err


def test_a_bad_input_that_stops_rank_0_stops_the_others_in_one_line(workdir):
    """Rank 0 prepares the data while the others wait: a missing file stops it with its one-line error,
    and the waiting rank stops in one line too (or is ended by torchrun first), never with a traceback
    about the connection rank 0 closed."""
    result = _torchrun(workdir, "training.output_dir=run", "data.data_files=[missing.txt]", check=False)
    assert result.returncode != 0
    assert "error: data file missing.txt not found" in result.stderr, result.stderr[-3000:]
    assert "[rank1]: Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("error:") == 1, result.stderr[-3000:]  # rank 1's stop follows rank 0's: not said
    assert not (workdir / "run" / "checkpoints").exists()
    # an error every rank meets alike, before any process group (a key misspelt): printed once, by rank 0
    result = _torchrun(workdir, "training.output_dir=run", "training.max_step=3", check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("error: command line: unknown key training.max_step;") == 1, result.stderr[-3000:]
    assert result.stderr.count("error:") == 1, result.stderr[-3000:]


def test_a_dead_rank_fails_the_job_instead_of_hanging(workdir):
    """A rank killed by SIGKILL mid-run ends the job; the survivor, whose collective fails on the closed
    connection, says so in one line that names the resume, not with gloo's traceback."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={_free_port()}",
        "-m",
        "llm_trainer",
        "train",
        "--config",
        "exp.yaml",
        "training.output_dir=run",
        "training.batch_size=4",
        "training.max_steps=100000",
        "training.save_steps=0",
        "training.eval_steps=0",
        "training.distributed_timeout_s=30",
    ]
    job = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        metrics = workdir / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.is_file() and metrics.read_text()) and time.time() < deadline:
            time.sleep(0.5)
        assert metrics.is_file(), "training never started"
        rank1 = [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_rank(pid, "1", launcher=job.pid)]
        assert rank1
        os.kill(int(rank1[0]), signal.SIGKILL)
        assert job.wait(timeout=120) != 0
        err = job.stderr.read()
        assert "[rank0]: Traceback" not in err, err[-3000:]
        assert "error: rank 0 stops at step " in err and "training.resume_from_checkpoint=latest" in err, err[-3000:]
    finally:
        if job.poll() is None:
            job.kill()


def _is_rank(pid: str, rank: str, launcher: int) -> bool:
    """Whether process `pid` is rank `rank` started by the torchrun process `launcher` (not another test's,
    which may run beside this one)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return (
        parent == launcher
        and f"RANK={rank}".encode() in environ
        and b"llm_trainer" in cmdline
        and b"torch.distributed.run" not in cmdline
    )


# -- DeepSpeed ZeRO, through DeepSpeed's own engine ---------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[1] / "src" / "llm_trainer" / "configs" / "deepspeed"


def _deepspeed(config) -> str:
    return f"training.deepspeed_config={json.dumps(config) if isinstance(config, dict) else config}"


@needs_deepspeed
def test_deepspeed_zero_stages_equal_one_process(workdir, references):
    """ZeRO 1, 2 and 3 (the shipped ZeRO-3 file: CPU optimizer offload) on 2 ranks of batch 4 train
    like one process of batch 8; DeepSpeed alone in one process (no torchrun) does too."""
    references.single(workdir)
    runs = {
        "zero1": {"zero_optimization": {"stage": 1}},
        "zero2_offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "zero3_shipped": str(SHIPPED / "zero3.json"),
    }
    for name, config in runs.items():
        result = _torchrun(
            workdir,
            f"training.output_dir={name}",
            "training.batch_size=4",
            "training.distributed_strategy=deepspeed",
            _deepspeed(config),
        )
        assert "effective batch 8 = 4 x 1 accumulation x 2 process(es) (deepspeed)" in result.stderr
        _assert_same_run(workdir / "single", workdir / name)
        a = load_file(workdir / "single/checkpoints/checkpoint-00000006/model.safetensors")
        b = load_file(workdir / name / "checkpoints/checkpoint-00000006/model.safetensors")  # ZeRO-3: gathered
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)
    _single(workdir, "training.output_dir=alone", "training.use_deepspeed=true")
    _assert_same_run(workdir / "single", workdir / "alone")


@needs_deepspeed
def test_deepspeed_checkpoint_resumes_exactly_and_is_verified_before_loading(workdir):
    """ZeRO-2 (the shipped file) with accumulation: step 3's checkpoint resumes to the same steps 4-6;
    its DeepSpeed files are checksummed, and a damaged one is refused before DeepSpeed unpickles it."""
    from llm_trainer.checkpoint.verify import verify

    args = (
        "training.batch_size=2",
        "training.gradient_accumulation_steps=2",
        "training.distributed_strategy=deepspeed",
        _deepspeed(SHIPPED / "zero2.json"),
    )
    _torchrun(workdir, "training.output_dir=full", *args)
    step3 = workdir / "full" / "checkpoints" / "checkpoint-00000003"
    meta = json.loads((step3 / "meta.json").read_text())
    assert meta["kind"] == "deepspeed_checkpoint" and meta["strategy"] == "deepspeed"
    ds_files = sorted(name for name in meta["files"] if name.startswith("sharded/") and name.endswith("_states.pt"))
    assert ds_files == [
        "sharded/mp_rank_00_model_states.pt",
        "sharded/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "sharded/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert not list((workdir / "full" / "checkpoints").glob(".staging*")) and not list(step3.glob("*.py"))

    resumed = workdir / "resumed" / "checkpoints"
    resumed.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(step3), str(resumed)], check=True)
    _torchrun(workdir, "training.output_dir=resumed", *args, "training.resume_from_checkpoint=latest")
    full, part = _losses(workdir / "full")[0], _losses(workdir / "resumed")[0]
    assert part == full[3:]  # bitwise

    # eval takes the checkpoint's model folder like any other
    step6 = workdir / "full" / "checkpoints" / "checkpoint-00000006"
    result = cli_in_process(["eval", "--checkpoint", step6, "--json"], workdir, threads=1)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss"] == pytest.approx(_losses(workdir / "full")[1][-1], rel=1e-5)

    # a flipped byte in DeepSpeed's optimizer file: refused by its checksum, DeepSpeed never reads it
    damaged = resumed / "checkpoint-00000003" / "sharded" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert "does not match its checksum" in verify(resumed / "checkpoint-00000003")
    result = _torchrun(
        workdir,
        "training.output_dir=resumed",
        *args,
        "training.resume_from_checkpoint=resumed/checkpoints/checkpoint-00000003",
        check=False,
    )
    assert result.returncode != 0 and "does not match its checksum" in result.stderr

    # the same checkpoint needs DeepSpeed, at its own world size, to resume: one line says what to do
    _refused_without_deepspeed(workdir, "full", args[:2])


def _refused_without_deepspeed(workdir, run: str, batch: tuple[str, ...]) -> None:
    """A DeepSpeed ZeRO checkpoint of 2 processes in `workdir/run` resumes neither under DDP nor in one
    process (DeepSpeed cannot repartition it)."""
    result = _torchrun(
        workdir,
        f"training.output_dir={run}",
        *batch,
        "training.distributed_strategy=ddp",
        "training.resume_from_checkpoint=latest",
        "training.max_steps=9",
        check=False,
    )
    assert result.returncode != 0 and "saved with distributed_strategy deepspeed" in result.stderr
    # both ranks refuse it alike: rank 0 says it, rank 1 (which found rank 0's line the same) stays quiet
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1, result.stderr
    refused = _refused_resume(workdir, f"training.output_dir={run}", "training.distributed_strategy=deepspeed")
    assert "saved by DeepSpeed ZeRO on 2 process(es), this run has 1" in refused
    assert "universal checkpoint" in refused and "model.init_from=" in refused


# Rank 1's forward returns NaN logits during step 4 (its loss is NaN; rank 0's is fine).
POISONED_RUNNER = r"""
import os, sys
import llm_trainer.api as pipeline
from llm_trainer import Callback
from llm_trainer.cli import main


class PoisonStep4(Callback):
    def on_train_begin(self, trainer):
        def hook(module, inputs, output):
            if trainer.state.step == 3 and os.environ["RANK"] == "1" and module.training:
                return output * float("nan")
        trainer.model.register_forward_hook(hook)


original = pipeline.train
pipeline.train = lambda experiment, callbacks=(): original(experiment, callbacks=[*callbacks, PoisonStep4()])
sys.exit(main(sys.argv[1:]))
"""


@needs_deepspeed
def test_deepspeed_skips_a_nonfinite_step_on_every_rank(workdir):
    """A NaN loss on one rank: the step is skipped everywhere (the weights of step 4 are those of
    step 3), counted, and training goes on with finite weights."""
    (workdir / "poisoned.py").write_text(POISONED_RUNNER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={_free_port()}",
        "poisoned.py",
        "train",
        "--config",
        "exp.yaml",
        "training.output_dir=ds",
        "training.batch_size=4",
        "training.distributed_strategy=deepspeed",
        "training.save_steps=1",
        "training.eval_steps=0",
        "training.save_total_limit=null",
    ]
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / "ds" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in train] == [0, 0, 0, 1, 1, 1]
    checkpoints = workdir / "ds" / "checkpoints"
    weights = {step: load_file(checkpoints / f"checkpoint-{step:08d}" / "model.safetensors") for step in (3, 4, 5)}
    assert all(torch.equal(weights[3][k], weights[4][k]) for k in weights[3])
    assert not all(torch.equal(weights[4][k], weights[5][k]) for k in weights[4])
    assert all(torch.isfinite(v).all() for v in weights[5].values())


@needs_deepspeed
def test_deepspeed_without_zero_resumes_at_another_world_size(workdir, references):
    """ZeRO stage 0 keeps the optimizer state whole: step 3 of 2 processes resumes in one and step 3 of
    one process on 2, with the uninterrupted run's losses (ZeRO 1-3 are refused: `_refused_without_deepspeed`)."""
    stage0 = ("training.distributed_strategy=deepspeed", _deepspeed({"zero_optimization": {"stage": 0}}))
    references.single(workdir)
    _torchrun(workdir, "training.output_dir=ds2", "training.batch_size=4", *stage0)
    _single(workdir, "training.output_dir=ds1", *stage0)
    _resume(workdir, "ds2", "two_to_one", *stage0)
    _resume(workdir, "ds1", "one_to_two", "training.batch_size=4", *stage0, nproc=2)
    _assert_resumed(workdir, "two_to_one", "one_to_two")


# -- several "nodes" and elastic restarts --------------------------------------------------------------


def test_hsdp_degrees_given_in_a_parallelism_section_set_the_mesh(workdir, references):
    """torchtitan's degrees on one node: a shard degree makes distributed_strategy auto fsdp, the mesh
    is 2 replicas x 1 shard (not hybrid_shard's one node x 2 shards), and the run equals one process's."""
    init = references.single(workdir, init=True)
    result = _torchrun(
        workdir,
        "training.output_dir=hsdp",
        "training.batch_size=4",
        "training.fsdp_sharding=hybrid_shard",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree=-1",
        f"model.init_from={init}",
    )
    assert "mesh: dp_replicate=2 x dp_shard=1 x pp=1 x cp=1 x tp=1" in result.stderr
    assert "x 2 process(es) (fsdp)" in result.stderr
    _assert_same_run(workdir / "single", workdir / "hsdp")


def test_hybrid_shard_on_two_nodes_equals_one_process(workdir, references):
    """The README's multi-node recipe on one machine: two torchrun agents (2 "nodes" x 2 processes)
    meet through the c10d rendezvous; FSDP2 hybrid_shard replicates across the nodes and shards within."""
    init = references.single(workdir, init=True)
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}",
                "--rdzv_id=hybrid-test",
                "-m",
                "llm_trainer",
                "train",
                "--config",
                "exp.yaml",
                "training.output_dir=hybrid",
                "training.batch_size=2",
                "training.distributed_strategy=fsdp",
                "training.fsdp_sharding=hybrid_shard",
                f"model.init_from={init}",
            ],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for _ in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=300)[1] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert any("effective batch 8 = 2 x 1 accumulation x 4 process(es) (fsdp)" in o for o in outputs)
    _assert_same_run(workdir / "single", workdir / "hybrid")


# A worker that dies at step 5 of the first attempt, once step 3's checkpoint is on disk.
FAULTY_RUNNER = r"""
import os, sys, time
import llm_trainer.api as pipeline
from llm_trainer import Callback
from llm_trainer.cli import main


class DieOnce(Callback):
    def on_step_end(self, trainer, row):
        if row["step"] == 5 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            latest = trainer.checkpoint_dir / "latest"
            while not (latest.is_file() and latest.read_text().strip() == "checkpoint-00000003"):
                time.sleep(0.01)
            os._exit(17)


original = pipeline.train
pipeline.train = lambda experiment, callbacks=(): original(experiment, callbacks=[*callbacks, DieOnce()])
sys.exit(main(sys.argv[1:]))
"""


def test_elastic_restart_resumes_from_the_latest_checkpoint(workdir):
    """torchrun --max-restarts=1: a rank dies at step 5; the restarted group resumes from step 3's
    checkpoint by itself and ends where an uninterrupted run ends."""
    (workdir / "faulty.py").write_text(FAULTY_RUNNER)
    common = ("training.batch_size=4", "training.resume_from_checkpoint=latest", "training.logging_steps=1")
    _torchrun(workdir, "training.output_dir=steady", *common)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{_free_port()}",
        "faulty.py",
        "train",
        "--config",
        "exp.yaml",
        "training.output_dir=elastic",
        *common,
    ]
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed (exitcode: 17) local_rank: 1" in result.stderr  # the first attempt did die
    assert "resume: no checkpoint in elastic/checkpoints yet; starting from step 0" in result.stderr
    assert "resume: continuing from elastic/checkpoints/checkpoint-00000003 (step 3" in result.stderr
    steady, elastic = _losses(workdir / "steady")[0], _losses(workdir / "elastic")[0]
    # steps 4-5 ran twice; the restarted run drops the first attempt's rows, so the log reads as one run
    assert elastic == steady and len(steady) == 6
    steps = [
        json.loads(line)["step"]
        for line in (workdir / "elastic/metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == [1, 2, 3, 4, 5, 6]
    a = load_file(workdir / "steady/checkpoints/checkpoint-00000006/model.safetensors")
    b = load_file(workdir / "elastic/checkpoints/checkpoint-00000006/model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)
