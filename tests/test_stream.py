"""Training tokens streamed from object storage in chunks (data/stream.py): the block order, the bounded
cache, checksums on arrival, and a training run that streams, against a real S3 endpoint (moto's server,
the fixtures of test_object_storage)."""

import json
import os

import numpy as np
import pytest
import yaml

from llm_trainer.data.loader import BatchLoader, WindowRows
from llm_trainer.data.stream import MIN_CACHED, WINDOW, ChunkedTokens, block_order, write_chunk_record
from llm_trainer.errors import UsageError
from test_object_storage import _cli, _experiment, s3, s3_server  # noqa: F401  (fixtures)


@pytest.fixture
def store(s3):  # noqa: F811
    """(an s3fs filesystem, a fresh bucket) on the local S3 server."""
    return s3


def _token_file(folder, n=20_000, dtype="uint16"):
    """A train.bin of `n` distinct-ish tokens and its chunk record, as prepare writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    np.arange(n, dtype=np.int64).astype(dtype).tofile(folder / "train.bin")
    write_chunk_record(folder)
    return json.loads((folder / "train.chunks.json").read_text())


def _samples(loader, steps):
    return [tuple(a.tolist() for a in loader.next_batch()[:2]) for _ in range(steps)]


def test_block_order_is_seeded_grouped_and_the_same_on_any_world_size(tmp_path, capsys):
    record = _token_file(tmp_path)
    tokens = ChunkedTokens(
        record, "uint16", url="unused", folder=tmp_path / "c", budget=0, whole=tmp_path / "train.bin"
    )
    assert tokens.n_chunks > 4 * WINDOW
    rows = WindowRows(tokens, 31, seed=3)
    first = rows.token_bounds()[0] // tokens.chunk_tokens
    order = block_order(first, tokens.n_chunks, seed=3, epoch=0)
    assert sorted(order.tolist()) == list(range(len(rows)))
    assert np.array_equal(order, block_order(first, tokens.n_chunks, seed=3, epoch=0))
    assert not np.array_equal(order, block_order(first, tokens.n_chunks, seed=3, epoch=1))
    # Rows of a group come from WINDOW chunks: a stretch of training touches few chunks.
    homes = first[order]
    for start in range(0, len(homes) - 50, 50):  # a stretch may straddle two groups
        assert len(set(homes[start : start + 50].tolist())) <= 2 * WINDOW
    # One process taking every batch == two processes taking alternate ones; a position saved on two
    # processes resumes on one (accumulation 2 keeps the global batch) at the same sample.
    one = BatchLoader(WindowRows(tokens, 31, seed=3), 4, shuffle=True, seed=3, accumulation=2)
    two = [BatchLoader(WindowRows(tokens, 31, seed=3), 4, shuffle=True, seed=3, rank=r, world_size=2) for r in (0, 1)]
    expected = _samples(one, 10)
    got = [batch for _ in range(5) for loader in two for batch in _samples(loader, 1)]
    assert got == expected
    resumed = BatchLoader(WindowRows(tokens, 31, seed=3), 4, shuffle=True, seed=3, accumulation=2)
    resumed.load_state_dict(two[0].state_dict())
    assert _samples(resumed, 6) == _samples(one, 6)
    # A position saved in the block order, resumed over a plain memory map (a local data.cache_dir): said.
    plain = np.memmap(tmp_path / "train.bin", dtype="uint16", mode="r")
    other = BatchLoader(WindowRows(plain, 31, seed=3), 4, shuffle=True, seed=3, accumulation=2)
    other.load_state_dict(one.state_dict())
    assert "data order was by chunks" in capsys.readouterr().err


def _bucket_tokens(store, tmp_path, budget, n=20_000):
    fs, bucket = store
    record = _token_file(tmp_path / "made", n)
    fs.put_file(str(tmp_path / "made" / "train.bin"), f"{bucket}/p/train.bin")
    url = f"s3://{bucket}/p/train.bin"
    return fs, bucket, record, ChunkedTokens(record, "uint16", url=url, folder=tmp_path / "cache", budget=budget)


def test_streamed_batches_equal_local_ones_and_the_cache_stays_under_its_limit(store, tmp_path):
    record = _token_file(tmp_path / "probe")
    budget = (MIN_CACHED + 1) * record["chunk_bytes"]
    assert budget < record["size"]  # the cache cannot hold the split
    _, _, _, streamed = _bucket_tokens(store, tmp_path, budget)
    local = ChunkedTokens(
        record, "uint16", url="unused", folder=tmp_path / "x", budget=0, whole=tmp_path / "probe" / "train.bin"
    )
    a = BatchLoader(WindowRows(streamed, 31, seed=1), 8, shuffle=False, seed=1)
    b = BatchLoader(WindowRows(local, 31, seed=1), 8, shuffle=False, seed=1)
    for _ in range(len(a)):
        assert _samples(a, 1) == _samples(b, 1)
        assert streamed.used_bytes() <= budget
    # Read in order, the chunks leave the cache oldest first.
    assert len(streamed.evicted) > 5
    assert streamed.evicted == sorted(streamed.evicted)
    # Slices across chunk boundaries (the document row layouts read them) and single tokens.
    plain = np.memmap(tmp_path / "probe" / "train.bin", dtype="uint16", mode="r")
    for a, b in [(0, 10), (500, 3000), (len(plain) - 5, len(plain) + 10), (7, 7)]:
        assert np.array_equal(streamed[a:b], plain[a:b])
    assert streamed[-1] == plain[-1] and streamed[1234] == plain[1234]
    # Shuffled (block order) too: the same rows as the local copy.
    a = BatchLoader(WindowRows(streamed, 31, seed=1), 8, shuffle=True, seed=1)
    b = BatchLoader(WindowRows(local, 31, seed=1), 8, shuffle=True, seed=1)
    assert _samples(a, 40) == _samples(b, 40)
    assert streamed.used_bytes() <= budget


def test_a_damaged_chunk_is_one_error_naming_it(store, tmp_path):
    fs, bucket, record, tokens = _bucket_tokens(store, tmp_path, 10**9)
    data = bytearray(fs.cat_file(f"{bucket}/p/train.bin"))
    data[3 * record["chunk_bytes"] + 10] ^= 0xFF
    fs.pipe_file(f"{bucket}/p/train.bin", bytes(data))
    assert tokens[5] == 5  # chunk 0 is intact
    with pytest.raises(UsageError, match=r"train\.bin chunk 3 .* does not match its checksum") as caught:
        tokens.chunk(3)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "cache" / "00000003.bin").exists()


def test_a_small_cache_limit_is_one_error_naming_the_setting(store, tmp_path):
    with pytest.raises(UsageError, match="raise data.stream_cache_limit"):
        _bucket_tokens(store, tmp_path, 1000)


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["kind"] == "train"]


def test_training_streams_from_a_bucket_with_the_losses_of_the_local_copy(store, tmp_path):
    fs, bucket = store
    words = ["cat", "dog", "bird", "fox", "owl", "eel"]
    for d in range(20):
        lines = [f"the {words[(d + i) % 6]} sat on mat {i % 13} of row {d}.\n" for i in range(60)]
        fs.pipe_file(f"{bucket}/corpus/doc{d:02d}.txt", "".join(lines).encode())
    config = _experiment(tmp_path, bucket, batch_size=32, max_steps=12, save_steps=0, eval_steps=6)
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    # The run that prepares and uploads the data reads its local copy, in the block order.
    first = _cli(["train", "--config", str(config), "training.checkpoint_dir=null"], endpoint, tmp_path)
    assert first.returncode == 0, first.stderr
    (folder,) = (tmp_path / "stream" / "prepared").glob("*/*")
    record = json.loads((folder / "train.chunks.json").read_text())
    fs.invalidate_cache()
    (remote,) = fs.ls(f"{bucket}/prepared")
    assert "train.chunks.json" in {p.rsplit("/", 1)[-1] for p in fs.ls(remote)}
    small = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name != "train.bin")
    limit = small + (MIN_CACHED + 2) * record["chunk_bytes"]
    assert limit < record["size"]
    # Another machine streams the training tokens through a cache smaller than them: the same losses.
    again = _cli(
        [
            "train",
            "--config",
            str(config),
            "training.checkpoint_dir=null",
            f"training.output_dir={tmp_path / 'streamed'}",
            f"data.stream_cache_dir={tmp_path / 'stream2'}",
            f"data.stream_cache_limit={limit}",
        ],
        endpoint,
        tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert "training tokens stream" in again.stderr + again.stdout
    assert _losses(tmp_path / "streamed") == _losses(tmp_path / "run")
    (copy,) = (tmp_path / "stream2" / "prepared").glob("*/*")
    assert not (copy / "train.bin").exists() and list((copy / "train.chunks").glob("*.bin"))
    size = sum(p.stat().st_size for p in (tmp_path / "stream2").rglob("*") if p.is_file())
    assert size <= limit
    # A folder uploaded without a chunk record (an earlier version) is downloaded whole.
    fs.rm_file(f"{remote}/train.chunks.json")
    record = json.loads(fs.cat_file(f"{remote}/files.json"))
    record.pop("train.chunks.json")
    fs.pipe_file(f"{remote}/files.json", json.dumps(record).encode())
    config_data = yaml.safe_load(config.read_text())
    config_data["data"]["stream_cache_dir"] = str(tmp_path / "stream3")
    config.write_text(yaml.safe_dump(config_data))
    whole = _cli(["prepare", "--config", str(config)], endpoint, tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert (next((tmp_path / "stream3" / "prepared").glob("*/*")) / "train.bin").is_file()
