"""`prepare_data`'s choices a user sees in the log: how a validation fraction splits few files, and a
Hub dataset name refused at once when the Hub cannot be reached."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import free_port, write_corpus
from llm_trainer.config import DataConfig
from llm_trainer.errors import UsageError


def test_a_fraction_split_over_few_files_splits_by_tokens_and_says_so(tmp_path, capfd):
    """Three files at validation_split 0.1: no document would validate; the last 10% of each one's tokens
    do instead. Enough documents: split by documents, as before. Either way the log says which."""
    from llm_trainer.data.prepare import prepare_data

    folder = tmp_path / "few"
    folder.mkdir()
    texts = ["".join(chr(ord("a") + (i + k) % 26) for i in range(100)) for k in range(3)]
    for k, text in enumerate(texts):
        (folder / f"{k}.txt").write_text(text)
    prepared = prepare_data(
        DataConfig(data_files=str(folder), tokenizer="char", validation_split=0.1, cache_dir=str(tmp_path / "cache"))
    )
    assert (
        "3 document(s) are too few for a 0.1 split by documents; validation is the last 10% of each"
        in capfd.readouterr().err
    )
    assert prepared.manifest["splits"]["val"] == {"documents": 3, "tokens": 3 * 11}
    assert prepared.manifest["validation_split_by"] == "tokens"
    val = prepared.tokenizer.decode(np.asarray(prepared.tokens("val")).tolist())
    assert val == "".join(text[90:] for text in texts)

    many = prepare_data(
        DataConfig(
            data_files=str(write_corpus(tmp_path / "many")),
            tokenizer="char",
            validation_split=0.25,
            cache_dir=str(tmp_path / "cache"),
        )
    )
    assert "validation: 3 of 12 documents (validation_split 0.25)" in capfd.readouterr().err
    assert many.manifest["validation_split_by"] == "documents" and many.manifest["splits"]["val"]["documents"] == 3


@pytest.mark.parametrize("named_as", ["folder", "pattern"])
def test_a_file_written_into_the_data_during_a_prepare_is_the_next_prepares(tmp_path, monkeypatch, named_as):
    """A file that lands in a data folder (or a pattern's matches) after the prepare has fingerprinted
    the data is not read into the folder named by that fingerprint, which leaves it out: the prepare
    reads the files it listed for the fingerprint. The next prepare fingerprints it and reads it."""
    from llm_trainer.data.prepare import build, prepare_data

    corpus = write_corpus(tmp_path / "corpus")
    late = corpus / "zz-late.txt"
    fingerprint = build.source_fingerprint

    def fingerprint_while_another_writes(config):
        seen = fingerprint(config)
        if not late.exists():
            late.write_text("LATECOMER " * 40)
        return seen

    monkeypatch.setattr(build, "source_fingerprint", fingerprint_while_another_writes)
    spec = str(corpus) if named_as == "folder" else str(corpus / "*.txt")
    config = DataConfig(data_files=spec, tokenizer="char", validation_split=0.25, cache_dir=str(tmp_path / "cache"))

    def text(prepared) -> str:
        return "".join(prepared.tokenizer.decode(np.asarray(prepared.tokens(s)).tolist()) for s in ("train", "val"))

    first = prepare_data(config)
    assert "LATECOMER" not in text(first) and "the cat sat" in text(first)
    assert first.manifest["documents_in"] == 12
    monkeypatch.setattr(build, "source_fingerprint", fingerprint)
    second = prepare_data(config)
    assert second.directory != first.directory and "LATECOMER" in text(second)
    assert second.manifest["documents_in"] == 13


# Few documents in two sources, messy as found: CRLF, trailing spaces, runs of blank lines, control
# characters, and text in several scripts (a split by documents would hold none of them out at 0.2).
MESSY = {
    "a": [
        "Caf\u00e9 au lait, cafe\u0301 noir.  \r\nLine two\t \r\n\r\n\r\n\r\nEnd\x07 of it.\n",
        "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! " * 40
        + "\n\n\n\n\u6f22\u5b57\u3068\u304b\u306a\u3002" * 30,
    ],
    "b": [
        "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e\u0964  \n" * 50,
        "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645   \r\n" * 45 + "x",
    ],
}


def _messy_sources(root) -> list[dict]:
    sources = []
    for name, texts in MESSY.items():
        folder = root / name
        folder.mkdir(parents=True)
        for k, text in enumerate(texts):
            (folder / f"{k}.txt").write_bytes(text.encode())
        sources.append({"name": name, "data_files": str(folder)})
    return sources


def _documents(prepared, split: str) -> list[list[int]]:
    offsets, tokens = np.load(prepared.directory / f"{split}.idx.npy"), np.asarray(prepared.tokens(split))
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_a_split_by_tokens_cuts_the_documents_the_run_without_a_split_writes(tmp_path, tokenizer):
    """Each document's first 80% of tokens train and the rest validate, in stream order, with its source:
    cut from the documents the default path writes (no validation split), whose tokens are what encoding
    each kept text again gives, as the split once did."""
    from llm_trainer.data.prepare import prepare_data
    from llm_trainer.data.prepare.build import _kept_texts

    sources = _messy_sources(tmp_path / "corpus")

    def config(split: float) -> DataConfig:
        cache = str(tmp_path / f"cache-{split}")
        return DataConfig(
            sources=sources, tokenizer=tokenizer, tokenizer_vocab_size=300, validation_split=split, cache_dir=cache
        )

    whole, split = prepare_data(config(0)), prepare_data(config(0.2))
    assert split.manifest["validation_split_by"] == "tokens"
    assert (whole.directory / "tokenizer.json").read_bytes() == (split.directory / "tokenizer.json").read_bytes()
    documents, eot = _documents(whole, "train"), split.tokenizer.eot_id
    texts = list(_kept_texts(config(0.2), ("train", "val")))
    assert len(documents) == len(texts) == 4
    assert [document[:-1] for document in documents] == [split.tokenizer.encode(text) for text in texts]
    assert all(document[-1] == eot for document in documents)

    expected = {"train": [], "val": []}
    expected_sources = {"train": [], "val": []}
    for document, source in zip(documents, np.load(whole.directory / "train.sources.npy")):
        ids = document[:-1]
        cut = min(len(ids) - 1, max(1, int(len(ids) * 0.8)))
        for name, part in zip(("train", "val"), (ids[:cut], ids[cut:])):
            expected[name].append([*part, eot])
            expected_sources[name].append(int(source))
    for name in ("train", "val"):
        assert _documents(split, name) == expected[name]
        assert np.load(split.directory / f"{name}.sources.npy").tolist() == expected_sources[name]
    assert sorted(set(expected_sources["val"])) == [0, 1]
    assert not [p.name for p in split.directory.iterdir() if p.name.startswith("shards")]


def test_a_split_by_tokens_gives_both_pieces_of_a_document_its_score(tmp_path):
    """With a column as the curriculum key, each piece keeps its document's score."""
    import json

    from llm_trainer.data.prepare import prepare_data

    records = [
        {"text": f"document {k}: " + "words and more words. " * (20 + 7 * k), "quality": 0.5 * k} for k in range(3)
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    prepared = prepare_data(
        DataConfig(
            data_files=str(tmp_path / "records.jsonl"),
            tokenizer="char",
            validation_split=0.2,
            curriculum_key="quality",
            cache_dir=str(tmp_path / "cache"),
        )
    )
    assert prepared.manifest["validation_split_by"] == "tokens"
    for split in ("train", "val"):
        assert np.load(prepared.directory / f"{split}.scores.npy").tolist() == [0.0, 0.5, 1.0]


def test_a_record_without_a_numeric_curriculum_score_is_refused_alike_in_jsonl_parquet_and_datasets(tmp_path):
    """A null score: refused when prepared (naming the record), or skipped and counted with
    data.on_bad_input: skip, whichever format holds the records; the scores kept are the numbers."""
    import json

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm_trainer.data.prepare import prepare_data

    texts = [f"curriculum document number {i} with a handful of words in it" for i in range(8)]
    scores = [float(i % 4) for i in range(8)]
    scores[3] = None
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text(
        "".join(json.dumps({"text": t, "d": s}) + "\n" for t, s in zip(texts, scores))
    )
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"text": texts, "d": pa.array(scores, type=pa.float64())}), tmp_path / "p" / "a.parquet")
    datasets.Dataset.from_dict({"text": texts, "d": scores}).save_to_disk(str(tmp_path / "ds"))
    where = {"j": "a.jsonl:4", "p": "a.parquet[3]", "ds": "[3]"}
    for name, origin in where.items():
        source = {"dataset_name": str(tmp_path / name)} if name == "ds" else {"data_files": str(tmp_path / name)}
        common = dict(tokenizer="char", validation_split=0.0, curriculum_key="d", **source)
        with pytest.raises(UsageError, match=rf"{re.escape(origin)} has no numeric 'd' field \(data.curriculum_key\)"):
            prepare_data(DataConfig(cache_dir=str(tmp_path / f"c_{name}"), **common))
        kept = prepare_data(DataConfig(cache_dir=str(tmp_path / f"s_{name}"), on_bad_input="skip", **common))
        assert np.load(kept.directory / "train.scores.npy").tolist() == [s for s in scores if s is not None], name
        assert kept.manifest["documents_out"] == 7


@pytest.mark.parametrize(
    "at, exchange",
    [
        ("before the swap", True),
        ("before the first shards are deleted", True),
        ("before the first shards are deleted", False),
    ],
    ids=["before-the-swap", "after-the-exchange", "after-the-renames-without-an-exchange"],
)
def test_a_split_by_tokens_interrupted_as_its_shards_take_the_first_ones_place_resumes_to_the_same_files(
    tmp_path, monkeypatch, at, exchange
):
    """Stopped (Ctrl-C) as the split shards take the first pass's place (in one atomic exchange, or where
    the file system has none between two renames), the next prepare ends with the files an uninterrupted
    one writes, says it split by tokens, and leaves no shards behind."""
    from llm_trainer.data.prepare import prepare_data
    from llm_trainer.files import atomic

    sources = _messy_sources(tmp_path / "corpus")

    def config(cache: str) -> DataConfig:
        return DataConfig(
            sources=sources,
            tokenizer="bpe",
            tokenizer_vocab_size=300,
            validation_split=0.2,
            cache_dir=str(tmp_path / cache),
        )

    uninterrupted = prepare_data(config("uninterrupted"))

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    if at == "before the swap":
        monkeypatch.setattr("llm_trainer.data.prepare.shards.move_into_place", stop)
    else:
        monkeypatch.setattr(atomic, "_discard", stop)
    if not exchange:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(config("interrupted"))
    monkeypatch.undo()
    resumed = prepare_data(config("interrupted"))
    assert resumed.manifest["validation_split_by"] == "tokens"
    assert resumed.manifest["splits"] == uninterrupted.manifest["splits"]
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "train.sources.npy", "val.sources.npy"):
        assert (resumed.directory / name).read_bytes() == (uninterrupted.directory / name).read_bytes(), name
    assert sorted(p.name for p in resumed.directory.iterdir()) == sorted(
        p.name for p in uninterrupted.directory.iterdir()
    )
    assert not list((tmp_path / "interrupted").glob(".*.partial"))


def test_a_hub_dataset_offline_fails_fast_and_names_data_files(tmp_path, monkeypatch):
    """Refused before `datasets` is asked for the dataset (whose retries take tens of seconds)."""
    datasets = pytest.importorskip("datasets")
    from llm_trainer.data.prepare import prepare_data

    def never(*args, **kwargs):
        raise AssertionError("datasets.load_dataset was called: its retries would make this slow")

    monkeypatch.setattr(datasets, "load_dataset", never)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens: the Hub is unreachable
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError) as error:
        prepare_data(DataConfig(dataset_name="wikitext", dataset_config="wikitext-2-raw-v1", cache_dir=str(tmp_path)))
    message = str(error.value)
    assert "cannot be reached" in message and "data.data_files" in message and "\n" not in message
