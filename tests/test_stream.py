"""Training tokens streamed from object storage in chunks (data/batches/stream.py): the block order, the bounded
cache, checksums on arrival, and a training run that streams, against a real S3 endpoint (moto's server,
the fixtures of test_object_storage)."""

import json

import numpy as np
import pytest
import yaml

from conftest import cli_in_process
from llm_trainer.data.batches.loader import BatchLoader, WindowRows
from llm_trainer.data.batches.stream import (
    WINDOW,
    ChunkedTokens,
    block_order,
    min_cached,
    schedule,
    write_chunk_record,
)
from llm_trainer.errors import UsageError
from test_object_storage import _experiment, s3, s3_server  # noqa: F401  (fixtures)


@pytest.fixture
def store(s3):  # noqa: F811
    """(an s3fs filesystem, a fresh bucket) on the local S3 server."""
    return s3


def _token_file(folder, n=100_000, dtype="uint16"):
    """A train.bin of `n` distinct-ish tokens and its chunk record, as prepare writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    np.arange(n, dtype=np.int64).astype(dtype).tofile(folder / "train.bin")
    write_chunk_record(folder)
    return json.loads((folder / "train.chunks.json").read_text())


def _samples(loader, steps):
    return [tuple(a.tolist() for a in loader.next_batch()[:2]) for _ in range(steps)]


def test_block_order_is_seeded_windowed_and_the_same_on_any_world_size(tmp_path, capsys):
    record = _token_file(tmp_path)
    tokens = ChunkedTokens(
        record, "uint16", url="unused", folder=tmp_path / "c", budget=0, whole=tmp_path / "train.bin"
    )
    assert tokens.n_chunks > 2 * WINDOW
    rows = WindowRows(tokens, 31, seed=3)
    first = rows.token_bounds()[0] // tokens.chunk_tokens
    order = block_order(first, tokens.n_chunks, seed=3, epoch=0)
    assert sorted(order.tolist()) == list(range(len(rows)))
    assert np.array_equal(order, block_order(first, tokens.n_chunks, seed=3, epoch=0))
    assert not np.array_equal(order, block_order(first, tokens.n_chunks, seed=3, epoch=1))
    homes = first[order]
    per_chunk = len(rows) // tokens.n_chunks
    for start in range(0, len(homes) - 64, 64):
        stretch = set(homes[start : start + 64].tolist())
        # A batch-sized stretch mixes many chunks (64 draws of WINDOW = 64 give ~40 distinct) ...
        assert len(stretch) >= 20
        # ... and a window's worth of training touches about WINDOW chunks, never the whole file.
        span = set(homes[start : start + WINDOW * per_chunk].tolist())
        assert len(span) <= 2 * WINDOW + 2 < tokens.n_chunks
    # Each chunk's rows are spread over about a window's time, not bunched together.
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))
    spreads = [np.ptp(where[first == c]) for c in range(1, tokens.n_chunks - 1)]
    assert np.median(spreads) > WINDOW * per_chunk // 2
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
    # A position saved in an earlier version's order (groups of 4 chunks): said too.
    again = BatchLoader(WindowRows(tokens, 31, seed=3), 4, shuffle=True, seed=3, accumulation=2)
    again.load_state_dict({**one.state_dict(), "order": "chunks"})
    assert "was by chunks in groups of 4, this run's is by chunks (an earlier version" in capsys.readouterr().err


def test_the_read_ahead_plan_names_each_chunk_again_when_its_rows_return(tmp_path):
    """A chunk whose keys wrap around the end of the epoch is read at its start and again at its end: the
    plan fetches it ahead both times, so no use of a chunk is far from the plan entry before it."""
    record = _token_file(tmp_path)
    tokens = ChunkedTokens(
        record, "uint16", url="unused", folder=tmp_path / "c", budget=0, whole=tmp_path / "train.bin"
    )
    first = WindowRows(tokens, 31, seed=3).token_bounds()[0] // tokens.chunk_tokens
    order = block_order(first, tokens.n_chunks, seed=3, epoch=0)
    samples, chunks = schedule(order, first, first, tokens.n_chunks)
    assert np.all(np.diff(samples) >= 0) and set(chunks.tolist()) == set(range(tokens.n_chunks))
    life = WINDOW * len(order) // tokens.n_chunks
    assert WINDOW // 2 <= len(chunks) - tokens.n_chunks <= 2 * WINDOW  # the wrapped ones, twice
    for c in range(tokens.n_chunks):
        entries = samples[chunks == c]
        uses = np.flatnonzero(first[order] == c)
        since = uses - entries[np.searchsorted(entries, uses, side="right") - 1]
        assert since.max() <= 2 * life


def _bucket_tokens(store, tmp_path, budget, n=100_000):
    fs, bucket = store
    record = _token_file(tmp_path / "made", n)
    fs.put_file(str(tmp_path / "made" / "train.bin"), f"{bucket}/p/train.bin")
    url = f"s3://{bucket}/p/train.bin"
    return fs, bucket, record, ChunkedTokens(record, "uint16", url=url, folder=tmp_path / "cache", budget=budget)


def test_streamed_batches_equal_local_ones_and_the_cache_stays_under_its_limit(store, tmp_path):
    record = _token_file(tmp_path / "probe")
    budget = (min_cached(len(record["chunks"])) + 1) * record["chunk_bytes"]
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


@pytest.mark.slow
def test_training_streams_from_a_bucket_with_the_losses_of_the_local_copy(store, tmp_path):
    fs, bucket = store
    words = ["cat", "dog", "bird", "fox", "owl", "eel"]
    for d in range(20):
        lines = [f"the {words[(d + i) % 6]} sat on mat {i % 13} of row {d}.\n" for i in range(150)]
        fs.pipe_file(f"{bucket}/corpus/doc{d:02d}.txt", "".join(lines).encode())
    config = _experiment(tmp_path, bucket, batch_size=32, max_steps=12, save_steps=0, eval_steps=6)
    # The run that prepares and uploads the data reads its local copy, in the block order.
    first = cli_in_process(["train", "--config", str(config), "training.checkpoint_dir=null"], tmp_path)
    assert first.returncode == 0, first.stderr
    (folder,) = (tmp_path / "stream" / "prepared").glob("*/*")
    record = json.loads((folder / "train.chunks.json").read_text())
    fs.invalidate_cache()
    (remote,) = fs.ls(f"{bucket}/prepared")
    assert "train.chunks.json" in {p.rsplit("/", 1)[-1] for p in fs.ls(remote)}
    small = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name != "train.bin")
    limit = small + (min_cached(len(record["chunks"])) + 2) * record["chunk_bytes"]
    assert limit < record["size"]
    # Another machine streams the training tokens through a cache smaller than them: the same losses.
    again = cli_in_process(
        [
            "train",
            "--config",
            str(config),
            "training.checkpoint_dir=null",
            f"training.output_dir={tmp_path / 'streamed'}",
            f"data.stream_cache_dir={tmp_path / 'stream2'}",
            f"data.stream_cache_limit={limit}",
        ],
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
    whole = cli_in_process(["prepare", "--config", str(config)], tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert (next((tmp_path / "stream3" / "prepared").glob("*/*")) / "train.bin").is_file()


@pytest.fixture
def uploaded(s3_server, tmp_path, request):  # noqa: F811
    """(fs, the prepared folder in a fresh bucket, a config that streams it into a fresh local cache)."""
    import re

    import s3fs

    from conftest import write_corpus
    from llm_trainer.config import DataConfig
    from llm_trainer.data.prepare import prepare_data

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    bucket = "t-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-50:].strip("-")
    fs.mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    config = DataConfig(
        data_files=[str(write_corpus(tmp_path / "corpus"))],
        tokenizer="char",
        validation_split=0.2,
        cache_dir=f"s3://{bucket}/prepared",
        stream_cache_dir=str(tmp_path / "made"),
    )
    prepare_data(config)
    fs.invalidate_cache()
    (remote,) = fs.ls(f"{bucket}/prepared")
    config.stream_cache_dir = str(tmp_path / "elsewhere")
    return fs, remote, config


def _plant(fs, remote: str, name: str, change) -> None:
    """Rewrite the JSON file `name` of the bucket's folder with `change` applied, and its files.json entry to
    match (a consistent record: the damage is in the content, not in transit)."""
    from llm_trainer.files.checksums import data_checksum

    data = json.loads(fs.cat_file(f"{remote}/{name}"))
    change(data)
    raw = json.dumps(data).encode()
    fs.pipe_file(f"{remote}/{name}", raw)
    files = json.loads(fs.cat_file(f"{remote}/files.json"))
    files[name] = {"size": len(raw), "checksum": data_checksum(raw)}
    fs.pipe_file(f"{remote}/files.json", json.dumps(files).encode())
    fs.invalidate_cache()


BAD_CONTENTS = {  # a manifest without splits or with a bad dtype; chunk records: chunk_bytes 0, a short
    # chunk list, a planted extra chunk, an unknown checksum kind
    "no-splits": ("manifest.json", lambda m: m.pop("splits"), r"no `splits`"),
    "dtype": ("manifest.json", lambda m: m.update(dtype="float64"), r"dtype 'float64'"),
    "chunk0": ("train.chunks.json", lambda r: r.update(chunk_bytes=0), r"chunk_bytes 0, not a positive"),
    "short": ("train.chunks.json", lambda r: r["chunks"].pop(), r"lists \d+ chunk checksums for"),
    "extra": (
        "train.chunks.json",
        lambda r: r["chunks"].append(r["chunks"][0]),
        r"lists \d+ chunk checksums for",
    ),
    "checksum": (
        "train.chunks.json",
        lambda r: r.update(checksum="md5-tree"),
        r"checksum kind 'md5-tree', which this version cannot compute",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONTENTS))
def test_bad_bucket_contents_are_one_line(uploaded, case):
    """Each is one line naming the file in the bucket and the fix."""
    from llm_trainer.data.prepare import prepare_data

    fs, remote, config = uploaded
    name, change, message = BAD_CONTENTS[case]
    _plant(fs, remote, name, change)
    with pytest.raises(UsageError, match=message) as caught:
        prepare_data(config)
    text = str(caught.value)
    assert "\n" not in text and f"{remote.rsplit('/', 1)[-1]}/{name}" in text and "prepare again" in text
    # The local copy of the damaged folder is not kept: a repaired bucket is fetched again.
    assert not any(config.local_cache_dir.glob("*/manifest.json"))


STREAMER = """
import sys
from llm_trainer.config import DataConfig
from llm_trainer.data.prepare import prepare_data
corpus, cache_dir, stream_dir = sys.argv[1:]
config = DataConfig(data_files=[corpus], tokenizer="char", validation_split=0.2, cache_dir=cache_dir,
                    stream_cache_dir=stream_dir)
tokens = prepare_data(config).tokens("train")
tokens.chunk(0)
print("streaming", flush=True)
sys.stdin.readline()  # another process makes room in the shared cache meanwhile
print("read", int(tokens[: len(tokens)].astype("int64").sum()), flush=True)
"""


@pytest.mark.slow
def test_the_shared_cache_never_evicts_a_folder_a_live_process_streams_from(uploaded, tmp_path):
    import subprocess
    import sys

    from conftest import src_env
    from llm_trainer.files import buckets

    fs, remote, config = uploaded
    args = [str(tmp_path / "corpus"), config.cache_dir, config.stream_cache_dir]
    child = subprocess.Popen(
        [sys.executable, "-c", STREAMER, *args],
        env={**src_env(), "OMP_NUM_THREADS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "streaming", child.stderr.read()
        (folder,) = config.local_cache_dir.glob("*/manifest.json")
        # Another process sharing the cache needs all its room: every folder not in use goes, this one stays.
        other = config.local_cache_dir.parent / "other" / "0123456789abcdef"
        other.mkdir(parents=True)
        (other / "tokens.bin").write_bytes(b"x" * 100)
        buckets.make_room(tmp_path / "elsewhere", 0, 1)
        assert folder.is_file() and not other.exists()
        out, err = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert out.startswith("read ")  # every chunk read (fetched into the folder) after the eviction
    # Its process gone, the folder is the least recently used like any other.
    buckets.make_room(tmp_path / "elsewhere", 0, 1)
    assert not folder.parent.exists()
