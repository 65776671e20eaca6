"""The per-batch work of `prepare` that needs no global state, so it can run in worker processes.

`DocumentProcessor`: raw texts -> cleaned texts, the filter each failed, dedup keys (exact hash,
MinHash signature and LSH band keys). `encode`: kept texts -> one flat token array + lengths, with
end-of-text after each document. Deciding duplicates needs every earlier document, so it stays in
the main process (`prepare`), in stream order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ...config import DataConfig
from ...tokenizer import Tokenizer
from ..text.clean import Cleaner
from ..text.dedup import MinHasher, exact_key
from ..text.filters import QualityFilter, Removal


@dataclass
class Processed:
    """Stage-one results for a batch of N raw documents."""

    texts: list[str | None]  # cleaned text, None where a filter dropped the document
    reasons: list[str | None]  # the filter that dropped it, or None
    removals: list[Removal | None]  # the same with the measured value and the threshold, for the report
    nbytes: list[int]  # UTF-8 size of the raw text (for bytes/s)
    keys: np.ndarray  # (N,) uint64 exact-dedup keys (0 for dropped documents)
    signatures: np.ndarray | None  # (N, num_perm) uint32, near dedup only
    bands: np.ndarray | None  # (N, bands) uint64 LSH keys, near dedup only


class DocumentProcessor:
    def __init__(self, config: DataConfig):
        self.clean = Cleaner(config)
        self.filter = QualityFilter(config)
        self.dedup = config.deduplication != "none"
        self.hasher = (
            MinHasher(config.minhash_num_perm, config.minhash_shingle_words, config.deduplication_threshold)
            if config.deduplication == "near"
            else None
        )

    def __call__(self, raw: list[str]) -> Processed:
        texts: list[str | None] = []
        reasons: list[str | None] = []
        removals: list[Removal | None] = []
        nbytes = [len(t) if t.isascii() else len(t.encode("utf-8", errors="surrogatepass")) for t in raw]
        keys = np.zeros(len(raw), dtype=np.uint64)
        signatures = np.zeros((len(raw), self.hasher.num_perm), dtype=np.uint32) if self.hasher else None
        for i, text in enumerate(raw):
            text = self.clean(text)
            removal = self.filter.check(text)
            reason = removal.reason if removal else None
            texts.append(None if reason else text)
            reasons.append(reason)
            removals.append(removal)
            if reason is None and self.dedup:
                keys[i] = exact_key(text)
                if self.hasher is not None:
                    signatures[i] = self.hasher.signature(text)
        bands = self.hasher.band_keys(signatures) if self.hasher else None
        return Processed(texts, reasons, removals, nbytes, keys, signatures, bands)


def encode(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (T,) dtype, lengths (D,) int64): every text's ids followed by end-of-text, concatenated."""
    if not texts:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    end = np.cumsum(lengths)
    flat[end - 1] = tokenizer.eot_id
    for x, stop in zip(ids, end.tolist()):
        flat[stop - 1 - len(x) : stop - 1] = x
    return flat, lengths


# -- worker processes: each builds its processor and tokenizer once ------------------------------------

_worker: dict = {}


def worker_init(config: DataConfig, tokenizer_json: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the processes
    from tokenizers import Tokenizer as HFTokenizer

    _worker.update(
        processor=DocumentProcessor(config),
        tokenizer=Tokenizer(HFTokenizer.from_str(tokenizer_json)),
        dtype=np.dtype(dtype),
    )


def worker_process(raw: list[str]) -> Processed:
    return _worker["processor"](raw)


def worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode(_worker["tokenizer"], texts, _worker["dtype"])
