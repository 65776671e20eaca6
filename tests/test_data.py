"""Data pipeline: sources, cleaning, splitting, tokenizers, the prepare cache, row layouts, the batch loader, the CLI.

Every corpus here is a few kilobytes written into `tmp_path`; tokenizers are char-level unless the test
is about BPE, so the whole file runs in seconds.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from conftest import kill9_when, src_env
from llm_trainer.config import DataConfig
from llm_trainer.data.batches.loader import IGNORE_INDEX, BatchLoader, DocumentRows, WindowRows
from llm_trainer.data.batches.packing import first_fit_decreasing
from llm_trainer.data.format import MANIFEST
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.text.clean import clean_text
from llm_trainer.data.text.sources import stdlib_files
from llm_trainer.errors import UsageError
from llm_trainer.tokenizer import EOT, UNK, Tokenizer

# ----------------------------------------------------------------------------------------------
# helpers


def config(tmp_path: Path, **overrides) -> DataConfig:
    """A DataConfig with a cache inside tmp_path and the (fast) char tokenizer unless told otherwise."""
    overrides.setdefault("cache_dir", str(tmp_path / "cache"))
    overrides.setdefault("tokenizer", "char")
    return DataConfig(**overrides)


def documents(prepared, split: str) -> list[str]:
    """Decode a split back into its documents, checking that each ends in exactly one end-of-text."""
    if prepared.manifest["splits"][split]["tokens"] == 0:
        return []
    tokens = np.asarray(prepared.tokens(split))
    offsets = prepared.offsets(split)
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    eot = prepared.tokenizer.eot_id
    out = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        assert tokens[end - 1] == eot
        assert eot not in tokens[start : end - 1].tolist()
        out.append(prepared.tokenizer.decode(tokens[start : end - 1].tolist()))
    return out


def write_jsonl(path: Path, records: list, *, compress: bool = False) -> Path:
    lines = "".join(json.dumps(r) + "\n" for r in records)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def numbered_docs(n: int) -> list[str]:
    return [f"document number {i}\n    indented line {i * 7}" for i in range(n)]


def finished_folders(cache: Path) -> list[Path]:
    """Every folder under the cache (temporary ones included) that holds a manifest."""
    return sorted({p.parent for p in cache.rglob(MANIFEST)})


# ----------------------------------------------------------------------------------------------
# sources


def test_text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first line\nsecond line\n", encoding="utf-8")
    prepared = prepare_data(config(tmp_path, data_files=str(path), validation_split=0.0))
    assert documents(prepared, "train") == ["first line\nsecond line"]
    assert prepared.manifest["splits"]["val"] == {"documents": 0, "tokens": 0}
    assert len(prepared.tokens("val")) == 0  # an empty split reads as an empty array
    assert prepared.manifest["documents_in"] == prepared.manifest["documents_out"] == 1


def test_folder_recursive_skips_and_counts_bad_files(tmp_path, capsys):
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha text", encoding="utf-8")
    (root / "sub" / "b.md").write_text("# beta\n\nmarkdown", encoding="utf-8")
    (root / "sub" / "deeper" / "c.py").write_text("def gamma():\n    return 3\n", encoding="utf-8")
    (root / "blob.txt").write_bytes(b"GIF89a\x00\x01\x02binary")
    (root / "latin.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / ".hidden.txt").write_text("never read", encoding="utf-8")

    prepared = prepare_data(config(tmp_path, data_files=str(root), validation_split=0.0))
    assert documents(prepared, "train") == ["alpha text", "# beta\n\nmarkdown", "def gamma():\n    return 3"]
    skipped, removed = prepared.manifest["skipped_inputs"], prepared.manifest["removed"]
    assert skipped == {"binary_files": 1, "non_utf8_files": 1, "unsupported_files": 1}  # files, never documents
    assert removed["min_length"] == 0 and "binary_files" not in removed
    assert prepared.manifest["documents_out"] == prepared.manifest["documents_in"] - sum(removed.values()) == 3
    # each skipped input is named with its reason, in the report and on the console
    named = json.loads((prepared.directory / "data_report.json").read_text())["skipped_inputs_named"]
    assert named["unsupported_files"] == [
        f"{root / 'image.png'} (not read: extension '.png' is not a text, "
        "JSONL or Parquet one; name the file in data.data_files to read it as text)"
    ]
    assert named["binary_files"] == [f"{root / 'blob.txt'} looks like a binary file, not text"]  # skipped: no advice
    assert named["non_utf8_files"][0].startswith(f"{root / 'latin.txt'} is not UTF-8 text")
    err = capsys.readouterr().err
    assert f"data: skipped (unsupported_files): {root / 'image.png'} (not read: extension '.png'" in err
    assert f"data: skipped (binary_files): {root / 'blob.txt'}" in err


def test_a_folder_never_gives_files_below_a_hidden_folder(tmp_path):
    """A folder someone else made: a git checkout's `.git/` (refs, config, the commit message) and any
    other dot-folder stay out of the training text, as hidden files do."""
    root = tmp_path / "repo"
    (root / ".git" / "refs").mkdir(parents=True)
    (root / ".git" / "config").write_text("[core]\n\trepositoryformatversion = 0\n", encoding="utf-8")
    (root / ".git" / "COMMIT_EDITMSG").write_text("private commit message\n", encoding="utf-8")
    (root / ".git" / "refs" / "main").write_text("0123abcd\n", encoding="utf-8")
    (root / "src" / ".cache").mkdir(parents=True)
    (root / "src" / ".cache" / "notes.txt").write_text("cached secret", encoding="utf-8")
    (root / "src" / "main.py").write_text('print("hi there")\n', encoding="utf-8")
    prepared = prepare_data(config(tmp_path, data_files=str(root), validation_split=0.0))
    assert documents(prepared, "train") == ['print("hi there")']
    assert not json.loads((prepared.directory / "data_report.json").read_text())["skipped_inputs_named"]


def test_an_existing_path_with_glob_characters_is_read_literally(tmp_path):
    """`data[1].txt` and a folder `corpus[2024]` are read as named, not as patterns that would match
    `data1.txt` (another file) or nothing; a pattern with a bracket that matches nothing says how to
    write a literal one."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "[1].txt").write_text("bracket file", encoding="utf-8")
    (tmp_path / "s" / "1.txt").write_text("plain file", encoding="utf-8")
    (tmp_path / "corpus[2024]").mkdir()
    (tmp_path / "corpus[2024]" / "a.txt").write_text("inside the bracket folder", encoding="utf-8")
    named = prepare_data(config(tmp_path, data_files=str(tmp_path / "s" / "[1].txt"), validation_split=0.0))
    assert documents(named, "train") == ["bracket file"]
    folder = prepare_data(config(tmp_path, data_files=str(tmp_path / "corpus[2024]"), validation_split=0.0))
    assert documents(folder, "train") == ["inside the bracket folder"]
    pattern = prepare_data(config(tmp_path, data_files=str(tmp_path / "s" / "[1].*"), validation_split=0.0))
    assert documents(pattern, "train") == ["plain file"]  # not a path that exists: a pattern, [1] matching "1"
    message = _error(tmp_path, data_files=str(tmp_path / "corpus[2024]" / "*.txt"))
    assert "matches no files" in message and "write [[] for a [ in a name" in message


def test_glob(tmp_path):
    (tmp_path / "g" / "nested").mkdir(parents=True)
    (tmp_path / "g" / "one.txt").write_text("one", encoding="utf-8")
    (tmp_path / "g" / "nested" / "two.txt").write_text("two", encoding="utf-8")
    (tmp_path / "g" / "nested" / "skip.md").write_text("not matched", encoding="utf-8")
    pattern = str(tmp_path / "g" / "**" / "*.txt")
    prepared = prepare_data(config(tmp_path, data_files=[pattern], validation_split=0.0))
    assert documents(prepared, "train") == ["two", "one"]  # sorted by path: g/nested/two.txt < g/one.txt


def test_jsonl_and_gzipped_jsonl(tmp_path):
    plain = write_jsonl(tmp_path / "a.jsonl", [{"text": "plain one", "id": 1}, {"text": "plain two"}])
    with plain.open("a", encoding="utf-8") as handle:
        handle.write("\n")  # blank lines are ignored
        handle.write(json.dumps({"text": None}) + "\n")  # non-string values are skipped, counted and named
        handle.write(json.dumps({"text": 42}) + "\n")
    packed = write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "zipped \u00fcn\u00efcode"}], compress=True)
    prepared = prepare_data(config(tmp_path, data_files=[str(plain), str(packed)], validation_split=0.0))
    assert documents(prepared, "train") == ["plain one", "plain two", "zipped \u00fcn\u00efcode"]
    named = json.loads((prepared.directory / "data_report.json").read_text())["skipped_inputs_named"]
    assert named["non_text_values"] == [
        f"{plain}:4: 'text' holds null, not text",
        f"{plain}:5: 'text' holds int, not text",
    ]
    only_nulls = write_jsonl(tmp_path / "nulls.jsonl", [{"text": None}, {"text": None}])
    message = _error(tmp_path, data_files=str(only_nulls))
    assert "has no documents (skipped: non_text_values 2; e.g. " in message and "'text' holds null, not text" in message


COMPRESSORS = {
    ".gz": gzip.compress,
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
    ".zst": lambda raw: pytest.importorskip("zstandard").ZstdCompressor().compress(raw),
}


def _messy_text(i: int) -> str:
    """Text as corpora come: CRLF, trailing spaces, runs of blank lines, control characters, other scripts."""
    return (
        f"Document {i}: caf\u00e9 and cafe\u0301\r\nwith trailing spaces   \n\n\n\n\u043c\u0438\u0440 \u6c34 "
        f"\u0928\u092e\u0938\u094d\u0924\u0947 \u0645\u0631\u062d\u0628\u0627\x07 bell\x0c feed\r\n" * (i + 2)
    )


def test_compressed_files_give_the_documents_of_the_same_files_uncompressed(tmp_path):
    """gzip, bzip2, xz and zstandard text files, and compressed JSON Lines (`.jsonl.bz2`, C4's `.json.gz`),
    found in a folder: the prepared data is byte for byte that of the same folder uncompressed."""
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    for i, suffix in enumerate(COMPRESSORS):
        raw = _messy_text(i).encode()
        (plain / f"doc{i}.txt").write_bytes(raw)
        (packed / f"doc{i}.txt{suffix}").write_bytes(COMPRESSORS[suffix](raw))
    for name, compress in (("records.jsonl", bz2.compress), ("c4-part.json", gzip.compress)):
        raw = "".join(json.dumps({"text": _messy_text(i) + name}) + "\n" for i in range(3)).encode()
        (plain / (name if name.endswith(".jsonl") else "c4-part.jsonl")).write_bytes(raw)
        (packed / (name + (".bz2" if compress is bz2.compress else ".gz"))).write_bytes(compress(raw))

    def prepared(folder: Path):
        return prepare_data(config(tmp_path, data_files=str(folder), validation_split=0.2, tokenizer="bpe"))

    expected, read = prepared(plain), prepared(packed)
    assert read.manifest["documents_in"] == expected.manifest["documents_in"] == 10
    assert "unsupported_files" not in read.manifest["skipped_inputs"]
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (read.directory / name).read_bytes() == (expected.directory / name).read_bytes(), name


def test_compressed_files_that_cannot_be_read_say_why(tmp_path, monkeypatch):
    """In a folder: an archive, a compressed file of an unknown kind, a damaged one and one that expands
    past the compression-ratio limit are skipped and named with the reason. Named on their own: the
    unknown kind is read as text (what its reason says), the others are one-line errors."""
    import tarfile

    from llm_trainer import limits

    root = tmp_path / "corpus"
    root.mkdir()
    (root / "good.txt.gz").write_bytes(gzip.compress(b"good text"))
    with tarfile.open(root / "bundle.tar.gz", "w:gz") as archive:
        archive.add(root / "good.txt.gz", arcname="good.txt.gz")
    (root / "notes.log.xz").write_bytes(lzma.compress(b"a log line"))
    (root / "damaged.txt.gz").write_bytes(gzip.compress(b"some text " * 100)[:-12])
    zst = zstandard.ZstdCompressor().compress(b"more text " * 100_000)
    (root / "damaged.txt.zst").write_bytes(zst[: len(zst) * 2 // 3])  # cut: refused as gzip's is, not read short
    (root / "bomb.txt.gz").write_bytes(gzip.compress(b"a" * (65 << 20), compresslevel=1))
    prepared = prepare_data(config(tmp_path, data_files=str(root), validation_split=0.0))
    assert documents(prepared, "train") == ["good text"]
    named = json.loads((prepared.directory / "data_report.json").read_text())["skipped_inputs_named"]
    bomb_size = (root / "bomb.txt.gz").stat().st_size
    assert named == {
        "oversized_files": [
            f"{root / 'bomb.txt.gz'} decompresses to more than {64 << 20:,} bytes, over 100 times its "
            f"{bomb_size:,} bytes (limits.MAX_COMPRESSION_RATIO); split it into smaller files, or write it as "
            "JSON Lines, which are read line by line"
        ],
        "unreadable_files": [
            f"{root / 'damaged.txt.gz'} could not be decompressed (Compressed file ended before the "
            "end-of-stream marker was reached)",
            f"{root / 'damaged.txt.zst'} could not be decompressed (the file ends inside a zstandard frame "
            "(truncated))",
        ],
        "unsupported_files": [
            f"{root / 'bundle.tar.gz'} (not read: an archive of files; unpack it and name the folder in data.data_files)",
            f"{root / 'notes.log.xz'} (not read: extension '.log' (compressed: .xz) is not a text, JSONL or Parquet "
            "one; name the file in data.data_files to read it as text)",
        ],
    }

    named_alone = prepare_data(config(tmp_path, data_files=str(root / "notes.log.xz"), validation_split=0.0))
    assert documents(named_alone, "train") == ["a log line"]
    assert _error(tmp_path, data_files=str(root / "bundle.tar.gz")) == (
        f"{root / 'bundle.tar.gz'} is an archive of files; unpack it and name the folder in data.data_files"
    )
    assert "damaged.txt.gz could not be decompressed" in _error(tmp_path, data_files=str(root / "damaged.txt.gz"))
    assert "damaged.txt.zst could not be decompressed" in _error(tmp_path, data_files=str(root / "damaged.txt.zst"))
    records = "".join(json.dumps({"text": f"record {i} of a few words"}) + "\n" for i in range(20_000)).encode()
    whole = zstandard.ZstdCompressor().compress(records)
    (root / "part.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    message = _error(tmp_path, data_files=str(root / "part.jsonl.zst"))
    assert "part.jsonl.zst:" in message and "could not be decompressed (the file ends inside a zstandard frame" in (
        message
    )
    monkeypatch.setattr(limits, "MAX_DECOMPRESSED_TEXT_BYTES", 5)
    assert _error(tmp_path, data_files=str(root / "good.txt.gz")) == (
        f"{root / 'good.txt.gz'} decompresses to more than 5 bytes, over the limit of 5 bytes for a text file, "
        "which is read whole (limits.MAX_DECOMPRESSED_TEXT_BYTES); split it into smaller files, or write it as "
        "JSON Lines, which are read line by line"
    )


def test_windows_encodings_a_utf8_bom_in_jsonl_and_utf16_text(tmp_path):
    """What Windows editors save: a UTF-8 BOM before the first JSON line is no part of the record, a
    UTF-16 text file (with its BOM) is read as the same text, and UTF-16 JSON Lines are named as such."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "first record"}).encode() + b"\n")
    utf16 = tmp_path / "notepad.txt"
    utf16.write_bytes("Caf\u00e9 from Notepad\r\n\u4e2d\u6587 line\r\n".encode("utf-16"))
    prepared = prepare_data(config(tmp_path, data_files=[str(bom), str(utf16)], validation_split=0.0))
    assert documents(prepared, "train") == ["first record", "Caf\u00e9 from Notepad\n\u4e2d\u6587 line"]
    lines16 = tmp_path / "records16.jsonl"
    lines16.write_bytes((json.dumps({"text": "x"}) + "\n").encode("utf-16"))
    assert "is UTF-16 text; JSON Lines are UTF-8: convert it" in _error(tmp_path, data_files=str(lines16))


def test_jsonl_custom_text_column(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"content": "from content"}, {"content": "second"}])
    prepared = prepare_data(config(tmp_path, data_files=str(path), text_column="content", validation_split=0.0))
    assert documents(prepared, "train") == ["from content", "second"]


def test_parquet_with_several_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i} body" for i in range(7)]
    table = pa.table({"id": list(range(7)), "body": texts})
    path = tmp_path / "data.parquet"
    pq.write_table(table, path, row_group_size=2)
    assert pq.ParquetFile(path).num_row_groups == 4
    prepared = prepare_data(config(tmp_path, data_files=str(path), text_column="body", validation_split=0.0))
    assert documents(prepared, "train") == texts


def test_local_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    folder = tmp_path / "ds"
    texts = [f"hf document {i}" for i in range(5)]
    datasets.Dataset.from_dict({"text": texts, "n": list(range(5))}).save_to_disk(str(folder))
    prepared = prepare_data(config(tmp_path, dataset_name=str(folder), validation_split=0.0))
    assert documents(prepared, "train") == texts

    # the folder is the source: new content under the same name must not reuse the old cache
    folder2 = tmp_path / "ds_new"
    datasets.Dataset.from_dict({"text": ["replaced"], "n": [0]}).save_to_disk(str(folder2))
    import shutil

    shutil.rmtree(folder)
    shutil.copytree(folder2, folder)
    again = prepare_data(config(tmp_path, dataset_name=str(folder), validation_split=0.0))
    assert again.directory != prepared.directory
    assert documents(again, "train") == ["replaced"]

    # a single saved split has no other named split to validate on
    with pytest.raises(UsageError, match="single split, so it has no split .test."):
        prepare_data(config(tmp_path, dataset_name=str(folder), validation_split="test"))


def test_local_hf_dataset_dict_named_validation_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    folder = tmp_path / "dd"
    train = [f"train doc {i}" for i in range(5)]
    test = [f"test doc {i}" for i in range(4)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": train}), "test": datasets.Dataset.from_dict({"text": test})}
    ).save_to_disk(str(folder))
    prepared = prepare_data(config(tmp_path, dataset_name=str(folder), validation_split="test"))
    assert documents(prepared, "train") == train
    assert documents(prepared, "val") == test
    # max_documents caps each split, so validation is not starved by the training split's count
    capped = prepare_data(config(tmp_path, dataset_name=str(folder), validation_split="test", max_documents=3))
    assert documents(capped, "train") == train[:3]
    assert documents(capped, "val") == test[:3]
    # a split it does not have: its splits named, and the setting that chose the wrong one
    message = _error(tmp_path, dataset_name=str(folder), validation_split="valid")
    assert (
        message
        == f"dataset {str(folder)!r} has no split 'valid' (its splits: train, test); set data.validation_split to one of them"
    )
    assert "set data.dataset_split to one of them" in _error(tmp_path, dataset_name=str(folder), dataset_split="tain")


def test_python_stdlib_source(tmp_path):
    cfg = config(tmp_path, dataset_name="python-stdlib", max_documents=3, validation_split=0.0)
    prepared = prepare_data(cfg)
    assert prepared.manifest["documents_out"] == 3
    expected = []
    for path in stdlib_files():
        try:
            text = clean_text(path.read_bytes().decode("utf-8"), cfg)
        except UnicodeDecodeError:
            continue
        if text.strip():
            expected.append(text)
        if len(expected) == 3:
            break
    assert documents(prepared, "train") == expected


# -- source errors


def _error(tmp_path, **overrides) -> str:
    with pytest.raises(UsageError) as info:
        prepare_data(config(tmp_path, **overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file_is_an_error(tmp_path):
    assert "nowhere.txt" in _error(tmp_path, data_files=str(tmp_path / "nowhere.txt"))


def test_explicit_binary_file_is_an_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00\x01\x02\x03" * 10)
    message = _error(tmp_path, data_files=str(path))
    assert str(path) in message and "binary" in message


def test_a_stray_nul_in_utf8_text_is_a_control_character_not_a_binary_file(tmp_path):
    """One NUL in a Hindi text file: the text is read and cleaned (the NUL removed, as in a JSON record),
    in a folder and named alone; bytes that decode as UTF-8 but are mostly NULs (small integers) stay binary."""
    line = "भारत एक विशाल देश है। हिंदी भाषा में बहुत सारी कहानियाँ लिखी गई हैं।\n"
    text = line * 100
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(text[:3000] + "stray\x00nul" + text[3000:], encoding="utf-8")
    (tmp_path / "corpus" / "ids.txt").write_bytes(np.arange(1, 100, dtype=np.int32).tobytes())  # valid UTF-8, 74% NULs
    clean = tmp_path / "clean.txt"
    clean.write_text(text[:3000] + "straynul" + text[3000:], encoding="utf-8")
    expected = documents(prepare_data(config(tmp_path / "c", data_files=str(clean), validation_split=0.0)), "train")
    in_folder = prepare_data(config(tmp_path / "f", data_files=str(tmp_path / "corpus"), validation_split=0.0))
    assert documents(in_folder, "train") == expected and "\x00" not in expected[0]
    assert in_folder.manifest["skipped_inputs"]["binary_files"] == 1  # ids.txt
    named = prepare_data(config(tmp_path / "n", data_files=str(tmp_path / "corpus" / "a.txt"), validation_split=0.0))
    assert documents(named, "train") == expected
    assert "binary" in _error(tmp_path / "e", data_files=str(tmp_path / "corpus" / "ids.txt"))


def test_explicit_non_utf8_file_is_an_error(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("na\u00efve".encode("latin-1"))
    message = _error(tmp_path, data_files=str(path))
    assert str(path) in message and "UTF-8" in message


def test_jsonl_line_that_is_not_json(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    assert f"{path}:2" in _error(tmp_path, data_files=str(path))


def test_jsonl_without_text_column(tmp_path):
    path = write_jsonl(tmp_path / "other.jsonl", [{"body": "x"}])
    message = _error(tmp_path, data_files=str(path))
    assert f"{path}:1" in message and "'text'" in message


def test_jsonl_not_utf8_is_an_error(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    message = _error(tmp_path, data_files=str(path))
    assert str(path) in message and "UTF-8" in message


def test_parquet_without_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), path)
    message = _error(tmp_path, data_files=str(path))
    assert str(path) in message and "'text'" in message and "body" in message
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), numbers)
    message = _error(tmp_path, data_files=str(numbers))
    assert f"{numbers}: column 'text' holds int64, not text; set data.text_column to a string column" in message


def test_glob_matching_nothing(tmp_path):
    pattern = str(tmp_path / "*.nomatch")
    message = _error(tmp_path, data_files=pattern)
    assert pattern in message and "matches no files" in message


def test_a_length_filter_that_removes_everything_says_what_it_measured(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("a short story of forty characters or so.\n", encoding="utf-8")
    message = _error(tmp_path, data_files=str(path), min_length=1000, validation_split=0.0)
    assert f"all 1 documents read were removed (1 by min_length), e.g. {path} (40 characters vs min_length 1000)" in (
        message
    )


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_sources_with_no_text_give_no_training_documents(tmp_path, tokenizer):
    path = tmp_path / "blank.txt"
    path.write_text("   \n\n\t\n", encoding="utf-8")
    kwargs = {"tokenizer_vocab_size": 300} if tokenizer == "bpe" else {}
    assert "no training documents" in _error(tmp_path, data_files=str(path), tokenizer=tokenizer, **kwargs)
    assert finished_folders(tmp_path / "cache") == []
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary folder is gone too


# ----------------------------------------------------------------------------------------------
# cleaning


def test_clean_text_rules(tmp_path):
    cfg = config(tmp_path, data_files="unused")
    assert clean_text("a\r\nb\rc\r\n", cfg) == "a\nb\nc"
    assert clean_text("x = 1   \ny = 2\t\nlast line  \t", cfg) == "x = 1\ny = 2\nlast line"
    assert clean_text("a\n\n\n\n\nb\n\n\nc", cfg) == "a\n\nb\n\nc"
    assert clean_text("a\n   \n\t\n\nb", cfg) == "a\n\nb"  # whitespace-only lines are blank lines
    code = "def f(x):\n    if x:\n\t\treturn  x\n    return 0"
    assert clean_text(code, cfg) == code
    assert clean_text("\n\n    indented first line\n", cfg) == "    indented first line"


def test_clean_text_without_normalization(tmp_path):
    cfg = config(tmp_path, data_files="unused", normalize_whitespace=False)
    text = "a   \n\n\n\n\tb  \n\n"
    assert clean_text(text, cfg) == text
    assert clean_text("a \r\nb", cfg) == "a \nb"  # newlines are still unified


def test_cleaning_and_min_length_in_prepare(tmp_path):
    docs = ["short", "long enough   \r\n\r\n\r\n\r\n  kept", "tiny", "   ", "another long document"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    prepared = prepare_data(config(tmp_path, data_files=str(path), min_length=10, validation_split=0.0))
    assert documents(prepared, "train") == ["long enough\n\n  kept", "another long document"]
    manifest = prepared.manifest
    assert manifest["removed"]["min_length"] == 3
    assert manifest["documents_in"] == 5 and manifest["documents_out"] == 2


def _corpus_with_everything_removed(path: Path) -> Path:
    """60 distinct documents with exact copies, near copies and too-short documents mixed in."""
    rng = np.random.default_rng(3)
    vocab = [f"w{i}" for i in range(500)]
    distinct = [" ".join(rng.choice(vocab, 30)) for _ in range(60)]
    docs = []
    for i, text in enumerate(distinct):
        docs.append(text)
        if i % 7 == 3:
            docs.append("  " + distinct[i - 2].upper() + "\n")  # an exact copy after normalisation
        if i % 9 == 4:
            words = distinct[i - 1].split()
            words[-1] = "changed"
            docs.append(" ".join(words))  # a near copy
        if i % 5 == 0:
            docs.append("tiny")  # dropped by min_length
    return write_jsonl(path, [{"text": t} for t in docs])


@pytest.mark.parametrize("tokenizer", ["bpe", "char"])
def test_the_tokenizer_learns_from_exactly_the_documents_written(tmp_path, monkeypatch, tokenizer):
    """Filters, exact and near dedup, the split and the document cap decide alike for the tokenizer's
    corpus and for the token files: BPE learns from the training documents written (in their order),
    the char vocabulary from the training and validation documents written."""
    seen: list[str] = []
    name = "train_bpe" if tokenizer == "bpe" else "build_char"
    real = getattr(Tokenizer, name).__func__

    def recording(cls, texts, *args, **kwargs):
        texts = list(texts)
        seen.extend(texts)
        return real(cls, texts, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, name, classmethod(recording))
    path = _corpus_with_everything_removed(tmp_path / "docs.jsonl")
    prepared = prepare_data(
        config(
            tmp_path,
            data_files=str(path),
            tokenizer=tokenizer,
            tokenizer_vocab_size=300,
            min_length=10,
            deduplication="near",
            validation_split=0.2,
            max_documents=45,
        )
    )
    manifest = prepared.manifest
    assert manifest["removed"]["min_length"] > 0
    assert manifest["removed"]["exact_duplicates"] > 0 and manifest["removed"]["near_duplicates"] > 0
    assert manifest["documents_out"] == 45 and manifest["documents_in"] < len(path.read_text().splitlines())
    train, val = documents(prepared, "train"), documents(prepared, "val")
    assert len(train) == 36 and len(val) == 9
    if tokenizer == "bpe":
        assert seen == train
    else:
        assert sorted(seen) == sorted(train + val)


# ----------------------------------------------------------------------------------------------
# splits


@pytest.mark.parametrize(
    "n, fraction, val_indices",
    [(20, 0.1, [9, 19]), (8, 0.25, [3, 7]), (10, 0.5, [1, 3, 5, 7, 9]), (10, 0.3, [3, 6, 9])],
)
def test_fractional_split_is_even_and_deterministic(tmp_path, n, fraction, val_indices):
    docs = numbered_docs(n)
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in docs])
    prepared = prepare_data(config(tmp_path, data_files=str(path), validation_split=fraction))
    assert documents(prepared, "val") == [docs[i] for i in val_indices]
    assert documents(prepared, "train") == [d for i, d in enumerate(docs) if i not in val_indices]
    assert prepared.manifest["splits"]["val"]["documents"] == len(val_indices)
    again = prepare_data(
        config(tmp_path, data_files=str(path), validation_split=fraction, cache_dir=str(tmp_path / "c2"))
    )
    assert again.directory.name == prepared.directory.name
    for split in ("train", "val"):
        assert (again.directory / f"{split}.bin").read_bytes() == (prepared.directory / f"{split}.bin").read_bytes()


def test_single_document_is_split_by_position(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    path = tmp_path / "one.txt"
    path.write_text(text + "\n", encoding="utf-8")
    prepared = prepare_data(config(tmp_path, data_files=str(path), validation_split=0.1))
    assert documents(prepared, "train") == [text[:90]]
    assert documents(prepared, "val") == [text[90:]]


def test_train_bin_decodes_to_documents_joined_by_eot(tmp_path):
    docs = [
        "def add(a, b):\n    return a + b  \n",
        "Plain prose,\r\nwith \u00fcmlauts and emoji \U0001f600.\n\n\n\n",
        "\tclass Tab:\n\t\tpass",
        "x = [1, 2, 3]\nprint(x)",
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": t} for t in docs])
    cfg = config(tmp_path, data_files=str(path), tokenizer="bpe", tokenizer_vocab_size=300, validation_split=0.25)
    prepared = prepare_data(cfg)
    cleaned = [clean_text(t, cfg) for t in docs]
    train = [cleaned[i] for i in (0, 1, 2)]  # document 3 is the validation one at 0.25
    tokens = np.asarray(prepared.tokens("train")).tolist()
    assert prepared.tokenizer.decode(tokens, skip_special_tokens=False) == "".join(t + EOT for t in train)
    val = np.asarray(prepared.tokens("val")).tolist()
    assert prepared.tokenizer.decode(val, skip_special_tokens=False) == cleaned[3] + EOT
    assert documents(prepared, "train") == train


# ----------------------------------------------------------------------------------------------
# tokenizers


def test_char_tokenizer_round_trip_and_unknown():
    text = "def f(x):\n\treturn x  # \u00e9t\u00e9 \u03bb\u2192 \U0001f600\n\nend"
    tok = Tokenizer.build_char([text])
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, newlines and emoji included
    assert tok.decode(ids) == text
    assert tok.vocab_size == len(set(text)) + 2
    unk = tok.backend.token_to_id(UNK)
    assert tok.encode("Z\u4e2d") == [unk, unk]
    assert tok.encode("x") == [tok.backend.token_to_id("x")]
    assert (
        tok.decode(tok.encode("de") + [tok.eot_id] + tok.encode("fx"), skip_special_tokens=False) == "de" + EOT + "fx"
    )


def test_char_tokenizer_ids_are_the_ids_tokenizers_gives(tmp_path):
    """The char tokenizer encodes by a table lookup (`CharTable`), built or read from its tokenizer.json:
    the ids are those of `tokenizers` itself on messy text in several scripts, unknown characters, the
    end-of-text string in a text (one token, read by `tokenizers`) and a lone surrogate (refused alike)."""
    seen = _messy_text(0) + "\U0001f468\u200d\U0001f469\u200d\U0001f467 \u0e20\u0e32\u0e29\u0e32 \t\x00\x7f"
    built = Tokenizer.build_char([seen])
    read = Tokenizer.load(built.save(tmp_path / "tok"))
    texts = [
        seen,
        _messy_text(3) + "unseen: \u00df\u0416\U0001f600 Z",
        "",
        "before" + EOT + "after \r\n",
        "\r\n\r\n  \n",
        "\u0928\u092e\u0938\u094d\u0924\u0947" * 1000,
    ]
    for tok in (built, read):
        assert tok._chars is not None  # the table, not tokenizers, encodes these
        expected = [e.ids for e in tok.backend.encode_batch(texts, add_special_tokens=False)]
        assert [tok.encode(text) for text in texts] == tok.encode_batch(texts) == expected
        assert tok.encode(texts[3]).count(tok.eot_id) == 1
        assert UNK not in {tok.backend.id_to_token(i) for i in tok.encode(seen)}
        with pytest.raises(TypeError, match="TextInputSequence must be str"):  # as tokenizers refuses it
            tok.encode("lone \ud800 surrogate")
    bpe = Tokenizer.train_bpe([seen], vocab_size=300, max_chars=10**6)
    assert bpe._chars is None  # anything but the char tokenizer goes to tokenizers
    empty = Tokenizer.build_char([""])  # no characters: nothing to look up
    assert empty._chars is None and empty.encode("ab") == [empty.unk_id] * 2


def test_bpe_trains_to_requested_size_and_round_trips():
    corpus = ["def function_name(argument):\n    return argument * 2\n" * 20, "caf\u00e9 na\u00efve \U0001f600 " * 20]
    tok = Tokenizer.train_bpe(corpus, vocab_size=300, max_chars=10**6)
    assert 257 < tok.vocab_size <= 300  # 256 bytes + end-of-text + merges
    assert tok.backend.token_to_id(EOT) == tok.eot_id
    for text in corpus + ["unseen \u4e2d\u6587 text\twith\ttabs\n\n  and spaces  ", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(corpus[0])) < len(corpus[0]) / 2  # merges were learnt


def test_bpe_respects_max_chars():
    small = Tokenizer.train_bpe(["abcd" * 1000], vocab_size=400, max_chars=8)
    large = Tokenizer.train_bpe(["abcd" * 1000], vocab_size=400, max_chars=10**6)
    assert small.vocab_size <= large.vocab_size
    assert len(small.encode("abcd" * 8)) > len(large.encode("abcd" * 8))


def test_tokenizer_path_is_used_as_is(tmp_path):
    own = Tokenizer.build_char(["abcdefgh ij\n"])
    folder = tmp_path / "tok"
    file = own.save(folder)
    source = tmp_path / "text.txt"
    source.write_text("a bad cafe\nhi jig", encoding="utf-8")
    for spec in (file, folder):
        prepared = prepare_data(config(tmp_path, data_files=str(source), tokenizer=str(spec), validation_split=0.0))
        assert prepared.tokenizer.to_json() == own.to_json()
        assert prepared.manifest["tokenizer_fingerprint"] == own.fingerprint()
        tokens = np.asarray(prepared.tokens("train")).tolist()
        assert tokens == own.encode("a bad cafe\nhi jig") + [own.eot_id]


def test_bad_tokenizer_json_is_a_usage_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ', encoding="utf-8")
    source = tmp_path / "text.txt"
    source.write_text("some text", encoding="utf-8")
    with pytest.raises(UsageError, match="tokenizer.json"):
        Tokenizer.load(bad)
    message = _error(tmp_path, data_files=str(source), tokenizer=str(bad))
    assert str(bad) in message
    assert "missing" in _error(tmp_path, data_files=str(source), tokenizer=str(tmp_path / "missing"))


# ----------------------------------------------------------------------------------------------
# the prepare cache


def test_second_prepare_reuses_the_folder(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in numbered_docs(12)])
    first = prepare_data(config(tmp_path, data_files=str(path)))
    stamp = (first.directory / "train.bin").stat().st_mtime_ns
    manifest_text = (first.directory / MANIFEST).read_text()
    time.sleep(0.02)
    second = prepare_data(config(tmp_path, data_files=str(path)))
    assert second.directory == first.directory
    assert (second.directory / "train.bin").stat().st_mtime_ns == stamp
    assert (second.directory / MANIFEST).read_text() == manifest_text
    assert second.manifest == first.manifest
    assert second.tokenizer.to_json() == first.tokenizer.to_json()
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_changes_give_a_new_fingerprint(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in numbered_docs(12)])
    base = prepare_data(config(tmp_path, data_files=str(path)))
    changed_setting = prepare_data(config(tmp_path, data_files=str(path), min_length=3))
    changed_tokenizer = prepare_data(config(tmp_path, data_files=str(path), tokenizer="bpe", tokenizer_vocab_size=280))
    workers_only = prepare_data(config(tmp_path, data_files=str(path), preprocessing_num_workers=2))
    assert workers_only.directory == base.directory  # how the work is spread is not an input
    time.sleep(0.02)
    write_jsonl(path, [{"text": t.upper()} for t in numbered_docs(12)])  # same size, new content
    changed_content = prepare_data(config(tmp_path, data_files=str(path)))
    names = {p.directory.name for p in (base, changed_setting, changed_tokenizer, changed_content)}
    assert len(names) == 4
    assert documents(changed_content, "train")[0] == numbered_docs(12)[0].upper()


@pytest.mark.slow
def test_parallel_workers_give_identical_token_files(tmp_path):
    docs = [f"doc {i}: " + "word " * (i % 13) + f"\n    line {i}" for i in range(600)]  # > 2 encode batches
    path = write_jsonl(tmp_path / "many.jsonl", [{"text": t} for t in docs])
    common = dict(data_files=str(path), tokenizer="bpe", tokenizer_vocab_size=300)
    one = prepare_data(config(tmp_path, cache_dir=str(tmp_path / "w1"), preprocessing_num_workers=1, **common))
    two = prepare_data(config(tmp_path, cache_dir=str(tmp_path / "w2"), preprocessing_num_workers=2, **common))
    assert one.directory.name == two.directory.name
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "tokenizer.json"):
        assert (one.directory / name).read_bytes() == (two.directory / name).read_bytes(), name
    assert one.manifest["splits"]["train"]["documents"] == 540


def test_token_dtype_follows_vocab_size(tmp_path):
    source = tmp_path / "text.txt"
    source.write_text("w69999 w3 w65536 w1", encoding="utf-8")
    small = prepare_data(config(tmp_path, data_files=str(source), validation_split=0.0))
    assert small.manifest["dtype"] == "uint16"
    assert (small.directory / "train.bin").stat().st_size == 2 * small.manifest["splits"]["train"]["tokens"]

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {EOT: 0, UNK: 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big_file = Tokenizer(backend).save(tmp_path / "big")
    big = prepare_data(config(tmp_path, data_files=str(source), tokenizer=str(big_file), validation_split=0.0))
    assert big.manifest["dtype"] == "uint32"
    assert np.asarray(big.tokens("train")).tolist() == [70_001, 5, 65_538, 3, 0]


# -- interrupted prepare


def test_failure_mid_prepare_leaves_no_finished_folder(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "many.jsonl", [{"text": t} for t in numbered_docs(600)])
    cfg = config(tmp_path, data_files=str(path))
    real = Tokenizer.encode_batch
    calls = []

    def failing(self, texts):
        calls.append(len(texts))
        if len(calls) == 2:
            raise RuntimeError("tokenizer died")
        return real(self, texts)

    monkeypatch.setattr(Tokenizer, "encode_batch", failing)
    with pytest.raises(RuntimeError, match="tokenizer died"):
        prepare_data(cfg)
    cache = tmp_path / "cache"
    assert finished_folders(cache) == []
    assert list(cache.iterdir()) == []

    monkeypatch.setattr(Tokenizer, "encode_batch", real)
    prepared = prepare_data(cfg)
    assert (prepared.directory / MANIFEST).is_file()
    assert len(documents(prepared, "train")) + len(documents(prepared, "val")) == 600


@pytest.mark.slow
def test_killed_prepare_leaves_no_finished_folder(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [{"text": t} for t in numbered_docs(600)])
    marker = tmp_path / "started"
    cache = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from llm_trainer.config import DataConfig
        from llm_trainer.data.prepare import prepare_data
        from llm_trainer.tokenizer import Tokenizer

        real = Tokenizer.encode_batch
        calls = []

        def slow(self, texts):
            calls.append(1)
            if len(calls) == 2:  # half of the token files are written: stop here until killed
                Path({str(marker)!r}).write_text("x")
                time.sleep(120)
            return real(self, texts)

        Tokenizer.encode_batch = slow
        prepare_data(DataConfig(data_files={str(path)!r}, tokenizer="char", cache_dir={str(cache)!r}))
        """
    )
    kill9_when(script, marker.exists, "the tokenizer")
    assert any(p.name.endswith(".bin") for p in cache.rglob("*"))  # it was mid-way through writing
    assert finished_folders(cache) == []

    prepared = prepare_data(config(tmp_path, data_files=str(path)))
    assert (prepared.directory / MANIFEST).is_file()
    assert documents(prepared, "train") + documents(prepared, "val") != []
    assert prepared.manifest["documents_out"] == 600
    assert finished_folders(cache) == [prepared.directory]


# ----------------------------------------------------------------------------------------------
# row layouts


def test_window_rows_cover_shifted_windows():
    tokens = np.arange(103, dtype=np.uint16)
    L = 10
    rows = WindowRows(tokens, L)
    assert rows.offset == 0 and len(rows) == 10
    x, y = rows.batch(np.arange(len(rows)))
    for i in range(len(rows)):
        assert x[i].tolist() == list(range(i * L, i * L + L))
        assert y[i].tolist() == list(range(i * L + 1, i * L + L + 1))

    for seed in range(5):
        seeded = WindowRows(tokens, L, seed=seed)
        for epoch in range(4):
            seeded.set_epoch(epoch)
            off = seeded.offset
            assert 0 <= off < L
            assert len(seeded) == (len(tokens) - 1 - off) // L
            x, y = seeded.batch(np.arange(len(seeded)))
            assert x.dtype == np.int64 and x.shape == (len(seeded), L)
            for i in range(len(seeded)):
                window = tokens[off + i * L : off + i * L + L + 1].tolist()
                assert x[i].tolist() == window[:-1] and y[i].tolist() == window[1:]
            assert (y[:, :-1] == x[:, 1:]).all()


def test_window_offset_changes_with_epoch_and_follows_the_seed():
    tokens = np.arange(1000, dtype=np.uint16)

    def offsets(seed):
        rows = WindowRows(tokens, 64, seed=seed)
        out = []
        for epoch in range(12):
            rows.set_epoch(epoch)
            out.append(rows.offset)
        return out

    first = offsets(7)
    assert len(set(first)) > 1
    assert offsets(7) == first
    assert offsets(8) != first
    rows = WindowRows(tokens, 64, seed=7)
    rows.set_epoch(5)
    rows.set_epoch(2)
    assert rows.offset == first[2]  # depends on (seed, epoch) only, not on the order of calls


def test_window_rows_keep_partial():
    tokens = np.arange(47, dtype=np.uint16)
    L = 10
    rows = WindowRows(tokens, L, keep_partial=True)
    assert len(rows) == 5
    x, y = rows.batch(np.arange(len(rows)))
    assert y[4].tolist() == [41, 42, 43, 44, 45, 46] + [IGNORE_INDEX] * 4
    assert x[4, :6].tolist() == [40, 41, 42, 43, 44, 45]
    targets = y[y != IGNORE_INDEX]
    assert sorted(targets.tolist()) == list(range(1, 47))  # every token but the first, exactly once
    exact = WindowRows(np.arange(41, dtype=np.uint16), L, keep_partial=True)
    assert len(exact) == 4 and (exact.batch(np.arange(4))[1] != IGNORE_INDEX).all()


def _doc_offsets(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def test_document_rows_unpacked():
    sizes = [3, 14, 6, 1]
    offsets = _doc_offsets(sizes)
    tokens = np.arange(offsets[-1], dtype=np.uint16) + 100
    L, pad = 5, 7
    rows = DocumentRows(tokens, offsets, L, pack=False, pad_id=pad)
    expected_pieces = [(0, 3), (3, 9), (9, 15), (15, 17), (17, 23), (23, 24)]
    assert [tuple(r) for row in rows.rows for r in row] == expected_pieces
    assert all(len(row) == 1 for row in rows.rows)
    x, y = rows.batch(np.arange(len(rows)))
    for r, (s, e) in enumerate(expected_pieces):
        n = e - s - 1
        assert x[r, :n].tolist() == tokens[s : e - 1].tolist()
        assert y[r, :n].tolist() == tokens[s + 1 : e].tolist()
        assert (x[r, n:] == pad).all()
        assert (y[r, n:] == IGNORE_INDEX).all()


def test_first_fit_rows_keep_documents_whole():
    rng = np.random.default_rng(0)
    L = 31
    capacity = L + 1
    sizes = rng.integers(1, 80, size=120)
    offsets = _doc_offsets(sizes)
    tokens = np.arange(offsets[-1], dtype=np.uint32)
    packed = DocumentRows(tokens, offsets, L, pack=True, pad_id=0)
    unpacked = DocumentRows(tokens, offsets, L, pack=False, pad_id=0)
    doc_of = {int(s): (int(s), int(e)) for s, e in zip(offsets[:-1], offsets[1:])}
    seen = []
    for row in packed.rows:
        assert sum(e - s for s, e in row) <= capacity
        for s, e in row:
            doc_start = max(d for d in doc_of if d <= s)
            ds, de = doc_of[doc_start]
            if de - ds <= capacity:
                assert (s, e) == (ds, de)  # a document that fits a row is never split
            seen.extend(range(s, e))
    assert sorted(seen) == list(range(len(tokens)))  # every token exactly once
    assert packed.padding_fraction() <= unpacked.padding_fraction()
    assert len(packed) < len(unpacked)
    x, y = packed.batch(np.arange(len(packed)))
    for r, row in enumerate(packed.rows):
        flat = np.concatenate([tokens[s:e] for s, e in row]).astype(np.int64)
        assert x[r, : len(flat) - 1].tolist() == flat[:-1].tolist()
        assert y[r, : len(flat) - 1].tolist() == flat[1:].tolist()
        assert (y[r, len(flat) - 1 :] == IGNORE_INDEX).all()


def _brute_force_ffd(pieces: np.ndarray, capacity: int) -> list[list[tuple[int, int]]]:
    sizes = (pieces[:, 1] - pieces[:, 0]).tolist()
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # stable: ties keep input order
    bins: list[list[tuple[int, int]]] = []
    free: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if free[b] >= sizes[i]:
                break
        else:
            b = len(bins)
            bins.append([])
            free.append(capacity)
        bins[b].append((int(pieces[i, 0]), int(pieces[i, 1])))
        free[b] -= sizes[i]
    return bins


def test_first_fit_decreasing_matches_brute_force():
    rng = np.random.default_rng(1234)
    for trial in range(40):
        capacity = int(rng.integers(1, 64))
        n = int(rng.integers(0, 150))
        sizes = rng.integers(1, capacity + 1, size=n)
        if trial % 3 == 0:
            sizes = rng.choice([1, capacity // 2 or 1, capacity], size=n)  # many ties and exact fits
        offsets = _doc_offsets(sizes)
        pieces = np.stack([offsets[:-1], offsets[1:]], axis=1).reshape(-1, 2)
        assert first_fit_decreasing(pieces, capacity) == _brute_force_ffd(pieces, capacity), (trial, capacity, n)


# ----------------------------------------------------------------------------------------------
# batch loader


def identity_rows(n_rows: int, L: int = 4) -> WindowRows:
    """Row i starts at token i*L, so a batch's first column names its rows."""
    return WindowRows(np.arange(n_rows * L + 1, dtype=np.uint16), L)


def row_ids(x, L: int = 4) -> list[int]:
    return (x[:, 0] // L).tolist()


def test_batch_loader_seeded_permutation():
    def take(seed, k):
        loader = BatchLoader(identity_rows(24), 4, shuffle=True, seed=seed)
        return [row_ids(loader.next_batch()[0]) for _ in range(k)]

    first = take(3, 12)
    assert take(3, 12) == first
    assert take(4, 12) != first
    epoch0, epoch1 = first[:6], first[6:]
    assert sorted(sum(epoch0, [])) == list(range(24))  # every row once per epoch
    assert sorted(sum(epoch1, [])) == list(range(24))
    assert epoch0 != epoch1  # a new order each epoch
    ordered = BatchLoader(identity_rows(24), 4, shuffle=False)
    assert [row_ids(ordered.next_batch()[0]) for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    x, y = ordered.next_batch()
    assert x.dtype == y.dtype == torch.int64 and tuple(x.shape) == (4, 4)


def _varying_rows():
    """Seeded windows whose row count differs between epoch 0 and epoch 1."""
    tokens = np.arange(82, dtype=np.uint16)
    for seed in range(200):
        rows = WindowRows(tokens, 8, seed=seed)
        counts = []
        for epoch in range(2):
            rows.set_epoch(epoch)
            counts.append(len(rows))
        if counts[0] != counts[1]:
            return tokens, seed, counts
    raise AssertionError("no seed gives different row counts")


@pytest.mark.parametrize("resumed_seed", ["same", "another"])
def test_batch_loader_resumes_exactly(resumed_seed, capsys):
    """At every position, also with another training.seed given to the resume: the checkpoint's seed
    orders the rows and places the windows (with a warning that it is kept)."""
    tokens, seed, counts = _varying_rows()

    def fresh(seed=seed):
        return BatchLoader(WindowRows(tokens, 8, seed=seed), 1, shuffle=True, seed=seed)

    reference = fresh()
    stream = [reference.next_batch() for _ in range(40)]
    # every position through epochs 0 and 1 (whose row counts differ) and into epoch 2
    for k in range(counts[0] + counts[1] + 2):
        original = fresh()
        for _ in range(k):
            original.next_batch()
        state = original.state_dict()
        resumed = fresh(seed if resumed_seed == "same" else seed + 1)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # checkpoints store it as JSON
        kept = "the resume keeps the checkpoint's data order" in capsys.readouterr().err
        assert kept == (resumed_seed == "another")
        for j in range(k, 40):
            x, y = resumed.next_batch()
            assert (x == stream[j][0]).all() and (y == stream[j][1]).all(), (k, j)
        assert resumed.state_dict() == reference.state_dict()


def test_batch_loader_ranks_split_the_global_batches():
    B, n = 3, 30
    single = BatchLoader(identity_rows(n), B, shuffle=True, seed=11)
    ranks = [BatchLoader(identity_rows(n), B, shuffle=True, seed=11, rank=r, world_size=2) for r in range(2)]
    assert len(ranks[0]) == n // (2 * B) == 5
    reference = [row_ids(single.next_batch()[0]) for _ in range(2 * len(ranks[0]) * 2)]  # two epochs
    for epoch in range(2):
        per_epoch = reference[epoch * 10 : (epoch + 1) * 10]
        for p in range(5):
            r0 = row_ids(ranks[0].next_batch()[0])
            r1 = row_ids(ranks[1].next_batch()[0])
            assert not set(r0) & set(r1)
            assert r0 == per_epoch[2 * p] and r1 == per_epoch[2 * p + 1]


def test_batch_loader_refuses_state_from_another_global_batch():
    """Another world size is fine when the global batch stays (tests/test_world_size_resume.py)."""
    one = BatchLoader(identity_rows(16), 2, shuffle=True, seed=0)
    one.next_batch()
    two = BatchLoader(identity_rows(16), 2, shuffle=True, seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="global batch of 2 samples per step, this run has 4"):
        two.load_state_dict(one.state_dict())


def test_batch_loader_needs_one_batch():
    with pytest.raises(ValueError, match="not enough data for one batch") as info:
        BatchLoader(identity_rows(3), 4, shuffle=True)
    assert "batch_size 4" in str(info.value)
    with pytest.raises(ValueError, match="not enough data"):
        BatchLoader(identity_rows(6), 4, shuffle=True, world_size=2)
    assert len(BatchLoader(identity_rows(3), 4, shuffle=False, drop_last=False)) == 1


def test_validation_loader_reads_everything_once():
    rows = WindowRows(np.arange(47, dtype=np.uint16), 10, keep_partial=True)
    loader = BatchLoader(rows, 2, shuffle=False, drop_last=False)
    targets = [t for _, y in loader for t in y[y != IGNORE_INDEX].tolist()]
    assert targets == list(range(1, 47))


# ----------------------------------------------------------------------------------------------
# the command line


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "llm_trainer", *args],
        cwd=cwd,
        env=src_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_cli_prepare_prints_json(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in numbered_docs(10)])
    yaml_file = tmp_path / "exp.yaml"
    yaml_file.write_text(
        f"data:\n  data_files: [{str(source)!r}]\n  tokenizer: char\n  cache_dir: {str(tmp_path / 'cache')!r}\n  validation_split: 0.2\n",
        encoding="utf-8",
    )
    result = run_cli("prepare", "--config", str(yaml_file), "data.min_length=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["splits"]["train"]["documents"] == 8 and out["splits"]["val"]["documents"] == 2
    assert out["documents_out"] == 10
    assert (Path(out["directory"]) / MANIFEST).is_file()
    assert json.loads((Path(out["directory"]) / MANIFEST).read_text())["config"]["min_length"] == 1


@pytest.mark.parametrize("where", ["file", "override"])
def test_cli_bad_key_is_one_line(tmp_path, where, monkeypatch, capsys):
    from llm_trainer import cli

    yaml_file = tmp_path / "exp.yaml"
    body = "data:\n  data_files: [x.txt]\n"
    extra = []
    if where == "file":
        body += "  max_lenght: 64\n"
    else:
        extra = ["data.max_lenght=64"]
    yaml_file.write_text(body, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["prepare", "--config", str(yaml_file), *extra]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:")
    assert "max_lenght" in lines[0] and "data.max_length" in lines[0]
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("split", ["train", "val"])
def test_token_ids_outside_the_vocabulary_are_refused_in_one_line(tmp_path, capsys, split, read_ahead):
    """A token file of the right size holding other bytes (ids the tokenizer never gave): the batch that
    reads one is refused in one line naming the folder, the id and the fix, read in place or on the
    worker thread that reads ahead, rather than an index error from the embedding (a device-side
    assert on a GPU). Nothing of the run is written past its start."""
    from conftest import write_tiny_experiment
    from llm_trainer import cli

    config = write_tiny_experiment(tmp_path)
    assert cli.main(["prepare", "--config", str(config)]) == 0
    capsys.readouterr()
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if (p / "manifest.json").is_file()]
    tokens = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
    tokens[::10] = 40000  # in every batch
    tokens.tofile(folder / f"{split}.bin")
    assert cli.main(["train", "--config", str(config), f"training.read_ahead={str(read_ahead).lower()}"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the prepared data in {folder} is damaged: {split}.bin holds the token id 40,000"), (
        last
    )
    assert "outside its tokenizer's" in last and last.endswith("to prepare it anew")
    assert "Traceback" not in err
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_damaged_prepared_data_is_refused_in_one_line_rather_than_trained_on_in_part(tmp_path, capsys):
    """A prepared folder whose train.bin was cut short (a copy that stopped): `train` refuses it in one
    line naming the folder and the fix, and writes no run; preparing it anew gives the data back.
    Offsets that do not end at the manifest's count are refused where they are read. (A folder missing
    a file is prepared again by itself.)"""
    from conftest import write_tiny_experiment
    from llm_trainer import cli
    from llm_trainer.data.prepare import find_prepared

    config = write_tiny_experiment(tmp_path)
    assert cli.main(["prepare", "--config", str(config)]) == 0
    capsys.readouterr()
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if (p / "manifest.json").is_file()]
    np.save(folder / "val.idx.npy", np.load(folder / "val.idx.npy")[:-1])
    with pytest.raises(UsageError, match=r"is damaged: val.idx.npy does not end at the [\d,]+ tokens its manifest"):
        find_prepared(tmp_path / "cache", folder.name).offsets("val")
    os.truncate(folder / "train.bin", 1000)
    assert cli.main(["train", "--config", str(config)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: the prepared data in {folder} is damaged: train.bin holds 500 tokens"), last
    assert last.endswith("remove that folder and run the command again to prepare it anew")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    shutil.rmtree(folder)
    assert cli.main(["train", "--config", str(config)]) == 0


def test_a_data_folder_that_holds_the_tool_s_own_output_reads_the_data_alone(tmp_path, monkeypatch):
    """`data_files: [.]` in a project folder that also receives the prepared-data cache and the runs:
    neither is read as data (a run's metrics.jsonl as text, the cache's files in the fingerprint), so
    every prepare reuses one folder and a second run trains on the same data as the first."""
    import yaml

    from conftest import write_corpus
    from llm_trainer import cli

    write_corpus(tmp_path)  # the documents, in the project folder itself
    monkeypatch.chdir(tmp_path)
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 24},
        "training": {"batch_size": 4, "max_steps": 2, "eval_steps": 0, "save_steps": 0, "device": "cpu"},
        "data": {"data_files": ["."], "tokenizer": "char", "validation_split": 0.2},
    }
    config["training"].update(output_dir="runs/a", progress_bar=False, report_to=["jsonl"])
    Path("exp.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["train", "--config", "exp.yaml"]) == 0
    assert cli.main(["train", "--config", "exp.yaml", "training.output_dir=runs/b"]) == 0
    assert cli.main(["prepare", "--config", "exp.yaml"]) == 0
    assert len(list(Path("data_cache").iterdir())) == 1
    first, second = (json.loads(Path(f"runs/{r}/metrics.jsonl").read_text().splitlines()[0]) for r in "ab")
    assert first["loss"] == second["loss"]


def test_a_source_of_a_mixture_too_small_to_hold_out_validation_is_named(tmp_path, capsys):
    """validation_split 0.1 takes one document in ten of each source: a source of five holds none out and
    has no validation loss of its own, which the prepare says, naming it."""
    from llm_trainer.data.prepare import prepare_data

    big, small = tmp_path / "big", tmp_path / "small"
    for folder, n in ((big, 30), (small, 5)):
        folder.mkdir()
        for i in range(n):
            (folder / f"d{i}.txt").write_text(f"document {i} of {folder.name}: " + "words and more words " * 5)
    sources = [{"name": "big", "data_files": str(big)}, {"name": "small", "data_files": str(small)}]
    config = DataConfig(sources=sources, tokenizer="char", validation_split=0.1, cache_dir=str(tmp_path / "c"))
    prepare_data(config)
    warned = [line for line in capsys.readouterr().err.splitlines() if "too few documents" in line]
    assert warned == [
        "warning: data: small (5 documents): too few documents for validation_split 0.1 to hold any out, so no "
        "validation loss of their own; raise validation_split, or give them more documents"
    ]


def test_a_named_json_file_is_read_as_json_lines_and_one_json_document_is_refused(tmp_path):
    """Many corpora name JSON Lines `*.json`: named in data_files it reads as the same records as a
    `.jsonl` (the same token files), not as raw JSON text; a JSON array is refused in one line that says
    how to convert it. In a folder a `.json` is left out (metadata such as dataset_info.json)."""
    from llm_trainer.data.prepare import prepare_data

    records = "".join(json.dumps({"text": f"record {i}: " + "some words here " * 4}) + "\n" for i in range(20))
    (tmp_path / "a.json").write_text(records)
    (tmp_path / "a.jsonl").write_text(records)
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}], indent=1))
    folders = []
    for name in ("a.json", "a.jsonl"):
        config = DataConfig(data_files=[str(tmp_path / name)], tokenizer="char", cache_dir=str(tmp_path / name[2:]))
        folders.append(prepare_data(config).directory)
    assert (folders[0] / "train.bin").read_bytes() == (folders[1] / "train.bin").read_bytes()
    with pytest.raises(UsageError, match=r"arr.json is one JSON document .* jq -c '\.\[\]' arr.json > arr.jsonl"):
        prepare_data(
            DataConfig(data_files=[str(tmp_path / "arr.json")], tokenizer="char", cache_dir=str(tmp_path / "c"))
        )


def test_a_dataset_name_written_as_a_path_that_is_not_there_is_not_called_a_hub_name(tmp_path, monkeypatch):
    from llm_trainer.data.prepare import prepare_data

    monkeypatch.chdir(tmp_path)
    for name in ("./nothere", str(tmp_path / "nothere")):
        with pytest.raises(UsageError, match=r"names a local dataset folder, and there is none there; fix the path"):
            prepare_data(DataConfig(dataset_name=name, tokenizer="char", cache_dir=str(tmp_path / "c")))
