"""Resumable prepare: shards committed one by one, SIGKILL mid-way, resume to byte-identical output."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import kill9_when
from llm_trainer.config import DataConfig
from llm_trainer.data.format import MANIFEST
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.prepare.report import REPORT
from llm_trainer.data.prepare.shards import ShardWriter

OUTPUTS = ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "tokenizer.json")


def corpus(tmp_path: Path) -> list[dict]:
    """Two sources of 1,000 short documents each, with exact and near duplicates across them."""
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(4000)]
    docs = [" ".join(rng.choice(vocab, 40)) for _ in range(2000)]
    for i in range(0, 2000, 50):  # copies across the two sources
        docs[(i + 1017) % 2000] = docs[i]
    for i in range(10, 2000, 70):  # near copies (the last word of 40 changed: Jaccard 36/38)
        words = docs[i - 5].split()
        words[-1] = "changed"
        docs[i] = " ".join(words)
    paths = []
    for name, part in (("a", docs[:1000]), ("b", docs[1000:])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in part), encoding="utf-8")
        paths.append(path)
    return [{"name": "a", "data_files": str(paths[0]), "weight": 2}, {"name": "b", "data_files": str(paths[1])}]


def settings(sources, cache: Path, **extra) -> dict:
    return dict(
        sources=sources,
        tokenizer="char",
        deduplication="near",
        cache_dir=str(cache),
        shard_tokens=3000,
        validation_split=0.1,
        progress_bar=False,
        max_length=32,
        **extra,
    )


def kill_mid_prepare(tmp_path: Path, values: dict, *, block_at_call: int = 7, min_shards: int = 4) -> Path:
    """Run prepare in a child that stops inside the tokenizer; SIGKILL it once shards are committed."""
    marker = tmp_path / "blocked"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from llm_trainer.config import DataConfig
        from llm_trainer.data.prepare import prepare_data
        from llm_trainer.tokenizer import Tokenizer

        real, calls = Tokenizer.encode_batch, []

        def slow(self, texts):
            calls.append(1)
            if len(calls) == {block_at_call}:
                Path({str(marker)!r}).write_text("x")
                time.sleep(120)
            return real(self, texts)

        Tokenizer.encode_batch = slow
        prepare_data(DataConfig(**{values!r}))
        """
    )
    cache = Path(values["cache_dir"])
    kill9_when(
        script,
        lambda: marker.exists() and len(list(cache.glob(".*.partial/shards/*.json"))) >= min_shards,
        "the blocked tokenizer call",
        timeout=90,
    )
    assert not list(cache.rglob(MANIFEST))  # nothing looks finished
    (work,) = cache.glob(".*.partial")
    return work


def comparable(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("seconds", "bytes_per_second", "resumed_from_shard")}


def small_corpus(tmp_path: Path) -> list[dict]:
    """900 ten-word documents (a few pipeline batches), every 40th an exact copy, every 70th a near copy."""
    rng = np.random.default_rng(1)
    vocab = [f"w{i}" for i in range(2000)]
    docs = [" ".join(rng.choice(vocab, 10)) for _ in range(900)]
    for i in range(40, 900, 40):
        docs[i] = docs[i - 17]
    for i in range(30, 900, 70):
        words = docs[i - 3].split()
        words[-1] = "changed"
        docs[i] = " ".join(words)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    return [{"name": "docs", "data_files": str(path)}]


def test_interrupted_after_the_first_shard_resumes_to_identical_output(tmp_path, monkeypatch):
    """Ctrl-C right after the first shard is committed; the next prepare takes that shard as it is and
    writes the rest: the same folder, byte for byte, as a run that was never interrupted."""
    sources = small_corpus(tmp_path)
    values = {**settings(sources, tmp_path / "interrupted"), "shard_tokens": 1000, "minhash_num_perm": 32}
    reference = prepare_data(DataConfig(**{**values, "cache_dir": str(tmp_path / "ref")}))
    ref_report = json.loads((reference.directory / REPORT).read_text())
    assert ref_report["shards"] >= 3
    assert ref_report["removed"]["exact_duplicates"] > 0 and ref_report["removed"]["near_duplicates"] > 0

    commit = ShardWriter.commit

    def commit_then_interrupt(self, state, *, done=False):
        commit(self, state, done=done)
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardWriter, "commit", commit_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(DataConfig(**values))
    monkeypatch.undo()
    (work,) = Path(values["cache_dir"]).glob(".*.partial")
    assert [path.name for path in (work / "shards").glob("*.json")] == ["00000.json"]
    assert not list(Path(values["cache_dir"]).rglob(MANIFEST))

    resumed = prepare_data(DataConfig(**values))
    report = json.loads((resumed.directory / REPORT).read_text())
    assert report["resumed_from_shard"] == 1
    assert resumed.directory.name == reference.directory.name
    for name in (*OUTPUTS, "train.sources.npy", "val.sources.npy"):
        assert (resumed.directory / name).read_bytes() == (reference.directory / name).read_bytes(), name

    def where_and_when_left_out(manifest: dict) -> dict:
        return {**manifest, "seconds": None, "config": {**manifest["config"], "cache_dir": None}}

    assert where_and_when_left_out(resumed.manifest) == where_and_when_left_out(reference.manifest)
    assert comparable(report) == comparable(ref_report)
    assert not work.exists()


@pytest.mark.slow
def test_sigkill_then_resume_gives_byte_identical_output(tmp_path):
    sources = corpus(tmp_path)
    reference = prepare_data(DataConfig(**settings(sources, tmp_path / "ref")))
    ref_report = json.loads((reference.directory / REPORT).read_text())
    assert ref_report["shards"] >= 5
    assert ref_report["removed"]["exact_duplicates"] > 0 and ref_report["removed"]["near_duplicates"] > 0

    values = settings(sources, tmp_path / "killed")
    work = kill_mid_prepare(tmp_path, values)
    records = sorted((work / "shards").glob("*.json"))
    committed = len(records)
    assert committed >= 3
    for path in records:  # each record's stream position is the number of documents its counters have seen
        state = json.loads(path.read_text())["state"]
        assert state["position"] == state["counts"]["documents_in"] > 0

    resumed = prepare_data(DataConfig(**values))
    report = json.loads((resumed.directory / REPORT).read_text())
    assert report["resumed_from_shard"] is not None and report["resumed_from_shard"] >= committed
    assert resumed.directory.name == reference.directory.name
    for name in OUTPUTS:
        assert (resumed.directory / name).read_bytes() == (reference.directory / name).read_bytes(), name
    assert comparable(report) == comparable(ref_report)  # counters continue where the shards left them
    assert resumed.manifest["splits"] == reference.manifest["splits"]
    assert not (resumed.directory / "shards").exists() and not work.exists()


@pytest.mark.slow
def test_a_damaged_shard_is_redone_not_trusted(tmp_path):
    sources = corpus(tmp_path)
    reference = prepare_data(DataConfig(**settings(sources, tmp_path / "ref")))
    values = settings(sources, tmp_path / "killed")
    work = kill_mid_prepare(tmp_path, values)
    records = sorted((work / "shards").glob("*.json"))
    last = int(records[-1].name.split(".")[0])
    damaged = work / "shards" / f"{last:05d}.train.bin"
    damaged.write_bytes(damaged.read_bytes()[:-6])  # a torn write the record does not match
    resumed = prepare_data(DataConfig(**values))
    assert json.loads((resumed.directory / REPORT).read_text())["resumed_from_shard"] == last
    for name in OUTPUTS:
        assert (resumed.directory / name).read_bytes() == (reference.directory / name).read_bytes(), name


@pytest.mark.slow
def test_changed_config_or_source_does_not_resume(tmp_path):
    sources = corpus(tmp_path)
    values = settings(sources, tmp_path / "cache")
    work = kill_mid_prepare(tmp_path, values, block_at_call=5, min_shards=2)
    other = prepare_data(DataConfig(**{**values, "min_length": 5}))  # another fingerprint: starts afresh
    assert json.loads((other.directory / REPORT).read_text())["resumed_from_shard"] is None
    assert work.exists()  # the interrupted build is still there for its own config
    time.sleep(0.02)
    path = Path(sources[1]["data_files"])
    path.write_text(path.read_text().replace("w1", "W1"))  # same config, changed source
    changed = prepare_data(DataConfig(**values))
    assert json.loads((changed.directory / REPORT).read_text())["resumed_from_shard"] is None
    assert changed.directory.name != work.name.strip(".").split(".")[0]


@pytest.mark.slow
def test_worker_processes_give_identical_output(tmp_path):
    sources = corpus(tmp_path)
    extra = {"quality_filters": "code"}  # cleaning, filters and MinHash run in the workers
    one = prepare_data(DataConfig(**{**settings(sources, tmp_path / "w1"), **extra}))
    two = prepare_data(DataConfig(**{**settings(sources, tmp_path / "w2", preprocessing_num_workers=2), **extra}))
    assert one.directory.name == two.directory.name
    for name in OUTPUTS:
        assert (one.directory / name).read_bytes() == (two.directory / name).read_bytes(), name
    assert comparable(json.loads((one.directory / REPORT).read_text())) == comparable(
        json.loads((two.directory / REPORT).read_text())
    )
