"""What a bucket may hold and what our writes to it keep: names taken literally, records checked before
use, a history never uploaded over unseen, a best model in the store at every moment, and local copies
reused only when they are the store's. In process, against the local S3 server of
test_object_storage.py (moto's server in its own process on 127.0.0.1), through s3fs."""

import json
import os
import subprocess
import sys
import time

import pytest

import test_object_storage as base
from conftest import cli_in_process, free_port, src_env, tiny_model

s3_server, s3 = base.s3_server, base.s3  # the server and bucket fixtures, shared


def _put(fs, files: dict) -> None:
    for key, data in files.items():
        fs.pipe_file(key, data if isinstance(data, bytes) else data.encode())
    fs.invalidate_cache()


def _keys(fs, bucket: str) -> set[str]:
    fs.invalidate_cache()
    return {key[len(bucket) + 1 :] for key in fs.find(bucket)}


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> str:
    text = str(exc.value)
    assert "\n" not in text and len(text) < 400, text
    for word in words:
        assert word in text, text
    return text


# ----------------------------------------------------------------------------------------------
# names with [, *, ? are names: deleting `runs/exp[1]` never touches `runs/exp1`


def test_glob_characters_in_a_url_delete_only_that_folder(s3, tmp_path):
    from llm_trainer.checkpoint import remote
    from llm_trainer.config import TrainingConfig
    from llm_trainer.files import buckets
    from llm_trainer.train.output_folder import clear_run_files

    fs, bucket = s3
    other = {
        f"{bucket}/runs/exp1/metrics.jsonl": "theirs",
        f"{bucket}/runs/exp1/checkpoints/latest": "checkpoint-00000004",
        f"{bucket}/runs/exp1/checkpoints/checkpoint-00000004/meta.json": "{}",
        f"{bucket}/runs/exp1/checkpoints/best_model/meta.json": "{}",
        f"{bucket}/runs/exp[1]x/metrics.jsonl": "a sibling whose name starts the same",
    }
    mine = {
        f"{bucket}/runs/exp[1]/metrics.jsonl": "mine",
        f"{bucket}/runs/exp[1]/files.json": "{}",
        f"{bucket}/runs/exp[1]/checkpoints/latest": "checkpoint-00000002",
        f"{bucket}/runs/exp[1]/checkpoints/checkpoint-00000002/meta.json": "{}",
        f"{bucket}/runs/exp[1]/checkpoints/checkpoint-00000001/meta.json": "{}",
        f"{bucket}/runs/exp[1]/checkpoints/best_model/meta.json": "{}",
    }
    _put(fs, {**other, **mine})
    url = f"s3://{bucket}/runs/exp[1]"
    # Rotation in the store: checkpoint-1 goes, and only it.
    remote._rotate(f"{url}/checkpoints", tmp_path / "none", 1, set())
    assert "runs/exp[1]/checkpoints/checkpoint-00000001/meta.json" not in _keys(fs, bucket)
    assert {k[len(bucket) + 1 :] for k in other} <= _keys(fs, bucket)
    # The best model's replacement and `--overwrite`.
    buckets.remove(f"s3://{bucket}/runs/ex?1/metrics.jsonl")  # matches nothing by name: nothing goes
    buckets.remove(f"s3://{bucket}/runs/*")
    clear_run_files(TrainingConfig(output_dir=url, staging_dir=str(tmp_path / "stage")))
    left = _keys(fs, bucket)
    assert left == {k[len(bucket) + 1 :] for k in other}, left
    assert buckets.files_under(f"s3://{bucket}/runs/exp[1]x") == ["metrics.jsonl"]


def test_sharded_writes_into_a_url_with_brackets_rename_and_delete_by_name(s3):
    import torch

    from llm_trainer.checkpoint.sharded import save_sharded_to_store

    fs, bucket = s3
    theirs = {f"{bucket}/exp1/sharded/.metadata": "theirs", f"{bucket}/exp1/sharded/.metadata.tmp": "theirs too"}
    _put(fs, theirs)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # the second save replaces the first's .metadata
        written = save_sharded_to_store(
            model, optimizer, f"s3://{bucket}/exp[1]/sharded"
        )()  # the write, then its records
    assert all(fs.cat_file(k) == v.encode() for k, v in theirs.items())
    assert _keys(fs, bucket) == {"exp1/sharded/.metadata", "exp1/sharded/.metadata.tmp"} | {
        f"exp[1]/{name}" for name in written
    }


@pytest.mark.slow
def test_train_overwrite_into_a_url_with_brackets_leaves_the_run_it_would_match(s3, tmp_path):
    fs, bucket = s3
    base._upload_corpus(fs, bucket, tmp_path)
    theirs = {
        f"{bucket}/runs/exp1/metrics.jsonl": "theirs",
        f"{bucket}/runs/exp1/files.json": "{}",
        f"{bucket}/runs/exp1/checkpoints/latest": "checkpoint-00000002",
        f"{bucket}/runs/exp1/checkpoints/checkpoint-00000002/meta.json": "{}",
        f"{bucket}/runs/exp1/checkpoints/best_model/meta.json": "{}",
    }
    _put(fs, theirs)
    url = f"s3://{bucket}/runs/exp[1]"
    config = base._experiment(
        tmp_path, bucket, output_dir=url, checkpoint_dir=None, staging_dir=str(tmp_path / "stage"), max_steps=4
    )
    args = ["train", "--config", str(config), "training.save_total_limit=1", "training.eval_steps=2"]
    for extra in ([], ["--overwrite"]):
        done = cli_in_process([*args, "training.save_steps=2", *extra], tmp_path)
        assert done.returncode == 0, done.stderr
    assert {k for k in _keys(fs, bucket) if k.startswith("runs/exp1/")} == {k[len(bucket) + 1 :] for k in theirs}
    assert all(fs.cat_file(k) == v.encode() for k, v in theirs.items())
    ours = {k for k in _keys(fs, bucket) if k.startswith("runs/exp[1]/checkpoints/checkpoint-")}
    assert {k.split("/")[3] for k in ours} == {"checkpoint-00000004"}  # rotated in the bracketed folder only


# ----------------------------------------------------------------------------------------------
# bad bucket contents: one line each


BAD_RECORDS = [
    ('{"a.bin": {"size": 1e999, "checksum": "x"}}', ["size inf", "damaged"]),
    ('{"a": {"size": 1, "checksum": "x"}, "a/b": {"size": 1, "checksum": "x"}}', ["both as a file and", "a"]),
    ('{"../up": {"size": 1, "checksum": "x"}}', ["outside its folder"]),
    ('{"a.bin": {"size": 1', ["not a file record"]),
    ('{"a.bin": {"size": ' + "9" * 5000 + ', "checksum": "x"}}', ["not a file record"]),
]


def test_a_damaged_files_record_is_one_line(s3, tmp_path):
    from llm_trainer.errors import UsageError
    from llm_trainer.files import buckets

    fs, bucket = s3
    for i, (record, words) in enumerate(BAD_RECORDS):
        _put(fs, {f"{bucket}/f{i}/files.json": record, f"{bucket}/f{i}/a.bin": "x"})
        with pytest.raises(UsageError) as exc:
            buckets.get_folder(f"s3://{bucket}/f{i}", tmp_path / "copy")
        _one_line(exc, *words)
        assert not (tmp_path / "copy").exists()


@pytest.mark.slow
def test_export_of_a_url_with_a_damaged_record_is_one_line_exit_2(s3, tmp_path):
    fs, bucket = s3
    record = '{"meta.json": {"size": 1e999, "checksum": "x"}}'
    _put(fs, {f"{bucket}/run/checkpoints/latest": "checkpoint-00000002"})
    _put(fs, {f"{bucket}/run/checkpoints/checkpoint-00000002/{n}": record for n in ("files.json", "meta.json")})
    args = ["export", "--checkpoint", f"s3://{bucket}/run", "--output", str(tmp_path / "hf")]
    done = base._cli(args, os.environ["AWS_ENDPOINT_URL"], tmp_path)
    base._one_line_exit_2(done, "files.json", "damaged")
    assert not (tmp_path / "hf").exists()


def test_a_planted_checkpoint_name_of_5000_digits_is_not_a_checkpoint(s3, tmp_path):
    from llm_trainer.checkpoint import remote
    from llm_trainer.errors import CheckpointError

    fs, bucket = s3
    planted = "checkpoint-" + "9" * 5000
    _put(fs, {f"{bucket}/c/{planted}": "x", f"{bucket}/c/checkpoint-00000002/meta.json": "{}"})
    assert remote.held_checkpoints(f"s3://{bucket}/c") == ["checkpoint-00000002"]
    remote._rotate(f"s3://{bucket}/c", tmp_path, 1, set())  # sorts by step: the planted one is not ours
    assert f"c/{planted}" in _keys(fs, bucket)
    _put(fs, {f"{bucket}/c/latest": planted})
    with pytest.raises(CheckpointError) as exc:
        remote.fetch_for_reading(f"s3://{bucket}/c", tmp_path / "cache")
    _one_line(exc, "not a checkpoint")


def test_data_file_keys_dot_and_dot_dot_are_refused(s3, tmp_path):
    from llm_trainer.data.text.sources import resolve_files
    from llm_trainer.errors import UsageError

    fs, bucket = s3
    for bad in ("..", "."):
        fs.rm(f"{bucket}/corpus", recursive=True) if fs.exists(f"{bucket}/corpus") else None
        _put(fs, {f"{bucket}/corpus/a.txt": "text", f"{bucket}/corpus/{bad}": "planted"})
        with pytest.raises(UsageError) as exc:
            resolve_files([f"s3://{bucket}/corpus/"], cache=tmp_path / "cache")
        _one_line(exc, "not a plain file name", bad)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("planted"))


def test_data_in_a_bucket_is_listed_as_a_local_folder_is(s3, tmp_path):
    """The rules of a local folder hold in a store: nothing below a hidden folder (a synced `.git/`) is
    read, and a folder whose name has glob characters is read by its name, not as a pattern."""
    from llm_trainer.data.text.sources import resolve_files

    fs, bucket = s3
    files = {"a.txt": "read", ".git/config": "[core]", "sub/.cache/b.txt": "cached", "sub/c.txt": "read too"}
    for root in ("corpus", "corpus[2024]"):
        _put(fs, {f"{bucket}/{root}/{name}": text for name, text in files.items()})
        local = tmp_path / root
        for name, text in files.items():
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_text(text)
        from_store = resolve_files([f"s3://{bucket}/{root}"], cache=tmp_path / "cache")
        from_disk = resolve_files([str(local)])
        assert [f.path.read_text() for f in from_store] == ["read", "read too"]
        assert [f.path.read_text() for f in from_disk] == ["read", "read too"]


def test_a_model_folder_whose_object_is_also_a_folder_is_one_line(s3, tmp_path):
    from llm_trainer.errors import UsageError
    from llm_trainer.files import buckets

    fs, bucket = s3
    _put(fs, {f"{bucket}/m[1]/config.json": "{}", f"{bucket}/m[1]/a": "x", f"{bucket}/m[1]/a/b": "y"})
    with pytest.raises(UsageError) as exc:
        buckets.fetch_tree(f"s3://{bucket}/m[1]", tmp_path / "models")
    _one_line(exc, "both an object and a folder", "m[1]/a")
    assert not any((tmp_path / "models").iterdir())


@pytest.mark.slow
def test_an_unreachable_gs_store_is_one_line_soon(tmp_path):
    pytest.importorskip("gcsfs")
    script = "from llm_trainer.cli import main; import sys; sys.exit(main(['export', '--checkpoint', 'gs://b/run', '--output', 'x']))"
    env = {**src_env(), "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    took = time.monotonic() - start
    *retries, last = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and last.startswith("error: ") and "cannot reach the store" in last, done.stderr[-2000:]
    assert "STORAGE_EMULATOR_HOST" in last
    assert len(retries) == 3 and all("trying again in" in line for line in retries), retries  # our tries, as for s3
    assert took < 30, took  # gcsfs alone tries a call for about 35 s; our connections end after 3.5 s of waits


@pytest.mark.slow
def test_an_unreachable_http_address_is_one_line_that_names_no_cloud_setting(tmp_path):
    """A data file named by an http(s) URL whose server does not answer: our tries, then one line that
    says to check the address (no S3 or GCS endpoint variable is involved)."""
    url = f"http://127.0.0.1:{free_port()}/corpus/input.txt"
    start = time.monotonic()
    done = cli_in_process(["prepare", "--config", "tiny", f"data.data_files=[{url}]"], tmp_path)
    took = time.monotonic() - start
    *retries, last = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and last.startswith("error: listing data files: cannot reach the store"), last
    assert last.endswith("check the address and the network, then run again") and "AWS" not in last, last
    assert len(retries) == 3 and all("trying again in" in line for line in retries), retries
    assert took < 30, took


class _SilentStore:
    """A server on 127.0.0.1 that takes every connection and reads every request, and never answers:
    a store that has hung. Counts the requests it was sent."""

    def __init__(self):
        import socket
        import threading

        self.requests = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            self._held.append(connection)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection) -> None:
        pending = b""
        try:
            while data := connection.recv(65536):
                pending += data
                while b"\r\n\r\n" in pending:  # a request's head; bodies here are a few bytes
                    _, pending = pending.split(b"\r\n\r\n", 1)
                    self.requests += 1
        except OSError:
            pass

    def close(self) -> None:
        self._server.close()
        for connection in self._held:
            connection.close()


def test_a_store_that_never_answers_is_said_at_once_and_one_line_after_botocore_s_tries(monkeypatch, tmp_path, capsys):
    """An upload to a store that takes the connection and falls silent (it used to wait forever for an
    answer to `Expect: 100-continue`): the first read timeout is said in a warning at once, and after
    botocore's attempts of the request, each ended by the read timeout, one line. Neither s3fs's 5
    tries of those attempts nor our own tries (meant for a store that cannot be reached) multiply the
    wait. The user's fsspec configuration (a short read timeout, the attempts) is kept."""
    import fsspec.config
    import s3fs

    from llm_trainer.errors import UsageError
    from llm_trainer.files import buckets

    store = _SilentStore()
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
    for name, value in base.FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    config = {"read_timeout": 0.5, "retries": {"total_max_attempts": 2, "mode": "standard"}}
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": config})
    s3fs.S3FileSystem.clear_instance_cache()
    (tmp_path / "a.txt").write_text("x")
    try:
        with pytest.raises(UsageError) as info:
            buckets.upload(tmp_path / "a.txt", "s3://hung/run/a.txt")
        _one_line(info, "uploading", "cannot reach the store", "AWS_ENDPOINT_URL")
        assert "took the connection and answered none of 2 tries" in str(info.value), str(info.value)
        assert store.requests == 2
        warned = [line for line in capsys.readouterr().err.splitlines() if "sent no answer" in line]
        assert len(warned) == 1 and warned[0].startswith(f"warning: the store at {store.endpoint} took"), warned
    finally:
        store.close()
        s3fs.S3FileSystem.clear_instance_cache()


# ----------------------------------------------------------------------------------------------
# a URL output_dir's history between machines


def _rows(steps) -> str:
    return "".join(json.dumps({"kind": "train", "step": s, "machine": m}) + "\n" for m, s in steps)


def _machine(tmp_path, name: str, url: str):
    from llm_trainer.config import TrainingConfig

    training = TrainingConfig(output_dir=url, staging_dir=str(tmp_path / name), resume_from_checkpoint="latest")
    training.local_output_dir.mkdir(parents=True, exist_ok=True)
    return training


def test_a_resume_on_a_machine_that_ran_before_takes_the_store_history(s3, tmp_path):
    from llm_trainer.train.output_folder import fetch_run_files, upload_run_files

    fs, bucket = s3
    url = f"s3://{bucket}/runs/x"
    b, a = _machine(tmp_path, "b", url), _machine(tmp_path, "a", url)
    b_rows = [("B", s) for s in range(1, 7)]
    (b.local_output_dir / "metrics.jsonl").write_text(_rows(b_rows))
    upload_run_files(b)  # B ran 1-6
    fetch_run_files(a)
    assert (a.local_output_dir / "metrics.jsonl").read_text() == _rows(b_rows)
    a_rows = b_rows + [("A", s) for s in range(7, 11)]
    (a.local_output_dir / "metrics.jsonl").write_text(_rows(a_rows))
    (a.local_output_dir / "config.yaml").write_text("max_steps: 10\n")
    upload_run_files(a)  # A ran 7-10
    (b.local_output_dir / "config.yaml").write_text("max_steps: 12\n")  # this run's own config
    fetch_run_files(b)  # B again, its staging copy holding 1-6 only
    assert (b.local_output_dir / "metrics.jsonl").read_text() == _rows(a_rows)
    assert (b.local_output_dir / "config.yaml").read_text() == "max_steps: 12\n"
    both = a_rows + [("B", 11), ("B", 12)]
    (b.local_output_dir / "metrics.jsonl").write_text(_rows(both))
    upload_run_files(b)
    assert fs.cat_file(f"{bucket}/runs/x/metrics.jsonl").decode() == _rows(both)
    fetch_run_files(b)  # this machine ran last: its copy (the store's and beyond) stays
    assert (b.local_output_dir / "metrics.jsonl").read_text() == _rows(both)


def test_a_history_that_cannot_be_verified_is_kept_aside_not_overwritten(s3, tmp_path, capsys):
    for damage in ("killed before files.json", "files.json truncated", "no files.json"):
        _damaged_history_is_kept_aside(*s3, tmp_path / damage.replace(" ", "-"), capsys, damage)


def _damaged_history_is_kept_aside(fs, bucket, tmp_path, capsys, damage):
    from llm_trainer.train.output_folder import fetch_run_files, upload_run_files

    url = f"s3://{bucket}/{tmp_path.name}"
    a, b = _machine(tmp_path, "a", url), _machine(tmp_path, "b", url)
    rows = [("A", s) for s in range(1, 9)]
    (a.local_output_dir / "metrics.jsonl").write_text(_rows(rows[:4]))
    upload_run_files(a)
    if damage == "killed before files.json":  # the new metrics.jsonl reached the store, its record did not
        fs.pipe_file(f"{bucket}/{tmp_path.name}/metrics.jsonl", _rows(rows).encode())
    elif damage == "files.json truncated":
        fs.pipe_file(f"{bucket}/{tmp_path.name}/metrics.jsonl", _rows(rows).encode())
        fs.pipe_file(f"{bucket}/{tmp_path.name}/files.json", fs.cat_file(f"{bucket}/{tmp_path.name}/files.json")[:20])
    else:
        fs.rm_file(f"{bucket}/{tmp_path.name}/files.json")
        fs.pipe_file(f"{bucket}/{tmp_path.name}/metrics.jsonl", _rows(rows).encode())
    fs.invalidate_cache()
    fetch_run_files(b)
    said = capsys.readouterr()
    assert "could not be verified" in said.out + said.err and "aside" in said.out + said.err
    (b.local_output_dir / "metrics.jsonl").write_text(_rows([("B", 9)]))
    upload_run_files(b)
    fs.invalidate_cache()
    kept = [k for k in fs.find(f"{bucket}/{tmp_path.name}") if "/unverified-" in k and k.endswith("metrics.jsonl")]
    assert len(kept) == 1 and fs.cat_file(kept[0]).decode() == _rows(rows)  # rows 1-8, whole


# ----------------------------------------------------------------------------------------------
# best_model in the store, and local copies of what a URL names


class _Crash(BaseException):
    """A process killed at this point: nothing after it runs."""


def _best_folder(root, seed: int):
    import torch

    from llm_trainer.checkpoint.local import save_best_model

    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(seed))
    return save_best_model(root, model, tokenizer_json=None, config={}, metrics={"seed": seed})


def _seed_of(folder) -> int:
    from llm_trainer.checkpoint.verify import verify_once

    assert verify_once(folder) is None
    return json.loads((folder / "meta.json").read_text())["metrics"]["seed"]


def test_best_model_in_the_store_survives_a_kill_at_any_point_of_its_replacement(s3, tmp_path, monkeypatch):
    from llm_trainer.checkpoint import remote
    from llm_trainer.files import buckets

    fs, bucket = s3
    checkpoints = f"s3://{bucket}/checkpoints"
    remote.upload_best(_best_folder(tmp_path / "old", 1), checkpoints)
    new = _best_folder(tmp_path / "new", 2)
    writes = {"left": 0}
    real = {name: getattr(buckets, name) for name in ("upload", "write_text", "remove")}

    def crashing(name):
        def write(*args):
            if writes["left"] == 0:
                raise _Crash
            writes["left"] -= 1
            return real[name](*args)

        return write

    for name in real:
        monkeypatch.setattr(buckets, name, crashing(name))
    seen = set()
    for k in range(100):
        writes["left"] = k
        try:
            remote.upload_best(new, checkpoints)
            break
        except _Crash:
            pass
        seen.add(_seed_of(remote.fetch_for_reading(f"{checkpoints}/best_model", tmp_path / f"cache{k}")))
        writes["left"] = 10**6
        remote.upload_best(_best_folder(tmp_path / f"again{k}", 1), checkpoints)  # the next save starts over
    assert seen == {1, 2} and k > 4
    assert _seed_of(remote.fetch_for_reading(f"{checkpoints}/best_model", tmp_path / "cache")) == 2
    assert not fs.exists(f"{bucket}/checkpoints/best_model.new/meta.json")


def _checkpoint_folder(root, seed: int):
    """A folder named like step 6's checkpoint (a model folder is enough for export and eval)."""
    folder = _best_folder(root, seed)
    return folder.rename(folder.with_name("checkpoint-00000006"))


def test_a_local_copy_of_a_url_is_reused_only_when_it_is_the_store_s(s3, tmp_path):
    from llm_trainer.checkpoint import remote

    fs, bucket = s3
    checkpoints = f"s3://{bucket}/run/checkpoints"
    remote.upload_checkpoint(_checkpoint_folder(tmp_path / "first", 1), checkpoints, None, set())
    cache = tmp_path / "cache"
    first = remote.fetch_for_reading(f"s3://{bucket}/run", cache)
    assert _seed_of(first) == 1
    stamp = os.stat(first / "meta.json").st_mtime_ns
    assert remote.fetch_for_reading(f"s3://{bucket}/run", cache) == first  # the same: not downloaded again
    assert os.stat(first / "meta.json").st_mtime_ns == stamp
    # Another run into the same URL (train --overwrite) saves a checkpoint of the same name.
    remote.remove_checkpoints(checkpoints)
    remote.upload_checkpoint(_checkpoint_folder(tmp_path / "second", 2), checkpoints, None, set())
    assert _seed_of(remote.fetch_for_reading(f"s3://{bucket}/run", cache)) == 2
    assert _seed_of(remote.fetch_for_reading(f"{checkpoints}/checkpoint-00000006", cache)) == 2
    # A resume's local copy of the same name is replaced too.
    local = tmp_path / "machine" / "checkpoint-00000006"
    _checkpoint_folder(tmp_path / "machine", 1)
    remote.fetch_latest(checkpoints, local.parent)
    assert _seed_of(local) == 2
