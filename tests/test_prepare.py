"""`prepare_data`'s choices a user sees in the log: how a validation fraction splits few files, and a
Hub dataset name refused at once when the Hub cannot be reached."""

from __future__ import annotations

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
