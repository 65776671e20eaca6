"""The local side of object storage (llm_trainer.files.buckets): which paths are URLs, and the bounded cache of
local copies. The store itself is exercised against a real S3 server in test_object_storage.py."""

import os

import pytest

from llm_trainer.errors import UsageError
from llm_trainer.files.buckets import is_url, make_room, mirror_name


def test_which_paths_are_urls():
    assert is_url("s3://bucket/data/") and is_url("gs://b/x") and is_url("hf://datasets/x") and is_url("az://c/p")
    assert not is_url("data/corpus") and not is_url("/abs/path") and not is_url("file:///tmp/x") and not is_url(None)
    assert mirror_name("s3://b/a") != mirror_name("s3://b/b") and "/" not in mirror_name("s3://b/a/c")


def _entry(folder, size: int, age: int):
    folder.mkdir(parents=True)
    (folder / "data.bin").write_bytes(b"x" * size)
    os.utime(folder, (1_000_000 + age, 1_000_000 + age))
    return folder


def test_the_stream_cache_evicts_the_least_recently_used_first(tmp_path):
    oldest = _entry(tmp_path / "prepared" / "s3_a" / "f1", 100, 1)
    middle = _entry(tmp_path / "sources" / "s3_x", 100, 2)
    newest = _entry(tmp_path / "prepared" / "s3_b" / "f2", 100, 3)
    make_room(tmp_path, 150, 300)  # 300 held: two must go, oldest first
    assert not oldest.exists() and not middle.exists() and newest.exists()
    kept = _entry(tmp_path / "prepared" / "s3_c" / "f3", 100, 0)  # the oldest, but in use
    make_room(tmp_path, 100, 200, keep=[kept])
    assert kept.exists() and not newest.exists()
    with pytest.raises(UsageError, match="stream_cache_limit"):
        make_room(tmp_path, 150, 200, keep=[kept])
    assert kept.exists()


def test_a_url_output_dir_is_written_in_a_staging_folder_with_its_checkpoints_in_the_store():
    from llm_trainer.config import TrainingConfig

    run = TrainingConfig(output_dir="s3://b/runs/x", staging_dir="/stage")
    assert run.remote_output_dir == "s3://b/runs/x" and run.local_output_dir.parent.as_posix() == "/stage"
    assert run.resolved_checkpoint_dir == run.local_output_dir / "checkpoints"
    assert run.remote_checkpoint_dir == "s3://b/runs/x/checkpoints"
    assert TrainingConfig(output_dir="s3://b/runs/y", staging_dir="/stage").local_output_dir != run.local_output_dir
    mine = TrainingConfig(output_dir="s3://b/runs/x", checkpoint_dir="/ckpt")  # a local checkpoint_dir stays local
    assert mine.remote_checkpoint_dir is None and mine.resolved_checkpoint_dir.as_posix() == "/ckpt"
    local = TrainingConfig(output_dir="out", checkpoint_dir="s3://b/c")
    assert local.remote_output_dir is None and local.local_output_dir.as_posix() == "out"
    assert local.resolved_checkpoint_dir.as_posix() == "out/checkpoints" and local.remote_checkpoint_dir == "s3://b/c"
