"""Shared fixtures: tiny configs and a tiny corpus, all in temporary folders."""

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO_SRC = Path(__file__).resolve().parents[1] / "src"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Runs here (and the CLIs they start, which inherit it) draw no plots at their end: a fixed cost per run
# that the plot tests and the default-on test in test_untrusted_input.py pay where they assert it.
os.environ.setdefault("LLM_TRAINER_PLOTS", "0")
# pytest-xdist runs a worker per core, each test in it (and the processes it starts) computing with
# torch's OpenMP threads: with a pool per core in every worker, waiting threads spin on the cores the
# other workers compute on, and the suite takes a third longer on 2 cores. So the cores are shared out,
# before torch is imported here or in a child (a child that needs more sets its own).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))
# Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE), each of the hundreds of processes
# the tests start compiles the package from source again, and each pytest worker rewrites every test
# file's asserts again: a third of a second and seconds, every time. The tests write it, as Python does by
# default: in __pycache__ folders beside the sources (git-ignored); the processes they start inherit that.
if sys.dont_write_bytecode:
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


# DeepSpeed is optional (`.[deepspeed]`): its tests skip, saying how to install it, where it is not.
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install '.[deepspeed]')",
)


def tiny_model_config(**overrides):
    from llm_trainer.config import ModelConfig

    values = dict(vocab_size=61, d_model=16, n_heads=2, n_layers=2, max_seq_len=24)
    values.update(overrides)
    return ModelConfig(**values)


def tiny_model(**overrides):
    """A one-layer Transformer on `tiny_model_config`, the same weights every call."""
    import torch

    from llm_trainer.model import Transformer

    torch.manual_seed(0)
    return Transformer(tiny_model_config(**{"n_layers": 1, **overrides}))


def tiny_loaders(n_tokens: int = 3000, length: int = 16):
    """(train, validation) loaders of `length`-token windows over a learnable token sequence (vocab 61)."""
    import numpy as np

    from llm_trainer.data.batches.loader import BatchLoader, WindowRows

    t = (np.cumsum(np.random.default_rng(0).integers(1, 3, size=n_tokens)) % 61).astype(np.uint16)
    train = BatchLoader(WindowRows(t, length), 4, shuffle=True, seed=0)
    val = BatchLoader(WindowRows(t[:600], length, keep_partial=True), 4, shuffle=False, drop_last=False)
    return train, val


def dead_pid() -> int:
    """The pid of a process of this host that has ended (a killed writer's, in a leftover's name)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def free_port() -> int:
    """A TCP port nothing listens on now (for a process group's rendezvous, or an unreachable server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_corpus(folder):
    """A small multi-document text folder (12 files) with enough repetition to learn from."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"the {w} sat on the mat number {i % 7}.\n" for i, w in enumerate(["cat", "dog", "bird", "fox"] * 30)]
    for d in range(12):
        (folder / f"doc{d:02d}.txt").write_text("".join(lines[d * 10 : d * 10 + 10]))
    return folder


def once_per_session(tmp_path_factory, name: str, build) -> Path:
    """The folder `name`, filled by `build(folder)` once per test session; what it built is then only
    read (a test may add files of names of its own). Under pytest-xdist every worker has its own base
    temporary folder: the folder lies in their common parent, and the first worker to ask builds it under
    a file lock while the others wait for it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            if folder.exists():  # a build that failed part-way, in a worker before this one
                shutil.rmtree(folder)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def write_tiny_experiment(root, name="exp.yaml", **training):
    """An experiment file for a one-layer char model on `write_corpus`; `training` overrides its fields."""
    values = {
        "batch_size": 4,
        "max_steps": 6,
        "learning_rate": 3e-3,
        "eval_steps": 3,
        "save_steps": 0,
        "logging_steps": 2,
        "output_dir": str(root / "run"),
        "device": "cpu",
        "progress_bar": False,
        "report_to": ["jsonl"],
    }
    values.update(training)
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 24},
        "training": values,
        "data": {
            "data_files": [str(write_corpus(root / "corpus"))],
            "tokenizer": "char",
            "validation_split": 0.2,
            "cache_dir": str(root / "cache"),
        },
    }
    path = root / name
    path.write_text(yaml.safe_dump(config))
    return path


LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def src_env() -> dict:
    """The environment for a child Python that imports this checkout's llm_trainer: no launcher's
    variables (an in-process DeepSpeed test may have set them, with its store still listening)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    return {**env, "PYTHONPATH": str(REPO_SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def cli_in_process(args, cwd, threads: int | None = None) -> subprocess.CompletedProcess:
    """`llm-trainer ARGS` run by this process in `cwd`, returned as a child's run would be (exit status,
    and what it printed to stdout and stderr): without an interpreter's and torch's start, which are most
    of a tiny run's cost. For tests whose subject is what a command does; signals, kills, locks, the
    entry point itself and DeepSpeed (whose process group lasts as long as its process) are tested in child
    processes. Like a child it sees no launcher's variables and makes its storage clients afresh (a bucket's
    address and credentials are read from the environment again), and with `threads` it computes with that
    many threads; the working directory, the environment and torch's thread count are restored afterwards."""
    import contextlib
    import io

    import torch

    from llm_trainer import cli

    environment, here, computing = dict(os.environ), os.getcwd(), torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    _fresh_filesystems()
    try:
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name, None)
        os.chdir(cwd)
        if threads is not None:
            torch.set_num_threads(threads)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as exc:  # argparse's own usage errors
                code = exc.code
    finally:
        os.chdir(here)
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update({name: value for name, value in environment.items() if os.environ.get(name) != value})
        torch.set_num_threads(computing)
    assert not torch.distributed.is_initialized(), "the command left a process group set up in this process"
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _fresh_filesystems() -> None:
    """fsspec's cache of filesystem instances emptied for every filesystem class (s3fs, gcsfs, ...): the
    next one made is new, as in a new process. Instances already made keep working."""
    from fsspec.spec import AbstractFileSystem

    classes = [AbstractFileSystem]
    while classes:
        cls = classes.pop()
        cls.clear_instance_cache()
        classes.extend(cls.__subclasses__())


def kill9_when(script: str, ready, what: str, timeout: float = 60) -> None:
    """Run `script` in a child Python; once `ready()` is true, kill it with SIGKILL (a crash at that point)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=src_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"the child never reached {what}"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
