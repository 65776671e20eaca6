"""Nothing of the user's is lost: an export killed mid-way leaves the old folder or the new one, whole;
a run never writes into (or rotates) a checkpoint folder that belongs to another run."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import dead_pid
from llm_trainer.checkpoint.durable import remove_stale
from llm_trainer.checkpoint.publish import publish
from llm_trainer.errors import UsageError
from llm_trainer.files.atomic import owner
from llm_trainer.train.run_lock import lock_run_folders, run_lock

SRC = Path(__file__).resolve().parents[1] / "src"


def write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


OLD = {"config.json": "old config", "model.safetensors": "old weights"}
NEW = {"config.json": "new config", "model.safetensors": "new weights", "README.md": "new card"}

# publish() in a process of its own that stops for good once the new folder is written: killed there.
PAUSED_EXPORT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from llm_trainer.checkpoint.publish import publish

    output, ready, source = (Path(a) for a in sys.argv[1:4])

    def build(tmp):
        for name, text in {new!r}.items():
            (tmp / name).write_text(text)
        ready.write_text("built")
        time.sleep(600)

    publish(output, build, source=source, overwrite=True)
    """
).format(new=NEW)


def test_an_overwrite_killed_mid_way_leaves_the_old_export_whole_and_the_next_one_cleans_up(tmp_path, capsys):
    target, source = tmp_path / "export", tmp_path / "source"
    target.mkdir()
    source.mkdir()
    write(target, {**OLD, "notes.txt": "mine"})
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_EXPORT, str(target), str(ready), str(source)], env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert contents(target) == {**OLD, "notes.txt": "mine"}  # the old export, whole
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == [f".tmp-export-{owner().rsplit('-', 1)[0]}-{proc.pid}"]
    (tmp_path / ".tmp-someone-elses").mkdir()  # not ours: kept

    capsys.readouterr()
    publish(target, lambda tmp: write(tmp, NEW), source=source, overwrite=True)
    assert contents(target) == {**NEW, "notes.txt": "mine"}  # the new export, whole; the user's file kept
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".tmp-someone-elses"]
    assert f"export: removed {leftovers[0]}, left by an interrupted export" in capsys.readouterr().err


def test_a_stale_weight_file_of_another_layout_does_not_survive_an_overwrite(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    write(target, {"model-00001-of-00002.safetensors": "old shard", "model.safetensors.index.json": "{}"})
    publish(target, lambda tmp: write(tmp, NEW), source=tmp_path / "source", overwrite=True)
    assert contents(target) == NEW


@pytest.mark.parametrize("new_complete", [False, True])
def test_an_export_parked_by_a_kill_between_two_renames_is_put_back(tmp_path, new_complete):
    """Where the atomic exchange is missing, the old folder is parked between two renames: a kill
    there leaves it parked, and the next run puts it back (an export has no checksums to prove the new
    one whole, so the old one returns)."""
    writer = f"{owner().rsplit('-', 1)[0]}-{dead_pid()}"
    parked = tmp_path / f".old-export-{writer}"
    parked.mkdir()
    write(parked, OLD)
    if new_complete:
        fresh = tmp_path / f".tmp-export-{writer}"
        fresh.mkdir()
        write(fresh, NEW)
    remove_stale(tmp_path, names={"export"})
    assert contents(tmp_path / "export") == OLD
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- the run lock guards a folder's subtree ---------------------------------------------------------------


def hold(folder: Path, pid: str = "424242"):
    """Another process's lock on `folder`, as a running run holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "a+")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.truncate(0)
    handle.write(f"{pid}\n{folder.resolve()}\n")
    handle.flush()
    return handle


def test_a_checkpoint_folder_inside_a_running_runs_folder_is_refused(tmp_path):
    first = tmp_path / "first"
    with hold(first):
        with pytest.raises(UsageError, match="lies inside .*first, the folder of a run still going .PID 424242"):
            with lock_run_folders(tmp_path / "second", first / "checkpoints", True):
                pass
    assert not (first / "checkpoints").exists() and not (tmp_path / "second").exists()


def test_a_folder_above_that_another_run_only_probes_is_not_taken_for_a_running_run(tmp_path, monkeypatch):
    """Two runs starting at once in sibling folders both probe the `.lock` of the folders above them (a
    finished run's, or pytest's own in its temporary root): one probe holding it for an instant while the
    other looks is not a run still going. Here the other probe holds it at our first look and lets go
    while we wait to look again."""
    import threading

    from llm_trainer.train import run_lock as module

    above = tmp_path / "above"
    above.mkdir()
    (above / ".lock").write_text(f"424242\n{above}\n")  # a finished run's lock file: no one holds it
    held, release = threading.Event(), threading.Event()

    def probe():  # another process's probe of `above`, as `_refuse_held_ancestor` takes it
        with open(above / ".lock") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            held.set()
            release.wait()

    prober = threading.Thread(target=probe)
    prober.start()
    held.wait()
    waits = []

    def sleep(seconds):  # our wait between two looks: the other probe ends meanwhile
        waits.append(seconds)
        release.set()
        prober.join()

    monkeypatch.setattr(module.time, "sleep", sleep)
    try:
        with lock_run_folders(above / "second", above / "second" / "checkpoints", True):
            assert (above / "second" / ".lock").is_file()
    finally:
        release.set()
        prober.join()
    assert waits  # the first look did find it held


def test_the_cli_refuses_it_in_one_line(tmp_path, capsys, monkeypatch):
    from llm_trainer import cli

    monkeypatch.chdir(tmp_path)
    first = tmp_path / "first"
    with hold(first):
        code = cli.main(
            [
                "train",
                "--config",
                "tiny",
                f"training.output_dir={tmp_path / 'second'}",
                f"training.checkpoint_dir={first / 'checkpoints'}",
            ]
        )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: ") and "lies inside" in lines[-1]
    assert not (tmp_path / "data_cache").exists()  # refused before any data was prepared


def test_a_finished_runs_checkpoints_are_not_another_runs_to_rotate(tmp_path):
    first = tmp_path / "first"
    with run_lock(first):  # the first run, finished: its lock file stays and says whose folder it is
        (first / "checkpoints" / "checkpoint-00000006").mkdir(parents=True)
    with pytest.raises(UsageError, match="holds the checkpoints of the run in .*first"):
        with lock_run_folders(tmp_path / "second", first / "checkpoints", True):
            pass
    # its own run may continue there, and a checkpoint folder elsewhere stays its owner's
    with lock_run_folders(first, first / "checkpoints", True):
        pass
    elsewhere = tmp_path / "scratch" / "ckpt"
    with lock_run_folders(tmp_path / "third", elsewhere, True):
        (elsewhere / "checkpoint-00000003").mkdir()
    with lock_run_folders(tmp_path / "third", elsewhere, True):
        pass
    with pytest.raises(UsageError, match="holds the checkpoints of the run in .*third"):
        with lock_run_folders(tmp_path / "fourth", elsewhere, True):
            pass


# publish() where the atomic exchange is missing, killed between its two renames (the old folder parked).
KILLED_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from llm_trainer.files import atomic
    from llm_trainer.checkpoint.publish import publish

    atomic._renameat2 = None  # a system without the atomic exchange
    real = Path.rename

    def rename(self, target):
        result = real(self, target)
        if self.name == "export":
            os.kill(os.getpid(), signal.SIGKILL)  # the old export parked, the new one not yet in place
        return result

    Path.rename = rename
    output, source = Path(sys.argv[1]), Path(sys.argv[2])
    publish(output, lambda tmp: (tmp / "config.json").write_text("new config"), source=source, overwrite=True)
    """
)


def test_an_overwrite_killed_between_the_two_renames_loses_nothing(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    write(target, OLD)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(target), str(tmp_path / "source")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not target.exists() and list(tmp_path.glob(".old-export-*"))  # the window the exchange closes
    publish(target, lambda tmp: write(tmp, NEW), source=tmp_path / "source", overwrite=True)
    assert contents(target) == NEW  # the parked export was put back, then replaced whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_output_that_is_a_symlink_is_written_at_its_target(tmp_path):
    """An export folder linked to another disk: the new version goes where the link points, with the
    user's other files there kept, and the link stays (a rename onto it would replace the link and
    leave the export on the wrong disk)."""
    elsewhere = tmp_path / "disk" / "exports"
    elsewhere.mkdir(parents=True)
    write(elsewhere, {**OLD, "notes.txt": "mine"})
    (tmp_path / "export").symlink_to(elsewhere)
    publish(tmp_path / "export", lambda tmp: write(tmp, NEW), source=tmp_path / "source", overwrite=True)
    assert (tmp_path / "export").is_symlink() and (tmp_path / "export").resolve() == elsewhere
    assert contents(elsewhere) == {**NEW, "notes.txt": "mine"}
    assert not [p for p in [*tmp_path.iterdir(), *elsewhere.parent.iterdir()] if p.name.startswith(".")]
    # an empty linked folder is filled, no overwrite needed
    empty = tmp_path / "disk" / "empty"
    empty.mkdir()
    (tmp_path / "fresh").symlink_to(empty)
    publish(tmp_path / "fresh", lambda tmp: write(tmp, NEW), source=tmp_path / "source", overwrite=False)
    assert (tmp_path / "fresh").is_symlink() and contents(empty) == NEW


def test_a_run_whose_folder_is_deleted_mid_way_says_so_and_keeps_what_comes_after(tmp_path, capsys):
    """The run folder removed under a training run (by hand, a cleanup job): the run says so at its next
    logged row, and its later rows and its last checkpoint are written there again, not into a deleted file."""
    import shutil

    from conftest import tiny_loaders, tiny_model
    from llm_trainer.config import TrainingConfig
    from llm_trainer.train.callbacks import Callback
    from llm_trainer.train.trainer import Trainer

    out = tmp_path / "run"

    class RemoveTheFolder(Callback):
        def on_step_end(self, trainer, row):
            if row["step"] == 2:
                shutil.rmtree(out)

    train, val = tiny_loaders()
    training = TrainingConfig(
        device="cpu",
        batch_size=4,
        max_steps=6,
        logging_steps=2,
        eval_steps=0,
        save_steps=0,
        progress_bar=False,
        report_to=["jsonl"],
        output_dir=str(out),
    )
    Trainer(tiny_model(), training, train_dataloader=train, callbacks=[RemoveTheFolder()]).train()
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'} was removed while the run was writing it" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [4, 6] and rows[-1]["kind"] == "summary"
    assert (out / "checkpoints" / "latest").exists()
