"""gs:// through the same storage layer as s3://: a real Cloud Storage endpoint on this machine (the
`gcp-storage-emulator` package's server, its own process on 127.0.0.1) reached through gcsfs. The
emulator's address goes to gcsfs in STORAGE_EMULATOR_HOST, for the tests and every child process;
nothing leaves the machine."""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import yaml

from conftest import cli_in_process, free_port, write_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gcs_server():
    """The emulator on a free local port, or a skip saying why it could not start."""
    try:
        import gcp_storage_emulator  # noqa: F401
        import gcsfs  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"the gs:// tests need gcsfs and gcp-storage-emulator (pip install -e '.[dev]'): {exc}")
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
        + ["--in-memory"],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/storage/v1/b?project=test", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                pytest.skip(
                    f"the local Cloud Storage emulator did not start: {log.read().decode(errors='replace')[-300:]}"
                )
            time.sleep(0.2)
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved


def test_prepare_train_and_resume_with_everything_in_a_gs_bucket(gcs_server, tmp_path):
    import gcsfs

    fs = gcsfs.GCSFileSystem()
    bucket = "llm-trainer-gs"
    fs.mkdir(bucket)
    for file in sorted(write_corpus(tmp_path / "corpus").iterdir()):
        fs.put_file(str(file), f"{bucket}/corpus/{file.name}")
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 24},
        "training": {
            "batch_size": 4,
            "max_steps": 4,
            "learning_rate": 3e-3,
            "eval_steps": 2,
            "save_steps": 2,
            "logging_steps": 2,
            "output_dir": str(tmp_path / "run"),
            "checkpoint_dir": f"gs://{bucket}/checkpoints",
            "device": "cpu",
            "progress_bar": False,
            "report_to": ["jsonl"],
        },
        "data": {
            "data_files": [f"gs://{bucket}/corpus/"],
            "tokenizer": "char",
            "validation_split": 0.2,
            "cache_dir": f"gs://{bucket}/prepared",
            "stream_cache_dir": str(tmp_path / "stream"),
        },
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))

    done = cli_in_process(["train", "--config", str(path)], tmp_path)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    (prepared,) = fs.ls(f"{bucket}/prepared")
    manifest = json.loads(fs.cat_file(f"{prepared}/manifest.json"))
    assert manifest["splits"]["train"]["tokens"] > 0
    assert fs.cat_file(f"{bucket}/checkpoints/latest").decode().strip() == "checkpoint-00000004"

    # Another machine: empty local folders; the data and the checkpoint come from the bucket.
    more = cli_in_process(
        [
            "train",
            "--config",
            str(path),
            "training.max_steps=6",
            f"training.output_dir={tmp_path / 'elsewhere'}",
            f"data.stream_cache_dir={tmp_path / 'stream2'}",
            "--resume_from_checkpoint",
            "latest",
        ],
        tmp_path,
    )
    assert more.returncode == 0, more.stderr
    assert "downloaded gs://" in more.stderr + more.stdout and "continuing from" in more.stderr + more.stdout
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/checkpoints/latest").decode().strip() == "checkpoint-00000006"


def test_a_missing_gs_bucket_is_one_line_exit_2(gcs_server, tmp_path):
    data = {
        "data_files": [str(write_corpus(tmp_path / "corpus"))],
        "tokenizer": "char",
        "cache_dir": "gs://no-such-bucket/prepared",
        "stream_cache_dir": str(tmp_path / "stream"),
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"data": data}))
    done = cli_in_process(["prepare", "--config", str(path)], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "gs://no-such-bucket" in lines[0] and "Traceback" not in done.stderr, done.stderr
