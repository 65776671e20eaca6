"""`prepare`: raw documents -> cleaned, split, tokenized, memory-mapped token files with a manifest.

Output folder `{cache_dir}/{fingerprint}/`:
  train.bin / val.bin          every document's tokens followed by end-of-text, uint16 or uint32
  train.idx.npy / val.idx.npy  int64 offsets: document i is tokens[idx[i]:idx[i+1]]
  tokenizer.json, manifest.json (written last: its presence marks a complete, reusable folder)

The fingerprint covers the data settings, the sources (paths, sizes, times) and the tokenizer choice,
so a second `prepare` with the same inputs reuses the folder and any change builds a new one. The
folder is built under a temporary name and renamed when complete: an interrupted run leaves no
folder that could be taken for a finished one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..config import DataConfig
from ..errors import UsageError
from ..logs import log
from ..tokenizer import Tokenizer
from .sources import SourceStats, iter_documents, source_fingerprint

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
_ENCODE_BATCH = 256


@dataclass
class PreparedData:
    directory: Path
    tokenizer: Tokenizer
    manifest: dict

    def tokens(self, split: str) -> np.memmap:
        if self.manifest["splits"][split]["tokens"] == 0:  # an empty file cannot be memory-mapped
            return np.zeros(0, dtype=self.manifest["dtype"])
        return np.memmap(self.directory / f"{split}.bin", dtype=self.manifest["dtype"], mode="r")

    def offsets(self, split: str) -> np.ndarray:
        return np.load(self.directory / f"{split}.idx.npy")


def clean_text(text: str, config: DataConfig) -> str:
    """Unify newlines; optionally strip trailing spaces and collapse runs of blank lines (indentation kept)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if config.normalize_whitespace:
        text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)  # the last line too
        text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text


def _fingerprint(config: DataConfig) -> str:
    settings = {k: v for k, v in config.to_dict().items() if k not in ("preprocessing_num_workers", "cache_dir")}
    if config.tokenizer not in ("bpe", "char"):
        settings["tokenizer"] = Tokenizer.load(config.tokenizer).fingerprint()
    payload = json.dumps([FORMAT_VERSION, settings, source_fingerprint(config)], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _split_documents(config: DataConfig, stats: SourceStats, counts: dict) -> Iterator[tuple[str, str]]:
    """(split, cleaned text) for every kept document, in a fixed order.

    A fractional validation_split sends document i to validation when floor((i+1)f) > floor(if): an
    even, deterministic spread that needs no second pass. A corpus of one document (a single text
    file) is split by position instead: the first 1-f of its characters train, the rest validate.
    """

    def cleaned(split: str | None = None) -> Iterator[str]:
        kept = 0  # max_documents caps each split read, not the running total of both
        for text in iter_documents(config, stats, split):
            counts["documents_in"] += 1
            text = clean_text(text, config)
            if not text.strip() or len(text) < config.min_length:
                counts["removed_min_length"] += 1
                continue
            counts["documents_out"] += 1
            kept += 1
            yield text
            if config.max_documents is not None and kept >= config.max_documents:
                return

    if isinstance(config.validation_split, str):
        if config.dataset_name is None:
            raise UsageError("data.validation_split names a split, which needs a dataset_name; use a fraction such as 0.1 for files")
        yield from (("train", t) for t in cleaned())
        yield from (("val", t) for t in cleaned(config.validation_split))
        return

    fraction = config.validation_split
    docs = cleaned()
    head = list(itertools.islice(docs, 2))
    if len(head) == 1 and fraction > 0:
        cut = int(len(head[0]) * (1 - fraction))
        yield "train", head[0][:cut]
        yield "val", head[0][cut:]
        return
    for i, text in enumerate(itertools.chain(head, docs)):
        yield ("val" if int((i + 1) * fraction) > int(i * fraction) else "train"), text


def _build_tokenizer(config: DataConfig, documents: Iterable[tuple[str, str]]) -> Tokenizer:
    if config.tokenizer == "char":  # vocabulary of the whole corpus, as char-level experiments expect
        return Tokenizer.build_char(text for _, text in documents)
    if config.tokenizer == "bpe":
        return Tokenizer.train_bpe(
            (text for split, text in documents if split == "train"),
            vocab_size=config.tokenizer_vocab_size,
            max_chars=config.tokenizer_train_max_chars,
        )
    return Tokenizer.load(config.tokenizer)


# Worker processes keep their own tokenizer, built once from JSON.
_worker_tokenizer: Tokenizer | None = None


def _worker_init(tokenizer_json: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer as HFTokenizer

    _worker_tokenizer = Tokenizer(HFTokenizer.from_str(tokenizer_json))


def _worker_encode(texts: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_batch(texts)


def _encoded_batches(tokenizer: Tokenizer, documents: Iterator[tuple[str, str]], workers: int):
    """Yield (splits, token lists) per batch of documents, in order, over `workers` processes."""

    def batches():
        while batch := list(itertools.islice(documents, _ENCODE_BATCH)):
            yield batch

    if workers <= 1:  # the Rust tokenizer already uses threads inside encode_batch
        for batch in batches():
            yield [s for s, _ in batch], tokenizer.encode_batch([t for _, t in batch])
        return
    with mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(tokenizer.to_json(),)) as pool:
        pending = []
        for batch in batches():
            pending.append(([s for s, _ in batch], pool.apply_async(_worker_encode, ([t for _, t in batch],))))
            if len(pending) > 2 * workers:
                splits, result = pending.pop(0)
                yield splits, result.get()
        for splits, result in pending:
            yield splits, result.get()


def prepare_data(config: DataConfig) -> PreparedData:
    """Build (or reuse) the token files for `config`; see the module docstring for the layout."""
    cache_root = Path(config.cache_dir)
    directory = cache_root / _fingerprint(config)
    if (directory / MANIFEST).is_file():
        manifest = json.loads((directory / MANIFEST).read_text())
        log(f"data: reusing {directory} ({manifest['splits']['train']['tokens']:,} training tokens)")
        return PreparedData(directory, Tokenizer.load(directory), manifest)

    started = time.perf_counter()
    tmp = cache_root / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        log(f"data: preparing {directory}")
        stats = SourceStats()
        counts = {"documents_in": 0, "documents_out": 0, "removed_min_length": 0}
        tokenizer = _build_tokenizer(config, _split_documents(config, SourceStats(), dict(counts)))
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        sizes = {split: 0 for split in SPLITS}
        offsets = {split: [0] for split in SPLITS}
        files = {split: open(tmp / f"{split}.bin", "wb") for split in SPLITS}
        with files["train"], files["val"]:
            documents = _split_documents(config, stats, counts)
            for splits, token_lists in _encoded_batches(tokenizer, documents, config.preprocessing_num_workers):
                for split, ids in zip(splits, token_lists):
                    ids.append(tokenizer.eot_id)
                    files[split].write(np.asarray(ids, dtype=dtype).tobytes())
                    sizes[split] += len(ids)
                    offsets[split].append(sizes[split])
            for handle in files.values():
                handle.flush()
                os.fsync(handle.fileno())
        if sizes["train"] == 0:
            raise UsageError("the data sources produced no training documents; check data_files / dataset_name and min_length")
        for split in SPLITS:
            np.save(tmp / f"{split}.idx.npy", np.asarray(offsets[split], dtype=np.int64))
        tokenizer.save(tmp)
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": directory.name,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "tokenizer_fingerprint": tokenizer.fingerprint(),
            "source_fingerprint": hashlib.sha256(json.dumps(source_fingerprint(config), default=str).encode()).hexdigest()[:16],
            "splits": {s: {"documents": len(offsets[s]) - 1, "tokens": sizes[s]} for s in SPLITS},
            "documents_in": counts["documents_in"],
            "documents_out": counts["documents_out"],
            "removed": {"min_length": counts["removed_min_length"], **dict(stats.skipped)},
            "seconds": round(time.perf_counter() - started, 3),
            "config": config.to_dict(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(directory, ignore_errors=True)  # a folder without a manifest is an old partial one
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(
        f"data: {manifest['documents_out']:,} documents -> {sizes['train']:,} train / {sizes['val']:,} val tokens "
        f"(vocab {tokenizer.vocab_size:,}) in {manifest['seconds']:.1f}s"
    )
    return PreparedData(directory, tokenizer, manifest)
