"""Checkpoints that never lose work: kill -9 at any point, corrupt files, a full disk, malicious pickles,
mismatched shapes, SIGTERM, non-finite steps, rotation, wrapper prefixes and foreign devices.

Every resumed run is compared with an uninterrupted run of the same config, bitwise: each logged
loss/lr/grad_norm after the resume point, and the bytes of the final model and optimizer tensors.
The model is a 4k-parameter character-level GPT on a 660-character corpus (an epoch is 5 batches),
so a whole run takes about a second; runs that must be killed or signalled are subprocesses of the
real CLI (`llm_trainer.cli.main`), paused at a chosen point by a callback, then killed by this process.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml
from safetensors.torch import load_file

from llm_trainer import cli
from llm_trainer.checkpoint import layout, local
from llm_trainer.checkpoint.find import find_checkpoint, resolve_checkpoint
from llm_trainer.checkpoint.layout import kind_of
from llm_trainer.checkpoint.model_folder import (
    WEIGHTS_NAME,
    load_model_folder,
    load_model_state,
    model_state_dict,
    save_model_folder,
)
from llm_trainer.checkpoint.train_state import TrainState, train_state_problem
from llm_trainer.checkpoint.verify import verify
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.errors import CheckpointError, TrainingStopped, UsageError
from llm_trainer.files import atomic, checksums
from llm_trainer.model import Transformer
from llm_trainer.train.trainer import Callback, Trainer

MAX_STEPS = 12
SAVE_STEPS = 4
TRAIN_FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens_seen", "skipped_steps")

# The child process: the real CLI, with a callback that stops at a chosen point (after a step, just
# after a save, or inside a save with its temporary folder created) and waits there to be killed, or
# signalled and then let go. It writes `ready_file` when it gets there and goes on once `go_file` exists.
RUNNER = r"""
import json, os, sys, time
import llm_trainer.api as pipeline
from llm_trainer import Callback
from llm_trainer.cli import main

plan = json.loads(os.environ.get("CKPT_TEST_PLAN") or "{}")


def pause(trainer, where):
    with open(plan["ready_file"], "w") as handle:
        handle.write(where)
    deadline = time.time() + 90
    while time.time() < deadline and not os.path.exists(plan.get("go_file", "")):
        time.sleep(0.01)  # signal handlers run here, as they would in the middle of a step


if "pause_in_save_at" in plan:  # inside the save (in the writer thread if it is a background save),
    import llm_trainer.checkpoint.local as local  # the temporary folder made and the weights written into it
    write_weights = local.save_model_folder

    def paused_write(model, folder, *args, **kwargs):
        write_weights(model, folder, *args, **kwargs)
        if f"checkpoint-{plan['pause_in_save_at']:08d}-" in str(folder):
            pause(None, "in-save")
    local.save_model_folder = paused_write


class Plan(Callback):
    def on_step_end(self, trainer, row):
        if row["step"] == plan.get("pause_after_step"):
            trainer.checkpointer.wait()  # an earlier step's save still being written in the background completes first
            pause(trainer, "after-step")

    def on_save(self, trainer, path):  # called once the checkpoint is complete (later, for a background save)
        if path.name == f"checkpoint-{plan.get('pause_after_save_at', -1):08d}":
            pause(trainer, "after-save")


original = pipeline.train
pipeline.train = lambda experiment, callbacks=(): original(experiment, callbacks=[*callbacks, Plan()])
sys.exit(main(sys.argv[1:]))
"""


# -- fixtures and helpers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A corpus (660 characters: 5 batches of 4 x 32 tokens per epoch), a shared data cache, the runner."""
    root = tmp_path_factory.mktemp("ckpt")
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog and cat sat on mat while bird sang".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(14)) + "\n"
    (root / "corpus.txt").write_text(text)
    (root / "runner.py").write_text(RUNNER)
    return root


@pytest.fixture(autouse=True)
def one_thread():
    """In-process runs compute like the subprocesses (OMP_NUM_THREADS=1), so results compare bitwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_config(workspace: Path, run: Path, **training) -> Path:
    config = {
        "model": {"architecture": "gpt2", "d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 32},
        "training": {
            "batch_size": 4,
            "max_steps": MAX_STEPS,
            "learning_rate": 1e-2,
            "eval_steps": 0,
            "save_steps": SAVE_STEPS,
            "save_total_limit": None,
            "logging_steps": 1,
            "output_dir": str(run),
            "device": "cpu",
            "progress_bar": False,
            "report_to": ["jsonl"],
            **training,
        },
        "data": {
            "data_files": str(workspace / "corpus.txt"),
            "tokenizer": "char",
            "validation_split": 0.0,
            "cache_dir": str(workspace / "cache"),
        },
    }
    run.mkdir(parents=True, exist_ok=True)
    path = run / "config.input.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(workspace: Path, config: Path, *overrides: str, plan: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CKPT_TEST_PLAN": json.dumps(plan or {})}
    log = config.parent / f"stderr-{time.monotonic_ns()}.txt"
    with open(log, "w") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(workspace / "runner.py"), "train", "--config", str(config), *overrides],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
        )
    proc.stderr_path = log  # type: ignore[attr-defined]
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    return Path(proc.stderr_path).read_text()  # type: ignore[attr-defined]


def finish(proc: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def run_cli(workspace: Path, config: Path, *overrides: str) -> subprocess.Popen:
    proc = launch(workspace, config, *overrides)
    assert finish(proc) == 0, stderr_of(proc)
    return proc


def wait_until_ready(proc: subprocess.Popen, ready: Path, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (status {proc.returncode}) before its pause point:\n{stderr_of(proc)}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run never reached its pause point")
        time.sleep(0.02)
    return ready.read_text()


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert finish(proc, 30) == -signal.SIGKILL


def train_rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: row[k] for k in TRAIN_FIELDS} for row in map(json.loads, lines) if row["kind"] == "train"]


def checkpoints(run: Path) -> Path:
    return run / "checkpoints"


def final_bytes(run: Path, step: int = MAX_STEPS) -> dict[str, bytes]:
    folder = checkpoints(run) / f"{layout.PREFIX}{step:08d}"
    return {name: (folder / name).read_bytes() for name in (WEIGHTS_NAME, layout.OPTIMIZER_TENSORS)}


def assert_same_as_reference(run: Path, reference: Path, before: list[dict], first_step: int) -> None:
    """metrics.jsonl reads as one run, row for row the uninterrupted run's: the rows logged before the
    resume up to its checkpoint kept as they were, every replayed step logged once (the interrupted
    run's rows after the checkpoint dropped); and the final files' bytes are the same."""
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert rows[: first_step - 1] == before[: first_step - 1]
    assert rows == train_rows(reference)  # floats compared exactly
    assert final_bytes(run) == final_bytes(reference)


def latest_name(run: Path) -> str:
    return (checkpoints(run) / layout.LATEST).read_text().strip()


@pytest.fixture(scope="module")
def reference(workspace) -> Path:
    """The uninterrupted run (gradient_accumulation_steps=1); epochs start at steps 6 and 10."""
    run = workspace / "reference"
    run_cli(workspace, write_config(workspace, run))
    return run


@pytest.fixture(scope="module")
def reference_accum2(workspace) -> Path:
    """The uninterrupted run with gradient_accumulation_steps=2; epoch boundaries fall inside steps."""
    run = workspace / "reference_accum2"
    run_cli(workspace, write_config(workspace, run, gradient_accumulation_steps=2))
    return run


def copy_run(reference: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "config.input.yaml").write_text((run / "config.input.yaml").read_text().replace(str(reference), str(run)))
    return run


def the_error(stderr: str) -> str:
    """The CLI's error: exactly one `error: ...` line, the last one, and no traceback."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], stderr
    return lines[-1]


def cli_train(run: Path, *overrides: str) -> int:
    """The CLI in this process (fast; no kill needed)."""
    return cli.main(["train", "--config", str(run / "config.input.yaml"), *overrides])


# -- 1. kill -9, then resume: bitwise the same as never stopping ---------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "accum, plan_key, pause_step, resumes_from, crosses_epoch, async_save",
    [
        pytest.param(1, "pause_after_step", 2, None, False, True, id="before-first-save"),
        pytest.param(1, "pause_after_save_at", 4, 4, False, True, id="right-after-save"),
        pytest.param(1, "pause_in_save_at", 8, 4, True, True, id="during-background-save-epoch-boundary-in-span"),
        pytest.param(1, "pause_in_save_at", 8, 4, True, False, id="during-synchronous-save"),
        pytest.param(2, "pause_after_step", 7, 4, True, True, id="accum2-epoch-boundary-in-span"),
    ],
)
def test_kill9_then_resume_is_bitwise_identical(
    workspace,
    reference,
    reference_accum2,
    tmp_path,
    accum,
    plan_key,
    pause_step,
    resumes_from,
    crosses_epoch,
    async_save,
):
    """A background save paused mid-write lets training run on to the final save, which waits for it;
    a synchronous one holds the training thread. Either way the kill loses only the unfinished save."""
    ref = reference if accum == 1 else reference_accum2
    run = tmp_path / "run"
    config = write_config(workspace, run, gradient_accumulation_steps=accum, async_checkpoint=async_save)
    ready = tmp_path / "ready"
    proc = launch(workspace, config, plan={plan_key: pause_step, "ready_file": str(ready)})
    wait_until_ready(proc, ready)
    if async_save and plan_key == "pause_in_save_at":  # training went on while the write was held
        deadline = time.monotonic() + 60
        while (train_rows(run) or [{"step": 0}])[-1]["step"] < MAX_STEPS and time.monotonic() < deadline:
            time.sleep(0.02)
        assert train_rows(run)[-1]["step"] == MAX_STEPS
    tmp_folders = sorted(p.name for p in checkpoints(run).glob(".tmp-checkpoint-*"))
    if plan_key == "pause_in_save_at":  # the parent sees the save in progress before it kills
        assert tmp_folders and tmp_folders[0].startswith(f".tmp-{layout.PREFIX}{pause_step:08d}-")
        assert not (checkpoints(run) / f"{layout.PREFIX}{pause_step:08d}").exists()
    else:  # a background write of an earlier step may still be finishing (the writer thread is not paused)
        deadline = time.monotonic() + 30
        while tmp_folders and time.monotonic() < deadline:
            time.sleep(0.02)
            tmp_folders = sorted(p.name for p in checkpoints(run).glob(".tmp-checkpoint-*"))
        assert tmp_folders == []
    kill9(proc)

    logged_before_kill = train_rows(run)
    assert logged_before_kill == train_rows(ref)[: len(logged_before_kill)]
    saved = [p.name for p in layout.list_checkpoints(checkpoints(run))]
    if resumes_from is None:
        assert saved == []
    else:
        assert latest_name(run) == f"{layout.PREFIX}{resumes_from:08d}"
        assert verify(checkpoints(run) / latest_name(run)) is None
    # The work lost (from the checkpoint resumed from to the kill) crosses an epoch boundary or not.
    epochs = {row["epoch"] for row in train_rows(ref) if (resumes_from or 1) <= row["step"] <= pause_step}
    assert (len(epochs) > 1) == crosses_epoch

    resumed = launch(workspace, config, "training.resume_from_checkpoint=latest")
    assert finish(resumed) == 0, stderr_of(resumed)
    assert_same_as_reference(run, ref, logged_before_kill, (resumes_from or 0) + 1)
    assert list(checkpoints(run).glob(".tmp-*")) == [], "the dead writer's temporary folder was removed"
    expected = (
        f"continuing from {checkpoints(run) / layout.PREFIX}{resumes_from:08d}"
        if resumes_from
        else "starting from step 0"
    )
    assert expected in stderr_of(resumed)


# -- background saves: the same files as synchronous ones; their errors stop the run -------------------


def test_background_checkpoints_equal_synchronous_ones(workspace, reference, tmp_path):
    """The reference saved in the background (the default) while training changed the weights; each
    of its checkpoints holds exactly the bytes of a synchronous save at the same step."""
    run = tmp_path / "run"
    write_config(workspace, run, async_checkpoint=False)
    assert cli_train(run) == 0
    names = [p.name for p in layout.list_checkpoints(checkpoints(reference))]
    assert names == [f"{layout.PREFIX}{step:08d}" for step in (12, 8, 4)]
    assert [p.name for p in layout.list_checkpoints(checkpoints(run))] == names
    for name in names:
        ours, theirs = checkpoints(run) / name, checkpoints(reference) / name
        files = sorted(p.name for p in theirs.iterdir() if p.name != layout.META)  # meta.json has the time
        assert sorted(p.name for p in ours.iterdir() if p.name != layout.META) == files
        for file in files:
            assert (ours / file).read_bytes() == (theirs / file).read_bytes(), f"{name}/{file}"


def test_host_snapshot_copies_into_buffers_reserved_ahead_and_reused():
    from llm_trainer.checkpoint.background import HostSnapshot

    model, optimizer = tiny_parts()
    state = ({k: v for k, v in model.state_dict().items()}, optimizer.state_dict())
    snapshot = HostSnapshot()
    snapshot.reserve(state)()  # what the writer thread runs after the first step
    reserved = {where: buffer.data_ptr() for where, buffer in snapshot._buffers.items()}
    assert len(reserved) == len(state[0]) + sum(len(s) for s in state[1]["state"].values())

    first = snapshot.take(state)
    assert {where: buffer.data_ptr() for where, buffer in snapshot._buffers.items()} == reserved  # nothing new
    weight = next(iter(state[0]))
    assert (
        torch.equal(first[0][weight], state[0][weight]) and first[0][weight].data_ptr() != state[0][weight].data_ptr()
    )
    before = first[0][weight].clone()
    with torch.no_grad():
        state[0][weight].add_(1.0)  # training goes on: the copy does not move
    assert torch.equal(first[0][weight], before)
    second = snapshot.take(state)  # the next save reuses the same buffers
    assert second[0][weight].data_ptr() == first[0][weight].data_ptr() and torch.equal(
        second[0][weight], state[0][weight]
    )
    assert second[1]["param_groups"] == state[1]["param_groups"]


def test_the_writer_thread_starts_no_thread_team_and_leaves_the_others_their_threads():
    """An armed background writer must cost the loop nothing while idle. A thread that runs a parallel
    torch op gets an OpenMP team of its own for the rest of the process, whose idle threads then
    compete with the training thread's at every step: the writer runs its torch ops on one core, and
    every other thread keeps the intra-op count it had."""
    import threading

    from llm_trainer.checkpoint.background import BackgroundWriter

    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    default = torch.get_num_threads()
    torch.set_num_threads(2)  # a team is only visible with two threads or more
    try:
        torch.ones(4_000_000).add_(1)  # this thread's own team exists before we count
        before = os_threads()
        writer = BackgroundWriter()
        seen = {}

        def write():
            seen["threads"] = torch.get_num_threads()
            torch.zeros(8_000_000).add_(1)  # large enough to run in parallel on two threads
            return Path("done")

        writer.submit(write)
        assert writer.wait() == Path("done")
        assert seen["threads"] == 1
        assert os_threads() == before + 1  # the writer itself, and no team of its own
        assert torch.get_num_threads() == 2
        later = {}
        thread = threading.Thread(target=lambda: later.setdefault("threads", torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later["threads"] == 2  # a thread started later takes up the default, not the writer's 1
        writer.close()
    finally:
        torch.set_num_threads(default)


def test_disk_full_in_a_background_save_stops_the_run_and_keeps_the_previous_checkpoint(
    workspace, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    write_config(workspace, run)
    import llm_trainer.checkpoint.model_folder as model_files

    real_save_file = model_files.save_file

    def full_at_step_8(tensors, filename, *args, **kwargs):
        if f".tmp-{layout.PREFIX}{8:08d}-" in str(filename):
            safetensors_enospc()
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(model_files, "save_file", full_at_step_8)
    assert cli_train(run) == 2
    error = the_error(capsys.readouterr().err)
    assert "disk full while saving checkpoint-00000008" in error and "intact" in error
    assert [p.name for p in layout.list_checkpoints(checkpoints(run))] == [f"{layout.PREFIX}{4:08d}"]
    assert latest_name(run) == f"{layout.PREFIX}{4:08d}"
    assert verify(checkpoints(run) / latest_name(run)) is None
    assert not [p for p in checkpoints(run).iterdir() if p.name.startswith(".")]


# -- 6. SIGTERM: checkpoint at the step boundary, status 143, resume bitwise ---------------------------


@pytest.mark.slow
def test_sigterm_saves_at_step_boundary_and_resumes_bitwise(workspace, reference, tmp_path, capsys):
    run = tmp_path / "run"
    config = write_config(workspace, run)
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = launch(workspace, config, plan={"pause_after_step": 5, "ready_file": str(ready), "go_file": str(go)})
    wait_until_ready(proc, ready)  # step 5 is done and logged; the run waits in a callback
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    go.touch()
    assert finish(proc, 60) == 128 + signal.SIGTERM
    err = stderr_of(proc)
    assert "SIGTERM: saving a checkpoint" in err
    assert "resume with training.resume_from_checkpoint=latest" in err
    assert "Traceback" not in err
    # Saved at a step boundary (the end of step 5, or of step 6 if the signal is acted on at the next
    # step's check), not at a save_steps multiple, and nothing after it was trained.
    stopped_at = int(latest_name(run)[len(layout.PREFIX) :])
    assert stopped_at in (5, 6)
    assert [row["step"] for row in train_rows(run)] == list(range(1, stopped_at + 1))
    assert [p.name for p in layout.list_checkpoints(checkpoints(run))] == [latest_name(run), f"{layout.PREFIX}{4:08d}"]

    before = train_rows(run)
    assert cli_train(run, "training.resume_from_checkpoint=latest") == 0
    assert f"continuing from {checkpoints(run) / layout.PREFIX}{stopped_at:08d}" in capsys.readouterr().err
    assert_same_as_reference(run, reference, before, stopped_at + 1)


# -- 2. truncated and bit-flipped files ------------------------------------------------------------


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "damage, file, reason",
    [
        (truncate, layout.OPTIMIZER_TENSORS, "optimizer.safetensors is not the file written there"),
        (flip_byte, WEIGHTS_NAME, "model.safetensors does not match its checksum"),
        (flip_byte, layout.OPTIMIZER, "optimizer.pt does not match its checksum"),
        (
            lambda p: p.write_text(p.read_text().replace('"step": 12', '"step": 13')),
            layout.META,
            "meta.json does not match its checksum",
        ),
        (lambda p: p.unlink(), layout.RNG, "rng.pt is missing"),
        (lambda p: p.unlink(), layout.META, "no meta.json"),
    ],
    ids=["truncated", "bit-flip-model", "bit-flip-optimizer", "edited-meta", "missing-file", "no-meta"],
)
def test_latest_falls_back_past_a_damaged_checkpoint(reference, tmp_path, capsys, damage, file, reason):
    run = copy_run(reference, tmp_path)
    newest = checkpoints(run) / f"{layout.PREFIX}{MAX_STEPS:08d}"
    damage(newest / file)
    found = resolve_checkpoint("latest", checkpoints(run))
    assert found == checkpoints(run) / f"{layout.PREFIX}{8:08d}"
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}" in err and reason in err

    # An explicitly named damaged checkpoint is refused: one line, status 2.
    assert cli_train(run, "training.max_steps=14", f"training.resume_from_checkpoint={newest}") == 2
    line = the_error(capsys.readouterr().err)
    assert line.startswith(f"error: checkpoint {newest} is unusable") and reason in line


def test_resume_after_fallback_continues_bitwise(reference, tmp_path, capsys):
    run = copy_run(reference, tmp_path)
    shutil.rmtree(checkpoints(run) / f"{layout.PREFIX}{MAX_STEPS:08d}")  # as if never written: `latest` is dangling
    truncate(checkpoints(run) / f"{layout.PREFIX}{8:08d}" / layout.OPTIMIZER_TENSORS)
    before = train_rows(run)
    assert cli_train(run, "training.resume_from_checkpoint=latest") == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and f"continuing from {checkpoints(run) / layout.PREFIX}{4:08d}" in err
    assert_same_as_reference(run, reference, before, 5)


def test_every_checkpoint_damaged_is_an_error(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    for folder in layout.list_checkpoints(checkpoints(run)):
        flip_byte(folder / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        resolve_checkpoint("latest", checkpoints(run))


def test_a_completed_save_is_used_even_if_latest_was_not_updated(reference, tmp_path):
    """Killed between the rename and the `latest` update: the newest complete checkpoint still wins."""
    run = copy_run(reference, tmp_path)
    (checkpoints(run) / layout.LATEST).write_text(f"{layout.PREFIX}{4:08d}")
    assert resolve_checkpoint("latest", checkpoints(run)).name == f"{layout.PREFIX}{MAX_STEPS:08d}"
    (checkpoints(run) / layout.LATEST).write_bytes(b"\xff\xfe garbage")
    assert resolve_checkpoint("latest", checkpoints(run)).name == f"{layout.PREFIX}{MAX_STEPS:08d}"


# -- 3. a full disk during a save -------------------------------------------------------------------


def tiny_parts(seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1, max_seq_len=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 30, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def save(root: Path, step: int, model, optimizer) -> Path:
    return local.save_checkpoint(
        root,
        step,
        model=model,
        optimizer_state=optimizer.state_dict(),
        train_state={"step": step},
        rng_tensors={"torch": torch.get_rng_state()},
        config={"test": True},
        tokenizer_json=None,
    )


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def partial_then_enospc(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"\0" * 1000)  # some bytes made it to disk before the disk filled
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def safetensors_enospc(*args, **kwargs):  # what safetensors really raises (its own type, no errno)
    raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize(
    "target, replacement",
    [
        ("llm_trainer.checkpoint.model_folder.save_file", safetensors_enospc),
        ("safetensors.torch.save_file", partial_then_enospc),  # the optimizer tensors
        ("torch.save", enospc),
    ],
    ids=["model-weights", "optimizer-tensors-partly-written", "torch-save"],
)
def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, target, replacement):
    root = tmp_path / "checkpoints"
    model, optimizer = tiny_parts()
    first = save(root, 1, model, optimizer)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    optimizer.step()

    monkeypatch.setattr(target, replacement)
    with pytest.raises(CheckpointError) as info:
        save(root, 2, model, optimizer)
    monkeypatch.undo()
    message = str(info.value)
    assert "disk full" in message and "intact" in message and "\n" not in message
    assert sorted(p.name for p in root.iterdir()) == [f"{layout.PREFIX}{1:08d}", layout.LATEST]  # no tmp folder
    assert (root / layout.LATEST).read_text() == first.name
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert resolve_checkpoint("latest", root) == first
    parts = local.load_checkpoint(first)
    assert torch.equal(parts["model"]["tok_emb.weight"], load_file(str(first / WEIGHTS_NAME))["tok_emb.weight"])


def test_disk_full_reported_when_the_writer_hides_the_errno(tmp_path, monkeypatch):
    """torch.save on a full disk says only "unexpected pos"; the free space tells what happened."""
    root = tmp_path / "checkpoints"
    model, optimizer = tiny_parts()
    save(root, 1, model, optimizer)

    def torch_save_on_full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", torch_save_on_full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 0))
    with pytest.raises(CheckpointError, match="disk full"):
        save(root, 2, model, optimizer)
    monkeypatch.undo()
    assert [p.name for p in layout.list_checkpoints(root)] == [f"{layout.PREFIX}{1:08d}"]
    assert not list(root.glob(".tmp-*"))


def test_disk_full_while_updating_latest(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    model, optimizer = tiny_parts()
    first = save(root, 1, model, optimizer)
    real_open = open

    def open_failing_for_latest(file, *args, **kwargs):
        if Path(file).name.startswith(f".{layout.LATEST}.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", open_failing_for_latest)
    with pytest.raises(CheckpointError, match="disk full"):
        save(root, 2, model, optimizer)
    monkeypatch.undo()
    assert (root / layout.LATEST).read_text() == first.name
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert resolve_checkpoint("latest", root).name == f"{layout.PREFIX}{2:08d}"  # complete, so not lost


def test_interrupt_mid_save_removes_tmp_folder_and_reraises(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    model, optimizer = tiny_parts()
    save(root, 1, model, optimizer)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(root, 2, model, optimizer)
    assert not list(root.glob(".tmp-*"))


def test_leftovers_of_dead_writers_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = tiny_parts()
    save(root, 1, model, optimizer)
    host = atomic.owner().rsplit("-", 1)[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f".tmp-{layout.PREFIX}{2:08d}-{host}-{dead.pid}"
    alive = root / f".tmp-{layout.PREFIX}{3:08d}-{host}-{os.getppid()}"
    other_host = root / f".tmp-{layout.PREFIX}{4:08d}-elsewhere-{dead.pid}"
    for folder in (stale, alive, other_host):
        folder.mkdir()
        (folder / WEIGHTS_NAME).write_bytes(b"partial")
    save(root, 5, model, optimizer)
    assert not stale.exists() and alive.exists() and other_host.exists()


def test_staging_folders_of_a_killed_multi_process_save_are_removed_at_the_next_start(workspace, reference, tmp_path):
    run = copy_run(reference, tmp_path)
    leftovers = [
        checkpoints(run) / f".staging-{layout.PREFIX}{8:08d}",
        checkpoints(run) / f".staging-{layout.PREFIX}{8:08d}-deepspeed",
    ]
    for folder in leftovers:
        folder.mkdir()
        (folder / "rng-rank1.pt").write_bytes(b"partial")
    assert cli_train(run, "training.resume_from_checkpoint=latest", f"training.max_steps={MAX_STEPS + 2}") == 0
    assert not any(folder.exists() for folder in leftovers)
    assert latest_name(run) == f"{layout.PREFIX}{MAX_STEPS + 2:08d}"


# -- 4. a malicious pickle with valid checksums ------------------------------------------------------


class Payload:
    """Unpickling this calls open(target, "w"): it creates a file."""

    def __init__(self, target: Path):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def reseal(folder: Path) -> None:
    """Recompute meta.json's sizes and checksums, as an attacker would, so only the safe loader remains."""
    meta = json.loads((folder / layout.META).read_text())
    for name in meta["files"]:
        meta["files"][name] = {
            "size": (folder / name).stat().st_size,
            "checksum": checksums.file_checksum(folder / name),
        }
    meta["meta_sha256"] = checksums.meta_checksum(meta)
    (folder / layout.META).write_text(json.dumps(meta))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_is_refused_and_never_runs(reference, tmp_path, capsys, writer):
    run = copy_run(reference, tmp_path)
    folder = checkpoints(run) / f"{layout.PREFIX}{MAX_STEPS:08d}"
    target = tmp_path / "pwned"
    with open(folder / layout.OPTIMIZER, "wb") as handle:
        torch.save(Payload(target), handle) if writer == "torch.save" else pickle.dump(Payload(target), handle)
    reseal(folder)
    assert verify(folder) is None  # checksums are fine: only the loader stands in the way

    # The payload is live: an unsafe load would run it.
    probe = tmp_path / "probe.pt"
    shutil.copy(folder / layout.OPTIMIZER, probe)
    try:
        torch.load(probe, weights_only=False)
    except Exception:  # a bare pickle is not a torch file: torch.load fails, after unpickling it
        pass
    assert target.exists()
    target.unlink()

    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        local.load_checkpoint(folder)
    assert not target.exists()
    assert cli_train(run, "training.max_steps=14", "training.resume_from_checkpoint=latest") == 2
    line = the_error(capsys.readouterr().err)
    assert line.startswith("error: checkpoint") and "optimizer.pt" in line and "refusing to unpickle" in line
    assert not target.exists()


# -- 5. resuming into a model of another shape --------------------------------------------------------


def test_shape_mismatch_lists_tensors_exit_2(reference, tmp_path, capsys):
    run = copy_run(reference, tmp_path)
    assert cli_train(run, "model.d_model=24", "training.max_steps=14", "training.resume_from_checkpoint=latest") == 2
    line = the_error(capsys.readouterr().err)
    assert "does not fit this model" in line
    assert "tok_emb.weight: file has (" in line and ", 16), model has (" in line and ", 24)" in line
    assert "pos_emb.weight" in line


@pytest.mark.slow
def test_shape_mismatch_in_a_subprocess_prints_no_traceback(workspace, reference, tmp_path):
    run = copy_run(reference, tmp_path)
    proc = launch(workspace, run / "config.input.yaml", "model.n_layers=2", "training.resume_from_checkpoint=latest")
    assert finish(proc) == 2
    assert "missing blocks.1." in the_error(stderr_of(proc))


# -- 7. non-finite steps ---------------------------------------------------------------------------------


class Poisoned(nn.Module):
    """A bigram model whose logits are NaN on the forward calls listed in `poison` (1-based)."""

    def __init__(self, vocab: int = 11, poison: set[int] = frozenset()):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)
        self.poison, self.calls = set(poison), 0

    def forward(self, x):
        self.calls += 1
        logits = self.head(self.emb(x))
        return logits * float("nan") if self.calls in self.poison else logits


class Snapshots(Callback):
    def __init__(self):
        self.weights, self.rows = {}, []

    def on_step_end(self, trainer, row):
        self.weights[row["step"]] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        self.rows.append(row)


def batches(vocab: int = 11, n: int = 16):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (2, 9), generator=g) for _ in range(n)]


def test_nonfinite_step_is_skipped_without_touching_weights(tmp_path):
    config = TrainingConfig(
        max_steps=8,
        save_steps=4,
        logging_steps=1,
        learning_rate=1e-2,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        report_to=["jsonl"],
        max_consecutive_bad_steps=3,
    )
    snapshots = Snapshots()
    trainer = Trainer(Poisoned(poison={3, 6}), config, train_dataloader=batches(), callbacks=[snapshots])
    summary = trainer.train()
    assert summary["skipped_steps"] == 2 and trainer.state.skipped_steps == 2
    for bad in (3, 6):
        assert all(
            torch.equal(snapshots.weights[bad][k], snapshots.weights[bad - 1][k]) for k in snapshots.weights[bad]
        )
    for good in (2, 4, 5, 7):
        assert not torch.equal(snapshots.weights[good]["head.weight"], snapshots.weights[good - 1]["head.weight"])
    assert [r["skipped_steps"] for r in snapshots.rows] == [0, 0, 1, 1, 1, 2, 2, 2]
    assert all(torch.isfinite(v).all() for v in snapshots.weights[8].values())


def test_too_many_nonfinite_steps_stop_and_leave_last_checkpoint_untouched(tmp_path):
    config = TrainingConfig(
        max_steps=12,
        save_steps=4,
        logging_steps=1,
        learning_rate=1e-2,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        report_to=["jsonl"],
        max_consecutive_bad_steps=3,
    )
    snapshots = Snapshots()
    trainer = Trainer(Poisoned(poison={6, 7, 8}), config, train_dataloader=batches(), callbacks=[snapshots])
    root = trainer.checkpoint_dir
    with pytest.raises(TrainingStopped, match="3 steps in a row") as info:
        trainer.train()
    assert "last checkpoint" in str(info.value) and "untouched" in str(info.value)
    assert [p.name for p in layout.list_checkpoints(root)] == [f"{layout.PREFIX}{4:08d}"]
    assert (root / layout.LATEST).read_text() == f"{layout.PREFIX}{4:08d}"
    assert verify(root / f"{layout.PREFIX}{4:08d}") is None
    saved = local.load_checkpoint(root / f"{layout.PREFIX}{4:08d}")["model"]
    assert all(torch.equal(saved[k], snapshots.weights[4][k]) for k in saved)
    assert trainer.state.skipped_steps == 3 and max(snapshots.weights) == 7  # stopped at step 8, before logging it


# -- 8. rotation, best_model ---------------------------------------------------------------------------


def test_rotation_keeps_newest_two_plus_best_and_best_model_is_standalone(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    config = write_config(
        workspace,
        run,
        max_steps=6,
        save_steps=2,
        eval_steps=2,
        save_total_limit=2,
        lr_scheduler="constant",
    )
    text = yaml.safe_load(config.read_text())
    text["data"]["validation_split"] = 0.3
    config.write_text(yaml.safe_dump(text))
    assert cli.main(["train", "--config", str(config)]) == 0
    # Then a learning rate far too high, so validation gets worse and the best checkpoint is an old one.
    overrides = ["training.max_steps=12", "training.learning_rate=5.0", "training.max_grad_norm=null"]
    assert cli.main(["train", "--config", str(config), *overrides, "training.resume_from_checkpoint=latest"]) == 0
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in evals if row["kind"] == "eval"]
    best_eval = min(evals, key=lambda row: row["val_loss"])
    best_step = best_eval["step"]
    assert best_step <= 6, "the high learning rate should only make validation worse"
    kept = sorted(int(p.name[len(layout.PREFIX) :]) for p in layout.list_checkpoints(checkpoints(run)))
    assert kept == sorted({10, 12, best_step})  # the newest two, and the best

    best = checkpoints(run) / layout.BEST
    assert sorted(p.name for p in best.iterdir()) == [
        layout.META,
        "model.safetensors",
        "model_config.json",
        "tokenizer.json",
    ]
    assert json.loads((best / layout.META).read_text())["metrics"]["step"] == best_step
    a = load_file(str(best / WEIGHTS_NAME))
    b = load_file(str(checkpoints(run) / f"{layout.PREFIX}{best_step:08d}" / WEIGHTS_NAME))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(best), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(best_eval["val_loss"], rel=1e-6)
    assert (
        cli.main(["generate", "--checkpoint", str(best), "--prompt", "the ", "--max_new_tokens", "8", "--seed", "0"])
        == 0
    )
    assert capsys.readouterr().out.startswith("the ")


def test_rotate_never_deletes_protected_and_deletes_oldest_first(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = tiny_parts()
    for step in (1, 2, 3, 4, 5):
        save(root, step, model, optimizer)
    local.rotate(root, 2, protect={f"{layout.PREFIX}{2:08d}", f"{layout.PREFIX}{5:08d}"})
    assert [p.name for p in layout.list_checkpoints(root)] == [f"{layout.PREFIX}{s:08d}" for s in (5, 4, 2)]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


# -- 9. wrapper prefixes ---------------------------------------------------------------------------------


class DDPLike(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


@pytest.mark.parametrize(
    "wrap", [torch.compile, DDPLike, lambda m: DDPLike(torch.compile(m))], ids=["compile", "ddp", "ddp+compile"]
)
def test_wrapped_models_save_clean_names(tmp_path, wrap):
    model, optimizer = tiny_parts()
    wrapped = wrap(model)
    assert any(k.startswith(("_orig_mod.", "module.")) for k in wrapped.state_dict())
    folder = save(tmp_path / "checkpoints", 1, wrapped, optimizer)
    names = list(load_file(str(folder / WEIGHTS_NAME)))
    assert names and not [n for n in names if "_orig_mod." in n or "module." in n]
    assert set(names) == set(model_state_dict(model))

    fresh, _ = tiny_parts(seed=1)
    rewrapped = wrap(fresh)
    load_model_state(rewrapped, local.load_checkpoint(folder)["model"], str(folder))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


# -- 10. written on another device, loaded on the CPU -----------------------------------------------------


def test_checkpoint_from_another_device_loads_on_cpu(tmp_path, monkeypatch):
    """Tensors in the pickled files are tagged "cuda:0" (as torch.save does on a GPU); this machine has none."""
    model, optimizer = tiny_parts()
    state = optimizer.state_dict()
    state["param_groups"][0]["odd"] = torch.zeros(3, dtype=torch.complex64)  # stays in optimizer.pt
    import torch.serialization as serialization

    monkeypatch.setattr(serialization, "location_tag", lambda storage: "cuda:0")
    folder = local.save_checkpoint(
        tmp_path / "checkpoints",
        1,
        model=model,
        optimizer_state=state,
        train_state={"step": 1},
        rng_tensors={"torch": torch.get_rng_state(), "cuda": [torch.get_rng_state()]},
        config={},
        tokenizer_json=None,
    )
    monkeypatch.undo()
    if not torch.cuda.is_available():  # the file really is tagged for a device this machine lacks
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(folder / layout.RNG, weights_only=True)

    calls = {"load_file": [], "torch.load": []}
    import safetensors.torch as st

    real_load_file, real_torch_load = st.load_file, torch.load
    monkeypatch.setattr(
        st,
        "load_file",
        lambda f, device="cpu", **kw: calls["load_file"].append(device) or real_load_file(f, device=device, **kw),
    )
    monkeypatch.setattr(
        torch, "load", lambda f, **kw: calls["torch.load"].append(kw.get("map_location")) or real_torch_load(f, **kw)
    )
    parts = local.load_checkpoint(folder, map_location="cpu")
    assert calls["load_file"] and set(calls["load_file"]) == {"cpu"}
    assert calls["torch.load"] and None not in calls["torch.load"]
    tensors = [parts["model"]["tok_emb.weight"], parts["rng"]["torch"], parts["rng"]["cuda"][0]]
    tensors += [v for s in parts["optimizer"]["state"].values() for v in s.values()]
    tensors += [parts["optimizer"]["param_groups"][0]["odd"]]
    assert all(t.device.type == "cpu" for t in tensors)

    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parts["optimizer"]["param_groups"][0].pop("odd")
    state["param_groups"][0].pop("odd")
    fresh.load_state_dict(parts["optimizer"])
    for index, values in state["state"].items():
        for key, value in values.items():
            assert torch.equal(fresh.state_dict()["state"][index][key], value)


# -- the file format ---------------------------------------------------------------------------------------


def test_optimizer_state_round_trips_exactly(tmp_path):
    model, optimizer = tiny_parts()
    state = optimizer.state_dict()
    folder = save(tmp_path / "checkpoints", 1, model, optimizer)
    loaded = local.load_checkpoint(folder)["optimizer"]
    assert loaded["param_groups"] == state["param_groups"]
    assert loaded["state"].keys() == state["state"].keys()
    for index, values in state["state"].items():
        assert loaded["state"][index].keys() == values.keys()
        for key, value in values.items():
            assert torch.equal(loaded["state"][index][key], value) and loaded["state"][index][key].dtype == value.dtype
    assert torch.load(folder / layout.OPTIMIZER, weights_only=True)["state"][0]["exp_avg"] == {
        "__llm_trainer_tensor__": "state.0.exp_avg"
    }


def test_optimizer_state_with_views_of_one_buffer_round_trips(tmp_path):
    """Optimizers that keep their state in one flat buffer (views) still save: each view gets its own bytes."""
    flat = torch.arange(10.0)
    state = {
        "state": {0: {"exp_avg": flat[:5], "exp_avg_sq": flat[5:], "alias": flat[5:], "empty": torch.zeros(0)}},
        "param_groups": [{"params": [0], "betas": (0.9, 0.95), "lr": 0.1, "foreach": None}],
    }
    model, _ = tiny_parts()
    folder = local.save_checkpoint(
        tmp_path / "checkpoints",
        1,
        model=model,
        optimizer_state=state,
        train_state={},
        rng_tensors={},
        config={},
        tokenizer_json=None,
    )
    loaded = local.load_checkpoint(folder)["optimizer"]
    assert loaded["param_groups"] == state["param_groups"] and isinstance(loaded["param_groups"][0]["betas"], tuple)
    for key, value in state["state"][0].items():
        assert torch.equal(loaded["state"][0][key], value)


def test_format_1_checkpoints_still_load(tmp_path):
    """Format 1: plain sha256 per file, everything of the optimizer in optimizer.pt."""
    import hashlib

    model, optimizer = tiny_parts()
    folder = save(tmp_path / "checkpoints", 1, model, optimizer)
    torch.save(optimizer.state_dict(), folder / layout.OPTIMIZER)
    (folder / layout.OPTIMIZER_TENSORS).unlink()
    meta = json.loads((folder / layout.META).read_text())
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != layout.META}
    meta = {k: v for k, v in meta.items() if k not in ("meta_sha256", "checksum", "sequence")}
    (folder / layout.META).write_text(json.dumps({**meta, "format_version": 1, "files": files}))
    assert verify(folder) is None
    loaded = local.load_checkpoint(folder)["optimizer"]
    assert torch.equal(loaded["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    flip_byte(folder / WEIGHTS_NAME)
    assert "does not match its checksum" in verify(folder)


def test_format_2_crc32_checkpoints_still_load(tmp_path):
    """Format 2: CRC-32 per 64 MiB chunk ("crc32-64MiB-tree"); new saves record XXH3 chunks (format 3)."""
    model, optimizer = tiny_parts()
    folder = save(tmp_path / "checkpoints", 1, model, optimizer)
    meta = json.loads((folder / layout.META).read_text())
    assert (meta["format_version"], meta["checksum"]) == (3, checksums.XXH3_TREE)
    for name in meta["files"]:
        meta["files"][name]["checksum"] = checksums.file_checksum(folder / name, checksums.CRC32_TREE)
    meta.update(format_version=2, checksum=checksums.CRC32_TREE)
    meta["meta_sha256"] = checksums.meta_checksum(meta)
    (folder / layout.META).write_text(json.dumps(meta))
    assert verify(folder) is None
    loaded = local.load_checkpoint(folder)["optimizer"]
    assert torch.equal(loaded["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    flip_byte(folder / WEIGHTS_NAME)
    assert "does not match its checksum" in verify(folder)


def test_chunk_checksums_catch_a_flip_in_any_chunk_and_a_short_read(tmp_path, monkeypatch):
    """Files over one chunk: a flip in the second chunk is caught, and so is a file that shrank after its
    size was checked (read, not memory-mapped past the end)."""
    monkeypatch.setattr(checksums, "_CHUNK", 1 << 16)
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(3 * (1 << 16) + 123))
    for kind in (checksums.XXH3_TREE, checksums.CRC32_TREE):
        before = checksums.file_checksum(path, kind)
        assert checksums.file_checksum(path, kind) == before
        data = bytearray(path.read_bytes())
        data[(1 << 16) + 5] ^= 1
        path.write_bytes(data)
        assert checksums.file_checksum(path, kind) != before
        data[(1 << 16) + 5] ^= 1
        path.write_bytes(data)
        size = path.stat().st_size
        jobs = checksums.checksum_jobs(path, size, kind)
        assert checksums.combine(jobs, kind) == before
        path.write_bytes(data[:-200])  # shorter than the size the jobs were made for
        assert checksums.combine(checksums.checksum_jobs(path, size, kind), kind) != before
        path.write_bytes(data)


def test_explicit_missing_checkpoint_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        resolve_checkpoint(str(tmp_path / "nope"), tmp_path)
    assert resolve_checkpoint("latest", tmp_path / "empty") is None


def test_a_model_folder_loads_into_the_class_asked_for(tmp_path):
    class Tagged(Transformer):
        def tag(self) -> str:
            return "mine"

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1, max_seq_len=32))
    save_model_folder(model, tmp_path)
    again = load_model_folder(tmp_path, cls=Tagged)
    assert type(again) is Tagged and again.tag() == "mine"
    x = torch.randint(0, 30, (1, 7))
    assert torch.equal(model(x), again(x))
    assert type(load_model_folder(tmp_path)) is Transformer


def test_find_checkpoint_takes_every_way_of_naming_one(tmp_path, capsys):
    model, optimizer = tiny_parts(0)
    run = tmp_path / "run"
    root = run / layout.CHECKPOINTS_DIR
    first, newest = save(root, 3, model, optimizer), save(root, 10, model, optimizer)
    local.save_best_model(root, model, tokenizer_json=None, config={}, metrics={"val_loss": 1.0})
    assert find_checkpoint(first) == first
    assert find_checkpoint(root / layout.BEST) == root / layout.BEST
    assert find_checkpoint(root) == newest and find_checkpoint(run) == newest
    assert find_checkpoint(root / "checkpoint-3.pt") == first and find_checkpoint(root / "checkpoint-10") == newest
    # the names the seed documents' trainers give them
    assert find_checkpoint(root / "checkpoint_step_3.pt") == first and find_checkpoint(root / "step_10.pth") == newest
    for name in ("best_model.pt", "checkpoint_best.pt", "model_best.bin"):
        assert find_checkpoint(root / name) == root / layout.BEST, name
    with pytest.raises(CheckpointError, match=r"checkpoint_epoch_1.pt not found \(.* holds checkpoint-00000010"):
        find_checkpoint(root / "checkpoint_epoch_1.pt")  # an epoch is no name here: the folder's are listed
    (tmp_path / "interrupted").mkdir()  # no meta.json: the folder itself, for verification to refuse
    assert find_checkpoint(tmp_path / "interrupted") == tmp_path / "interrupted"
    (tmp_path / "fresh" / layout.CHECKPOINTS_DIR).mkdir(parents=True)
    assert find_checkpoint(tmp_path / "fresh") is None
    with pytest.raises(CheckpointError, match=r"not found \(.* holds checkpoint-00000010, checkpoint-00000003\)"):
        find_checkpoint(root / "checkpoint-00000007")


def test_a_checkpoint_another_process_reads_is_kept_by_the_rotation_until_a_later_save(tmp_path, capsys):
    """`export`, `eval` or `generate` on a run that is still training: the checkpoint being read is held
    (a shared lock on its meta.json), and the training's rotation passes over it until a save after
    the reader is done, rather than removing it mid-read."""
    from llm_trainer.checkpoint.reading import held_checkpoint

    model, optimizer = tiny_parts(0)
    root = tmp_path / "run" / layout.CHECKPOINTS_DIR
    first = save(root, 1, model, optimizer)
    with held_checkpoint(tmp_path / "run") as path:
        assert path == first
        second = save(root, 2, model, optimizer)
        local.rotate(root, 1, protect={second.name})
        assert first.is_dir() and local.load_checkpoint(first)["model"] is not None
    assert (
        "checkpoint-00000001 is being read by another process; it is removed at a later save" in capsys.readouterr().err
    )
    third = save(root, 3, model, optimizer)
    local.rotate(root, 1, protect={third.name})
    assert layout.list_checkpoints(root) == [third]


def test_a_reader_whose_checkpoint_was_removed_before_it_took_hold_takes_the_newest(tmp_path, monkeypatch, capsys):
    """The rotation removes the checkpoint a reader has found but not yet taken hold of: named through the
    run folder, the reader takes the newest one; named itself, it says what removed it, in one line."""
    from llm_trainer.checkpoint import reading

    model, optimizer = tiny_parts(0)
    root = tmp_path / "run" / layout.CHECKPOINTS_DIR
    old, new = save(root, 1, model, optimizer), save(root, 2, model, optimizer)
    found = iter([old, new])

    def found_then_removed(spec):  # what the rotation of a running training does between the two
        path = next(found)
        if path == old:
            atomic.remove_folder(old)
        return path

    monkeypatch.setattr(reading, "find_checkpoint", found_then_removed)
    with reading.held_checkpoint(tmp_path / "run") as path:
        assert path == new
    assert f"checkpoint: {old} was removed as it was to be read" in capsys.readouterr().err
    gone = save(root, 3, model, optimizer)
    monkeypatch.setattr(reading, "find_checkpoint", lambda spec: atomic.remove_folder(gone) and gone)
    with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoint-00000003 was removed as it was to be read, by"):
        with reading.held_checkpoint(gone):
            pass


def test_no_usable_checkpoint_says_how_to_start_anew(tmp_path):
    model, optimizer = tiny_parts(0)
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        (save(root, step, model, optimizer) / WEIGHTS_NAME).write_bytes(b"x")
    with pytest.raises(
        CheckpointError, match=r"every one is corrupt .*; to start the run anew there, pass --overwrite"
    ):
        resolve_checkpoint("latest", root)


def test_meta_json_records_the_kind_and_a_resume_reads_what_it_names(tmp_path):
    model, optimizer = tiny_parts(0)
    folder = save(tmp_path, 1, model, optimizer)
    assert kind_of(folder) is layout.WHOLE and layout.read_meta(folder)["kind"] == layout.WHOLE.name
    parts = local.load_checkpoint(folder)
    assert parts["model"] is not None and parts["optimizer"] is not None
    assert kind_of(tmp_path / "nowhere") is None
    for kind in layout.KINDS.values():  # every kind says where model and optimizer are, and requires their files
        assert (layout.OPTIMIZER in kind.required) != kind.optimizer_in_shards
        assert (WEIGHTS_NAME in kind.required) != kind.weights_in_shards


def test_train_state_json_is_checked_against_train_state_itself():
    state = TrainState(step=4, tokens_seen=100, best_val_loss=2.5, best_step=4)
    content = state.to_file(
        epoch=0,
        data={"epoch": 0, "position": 4},
        schedule={"name": "cosine", "total_steps": 8},
        scaler=None,
        rng={"python": [3, [1, 2], None], "numpy": ["MT19937", [1, 2], 0, 0, 0.0]},
    )
    assert train_state_problem(json.loads(json.dumps(content))) is None
    restored = TrainState()
    restored.load_state_dict(content)
    assert restored == state
    for name, bad in [("step", "six"), ("tokens_seen", -1), ("best_val_loss", "low"), ("patience_reference", [1])]:
        assert "train_state.json is corrupt" in train_state_problem({**content, name: bad}), name
    for name, bad in [("schedule", {"total_steps": "8"}), ("data", []), ("rng", {"python": []}), ("scaler", 1)]:
        assert "train_state.json is corrupt" in train_state_problem({**content, name: bad}), name
    assert "step is missing" in train_state_problem({k: v for k, v in content.items() if k != "step"})
    older = {k: v for k, v in content.items() if k not in ("consecutive_bad_steps", "epoch", "scaler")}
    assert train_state_problem(older) is None  # written before those existed: their defaults apply


def test_wrapper_parts_leave_parameter_names_and_nothing_else_does():
    from llm_trainer.checkpoint.model_folder import clean_name

    assert clean_name("module._orig_mod.blocks.0._checkpoint_wrapped_module.attn.q.weight") == "blocks.0.attn.q.weight"
    assert clean_name("blocks.0._fsdp_wrapped_module.mlp.up.weight") == "blocks.0.mlp.up.weight"
    assert clean_name("encoder.submodule.weight") == "encoder.submodule.weight"  # a model's own names stay
    assert clean_name("encoder.module.weight") == "encoder.module.weight"


def test_shards_read_in_one_process_load_without_dcps_one_process_warning(tmp_path):
    """A sharded checkpoint read by one process (`eval`, `export`, `generate` of an FSDP run, or its resume
    in one process): the values are loaded and the console gets no warning from DCP that it assumes one
    process, which is what was asked for."""
    import warnings

    from llm_trainer.checkpoint import sharded

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=sharded.ONE_PROCESS_WARNING)  # the save's own: not ours to read
        sharded.save_sharded(model, optimizer, tmp_path / "sharded")()
    fresh = nn.Linear(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded.load_sharded(fresh, None, tmp_path / "sharded")
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert [str(w.message) for w in caught] == []
