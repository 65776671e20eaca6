"""Data and checkpoints in object storage, against a real S3 endpoint: moto's server in its own process
on 127.0.0.1, reached through s3fs. Nothing leaves the machine: the endpoint, fake credentials and
AWS_EC2_METADATA_DISABLED are pinned for the tests and for every child process they start."""

import gzip
import json
import lzma
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pytest
import yaml

from conftest import cli_in_process, free_port, kill9_when, src_env, write_corpus

pytestmark = pytest.mark.slow

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _start_server(extra_env: dict | None = None):
    """A moto S3 server process on a free local port, or a skip saying why it could not start."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"the S3 tests need moto[server] and s3fs (pip install -e '.[dev]'): {exc}")
    port = free_port()
    env = {**os.environ, **FAKE_CREDENTIALS, **(extra_env or {})}
    log = tempfile.TemporaryFile()  # its request log: a pipe nobody reads would fill and stall it
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    proc.log = log
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                pytest.skip(f"the local S3 server did not start: {log.read().decode(errors='replace')[-300:]}")
            time.sleep(0.2)


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()


@pytest.fixture(scope="session")
def s3_server():
    saved = {k: os.environ.get(k) for k in [*FAKE_CREDENTIALS, "AWS_ENDPOINT_URL"]}
    proc, endpoint = _start_server()
    os.environ.update({**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    try:
        yield endpoint
    finally:
        _stop(proc)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3(s3_server, request):
    """An s3fs filesystem on the local server and a fresh bucket named after the test."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    bucket = "t-" + request.node.name.lower().replace("_", "-")[:50].strip("-")
    fs.mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    return fs, bucket


def _env(endpoint: str) -> dict:
    return {**src_env(), **FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "OMP_NUM_THREADS": "1"}


def _cli(args, endpoint: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llm_trainer", *args],
        env=_env(endpoint),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _experiment(root, bucket: str, **training) -> "os.PathLike":
    """A one-layer char model; its corpus, prepared data and checkpoints in `bucket`."""
    values = {
        "batch_size": 4,
        "max_steps": 6,
        "learning_rate": 3e-3,
        "eval_steps": 3,
        "save_steps": 3,
        "logging_steps": 2,
        "output_dir": str(root / "run"),
        "checkpoint_dir": f"s3://{bucket}/checkpoints",
        "device": "cpu",
        "progress_bar": False,
        "report_to": ["jsonl"],
    }
    values.update(training)
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 24},
        "training": values,
        "data": {
            "data_files": [f"s3://{bucket}/corpus/"],
            "tokenizer": "char",
            "validation_split": 0.2,
            "cache_dir": f"s3://{bucket}/prepared",
            "stream_cache_dir": str(root / "stream"),
        },
    }
    path = root / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _upload_corpus(fs, bucket: str, tmp_path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    for file in sorted(corpus.iterdir()):
        fs.put_file(str(file), f"{bucket}/corpus/{file.name}")


def test_prepare_from_a_bucket_into_a_bucket(s3, tmp_path):
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    config = _experiment(tmp_path, bucket)
    done = cli_in_process(["prepare", "--config", str(config)], tmp_path)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    (folder,) = fs.ls(f"{bucket}/prepared")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(folder)}
    assert {"manifest.json", "files.json", "train.bin", "val.bin", "tokenizer.json"} <= names
    manifest = json.loads(fs.cat_file(f"{folder}/manifest.json"))
    assert manifest["splits"]["train"]["tokens"] > 0
    assert (
        fs.cat_file(f"{folder}/train.bin")
        == next((tmp_path / "stream" / "prepared").glob("*/*/train.bin")).read_bytes()
    )
    # Another machine (an empty local cache) downloads it, checksummed, instead of preparing again.
    config2 = yaml.safe_load(config.read_text())
    config2["data"]["stream_cache_dir"] = str(tmp_path / "stream2")
    config.write_text(yaml.safe_dump(config2))
    again = cli_in_process(["prepare", "--config", str(config)], tmp_path)
    assert again.returncode == 0, again.stderr
    assert "downloaded" in again.stderr + again.stdout
    # A local cache too small for the prepared data: one line naming the setting, nothing downloaded.
    small = cli_in_process(
        [
            "prepare",
            "--config",
            str(config),
            f"data.stream_cache_dir={tmp_path / 'stream3'}",
            "data.stream_cache_limit=1000",
        ],
        tmp_path,
    )
    _one_line_exit_2(small, "data.stream_cache_limit")
    assert not list((tmp_path / "stream3").rglob("*.bin"))


def _log_size(log) -> int:
    return os.fstat(log.fileno()).st_size


def _listings_of(log, since: int, bucket: str, prefix: str) -> int:
    """The LIST requests for `prefix` in `bucket` the server logged after the log's first `since` bytes
    (read without moving the file offset, which the server's writes share)."""
    text = os.pread(log.fileno(), _log_size(log) - since, since).decode(errors="replace")
    return sum(
        f"/{bucket}" in line and "list-type=2" in line and f"prefix={prefix}" in line for line in text.splitlines()
    )


def _newest_prepared_text(root) -> str:
    """The text of the train and val tokens of the char-tokenized folder in `root` prepared last."""
    from llm_trainer.tokenizer import Tokenizer

    folders = [f for f in root.iterdir() if (f / "manifest.json").is_file()]
    newest = max(folders, key=lambda f: (f / "manifest.json").stat().st_mtime_ns)
    dtype = json.loads((newest / "manifest.json").read_text())["dtype"]
    tokenizer = Tokenizer.load(newest / "tokenizer.json")
    return "".join(
        tokenizer.decode(np.fromfile(newest / name, dtype=dtype).tolist()) for name in ("train.bin", "val.bin")
    )


def test_a_prepare_lists_its_bucket_folder_once_and_reads_what_it_fingerprinted(tmp_path, monkeypatch):
    """A fresh prepare of a bucket folder lists it in the store as often as listing it once does: the
    fingerprint, the reading and the manifest see one answer of the store. So an object written into the
    folder during a prepare is not read into a folder whose fingerprint leaves it out; the next prepare
    reads it. A server of its own, whose request log the test reads."""
    import s3fs

    from llm_trainer.data.text import sources
    from llm_trainer.files.buckets import list_files

    proc, endpoint = _start_server()
    try:
        for key, value in {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(key, value)
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        bucket = "t-listed-once"
        fs.mkdir(bucket)
        _upload_corpus(fs, bucket, tmp_path)
        s3fs.S3FileSystem.clear_instance_cache()
        before = _log_size(proc.log)
        list_files(f"s3://{bucket}/corpus/")
        time.sleep(0.5)  # the server writes its log line after it answers
        once = _listings_of(proc.log, before, bucket, "corpus")
        assert once >= 1
        config = _experiment(tmp_path, bucket)
        values = yaml.safe_load(config.read_text())
        values["data"]["cache_dir"] = str(tmp_path / "prepared")  # the corpus alone is in the store
        config.write_text(yaml.safe_dump(values))
        before = _log_size(proc.log)
        done = cli_in_process(["prepare", "--config", str(config)], tmp_path)
        assert done.returncode == 0, done.stderr
        assert "data: preparing" in done.stderr
        time.sleep(0.5)
        assert _listings_of(proc.log, before, bucket, "corpus") == once

        identity, late = sources.identity, f"{bucket}/corpus/zz-late.txt"

        def identity_while_another_writes(info):  # the fingerprint's look at each object
            if not fs.exists(late):
                fs.pipe_file(late, b"LATECOMER " * 40)
            return identity(info)

        monkeypatch.setattr(sources, "identity", identity_while_another_writes)
        split = ["data.validation_split=0.25"]  # not the folder prepared above
        done = cli_in_process(["prepare", "--config", str(config), *split], tmp_path)
        assert done.returncode == 0, done.stderr
        text = _newest_prepared_text(tmp_path / "prepared")
        assert "LATECOMER" not in text and "the cat sat" in text
        monkeypatch.setattr(sources, "identity", identity)
        again = cli_in_process(["prepare", "--config", str(config), *split], tmp_path)
        assert "data: preparing" in again.stderr  # the folder changed: another fingerprint
        assert "LATECOMER" in _newest_prepared_text(tmp_path / "prepared")
    finally:
        _stop(proc)


def test_the_report_of_data_read_from_a_bucket_names_its_urls(s3, tmp_path):
    """The report and the skip lines of data read from a store name its files by their URLs, as a local
    file is named by its path, in-process and on the local executor: never the local copy's path."""
    fs, bucket = s3
    lines = [{"text": f"document number {i} " * 12} for i in range(40)] + [{"text": "short"}]
    lines.append(lines[3])  # an exact duplicate, at line 42
    files = {
        f"{bucket}/corpus/a.jsonl": "".join(json.dumps(x) + "\n" for x in lines).encode(),
        f"{bucket}/corpus/blob.txt": b"\x00\x01\x02binary" * 50,
        f"{bucket}/corpus/b.txt.gz": gzip.compress(b"compressed text read from the bucket " * 8),
        f"{bucket}/corpus/damaged.txt.xz": lzma.compress(b"a damaged file " * 50)[:-10],
    }
    for key, data in files.items():
        fs.pipe_file(key, data)
    config = _experiment(tmp_path, bucket)
    values = yaml.safe_load(config.read_text())
    values["data"].update(cache_dir=str(tmp_path / "prepared"), min_length=10, deduplication="exact")
    config.write_text(yaml.safe_dump(values))
    for executor in ([], ["--executor", "local", "--tasks", "2"]):
        done = cli_in_process(["prepare", "--config", str(config), *executor], tmp_path)
        assert done.returncode == 0, done.stderr
        (report_file,) = (tmp_path / "prepared").glob("*/data_report.json")
        report = json.loads(report_file.read_text())
        assert report["removed_documents"]["min_length"][0]["origin"] == f"s3://{bucket}/corpus/a.jsonl:41"
        assert report["removed_documents"]["exact_duplicates"][0]["origin"] == f"s3://{bucket}/corpus/a.jsonl:42"
        (skipped,) = report["skipped_inputs_named"]["binary_files"]
        assert skipped.startswith(f"s3://{bucket}/corpus/blob.txt looks like a binary file")
        (skipped,) = report["skipped_inputs_named"]["unreadable_files"]
        assert skipped.startswith(f"s3://{bucket}/corpus/damaged.txt.xz could not be decompressed")
        assert report["documents_in"] == len(lines) + 1  # the records and the gzip file's text
        assert str(tmp_path / "stream") not in report_file.read_text() + done.stderr, executor
        shutil.rmtree(tmp_path / "prepared")


def _latest(fs, bucket: str) -> str:
    fs.invalidate_cache()
    return fs.cat_file(f"{bucket}/checkpoints/latest").decode().strip()


def _steps(run) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if row["kind"] == "train"]


def test_train_from_a_bucket_with_checkpoints_in_it_then_resume_elsewhere(s3, tmp_path):
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    config = _experiment(tmp_path, bucket, save_total_limit=1)
    done = cli_in_process(["train", "--config", str(config)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert _latest(fs, bucket) == "checkpoint-00000006"
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/checkpoints")}
    assert "checkpoint-00000003" not in names  # rotated in the store as on disk
    assert {"checkpoint-00000006", "latest", "best_model"} <= names
    # Export straight into the bucket: a transformers folder, config.json uploaded last.
    pytest.importorskip("transformers")
    exported = cli_in_process(
        ["export", "--checkpoint", str(tmp_path / "run"), "--output", f"s3://{bucket}/hf-model"], tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    fs.invalidate_cache()
    assert {"config.json", "model.safetensors", "files.json"} <= {
        p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/hf-model")
    }
    card = fs.cat(f"{bucket}/hf-model/README.md").decode()
    assert "\n# hf-model\n" in card and 'from_pretrained("hf-model")' in card  # named as its target
    # the shapes of a URL that would not be the one meant: refused in one line, nothing written
    for output_dir, said in (
        (f"s3:/{bucket}/one-slash", f"write s3://{bucket}/one-slash"),
        (f"s3://{bucket}/runs/x/../y", "holds '.', '..' or '//' in its key"),
    ):
        refused = cli_in_process(["train", "--config", str(config), f"training.output_dir={output_dir}"], tmp_path)
        _one_line_exit_2(refused, said)
    assert not (tmp_path / "s3:").exists()
    missing = cli_in_process(
        ["prepare", "--config", str(config), "data.data_files=s3://no-such-bucket/corpus/"], tmp_path
    )
    _one_line_exit_2(missing, "the bucket 'no-such-bucket' of s3://no-such-bucket/corpus/ does not exist")
    # A new run starts from the best model in the bucket (model.init_from a URL), read as any folder.
    tuned = cli_in_process(
        [
            "train",
            "--config",
            str(config),
            "training.max_steps=2",
            f"training.output_dir={tmp_path / 'tuned'}",
            f"training.checkpoint_dir=s3://{bucket}/tuned",
            f"model.init_from=s3://{bucket}/checkpoints/best_model",
        ],
        tmp_path,
    )
    assert tuned.returncode == 0, tuned.stderr
    assert list((tmp_path / "stream" / "models").glob("*/model.safetensors"))
    # A new run into the same bucket folder would replace its `latest`: refused, one line.
    fresh = cli_in_process(["train", "--config", config, f"training.output_dir={tmp_path / 'fresh'}"], tmp_path)
    _one_line_exit_2(fresh, "holds checkpoints already", "--resume_from_checkpoint latest")
    # Another machine: a new output folder and local cache; the run continues from the bucket.
    more = cli_in_process(
        [
            "train",
            "--config",
            str(config),
            "training.max_steps=8",
            f"training.output_dir={tmp_path / 'elsewhere'}",
            f"data.stream_cache_dir={tmp_path / 'stream-elsewhere'}",
            "--resume_from_checkpoint",
            "latest",
        ],
        tmp_path,
    )
    assert more.returncode == 0, more.stderr
    assert "downloaded s3://" in more.stderr + more.stdout
    assert "continuing from" in more.stderr + more.stdout
    assert _steps(tmp_path / "elsewhere")[0] > 6
    assert _latest(fs, bucket) == "checkpoint-00000008"


def test_sigkill_mid_upload_keeps_the_previous_checkpoint_as_latest(s3, tmp_path):
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    config = _experiment(tmp_path, bucket)
    mark = tmp_path / "uploading"
    # The run is killed after the first file of step 6's checkpoint reached the bucket, before the rest.
    script = f"""
import pathlib, sys, time
from llm_trainer.files import buckets
real = buckets.upload
def upload(local, url):
    real(local, url)
    if "checkpoint-00000006" in url:
        pathlib.Path({str(mark)!r}).touch()
        time.sleep(600)
buckets.upload = upload
from llm_trainer.cli import main
sys.exit(main(["train", "--config", {str(config)!r}]))
"""
    kill9_when(script, mark.exists, "the upload of checkpoint 6", timeout=240)
    assert _latest(fs, bucket) == "checkpoint-00000003"
    partial = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/checkpoints/checkpoint-00000006")}
    assert partial and "meta.json" not in partial and "files.json" not in partial
    # Resumed on another machine from the bucket alone: step 3 is intact, and the run completes.
    resumed = cli_in_process(
        [
            "train",
            "--config",
            str(config),
            f"training.output_dir={tmp_path / 'elsewhere'}",
            f"data.stream_cache_dir={tmp_path / 'stream-elsewhere'}",
            "--resume_from_checkpoint",
            "latest",
        ],
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "step 3" in resumed.stderr + resumed.stdout
    assert _steps(tmp_path / "elsewhere")[0] > 3
    assert _latest(fs, bucket) == "checkpoint-00000006"
    fs.invalidate_cache()
    assert "meta.json" in {p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/checkpoints/checkpoint-00000006")}


def _one_line_exit_2(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) >= 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[-1], lines[-1]
    assert "testing" not in done.stderr  # no credential is ever printed
    return lines[-1]


def test_a_missing_bucket_is_one_line_exit_2(s3, tmp_path):
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    config = _experiment(tmp_path, bucket, checkpoint_dir="s3://no-such-bucket-here/checkpoints")
    done = cli_in_process(["train", "--config", config], tmp_path)
    _one_line_exit_2(done, "no-such-bucket-here", "does not exist", "training.checkpoint_dir")
    prepare = cli_in_process(
        ["prepare", "--config", config, "data.cache_dir=s3://no-such-bucket-here/prepared"], tmp_path
    )
    _one_line_exit_2(prepare, "no-such-bucket-here", "does not exist")


def test_access_denied_is_one_line_exit_2(s3_server, tmp_path):
    # A second server that checks credentials: the fake ones are refused.
    proc, endpoint = _start_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        config = _experiment(tmp_path, "some-bucket")
        done = _cli(["prepare", "--config", str(config)], endpoint, tmp_path)
    finally:
        _stop(proc)
    _one_line_exit_2(done, "denied", "s3://some-bucket/corpus/")


class _Relay:
    """A TCP relay from a local port to the S3 server that can be cut: open connections are reset and
    new ones refused, as when the network or the endpoint goes away mid-run. A connection accepted while
    the cut happens is reset too (the lock): none survives it."""

    def __init__(self, endpoint: str):
        self.target = int(endpoint.rsplit(":", 1)[1])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.is_cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # the listener is closed: cut
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=30)
                upstream.settimeout(None)
            except OSError:  # the server did not take this one (a loaded machine): refuse it, keep relaying
                self._reset([client])
                continue
            with self.lock:
                if self.is_cut:
                    self._reset([client, upstream])
                    return
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _reset(sockets: list[socket.socket]) -> None:
        for s in sockets:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
                s.close()
            except OSError:
                pass

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            try:  # wakes the accept() blocked in the other thread; close() alone leaves the port accepting
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()
            self._reset(self.sockets)


def test_connection_lost_mid_run_is_retried_then_one_error_and_latest_stays_complete(s3, tmp_path):
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    config = _experiment(tmp_path, bucket, max_steps=400, save_steps=3, eval_steps=400)
    relay = _Relay(os.environ["AWS_ENDPOINT_URL"])
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llm_trainer", "train", "--config", str(config)],
            env=_env(relay.endpoint),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=stderr_file,
            text=True,
        )
    try:
        deadline = time.monotonic() + 240
        while not fs.exists(f"{bucket}/checkpoints/latest"):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint reached the bucket"
            time.sleep(0.1)
            fs.invalidate_cache()
        relay.cut()
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end after the cut; its stderr:\n{log.read_text()[-4000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = log.read_text()
    assert "trying again" in stderr  # retried first
    done = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
    _one_line_exit_2(done, "cannot reach", "AWS_ENDPOINT_URL")
    # `latest` names a checkpoint whose every file is in the bucket.
    name = _latest(fs, bucket)
    record = json.loads(fs.cat_file(f"{bucket}/checkpoints/{name}/files.json"))
    for file, entry in record.items():
        assert fs.size(f"{bucket}/checkpoints/{name}/{file}") == entry["size"]
    assert "meta.json" in record
