"""Nothing from outside runs code, and nothing of the user's is lost (issue #13).

Folders someone else made (crafted checkpoints, planted symlinks, embedded configs), two runs in one
folder, refused resumes, export targets, and environment errors. Every payload here would create a
marker file if it ran: the tests prove it never does. Every refusal is one `error:` line, exit
status 2, no traceback, and leaves the files byte-identical (the run folder's `.lock` holds the PID
of whoever last ran there, and is left out of those comparisons).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import dead_pid, src_env, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.checkpoint import durable, layout, local
from llm_trainer.checkpoint.find import resolve_checkpoint
from llm_trainer.checkpoint.verify import verify
from llm_trainer.errors import CheckpointError
from llm_trainer.files import atomic, checksums, safe_pickle
from warm_launch import python

MAX_STEPS = 6
OPEN = f"{open.__module__}.open"  # how a pickle names the payload's callable


class Payload:
    """Unpickling it creates `marker`: the proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# -- helpers ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not fight the other tests for the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run: checkpoints at steps 3 and 6, best_model, metrics; char tokenizer, one layer."""
    root = tmp_path_factory.mktemp("untrusted")
    config = write_tiny_experiment(root, max_steps=MAX_STEPS, save_steps=3, eval_steps=3, save_total_limit=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LLM_TRAINER_PLOTS", raising=False)  # the default: a finished run draws its plots
        assert cli.main(["train", "--config", str(config)]) == 0
    return root


def run_copy(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run folder (its experiment file, exp.yaml, keeps pointing at the shared corpus and cache)."""
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


def train(trained: Path, run: Path, *overrides: str) -> int:
    return cli.main(["train", "--config", str(trained / "exp.yaml"), f"training.output_dir={run}", *overrides])


def the_error(stderr: str) -> str:
    """The CLI's error: exactly one `error: ...` line, the last one, and no traceback."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and lines, stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], stderr
    return lines[-1]


def refused(capsys, *argv: str) -> str:
    code = cli.main(list(argv))
    error = the_error(capsys.readouterr().err)
    assert code == 2, error
    return error


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (symlinks as their target path), the lock file left out."""
    files = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            files[key] = os.readlink(path).encode()
        elif path.is_file() and path.name != ".lock":
            files[key] = path.read_bytes()
    return files


def reseal(folder: Path) -> None:
    """Recompute meta.json's sizes and checksums, as whoever crafts a folder can."""
    meta = json.loads((folder / layout.META).read_text())
    meta["files"] = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "checksum": checksums.file_checksum(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != layout.META
    }
    meta["meta_sha256"] = checksums.meta_checksum(meta)
    (folder / layout.META).write_text(json.dumps(meta))


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"{layout.PREFIX}{step:08d}"


# -- 1. no pickle from a folder is read but by torch's weights-only unpickler ------------------------------


def crafted_sharded_folder(trained: Path, tmp_path: Path, metadata: bytes, with_meta: bool) -> Path:
    """A real model_config.json and tokenizer.json, and `metadata` as sharded/.metadata."""
    folder = tmp_path / "crafted"
    (folder / layout.SHARDED_DIR).mkdir(parents=True)
    for name in ("model_config.json", "tokenizer.json"):
        shutil.copy(trained / "run" / "checkpoints" / layout.BEST / name, folder / name)
    (folder / layout.SHARDED_DIR / ".metadata").write_bytes(metadata)
    if with_meta:  # the checksums prove nothing: whoever made the folder recomputed them
        (folder / layout.META).write_text(
            json.dumps({"kind": "best_model", "format_version": 3, "checksum": checksums.CHECKSUM, "files": {}})
        )
        reseal(folder)
        assert verify(folder) is None
    return folder


REFUSED = "holds pickled objects other than tensors and plain data"


@pytest.mark.parametrize("with_meta", [False, True], ids=["no-meta", "resealed-meta"])
@pytest.mark.parametrize("command", ["eval", "generate", "export", "consolidate"])
def test_a_pickle_as_dcp_metadata_never_runs(trained, tmp_path, capsys, command, with_meta):
    marker = tmp_path / "pwned"
    folder = crafted_sharded_folder(trained, tmp_path, pickle.dumps(Payload(marker)), with_meta)
    before = snapshot(folder)
    argv = {
        "eval": ["--data", str(trained / "corpus" / "doc00.txt")],
        "generate": ["--prompt", "the"],
        "export": ["--output", str(tmp_path / "out")],
        "consolidate": ["--output", str(tmp_path / "out")],
    }[command]
    error = refused(capsys, command, "--checkpoint", str(folder), *argv)
    assert f"{folder / 'sharded' / '.metadata'}: it {REFUSED}" in error
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert snapshot(folder) == before


def torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_a_payload_inside_real_dcp_metadata_is_caught(trained, tmp_path, capsys):
    """A genuine DCP Metadata object with one field replaced: only a class-by-class allow-list stops it."""
    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "pwned"
    metadata = Metadata(state_dict_metadata={}, planner_data=Payload(marker))
    folder = crafted_sharded_folder(trained, tmp_path, torch_saved(metadata), with_meta=False)
    assert f"{REFUSED} ({OPEN})" in refused(capsys, "generate", "--checkpoint", str(folder))
    assert not marker.exists()


def real_sharded_folder(trained: Path, tmp_path: Path, extra: dict | None = None) -> Path:
    """The best model's weights written by torch.distributed.checkpoint, as an FSDP checkpoint holds them."""
    import torch.distributed.checkpoint as dcp

    from llm_trainer.checkpoint.model_folder import load_model_folder
    from llm_trainer.checkpoint.sharded import SafeWriter

    folder = crafted_sharded_folder(trained, tmp_path, b"", with_meta=False)
    (folder / layout.SHARDED_DIR / ".metadata").unlink()
    model = load_model_folder(trained / "run" / "checkpoints" / layout.BEST)
    dcp.save(
        {"model": model.state_dict(), **(extra or {})},
        storage_writer=SafeWriter(str(folder / layout.SHARDED_DIR)),
        no_dist=True,
    )
    return folder


def test_real_dcp_checkpoints_still_load(trained, tmp_path, capsys):
    """The allow-list admits what torch writes: consolidate gives back the weights exactly."""
    folder = real_sharded_folder(trained, tmp_path)
    assert cli.main(["consolidate", "--checkpoint", str(folder), "--output", str(tmp_path / "out")]) == 0
    ours = load_file(tmp_path / "out" / "model.safetensors")
    best = load_file(trained / "run" / "checkpoints" / layout.BEST / "model.safetensors")
    assert ours.keys() == best.keys() and all(torch.equal(ours[k], best[k]) for k in ours)


def test_shards_written_into_a_store_are_checked_as_they_are_read_back(tmp_path):
    """The store writer records each file's size and checksum from the bytes it sent; the store reader
    loads them back, refuses a flipped bit naming the file, and unpickles `.metadata` under the allow-list."""
    import re

    import fsspec
    from torch.distributed.checkpoint.metadata import Metadata

    from llm_trainer.checkpoint import sharded

    fs = fsspec.filesystem("memory")
    url = f"memory://{tmp_path.name}/checkpoint-00000001/sharded"
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    written = sharded.save_sharded_to_store(model, optimizer, url)()  # the write, then its records
    assert "sharded/.metadata" in written and any(name.endswith(".distcp") for name in written)
    for name, entry in written.items():
        data = fs.cat_file(f"{url}/{name.split('/', 1)[1]}")
        assert entry == {"size": len(data), "checksum": checksums.data_checksum(data)}
    folder = tmp_path / "checkpoint-00000001"
    (folder / layout.SHARDED_DIR).mkdir(parents=True)

    def list_in_meta(files: dict) -> None:
        meta = {"format_version": 3, "checksum": checksums.CHECKSUM, "files": files, "in_store": sorted(files)}
        (folder / layout.META).write_text(json.dumps(meta))

    list_in_meta(written)
    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    sharded.load_sharded(fresh, fresh_optimizer, folder / layout.SHARDED_DIR, store=url)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )

    shard = next(name for name in written if name.endswith(".distcp")).split("/", 1)[1]
    data = fs.cat_file(f"{url}/{shard}")
    fs.pipe_file(f"{url}/{shard}", data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=re.escape(f"{url}/{shard} does not match its checksum")):
        sharded.load_sharded(torch.nn.Linear(4, 3), None, folder / layout.SHARDED_DIR, store=url)
    fs.pipe_file(f"{url}/{shard}", data)

    marker = tmp_path / "pwned"
    crafted = torch_saved(Metadata(state_dict_metadata={}, planner_data=Payload(marker)))
    fs.pipe_file(f"{url}/.metadata", crafted)  # listed with its own checksum: only the allow-list stops it
    list_in_meta({**written, "sharded/.metadata": {"size": len(crafted), "checksum": checksums.data_checksum(crafted)}})
    with pytest.raises(CheckpointError, match=REFUSED):
        sharded.load_sharded(torch.nn.Linear(4, 3), None, folder / layout.SHARDED_DIR, store=url)
    assert not marker.exists()


def _length_past_any_file(metadata, fqn: str) -> None:
    next(info for index, info in metadata.storage_data.items() if index.fqn == fqn).length = 10**12


def _offset_past_the_end(metadata, fqn: str) -> None:
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    info.offset += 10**6


def _missing_key(metadata, fqn: str) -> None:
    del metadata.state_dict_metadata[fqn]


def _weight_as_bytes(metadata, fqn: str) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()


def _doubled_chunk(metadata, fqn: str) -> None:
    chunk = metadata.state_dict_metadata[fqn].chunks[0]
    chunk.sizes = torch.Size(2 * n for n in chunk.sizes)


def _doubled_shape(metadata, fqn: str) -> None:
    record = metadata.state_dict_metadata[fqn]
    record.size = torch.Size(2 * n for n in record.size)
    record.chunks[0].sizes = record.size


def _fewer_rows(metadata, fqn: str) -> None:
    """As an embedding saved before the vocabulary was padded: fewer rows than the model's."""
    record = metadata.state_dict_metadata[fqn]
    record.size = torch.Size([record.size[0] - 3, *record.size[1:]])
    record.chunks[0].sizes = record.size


def _negative_offset(metadata, fqn: str) -> None:
    chunk = metadata.state_dict_metadata[fqn].chunks[0]
    chunk.offsets = torch.Size([-1] + list(chunk.offsets)[1:])


def _data_of_no_record(metadata, fqn: str) -> None:
    for index in [index for index in metadata.storage_data if index.fqn == fqn]:
        del metadata.storage_data[index]


def _size_as_text(metadata, fqn: str) -> None:
    metadata.state_dict_metadata[fqn].size = "large"


@pytest.mark.parametrize(
    "craft, fragment",
    [
        (_length_past_any_file, "past the end of"),
        (_offset_past_the_end, "past the end of"),
        (_missing_key, "has no record of model.tok_emb.weight"),
        (_weight_as_bytes, "records model.tok_emb.weight as bytes"),
        (_doubled_chunk, "outside its shape"),
        (_doubled_shape, "this model's is"),
        (
            _fewer_rows,
            "this model's is (128, 16); written with unpadded vocabulary rows? set model.vocab_pad_multiple: 1",
        ),
        (_negative_offset, "outside its shape"),
        (_data_of_no_record, "names no data for"),
        (_size_as_text, "records model.tok_emb.weight with a malformed shape"),
    ],
)
def test_dcp_metadata_records_are_checked_against_the_files_and_the_model(trained, tmp_path, capsys, craft, fragment):
    """Records that pass the allow-list but describe what is not there: one line each, before any
    item is read, and nothing written."""
    folder = real_sharded_folder(trained, tmp_path)
    file = folder / layout.SHARDED_DIR / ".metadata"
    metadata = safe_pickle.load_pickle(file.read_bytes(), str(file), safe_pickle.DCP_METADATA)
    craft(metadata, "model.tok_emb.weight")
    file.write_bytes(torch_saved(metadata))
    error = refused(capsys, "consolidate", "--checkpoint", str(folder), "--output", str(tmp_path / "out"))
    assert fragment in error and str(file) in error
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_in_dcps_own_pickle_format_is_refused(trained, tmp_path, capsys):
    """DCP's own writer pickles `.metadata` (protocol 4, pathlib objects): never unpickled, refused."""
    import torch.distributed.checkpoint as dcp

    from llm_trainer.checkpoint.model_folder import load_model_folder

    folder = crafted_sharded_folder(trained, tmp_path, b"", with_meta=False)
    model = load_model_folder(trained / "run" / "checkpoints" / layout.BEST)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / layout.SHARDED_DIR), no_dist=True)
    assert REFUSED in refused(capsys, "consolidate", "--checkpoint", str(folder), "--output", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_payload_in_a_dcp_non_tensor_item_never_runs(trained, tmp_path):
    """DCP's planner torch.loads non-tensor items (optimizer hyperparameters) without weights_only."""
    from llm_trainer.checkpoint.model_folder import load_model_folder
    from llm_trainer.checkpoint.sharded import _load

    marker = tmp_path / "pwned"
    folder = real_sharded_folder(trained, tmp_path, extra={"optimizer": {"lr": Payload(marker)}})
    state = {
        "model": load_model_folder(trained / "run" / "checkpoints" / layout.BEST).state_dict(),
        "optimizer": {"lr": 0.0},
    }
    with pytest.raises(CheckpointError, match="optimizer.lr holds more than plain data"):
        _load(state, folder / layout.SHARDED_DIR, no_dist=True)
    assert not marker.exists()


def test_dcp_metadata_naming_a_file_outside_the_folder_is_refused(trained, tmp_path, capsys):
    folder = real_sharded_folder(trained, tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 64)
    file = folder / layout.SHARDED_DIR / ".metadata"
    metadata = safe_pickle.load_pickle(file.read_bytes(), str(file), safe_pickle.DCP_METADATA)
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.bin"
    file.write_bytes(torch_saved(metadata))
    assert "names the data file '../../secret.bin'" in refused(capsys, "generate", "--checkpoint", str(folder))


def import_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    return pytest.importorskip("deepspeed")


def test_a_pickle_in_sharded_pt_files_never_reaches_deepspeed(trained, tmp_path, monkeypatch):
    """DeepSpeed reads its files only through FolderLoads: torch's weights-only unpickler, from the
    bytes whose checksum was checked."""
    from llm_trainer.files.folder_files import FolderFiles
    from llm_trainer.parallel.deepspeed_engine import FolderLoads

    import_deepspeed(monkeypatch)
    run = run_copy(trained, tmp_path)
    folder = checkpoint(run, MAX_STEPS)
    marker = tmp_path / "pwned"
    (folder / layout.SHARDED_DIR).mkdir()
    bad = folder / layout.SHARDED_DIR / "mp_rank_00_model_states.pt"
    torch.save({"module": OrderedDict(w=torch.zeros(2)), "ds_config": Payload(marker)}, bad)
    reseal(folder)
    assert verify(folder) is None
    with pytest.raises(CheckpointError, match=rf"{bad}: it {REFUSED} \({OPEN}\)"):
        FolderLoads(None, FolderFiles.of(folder)).load(str(bad), map_location="cpu")
    assert not marker.exists()


def test_torch_refuses_a_payload_in_every_protocol_and_through_the_memo(tmp_path):
    marker = tmp_path / "pwned"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(CheckpointError, match=REFUSED):
            safe_pickle.load_pickle(pickle.dumps({"ok": OrderedDict(a=1), "x": [Payload(marker)]}, protocol), "f")
        with pytest.raises(CheckpointError, match=REFUSED):
            safe_pickle.load_pickle(torch_saved({"ok": OrderedDict(a=1), "x": [Payload(marker)]}), "f")
    # Names taken back from the memo, as an attacker would reuse the strings of an allowed global.
    crafted = (
        b"\x80\x04\x8c\x05posix\x940\x8c\x06system\x940"  # pushed, kept in the memo, popped
        b"\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x930"  # an allowed global, popped
        b"h\x00h\x01\x93\x8c\x04true\x94\x85R."
    )  # the memo's strings: posix.system("true")
    with pytest.raises(CheckpointError, match=REFUSED):
        safe_pickle.load_pickle(crafted, "f")
    assert not marker.exists()


def test_what_deepspeed_and_our_rng_files_hold_loads(tmp_path, monkeypatch):
    """What our RNG files and DeepSpeed-shaped state dicts hold is allowed; a pickle torch.save did not
    write is not a torch file."""
    import_deepspeed(monkeypatch)
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = {
        "torch": torch.get_rng_state(),
        "module": OrderedDict(w=torch.ones(2, dtype=torch.bfloat16)),
        "param_shapes": [OrderedDict(w=torch.Size([2]))],
        "p": torch.nn.Parameter(torch.zeros(1)),
        "zero_stage": ZeroStageEnum.gradients,
    }
    loaded = safe_pickle.load_pickle(torch_saved(state), "state.pt", safe_pickle.DEEPSPEED)
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and torch.equal(loaded["torch"], state["torch"])
    with pytest.raises(CheckpointError, match=rf"plain.pt: it {REFUSED} \(.*ZeroStageEnum\)"):
        safe_pickle.load_pickle(torch_saved(state), "plain.pt")  # not on the default list
    with pytest.raises(CheckpointError, match="is not a torch file"):
        safe_pickle.load_pickle(pickle.dumps({"a": 1}, protocol=2), "plain.pt")


# -- 2. the embedded config names no files to read, no folders to write -----------------------------


def test_a_crafted_embedded_config_cannot_make_eval_read_or_write(trained, tmp_path, capsys):
    run = run_copy(trained, tmp_path)
    folder = checkpoint(run, MAX_STEPS)
    secret = tmp_path / "secret.txt"
    secret.write_text("private words\n" * 50)
    meta = json.loads((folder / layout.META).read_text())
    meta["config"]["data"].update(data_files=[str(secret)], cache_dir=str(tmp_path / "planted_cache"))
    meta["config"]["data_fingerprint"] = "0123456789abcdef"
    (folder / layout.META).write_text(json.dumps(meta))
    reseal(folder)
    before = snapshot(tmp_path)
    error = refused(capsys, "eval", "--checkpoint", str(folder))
    assert "is not prepared in" in error and "--data FILE" in error
    assert not (tmp_path / "planted_cache").exists() and snapshot(tmp_path) == before


def test_eval_still_reads_the_runs_own_prepared_split(trained, capsys):
    """The legitimate use: the recorded fingerprint finds the data the run prepared, read-only."""
    cache = trained / "cache"
    before = snapshot(cache)
    assert cli.main(["eval", "--checkpoint", str(checkpoint(trained / "run", MAX_STEPS)), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in (trained / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result["loss"] == pytest.approx([r for r in rows if r["kind"] == "eval"][-1]["val_loss"], rel=1e-5)
    assert snapshot(cache) == before


# -- 3. symlinks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_meta", [True, False], ids=["checkpoint", "model-folder"])
def test_a_symlink_leading_out_of_a_checkpoint_is_refused(trained, tmp_path, capsys, with_meta):
    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    outside = tmp_path / "elsewhere.json"
    shutil.move(folder / "tokenizer.json", outside)
    (folder / "tokenizer.json").symlink_to(outside)
    if with_meta:
        reseal(folder)  # verify() reads through the link: the checksums match
    else:
        (folder / layout.META).unlink()
    error = refused(capsys, "generate", "--checkpoint", str(folder), "--prompt", "the")
    assert "tokenizer.json is a symlink that leads out of" in error


def test_planted_symlinks_in_the_output_folder_are_replaced_not_followed(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLM_TRAINER_PLOTS", raising=False)  # plots drawn by default, as in `trained`
    run = run_copy(trained, tmp_path)
    victims = {
        name: tmp_path / f"victim-{name.replace('/', '_')}"
        for name in ("config.yaml", "tokenizer.json", "plots/loss_vs_steps.png", "checkpoints/latest")
    }
    for name, victim in victims.items():
        victim.write_text("the user's own file\n")
        (run / name).unlink()
        (run / name).symlink_to(victim)
    assert train(trained, run, "training.max_steps=7", "training.resume_from_checkpoint=latest") == 0
    for name, victim in victims.items():
        assert victim.read_text() == "the user's own file\n", name
        assert not (run / name).is_symlink(), name
    assert yaml.safe_load((run / "config.yaml").read_text())["training"]["max_steps"] == 7

    victim = tmp_path / "victim-metrics"
    victim.write_text("mine\n")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={run}",
        "training.max_steps=8",
        "training.resume_from_checkpoint=latest",
    )
    assert "metrics.jsonl is a symlink" in error and victim.read_text() == "mine\n"


# -- 4. silent loss -----------------------------------------------------------------------------------------


def test_a_second_run_into_a_busy_folder_fails_at_once_naming_the_holder(trained, tmp_path, capsys):
    run = run_copy(trained, tmp_path)
    before = snapshot(run)
    with open(run / ".lock", "a+") as holder:  # another process's lock, as the first run holds it
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.truncate(0)
        holder.write("424242\n")
        holder.flush()
        error = refused(
            capsys,
            "train",
            "--config",
            str(trained / "exp.yaml"),
            f"training.output_dir={run}",
            "training.max_steps=8",
            "training.resume_from_checkpoint=latest",
        )
    assert f"output folder {run} is in use" in error and "PID 424242" in error
    assert snapshot(run) == before


@pytest.mark.slow
def test_two_real_runs_into_one_folder_and_no_stale_lock_after_sigkill(tmp_path):
    # a first run that cannot end on its own while the second starts, however fast this machine trains
    config = write_tiny_experiment(tmp_path, max_steps=10**9, save_steps=0, eval_steps=0)
    first = subprocess.Popen(
        [sys.executable, "-m", "llm_trainer", "train", "--config", str(config)],
        env=src_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "run" / "metrics.jsonl").is_file():  # training has begun
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        second = subprocess.run(
            [sys.executable, "-m", "llm_trainer", "train", "--config", str(config)],
            env=src_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and f"PID {first.pid}" in the_error(second.stderr)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stderr.close()
    third = subprocess.run(
        [sys.executable, "-m", "llm_trainer", "train", "--config", str(config), "--overwrite", "training.max_steps=2"],
        env=src_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert third.returncode == 0, third.stderr  # the killed run's lock died with it


def test_export_and_consolidate_never_delete_what_they_did_not_write(trained, tmp_path, capsys):
    pytest.importorskip("transformers")
    best = trained / "run" / "checkpoints" / layout.BEST
    for command, ours in (("export", "config.json"), ("consolidate", "model_config.json")):
        target = tmp_path / command
        target.mkdir()
        (target / ours).write_text("{}")  # looks like an earlier output...
        (target / "notes.txt").write_text("mine")  # ...and holds the user's work
        before = snapshot(target)
        error = refused(capsys, command, "--checkpoint", str(best), "--output", str(target))
        assert "is not empty" in error and "--overwrite" in error and snapshot(target) == before
        assert cli.main([command, "--checkpoint", str(best), "--output", str(target), "--overwrite"]) == 0
        assert (target / "notes.txt").read_text() == "mine" and (target / ours).read_text() != "{}"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("change", ["shape", "tokenizer"])
def test_a_refused_resume_writes_nothing(trained, tmp_path, capsys, change):
    run = run_copy(trained, tmp_path)
    overrides = ["model.d_model=24"]
    if change == "tokenizer":  # the same size, other ids: the shapes fit, the meaning does not
        saved = json.loads((run / "tokenizer.json").read_text())
        vocab = saved["model"]["vocab"]
        letters = sorted(k for k in vocab if len(k) == 1 and k.isalpha())
        vocab[letters[0]], vocab[letters[1]] = vocab[letters[1]], vocab[letters[0]]
        (tmp_path / "other.json").write_text(json.dumps(saved))
        overrides = [f"data.tokenizer={tmp_path / 'other.json'}"]
    before = snapshot(run)
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={run}",
        "training.max_steps=8",
        "training.resume_from_checkpoint=latest",
        *overrides,
    )
    assert ("does not fit this model" if change == "shape" else "was trained with another tokenizer") in error
    assert snapshot(run) == before


def test_best_model_is_swapped_in_one_atomic_step(trained, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, root / layout.BEST)
    from llm_trainer.checkpoint.model_folder import load_model_folder

    model = load_model_folder(root / layout.BEST)
    torch.nn.init.zeros_(model.tok_emb.weight)
    renames, exchanges = [], []
    real_rename, real_exchange = Path.rename, atomic.exchange
    monkeypatch.setattr(Path, "rename", lambda self, target: renames.append(self.name) or real_rename(self, target))
    monkeypatch.setattr(atomic, "exchange", lambda a, b: exchanges.append(b.name) or real_exchange(a, b))
    local.save_best_model(root, model, tokenizer_json=None, config={}, metrics={"val_loss": 1.0})
    assert exchanges == [layout.BEST] and layout.BEST not in renames  # never moved aside
    assert torch.equal(load_file(root / layout.BEST / "model.safetensors")["tok_emb.weight"], model.tok_emb.weight)
    assert sorted(p.name for p in root.iterdir()) == [layout.BEST]


@pytest.mark.parametrize("new_complete", [True, False], ids=["new-version-complete", "new-version-torn"])
def test_a_best_model_moved_aside_by_a_killed_save_is_recovered(trained, tmp_path, new_complete):
    """Where the exchange is unavailable, a kill between the two renames leaves best_model parked as
    .old-*: the next start puts back the new version if it is complete, else the previous one."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    writer = f"{atomic.owner().rsplit('-', 1)[0]}-{dead_pid()}"
    previous, new = root / f".old-{layout.BEST}-{writer}", root / f".tmp-{layout.BEST}-{writer}"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, previous)
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, new)
    meta = json.loads((new / layout.META).read_text())
    meta["metrics"]["val_loss"] = 0.5  # tells the two apart
    (new / layout.META).write_text(json.dumps(meta))
    reseal(new)
    if not new_complete:
        (new / "model.safetensors").write_bytes(b"torn")
    durable.remove_stale(root)
    assert sorted(p.name for p in root.iterdir()) == [layout.BEST]
    assert verify(root / layout.BEST) is None
    kept = json.loads((root / layout.BEST / layout.META).read_text())["metrics"]["val_loss"]
    assert (kept == 0.5) == new_complete


@pytest.mark.slow
def test_a_kill_between_the_two_renames_loses_no_best_model(trained, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, root / layout.BEST)
    script = f"""
import os, signal
from pathlib import Path
from llm_trainer.checkpoint import local
from llm_trainer.checkpoint.model_folder import load_model_folder
from llm_trainer.files import atomic
atomic._renameat2 = None  # a system without the atomic exchange
real = Path.rename
def rename(self, target):
    result = real(self, target)
    if self.name == "best_model":
        os.kill(os.getpid(), signal.SIGKILL)  # between the two renames
    return result
Path.rename = rename
root = Path({str(root)!r})
local.save_best_model(root, load_model_folder(root / "best_model"), tokenizer_json=None, config={{}}, metrics={{"val_loss": 0.5}})
"""
    proc = subprocess.run([sys.executable, "-c", script], env=src_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (root / layout.BEST).exists() and list(root.glob(".old-best_model-*"))  # the window the exchange closes
    durable.remove_stale(root)  # what the next run does first
    assert verify(root / layout.BEST) is None
    assert json.loads((root / layout.BEST / layout.META).read_text())["metrics"]["val_loss"] == 0.5
    assert sorted(p.name for p in root.iterdir()) == [layout.BEST]


def test_init_from_a_model_with_another_vocabulary_is_refused(trained, tmp_path, capsys):
    saved = json.loads((trained / "run" / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    letters = sorted(k for k in vocab if len(k) == 1 and k.isalpha())
    vocab[letters[0]], vocab[letters[1]] = vocab[letters[1]], vocab[letters[0]]
    (tmp_path / "other.json").write_text(json.dumps(saved))
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'new'}",
        f"model.init_from={trained / 'run' / 'checkpoints' / layout.BEST}",
        f"data.tokenizer={tmp_path / 'other.json'}",
    )
    assert "was trained with another vocabulary: 2 of this run's" in error
    assert not (tmp_path / "new").exists()


def metrics_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resuming_an_older_checkpoint_leaves_one_clean_metrics_file(trained, tmp_path, capsys):
    run = run_copy(trained, tmp_path)
    before = metrics_rows(run)
    with open(run / "metrics.jsonl", "a") as handle:  # a kill in the middle of a row
        handle.write('{"kind": "train", "step": 7, "lo')
    assert train(trained, run, f"training.resume_from_checkpoint={checkpoint(run, 3)}") == 0
    rows = metrics_rows(run)  # every line parses: the torn one did not swallow the next row
    train_steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) == [s for s in range(1, MAX_STEPS + 1) if s % 2 == 0]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [3, 6]
    assert [r["kind"] for r in rows].count("summary") == 1 and rows[-1]["kind"] == "summary"
    kept = [r for r in before if r["step"] <= 3 and r["kind"] != "summary"]
    assert kept and rows[: len(kept)] == kept  # the rows up to the checkpoint, kept as they were
    assert "dropped" in capsys.readouterr().err


def test_latest_naming_a_missing_folder_is_announced(trained, tmp_path, capsys):
    run = run_copy(trained, tmp_path)
    (run / "checkpoints" / layout.LATEST).write_text("checkpoint-00000099")
    assert resolve_checkpoint("latest", run / "checkpoints") == checkpoint(run, MAX_STEPS)
    err = capsys.readouterr().err
    assert "names 'checkpoint-00000099', which is not a checkpoint folder here" in err
    assert f"using {checkpoint(run, MAX_STEPS)} instead of checkpoint-00000099" in err and "does not exist" in err


# -- 5. environment and input errors: one line, exit 2, nothing half-written ---------------------------


def test_an_output_folder_that_is_a_file(trained, tmp_path, capsys):
    (tmp_path / "out").write_text("not a folder")
    error = refused(capsys, "train", "--config", str(trained / "exp.yaml"), f"training.output_dir={tmp_path / 'out'}")
    assert "is a file" in error and (tmp_path / "out").read_text() == "not a folder"


def test_an_output_folder_we_cannot_write(trained, capsys):
    folder = Path("/sys/kernel")  # a folder even root cannot create files in
    if not folder.is_dir() or os.access(folder, os.W_OK) and os.getuid() != 0:
        pytest.skip("needs a folder this user cannot write")
    error = refused(capsys, "train", "--config", str(trained / "exp.yaml"), f"training.output_dir={folder}")
    assert f"cannot write into output folder {folder}" in error


def test_a_cache_folder_that_is_a_file_or_on_a_full_disk(trained, tmp_path, capsys, monkeypatch):
    (tmp_path / "cache").write_text("x")
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    assert "data.cache_dir" in error and "is a file" in error and not (tmp_path / "run").exists()

    from llm_trainer.data.prepare import shards

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shards.ShardWriter, "commit", full)
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache2'}",
    )
    assert "disk full while preparing data" in error and not (tmp_path / "run").exists()
    assert not any((tmp_path / "cache2").iterdir())  # the partial work is gone


def test_data_smaller_than_one_batch(trained, tmp_path, capsys):
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'run'}",
        "training.batch_size=512",
    )
    assert "not enough data for one batch" in error and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["generate", "--temperature", "nan"], "--temperature must be a finite number"),
        (["generate", "--top_p", "2"], "--top_p must be in (0, 1]"),
        (["generate", "--max_new_tokens", "-1"], "--max_new_tokens must be >= 0"),
    ],
    ids=["eval-batch-0", "temperature-nan", "top-p-2", "negative-tokens"],
)
def test_bad_flags(trained, capsys, argv, message):
    best = str(trained / "run" / "checkpoints" / layout.BEST)
    assert message in refused(capsys, argv[0], "--checkpoint", best, *argv[1:])


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"d_model": "wide", "n_heads": 2}', "d_model must be an integer"),
    ],
    ids=["not-json", "a-list", "wrong-type"],
)
def test_a_broken_model_config(trained, tmp_path, capsys, content, message):
    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    (folder / layout.META).unlink()  # a bare model folder: nothing but the file itself to go by
    (folder / "model_config.json").write_text(content)
    assert message in refused(capsys, "generate", "--checkpoint", str(folder))


def test_a_tokenizer_larger_than_the_models_vocabulary(trained, tmp_path, capsys):
    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    (folder / layout.META).unlink()
    saved = json.loads((folder / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    for i in range(100):
        vocab[f"extra{i}"] = len(vocab)
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    assert "the folder holds another model's tokenizer" in refused(capsys, "generate", "--checkpoint", str(folder))


def _backtracking_split(saved: dict) -> None:
    saved["pre_tokenizer"]["pattern"] = {"Regex": "(a+)+b|(?m)."}  # 2**n steps on n a's not followed by b


def _strip_decoder(saved: dict) -> None:
    saved["decoder"] = {"type": "Strip", "content": " ", "start": 10**6, "stop": 10**6}  # panics on any decode


def _precompiled_normalizer(saved: dict) -> None:
    saved["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AQAAAA=="}  # panics on any encode


@pytest.mark.parametrize(
    "craft, fragment",
    [
        (_backtracking_split, "splits text with the regex '(a+)+b|(?m).', not one llm-trainer writes"),
        (_strip_decoder, "made the tokenizers library fail"),
        (_precompiled_normalizer, "made the tokenizers library fail"),
    ],
)
def test_a_crafted_tokenizer_json_is_refused_as_it_is_read(trained, tmp_path, capsys, craft, fragment):
    """A few hundred bytes of tokenizer.json cannot cost seconds per character nor panic mid-run."""
    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    saved = json.loads((folder / "tokenizer.json").read_text())
    craft(saved)
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    reseal(folder)
    started = time.perf_counter()
    error = refused(capsys, "generate", "--checkpoint", str(folder), "--prompt", "a" * 40, "--max-new-tokens", "2")
    assert fragment in error and str(folder / "tokenizer.json") in error
    assert time.perf_counter() - started < 30


def test_a_resume_from_a_checkpoint_with_a_crafted_tokenizer_json_is_refused(trained, tmp_path, capsys):
    run = run_copy(trained, tmp_path)
    newest = checkpoint(run, MAX_STEPS)
    saved = json.loads((newest / "tokenizer.json").read_text())
    _backtracking_split(saved)
    (newest / "tokenizer.json").write_text(json.dumps(saved))
    reseal(newest)
    before = snapshot(run)
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={run}",
        "training.max_steps=8",
        "training.resume_from_checkpoint=latest",
    )
    assert f"{newest / 'tokenizer.json'} splits text with the regex" in error and snapshot(run) == before


def test_init_from_a_folder_with_a_pickled_pytorch_model_bin(trained, tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_positions": 24, "n_embd": 16, "n_layer": 1, "n_head": 2})
    )
    marker = tmp_path / "pwned"
    torch.save({"transformer.wte.weight": Payload(marker)}, folder / "pytorch_model.bin")
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'run'}",
        f"model.init_from={folder}",
    )
    assert "has no safetensors weights (it has pytorch_model.bin, a pickle" in error
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("sequence", [1]),
        ("kind", {"a": 1}),
        ("config", []),
        ("format_version", "3"),
        ("files", "all"),
        ("files.model.safetensors.size", "big"),
    ],
    ids=lambda v: str(v),
)
def test_a_meta_json_with_wrong_types_is_damage_like_any_other(trained, tmp_path, capsys, field, value):
    run = run_copy(trained, tmp_path)
    newest = checkpoint(run, MAX_STEPS)
    meta = json.loads((newest / layout.META).read_text())
    if field.startswith("files."):
        meta["files"]["model.safetensors"]["size"] = value
    else:
        meta[field] = value
    meta["meta_sha256"] = checksums.meta_checksum(meta)
    (newest / layout.META).write_text(json.dumps(meta))
    assert resolve_checkpoint("latest", run / "checkpoints") == checkpoint(run, 3)
    assert "meta.json is corrupt" in capsys.readouterr().err
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={run}",
        "training.max_steps=8",
        f"training.resume_from_checkpoint={newest}",
    )
    assert "meta.json is corrupt" in error


@pytest.mark.parametrize(
    "part, value, fragment",
    [
        ("step", "six", "train_state.json is corrupt"),
        ("spike_history", {"loss": ["high"]}, "train_state.json is corrupt (spike_history"),
        ("data.skip", [[9, 3]], "malformed data position"),
        ("data.skip", "all", "malformed data position"),
        ("data.seed", "seven", "malformed data position (seed 'seven'"),
        ("data.seed", -1, "malformed data position (seed -1"),
        ("data.epoch", 1.5, "malformed data position (epoch 1.5"),
        ("data.epoch", -2, "malformed data position (epoch -2"),
        ("epoch", -1, "train_state.json is corrupt (epoch)"),
    ],
)
def test_a_train_state_with_wrong_types(trained, tmp_path, capsys, part, value, fragment):
    def edit(state: dict) -> None:
        (state["data"] if part.startswith("data.") else state)[part.removeprefix("data.")] = value

    assert fragment in resume_refused_after(trained, tmp_path, capsys, edit)


@pytest.mark.parametrize("position", ["three", -1, None])
def test_an_old_format_data_position_with_wrong_types(trained, tmp_path, capsys, position):
    """A position saved as this rank's batches ("position", "world_size"; before "epoch_samples")."""

    def edit(state: dict) -> None:
        data = state["data"]
        del data["epoch_samples"], data["global_batch"]
        data.update({"world_size": 1, **({} if position is None else {"position": position})})

    error = resume_refused_after(trained, tmp_path, capsys, edit)
    assert "malformed data position" in error and ("position" in error if position is not None else True)


@pytest.mark.parametrize(
    "skip, fragment",
    [
        ([[0, 10**18]], "batches ahead of its position"),  # a resume would pass over them one by one: for ever
        ([[2 * i, 2 * i + 1] for i in range(20_000)], "20,000 skipped ranges"),
    ],
)
def test_a_skip_range_no_rewind_makes_is_refused_at_once(trained, tmp_path, capsys, skip, fragment):
    def edit(state: dict) -> None:
        state["data"]["skip"] = skip

    started = time.perf_counter()
    error = resume_refused_after(trained, tmp_path, capsys, edit)
    assert fragment in error and "over the limit" in error and "resume from another checkpoint" in error
    assert time.perf_counter() - started < 30


def resume_refused_after(trained: Path, tmp_path: Path, capsys, edit) -> str:
    """The error of a resume from the newest checkpoint once `edit` changed its train_state.json (meta
    re-sealed); the run folder is left byte-identical."""
    run = run_copy(trained, tmp_path)
    newest = checkpoint(run, MAX_STEPS)
    state = json.loads((newest / "train_state.json").read_text())
    edit(state)
    (newest / "train_state.json").write_text(json.dumps(state))
    reseal(newest)
    before = snapshot(run)
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={run}",
        "training.max_steps=8",
        "training.resume_from_checkpoint=latest",
    )
    assert snapshot(run) == before
    return error


@pytest.mark.parametrize("value", ["inf", ".inf", "-.inf", ".nan"])
def test_a_non_finite_learning_rate(trained, tmp_path, capsys, value):
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'run'}",
        f"training.learning_rate={value}",
    )
    assert "training.learning_rate" in error or "TrainingConfig.learning_rate" in error
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_deepspeed_refusing_fp16_on_cpu(trained, tmp_path):
    pytest.importorskip("deepspeed")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_trainer",
            "train",
            "--config",
            str(trained / "exp.yaml"),
            f"training.output_dir={tmp_path / 'run'}",
            "training.distributed_strategy=deepspeed",
            "training.use_amp=true",
            "training.amp_dtype=float16",
        ],
        env=src_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    error = the_error(result.stderr)
    assert "DeepSpeed refused this configuration on cpu" in error and "fp16" in error


def test_generate_past_the_context_slides_the_window(trained, capsys):
    from llm_trainer.checkpoint.model_folder import load_model_folder
    from llm_trainer.generate import generate

    model = load_model_folder(trained / "run" / "checkpoints" / layout.BEST)
    context = model.config.max_seq_len
    prompt = [int(i) % 10 + 2 for i in range(context + 5)]  # longer than the context
    for kwargs in (dict(temperature=0.0), dict(temperature=1.0, top_k=5, seed=3)):
        cached = generate(model, prompt, max_new_tokens=8, use_cache=True, **kwargs)
        assert len(cached) == 8 and cached == generate(model, prompt, max_new_tokens=8, use_cache=False, **kwargs)
    short = [3, 4, 5]  # the cache serves until the window first moves, then each token sees its own window
    cached = generate(model, short, max_new_tokens=context, temperature=1.0, seed=1)
    assert len(cached) == context and cached == generate(
        model, short, max_new_tokens=context, temperature=1.0, seed=1, use_cache=False
    )
    err = capsys.readouterr().err
    assert f"the prompt has {context + 5} tokens, more than the model's context ({context})" in err
    assert "the context window slides" in err


# -- 6. beyond the list: other entry points a crafted folder reaches ---------------------------


def test_a_pickled_npy_in_the_prepared_data_eval_is_pointed_at(trained, tmp_path, capsys):
    """eval's default data is a prepared cache the checkpoint names; numpy refuses its object arrays."""
    import numpy as np

    run = run_copy(trained, tmp_path)
    folder = checkpoint(run, MAX_STEPS)
    meta = json.loads((folder / layout.META).read_text())
    fingerprint = meta["config"]["data_fingerprint"]
    shutil.copytree(trained / "cache" / fingerprint, tmp_path / "cache" / fingerprint)
    marker = tmp_path / "pwned"
    np.save(
        tmp_path / "cache" / fingerprint / "val.idx.npy", np.array([Payload(marker)], dtype=object), allow_pickle=True
    )
    meta["config"]["data"].update(cache_dir=str(tmp_path / "cache"), pack_sequences=False)  # rows by document offsets
    (folder / layout.META).write_text(json.dumps(meta))
    reseal(folder)
    error = refused(capsys, "eval", "--checkpoint", str(folder))
    assert "is unreadable" in error and "allow_pickle" in error and not marker.exists()


def test_a_model_config_is_only_an_architecture_and_must_match_the_weights(trained, tmp_path, capsys):
    from llm_trainer.checkpoint.model_folder import read_model_config

    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    (folder / layout.META).unlink()
    config = json.loads((folder / "model_config.json").read_text())
    (folder / "model_config.json").write_text(json.dumps({**config, "init_from": str(tmp_path / "elsewhere")}))
    assert read_model_config(folder).init_from is None
    # A config far larger than its weights (yet within this machine's memory) is refused from the file's
    # header, before any allocation.
    (folder / "model_config.json").write_text(json.dumps({**config, "d_model": 1 << 10, "n_layers": 8}))
    error = refused(capsys, "generate", "--checkpoint", str(folder))
    assert "does not fit this model" in error and "model has (" in error


def test_metrics_and_run_folders_of_any_shape_are_read_without_tracebacks(trained, tmp_path):
    from llm_trainer.tools.registry import collect_run_info
    from llm_trainer.train.plots import read_run

    run = run_copy(trained, tmp_path)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"kind": "train", "step": "seven", "loss": 1}\n[1, 2]\n{"kind": "eval", "step": null}\n')
    series = read_run(run)
    assert sorted(series.train) == [2, 4, 6] and sorted(series.eval) == [3, 6]
    (run / "config.yaml").write_text("- a list\n- not a mapping\n")
    meta = json.loads((checkpoint(run, MAX_STEPS) / layout.META).read_text())
    meta["config"] = [["model", 1]]
    (checkpoint(run, MAX_STEPS) / layout.META).write_text(json.dumps(meta))
    info = collect_run_info(run)
    assert info["model_path"] == str((run / "checkpoints" / layout.BEST).resolve()) and info["data_fingerprint"] is None


# -- 7. torch's own unpickler on the bytes checked, and one rule for every path ----------------------------
# The three ways a crafted DeepSpeed checkpoint ran code past a static opcode scanner (a file that is
# two formats at once, an opcode sequence a model of the pickle machine misreads, a file swapped
# between its check and its read), a BUILD on an allowed class through DCP metadata, and files that
# lead out of the folder or that meta.json does not list. Each end-to-end case goes through the
# command line, as a user's resume would.


def polyglot(payload: bytes, archive: bytes) -> bytes:
    """A legacy pickle at byte 0 (torch.load unpickles a file from there when it does not start as a
    zip) followed by the records of a torch zip archive, its offsets counted from the file's start (a
    reader that finds the zip from its end reads that)."""
    buffer = io.BytesIO(payload)
    with zipfile.ZipFile(io.BytesIO(archive)) as original, zipfile.ZipFile(buffer, "a") as crafted:
        for info in original.infolist():
            crafted.writestr(info.filename, original.read(info))
    return buffer.getvalue()


def desynced_pickle(marker: Path) -> bytes:
    """A pickle that calls io.open(marker, "w") while a model of the pickle machine built from
    pickletools' declared stack effects sees only collections.OrderedDict: POP right after MARK pops
    the mark in the real machine but an object in the model, so the memo then holds other strings."""

    def text(value: str) -> bytes:
        data = value.encode()
        return b"X" + len(data).to_bytes(4, "little") + data

    first = b"\x80\x04" + text("collections") + text("io") + b"(0q\x00"  # the model's memo 0: "collections"
    second = text("OrderedDict") + text("open") + b"(0q\x01"  # the model's memo 1: "OrderedDict"
    call = b"h\x00h\x01\x93" + text(str(marker)) + text("w") + b"\x86R."  # the real machine: io.open(marker, "w")
    return first + second + call


def test_the_crafted_pickles_are_live_and_torch_refuses_them(tmp_path):
    archive = torch_saved({"module": OrderedDict(w=torch.zeros(2))})
    for name, crafted in (
        ("polyglot", polyglot(pickle.dumps(Payload(tmp_path / "polyglot"), protocol=2), archive)),
        ("desynced", desynced_pickle(tmp_path / "desynced")),
    ):
        try:
            pickle.loads(crafted)  # an unrestricted unpickler runs it
        except Exception:
            pass
        assert (tmp_path / name).exists(), name
        (tmp_path / name).unlink()
        with pytest.raises(CheckpointError, match=REFUSED):
            safe_pickle.load_pickle(crafted, name)
        assert not (tmp_path / name).exists(), name


def test_a_file_changed_after_verification_is_refused_on_the_bytes_read(trained, tmp_path):
    from llm_trainer.files.folder_files import FolderFiles

    run = run_copy(trained, tmp_path)
    folder = checkpoint(run, MAX_STEPS)
    files = FolderFiles.of(folder)  # meta.json read once, as a load does
    data = bytearray((folder / layout.RNG).read_bytes())
    data[-40] ^= 0xFF  # same size, other bytes: swapped after verify() passed
    (folder / layout.RNG).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rng.pt does not match its checksum"):
        files.read(layout.RNG)
    with pytest.raises(CheckpointError, match="rng.pt does not match its checksum"):
        local.load_checkpoint(folder, verify_files=False)


def test_a_dcp_metadata_build_on_a_class_is_refused_and_changes_nothing(trained, tmp_path, capsys):
    """BUILD with slot state on an allowed class would set the attribute on the class for the whole
    process (here: PosixPath.is_symlink becoming OrderedDict, whose empty result reads as false)."""
    import pathlib

    original = pathlib.PosixPath.is_symlink
    name = b"is_symlink"
    crafted = (
        b"\x80\x02cpathlib\nPosixPath\nN}X"
        + len(name).to_bytes(4, "little")
        + name
        + b"ccollections\nOrderedDict\ns\x86b."
    )
    folder = crafted_sharded_folder(trained, tmp_path, crafted, with_meta=True)
    try:
        error = refused(capsys, "consolidate", "--checkpoint", str(folder), "--output", str(tmp_path / "out"))
        assert pathlib.PosixPath.is_symlink is original
        assert f"{REFUSED} (pathlib.PosixPath)" in error
    finally:
        pathlib.PosixPath.is_symlink = original
    assert not (tmp_path / "out").exists()


def test_files_in_sharded_that_meta_json_does_not_list_are_never_read(trained, tmp_path):
    from llm_trainer.files.folder_files import FolderFiles
    from llm_trainer.parallel.deepspeed_engine import FolderLoads

    run = run_copy(trained, tmp_path)
    folder = checkpoint(run, MAX_STEPS)
    (folder / layout.SHARDED_DIR).mkdir()
    outside = tmp_path / "outside.pt"
    outside.write_bytes(torch_saved({"module": OrderedDict(w=torch.zeros(2))}))
    planted = folder / layout.SHARDED_DIR / "mp_rank_01_model_states.pt"
    planted.symlink_to(outside)
    assert verify(folder) is None  # meta.json does not list it: verification never looks at it
    loads = FolderLoads(None, FolderFiles.of(folder))
    with pytest.raises(CheckpointError, match="mp_rank_01_model_states.pt is not listed in meta.json"):
        loads.load(str(planted))
    with pytest.raises(CheckpointError, match="is not in"):
        loads.load(str(outside))


@pytest.mark.parametrize("with_meta", [True, False], ids=["resealed-meta", "no-meta"])
def test_init_from_a_model_folder_whose_weights_lead_outside_is_refused(trained, tmp_path, capsys, with_meta):
    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(folder / "model.safetensors", outside)
    (folder / "model.safetensors").symlink_to(outside)
    if with_meta:
        reseal(folder)
    else:
        (folder / layout.META).unlink()
    error = refused(
        capsys,
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={tmp_path / 'run'}",
        f"model.init_from={folder}",
    )
    assert "model.safetensors is a symlink that leads out of the folder" in error
    assert not (tmp_path / "run").exists()


def test_a_file_meta_json_does_not_list_is_refused(trained, tmp_path, capsys):
    folder = tmp_path / "best"
    shutil.copytree(trained / "run" / "checkpoints" / layout.BEST, folder)
    meta = json.loads((folder / layout.META).read_text())
    del meta["files"]["tokenizer.json"]
    meta["meta_sha256"] = checksums.meta_checksum(meta)
    (folder / layout.META).write_text(json.dumps(meta))
    error = refused(capsys, "generate", "--checkpoint", str(folder), "--prompt", "the")
    assert "tokenizer.json is not listed in meta.json" in error


def deepspeed_train(trained: Path, run: Path, *overrides: str, script: str = "") -> subprocess.CompletedProcess:
    """`train` with the DeepSpeed strategy in a process of its own (one rank, CPU; started warm:
    `warm_launch`); `script` runs first."""
    argv = [
        "train",
        "--config",
        str(trained / "exp.yaml"),
        f"training.output_dir={run}",
        "training.distributed_strategy=deepspeed",
        *overrides,
    ]
    code = f"import os, sys\nos.environ.setdefault('DS_ACCELERATOR', 'cpu')\n{script}\n"
    code += f"from llm_trainer.cli import main\nsys.exit(main({argv!r}))\n"
    runner = run.with_name(f"{run.name}-train.py")
    runner.write_text(code)
    return python(Path.cwd(), [], src_env(), script=runner, timeout=600)


@pytest.fixture(scope="module")
def deepspeed_run(trained, tmp_path_factory) -> Path:
    """A finished DeepSpeed run (ZeRO-2, one process on CPU): checkpoints at steps 3 and 6."""
    pytest.importorskip("deepspeed")
    run = tmp_path_factory.mktemp("deepspeed") / "run"
    result = deepspeed_train(trained, run)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def resume_refused(trained: Path, run: Path, script: str = "") -> str:
    result = deepspeed_train(
        trained, run, "training.max_steps=8", "training.resume_from_checkpoint=latest", script=script
    )
    assert result.returncode == 2, result.stderr[-3000:]
    return the_error(result.stderr)


@pytest.mark.slow
def test_a_real_deepspeed_checkpoint_loads_through_torch_and_resumes(trained, deepspeed_run, tmp_path, monkeypatch):
    """The allow-list admits what DeepSpeed writes, and a resume goes on from it."""
    import_deepspeed(monkeypatch)
    for file in (checkpoint(deepspeed_run, 3) / layout.SHARDED_DIR).glob("*.pt"):
        safe_pickle.load_pickle(file.read_bytes(), str(file), safe_pickle.DEEPSPEED)
    run = tmp_path / "run"
    shutil.copytree(deepspeed_run, run)
    result = deepspeed_train(trained, run, "training.max_steps=8", "training.resume_from_checkpoint=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "continuing from" in result.stderr


MODEL_STATES = f"{layout.SHARDED_DIR}/mp_rank_00_model_states.pt"


@pytest.mark.slow
def test_deepspeed_resume_refuses_a_file_that_is_zip_and_legacy_pickle_at_once(trained, deepspeed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(deepspeed_run, run)
    folder, marker = checkpoint(run, MAX_STEPS), tmp_path / "pwned"
    target = folder / MODEL_STATES
    target.write_bytes(polyglot(pickle.dumps(Payload(marker), protocol=2), target.read_bytes()))
    reseal(folder)
    before = snapshot(run)
    error = resume_refused(trained, run)
    assert f"{target}: it {REFUSED} ({OPEN})" in error
    assert not marker.exists() and snapshot(run) == before


@pytest.mark.slow
def test_deepspeed_resume_refuses_an_opcode_sequence_a_static_model_misreads(trained, deepspeed_run, tmp_path):

    run = tmp_path / "run"
    shutil.copytree(deepspeed_run, run)
    folder, marker = checkpoint(run, MAX_STEPS), tmp_path / "pwned"
    target = folder / MODEL_STATES
    with zipfile.ZipFile(io.BytesIO(target.read_bytes())) as original:
        records = {info.filename: original.read(info) for info in original.infolist()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as crafted:
        for name, data in records.items():  # the same archive, its data.pkl replaced
            crafted.writestr(name, desynced_pickle(marker) if name.endswith("/data.pkl") else data)
    target.write_bytes(buffer.getvalue())
    reseal(folder)
    error = resume_refused(trained, run)
    assert f"{target}: it {REFUSED}" in error and not marker.exists()


@pytest.mark.slow
def test_deepspeed_resume_refuses_a_file_swapped_after_it_was_checked(trained, deepspeed_run, tmp_path):
    """Replaced when DeepSpeed starts loading (after meta.json's checksums and any check of the folder
    passed): the bytes DeepSpeed is given are the bytes checked, so the swap is caught."""
    run = tmp_path / "run"
    shutil.copytree(deepspeed_run, run)
    target, marker = checkpoint(run, MAX_STEPS) / MODEL_STATES, tmp_path / "pwned"
    script = f"""
import torch
import deepspeed.runtime.engine as engine

class Payload:
    def __reduce__(self):
        return (open, ({str(marker)!r}, "w"))

real = engine.DeepSpeedEngine.load_checkpoint
def load_checkpoint(self, *args, **kwargs):
    torch.save({{"module": {{}}, "payload": Payload()}}, {str(target)!r})
    return real(self, *args, **kwargs)
engine.DeepSpeedEngine.load_checkpoint = load_checkpoint
"""
    error = resume_refused(trained, run, script=script)
    assert "mp_rank_00_model_states.pt" in error and "(it changed since it was written)" in error
    assert not marker.exists()


def train_losses(run: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics_rows(run) if row["kind"] == "train"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, precision",
    [
        (stage, precision)
        for stage in (0, 1, 2, 3)
        for precision in ("fp32", "bf16")
        if (stage, precision) != (2, "fp32")
    ],
)
def test_deepspeed_resumes_through_torchs_unpickler_at_every_zero_stage(trained, tmp_path, stage, precision):
    """Every file DeepSpeed writes at ZeRO 0-3, fp32 and bf16, loads through FolderLoads: a resume
    from step 3 trains steps 4-6 as the run that never stopped. ZeRO-2 in fp32 writes what ZeRO-1 in
    fp32 writes (one optimizer class, DeepSpeedZeroOptimizer, for both; in bf16 ZeRO-1 has its own),
    and test_distributed resumes such a ZeRO-2 run exactly, through the same loads."""
    pytest.importorskip("deepspeed")
    overrides = (
        f"training.deepspeed_config={json.dumps({'zero_optimization': {'stage': stage}})}",
        *(
            ("training.use_amp=false",)
            if precision == "fp32"
            else ("training.use_amp=true", "training.amp_dtype=bfloat16")
        ),
    )
    full = deepspeed_train(trained, tmp_path / "full", *overrides)
    assert full.returncode == 0, full.stderr[-3000:]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint(tmp_path / "full", 3), checkpoint(tmp_path / "resumed", 3))
    resumed = deepspeed_train(trained, tmp_path / "resumed", *overrides, "training.resume_from_checkpoint=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing from" in resumed.stderr
    expected = {step: loss for step, loss in train_losses(tmp_path / "full").items() if step > 3}
    assert expected and train_losses(tmp_path / "resumed") == pytest.approx(expected, rel=1e-5)
