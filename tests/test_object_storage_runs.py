"""A run folder in object storage: training.output_dir a URL, checkpoints read by eval/generate/export
straight from a URL, and an export replaced in a bucket. Against the same local S3 server as
test_object_storage.py (moto's server in its own process on 127.0.0.1), through s3fs."""

import json
import os
import shutil
import subprocess

import pytest
import torch
import yaml

import test_object_storage as base
from conftest import cli_in_process
from test_object_storage import _env, _experiment, _one_line_exit_2, _upload_corpus
from warm_launch import torchrun

s3_server, s3 = base.s3_server, base.s3  # the server and bucket fixtures, shared

pytestmark = pytest.mark.slow


def _names(fs, folder: str) -> set[str]:
    fs.invalidate_cache()
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder)}


def _train_steps(text: str) -> list[int]:
    rows = [json.loads(line) for line in text.splitlines()]
    return [row["step"] for row in rows if row["kind"] == "train"]


def test_a_run_folder_in_a_bucket_is_written_resumed_elsewhere_and_refused_twice(s3, tmp_path):  # noqa: F811
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    url = f"s3://{bucket}/runs/x"
    config = _experiment(tmp_path, bucket, output_dir=url, checkpoint_dir=None, staging_dir=str(tmp_path / "stage"))
    done = cli_in_process(["train", "--config", str(config)], tmp_path)
    assert done.returncode == 0, done.stderr
    first = (done.stderr + done.stdout).strip().splitlines()[0]
    assert url in first and str(tmp_path / "stage") in first  # where the run is written, said first
    assert not (tmp_path / "s3:").exists()
    run = f"{bucket}/runs/x"
    assert {"metrics.jsonl", "config.yaml", "tokenizer.json", "files.json", "checkpoints"} <= _names(fs, run)
    assert fs.cat_file(f"{run}/checkpoints/latest").decode().strip() == "checkpoint-00000006"
    assert {"checkpoint-00000006", "best_model"} <= _names(fs, f"{run}/checkpoints")
    stored = fs.cat_file(f"{run}/metrics.jsonl").decode()
    assert _train_steps(stored) == [2, 4, 6] and '"summary"' in stored  # uploaded at the end, summary included
    # A new run into the same URL would mix with this one: refused in one line, as on disk (a finished one).
    again = cli_in_process(["train", "--config", config], tmp_path)
    _one_line_exit_2(again, "holds a finished run", "raise training.max_steps", "--overwrite")
    # Another machine (empty staging folder and local cache): the run continues from the bucket alone.
    more = cli_in_process(
        [
            "train",
            "--config",
            str(config),
            "training.max_steps=8",
            f"training.staging_dir={tmp_path / 'stage2'}",
            f"data.stream_cache_dir={tmp_path / 'stream2'}",
            "--resume_from_checkpoint",
            "latest",
        ],
        tmp_path,
    )
    assert more.returncode == 0, more.stderr
    assert "continuing from" in more.stderr + more.stdout
    assert fs.cat_file(f"{run}/checkpoints/latest").decode().strip() == "checkpoint-00000008"
    assert _train_steps(fs.cat_file(f"{run}/metrics.jsonl").decode()) == [2, 4, 6, 8]  # one history
    # A bucket that does not exist: one line naming the setting, before any data is prepared.
    gone = cli_in_process(["train", "--config", config, "training.output_dir=s3://no-such-bucket-here/x"], tmp_path)
    _one_line_exit_2(gone, "no-such-bucket-here", "does not exist", "training.output_dir")
    # Starting over removes what runs write there, and nothing else.
    fs.pipe_file(f"{run}/notes.txt", b"mine")
    over = cli_in_process(["train", "--config", str(config), "training.max_steps=2", "--overwrite"], tmp_path)
    assert over.returncode == 0, over.stderr
    assert fs.cat_file(f"{run}/notes.txt") == b"mine"
    assert _train_steps(fs.cat_file(f"{run}/metrics.jsonl").decode()) == [2]
    assert {n for n in _names(fs, f"{run}/checkpoints") if n.startswith("checkpoint-")} == {"checkpoint-00000002"}


def test_eval_generate_and_export_read_a_checkpoint_url_and_an_export_is_replaced_in_place(s3, tmp_path):
    pytest.importorskip("transformers")
    fs, bucket = s3
    _upload_corpus(fs, bucket, tmp_path)
    config = _experiment(tmp_path, bucket, output_dir=f"s3://{bucket}/run", checkpoint_dir=None)
    done = cli_in_process(["train", "--config", str(config)], tmp_path)
    assert done.returncode == 0, done.stderr
    # A run folder's URL means its latest checkpoint, as a local run folder does; downloaded, checked, read.
    text = str(tmp_path / "corpus" / "doc00.txt")
    scored = cli_in_process(["eval", "--checkpoint", f"s3://{bucket}/run", "--data", text, "--json"], tmp_path)
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout.strip().splitlines()[-1])["loss"] > 0
    assert "checkpoint-00000006" in scored.stderr + scored.stdout  # the one `latest` names
    # Without --data: the run's validation split, from this machine's copy of the bucket's prepared folder.
    own = cli_in_process(["eval", "--checkpoint", f"s3://{bucket}/run", "--json"], tmp_path)
    assert own.returncode == 0, own.stderr
    assert json.loads(own.stdout.strip().splitlines()[-1])["loss"] > 0
    # On a machine that never prepared it: the validation split the run names, fetched from the bucket.
    shutil.rmtree(tmp_path / "stream" / "prepared")
    elsewhere = cli_in_process(["eval", "--checkpoint", f"s3://{bucket}/run", "--json"], tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert json.loads(elsewhere.stdout.strip().splitlines()[-1]) == json.loads(own.stdout.strip().splitlines()[-1])
    (copy,) = (tmp_path / "stream_cache" / "validation").glob("*/*")
    assert (copy / "val.bin").is_file() and not (copy / "train.bin").exists()  # the training tokens stay there
    assert not (tmp_path / "stream" / "prepared").exists()  # nor is it taken for a prepared folder to train on
    # The run's own config is in the bucket with it; --config takes a local file (a URL is said in one line).
    assert f"cache_dir: s3://{bucket}/prepared" in fs.cat_file(f"{bucket}/run/config.yaml").decode()
    url = cli_in_process(["train", "--config", f"s3://{bucket}/run/config.yaml"], tmp_path)
    _one_line_exit_2(url, "is a URL", "local")
    # Its prepared folder gone from the bucket too: one line.
    shutil.rmtree(tmp_path / "stream_cache" / "validation")
    fs.rm(f"{bucket}/prepared", recursive=True)
    gone = cli_in_process(["eval", "--checkpoint", f"s3://{bucket}/run", "--json"], tmp_path)
    _one_line_exit_2(gone, "is not prepared in s3://", "llm-trainer prepare", "--data FILE")
    sample = cli_in_process(
        ["generate", "--checkpoint", f"s3://{bucket}/run/checkpoints/checkpoint-00000003", "--max-new-tokens", "4"],
        tmp_path,
    )
    assert sample.returncode == 0, sample.stderr
    local = tmp_path / "hf-local"
    exported = cli_in_process(
        ["export", "--checkpoint", f"s3://{bucket}/run/checkpoints/best_model", "--output", str(local)], tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert (local / "config.json").is_file()
    # A missing bucket or object: one line, exit 2.
    gone = cli_in_process(["eval", "--checkpoint", "s3://no-such-bucket-here/run"], tmp_path)
    _one_line_exit_2(gone, "no-such-bucket-here", "does not exist")
    nothing = cli_in_process(["generate", "--checkpoint", f"s3://{bucket}/nothing-here"], tmp_path)
    _one_line_exit_2(nothing, "holds no checkpoint")
    # export --output URL --overwrite: what an earlier export of ours wrote and this one does not is removed.
    target = f"s3://{bucket}/hf"
    first = cli_in_process(["export", "--checkpoint", f"s3://{bucket}/run", "--output", target], tmp_path)
    assert first.returncode == 0, first.stderr
    record = json.loads(fs.cat_file(f"{bucket}/hf/files.json"))
    fs.pipe_file(f"{bucket}/hf/model-00001-of-00002.safetensors", b"old layout")  # as an older export wrote it
    record["model-00001-of-00002.safetensors"] = {"size": 10, "checksum": "x"}
    fs.pipe_file(f"{bucket}/hf/files.json", json.dumps(record).encode())
    refused = cli_in_process(["export", "--checkpoint", f"s3://{bucket}/run", "--output", target], tmp_path)
    _one_line_exit_2(refused, "holds files already", "--overwrite")
    again = cli_in_process(
        ["export", "--checkpoint", f"s3://{bucket}/run", "--output", target, "--overwrite"], tmp_path
    )
    assert again.returncode == 0, again.stderr
    names = _names(fs, f"{bucket}/hf")
    assert "model-00001-of-00002.safetensors" not in names and {"config.json", "model.safetensors"} <= names
    assert set(json.loads(fs.cat_file(f"{bucket}/hf/files.json"))) == names - {"files.json"}
    # A file we did not write is never deleted: the target is refused, as it was left.
    fs.pipe_file(f"{bucket}/hf/notes.txt", b"mine")
    foreign = cli_in_process(
        ["export", "--checkpoint", f"s3://{bucket}/run", "--output", target, "--overwrite"], tmp_path
    )
    _one_line_exit_2(foreign, "did not write", "notes.txt")
    assert fs.cat_file(f"{bucket}/hf/notes.txt") == b"mine" and "config.json" in _names(fs, f"{bucket}/hf")


def _torchrun(cwd, endpoint: str, *args) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 -m llm_trainer ARGS` with the store at `endpoint`, its ranks started
    warm (`warm_launch`)."""
    return torchrun(cwd, args, {**_env(endpoint), "PYTHONUNBUFFERED": "1"})


def _losses(fs, run: str) -> dict[int, float]:
    rows = [json.loads(line) for line in fs.cat_file(f"{run}/metrics.jsonl").decode().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_fsdp_shards_go_straight_to_the_store_and_resume_at_two_and_one_processes(s3, tmp_path):  # noqa: F811
    """Each rank writes its DCP files straight into the store (none on local disk), meta.json and
    files.json list them, `latest` names the checkpoint; a tampered shard is refused in one line naming it;
    two fresh processes continue with the losses of an uninterrupted run, and one process reshards."""
    fs, bucket = s3
    (tmp_path / "corpus.txt").write_text("".join(f"the cat sat on the mat number {i % 7}.\n" for i in range(400)))
    endpoint = os.environ["AWS_ENDPOINT_URL"]

    def experiment(name: str, **training) -> "os.PathLike":
        config = _experiment(
            tmp_path,
            bucket,
            output_dir=f"s3://{bucket}/{name}",
            checkpoint_dir=None,
            staging_dir=str(tmp_path / f"stage-{name}"),
            distributed_strategy="fsdp",
            use_amp=False,
            lr_scheduler="constant",  # a run of 6 steps continued to 8 follows the schedule of one of 8
            **training,
        )
        values = yaml.safe_load(config.read_text())
        values["data"] = {"data_files": [str(tmp_path / "corpus.txt")], "tokenizer": "char", "validation_split": 0.2}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    reference = _torchrun(tmp_path, endpoint, "train", "--config", str(experiment("reference", max_steps=8)))
    assert reference.returncode == 0, reference.stderr[-3000:]
    config = experiment("direct")
    done = _torchrun(tmp_path, endpoint, "train", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoints = f"{bucket}/direct/checkpoints"
    assert fs.cat_file(f"{checkpoints}/latest").decode().strip() == "checkpoint-00000006"
    folder = f"{checkpoints}/checkpoint-00000006"
    meta = json.loads(fs.cat_file(f"{folder}/meta.json"))
    record = json.loads(fs.cat_file(f"{folder}/files.json"))
    stored = meta["in_store"]
    assert sorted(n for n in stored if n.endswith(".distcp")) == ["sharded/__0_0.distcp", "sharded/__1_0.distcp"]
    assert "sharded/.metadata" in stored
    for name in stored:  # listed with the size the store holds
        assert record[name] == meta["files"][name]
        assert fs.size(f"{folder}/{name}") == meta["files"][name]["size"]
    local = [p for p in (tmp_path / "stage-direct").rglob("*") if p.is_file()]
    assert any(p.name == "rng-rank1.pt" for p in local)  # the local folder was written...
    assert not [p for p in local if p.suffix == ".distcp" or p.name == ".metadata"]  # ...without the shards

    def one_process(name: str) -> subprocess.CompletedProcess:
        """A resume of checkpoint 6 in one process (this one), into its own output_dir (the same global batch)."""
        alone = experiment(name, max_steps=8, gradient_accumulation_steps=2)
        return cli_in_process(["train", "--config", alone, "--resume_from_checkpoint", f"s3://{folder}"], tmp_path)

    shard = f"{folder}/sharded/__1_0.distcp"
    original = fs.cat_file(shard)
    fs.pipe_file(shard, original[:-1] + bytes([original[-1] ^ 1]))  # same size, one bit flipped
    _one_line_exit_2(one_process("tampered"), "__1_0.distcp", "checksum")
    fs.pipe_file(shard, original)

    more = _torchrun(
        tmp_path,
        endpoint,
        "train",
        "--config",
        str(config),
        "training.max_steps=8",
        f"training.staging_dir={tmp_path / 'stage-fresh'}",
        "--resume_from_checkpoint",
        "latest",
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert "continuing from" in more.stderr + more.stdout
    assert fs.cat_file(f"{checkpoints}/latest").decode().strip() == "checkpoint-00000008"
    expected = _losses(fs, f"{bucket}/reference")
    resumed = _losses(fs, f"{bucket}/direct")
    assert resumed[8] == pytest.approx(expected[8], rel=1e-6)
    assert _train_steps(fs.cat_file(f"{bucket}/direct/metrics.jsonl").decode()) == [2, 4, 6, 8]  # one history

    alone = one_process("alone")
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert _losses(fs, f"{bucket}/alone")[8] == pytest.approx(expected[8], rel=1e-4)


def test_eval_follows_a_checkpoints_data_url_only_within_the_checkpoints_bucket():
    """A checkpoint's saved config may lead `eval` to its run's validation split in the bucket the user named
    with --checkpoint, and to no other store (nor from a local checkpoint to any store)."""
    from llm_trainer.files.buckets import same_bucket

    assert same_bucket("s3://b/prepared", "s3://b/runs/x")
    assert not same_bucket("s3://other/prepared", "s3://b/runs/x")
    assert not same_bucket("gs://b/prepared", "s3://b/runs/x")
    assert not same_bucket("s3://b/prepared", "runs/x")
    assert not same_bucket("data_cache", "s3://b/runs/x")
