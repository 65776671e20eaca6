"""Deduplication across all sources: exact (hash of the normalised text) and near (MinHash + LSH).

Exact: a 64-bit BLAKE2b of the text lower-cased with its whitespace removed (every Unicode space: the
ideographic space that indents Japanese paragraphs too), so copies that differ only in case,
indentation or line wrapping collide.

Near: MinHash signatures over word shingles (`minhash_shingle_words` consecutive words, lower-cased,
punctuation and symbols of every script as separators; in scripts written without spaces,
characters) and LSH banding. A
candidate from a shared band is confirmed by comparing signatures (estimated Jaccard >= threshold),
so chance band collisions between different documents are not removed; the banding is therefore
tuned for recall (`lsh_parameters`): with 128 permutations and threshold 0.8, 18 bands of 7 rows find
98.6% of pairs at exactly 0.8. The first document of a group is kept; later ones are dropped,
whichever source they come from.

Why NumPy and not `datasketch`: datasketch hashes every shingle with SHA-1 in a Python loop before its
NumPy permutation step; here words are hashed with vectorised polynomial hashing and the permutations
run over all shingles of a document at once, several times faster (`bench/prepare_throughput.py
--minhash` compares the two; see bench/README.md). It also avoids a dependency, and its hashes are the
same in every process (Python's `hash()` is salted per process), which resumable and multi-process
prepare need.

Memory is bounded by the number of kept documents, not their size: exact keeps one 64-bit key per
document in a set; near adds the signature (4 * num_perm bytes, in NumPy blocks) and one dict entry
per band.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ...config import DataConfig
from .unicode_text import separators_to_spaces, spaceless_apart

_WS = b" \t\n\r\x0b\x0c"
_U64 = np.uint64
_WORD_BYTE = np.zeros(256, dtype=bool)  # bytes of words: ASCII letters and digits, non-ASCII (separators_to_spaces)
_WORD_BYTE[ord("0") : ord("9") + 1] = True
_WORD_BYTE[ord("a") : ord("z") + 1] = True
_WORD_BYTE[0x80:] = True
_MAX_WORD_BYTES = 64  # bytes past this in one word share the last position's multiplier
_SIG_BLOCK = 4096  # signatures stored per NumPy block


def exact_key(text: str) -> int:
    """64-bit hash of the text lower-cased, whitespace removed."""
    text = text.lower()
    if not text.isascii():
        text = "".join(text.split())  # str.split's whitespace: Unicode's
    data = text.encode("utf-8", errors="surrogatepass").translate(None, _WS)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic): spreads every input bit over the output."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def lsh_parameters(threshold: float, num_perm: int, recall: float = 0.95) -> tuple[int, int]:
    """(bands, rows): as many rows per band as possible (fewest chance candidates) while two documents at
    the threshold still share a band with probability >= recall. Candidates are confirmed on the whole
    signature, so banding only has to find them; precision comes from the confirmation."""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1.0 - (1.0 - threshold**rows) ** bands >= recall:
            return bands, rows
    return num_perm, 1


class MinHasher:
    """Signatures (num_perm uint32) and LSH band keys (bands uint64) of texts; stateless, picklable."""

    def __init__(self, num_perm: int = 128, shingle_words: int = 5, threshold: float = 0.8, seed: int = 0x5EED):
        rng = np.random.default_rng(seed)  # fixed: signatures must agree between runs and processes
        self.num_perm, self.shingle_words = num_perm, shingle_words
        self.a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | _U64(1)  # odd multipliers
        self.b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
        self.q = rng.integers(1, 2**63, size=shingle_words, dtype=np.uint64) | _U64(1)  # shingle combiners
        self.power = np.cumprod(np.full(_MAX_WORD_BYTES, 1_000_003, dtype=np.uint64))  # P^(i+1), wrapping
        self.bands, self.rows = lsh_parameters(threshold, num_perm)
        self.band_mult = rng.integers(1, 2**63, size=(1, self.rows), dtype=np.uint64) | _U64(1)
        self.band_salt = rng.integers(0, 2**63, size=self.bands, dtype=np.uint64)

    def word_hashes(self, text: str) -> np.ndarray:
        """One uint64 per word: polynomial hash of its bytes, position within the word as the exponent. In
        scripts written without spaces (Chinese, Japanese, Thai) each character is a word; punctuation,
        symbols and spaces separate words in every script."""
        text = spaceless_apart(separators_to_spaces(text))
        data = np.frombuffer(text.lower().encode("utf-8", errors="surrogatepass"), dtype=np.uint8)
        is_word = _WORD_BYTE[data]  # (n,)
        starts = np.flatnonzero(is_word & ~np.concatenate(([False], is_word[:-1])))  # (W,)
        if len(starts) == 0:
            return np.zeros(0, dtype=np.uint64)
        start_of = np.zeros(len(data), dtype=np.int64)
        start_of[starts] = starts
        np.maximum.accumulate(start_of, out=start_of)  # each byte's word start
        within = np.minimum(np.arange(len(data)) - start_of, _MAX_WORD_BYTES - 1)
        contrib = (data.astype(np.uint64) + _U64(1)) * self.power[within]
        contrib[~is_word] = 0
        return _mix64(np.add.reduceat(contrib, starts))  # (W,)

    def signature(self, text: str) -> np.ndarray:
        """(num_perm,) uint32: the minimum of each permuted shingle hash; all-ones for a text without words."""
        words = self.word_hashes(text)
        if len(words) == 0:
            return np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        n = min(self.shingle_words, len(words))
        count = len(words) - n + 1
        shingles = np.zeros(count, dtype=np.uint64)
        for t in range(n):
            shingles += words[t : t + count] * self.q[t]
        mixed = _mix64(shingles)
        x = (mixed >> _U64(32)) ^ (mixed & _U64(0xFFFFFFFF))  # 32-bit keys for multiply-shift hashing
        out = np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint64)
        step = max(1, 2**18 // self.num_perm)  # bound the (shingles, num_perm) matrix to ~2 MB
        for i in range(0, count, step):
            block = (x[i : i + step, None] * self.a + self.b) >> _U64(32)  # (s, num_perm)
            np.minimum(out, block.min(axis=0), out=out)
        return out.astype(np.uint32)

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """(N, num_perm) uint32 -> (N, bands) uint64: one key per band, distinct between bands."""
        used = signatures[:, : self.bands * self.rows].astype(np.uint64).reshape(len(signatures), self.bands, self.rows)
        return _mix64((used * self.band_mult).sum(axis=2) + self.band_salt)


class Deduplicator:
    """The global state: keys of every kept document. `check` decides and remembers in one step."""

    def __init__(self, config: DataConfig):
        self.mode = config.deduplication
        self.threshold = config.deduplication_threshold
        self.hasher = (
            MinHasher(config.minhash_num_perm, config.minhash_shingle_words, config.deduplication_threshold)
            if self.mode == "near"
            else None
        )
        self.exact: set[int] = set()
        self.buckets: dict[int, int] = {}  # band key -> index of the first kept document with it
        self.blocks: list[np.ndarray] = []  # signatures of kept documents, _SIG_BLOCK per block
        self.count = 0

    def check(self, key: int, signature: np.ndarray | None = None, bands: np.ndarray | None = None) -> str | None:
        """None (new: remembered) or the removal reason: exact_duplicates / near_duplicates."""
        if self.mode == "none":
            return None
        if key in self.exact:
            return "exact_duplicates"
        if self.hasher is not None:
            band_list = bands.tolist()
            for band in band_list:
                j = self.buckets.get(band)
                if j is not None and np.count_nonzero(self._signature(j) == signature) >= self.threshold * len(
                    signature
                ):
                    return "near_duplicates"
            for band in band_list:
                self.buckets.setdefault(band, self.count)
            self._store(signature)
        self.exact.add(key)
        self.count += 1
        return None

    def restore(self, keys: np.ndarray, signatures: np.ndarray | None) -> None:
        """Remember documents kept by an earlier, interrupted run (from its shards' key files)."""
        bands = self.hasher.band_keys(signatures) if self.hasher is not None and signatures is not None else None
        for i, key in enumerate(keys.tolist()):
            self.exact.add(key)
            if bands is not None:
                for band in bands[i].tolist():
                    self.buckets.setdefault(band, self.count)
                self._store(signatures[i])
            self.count += 1

    def _store(self, signature: np.ndarray) -> None:
        row = self.count % _SIG_BLOCK
        if row == 0:
            self.blocks.append(np.empty((_SIG_BLOCK, len(signature)), dtype=np.uint32))
        self.blocks[-1][row] = signature

    def _signature(self, index: int) -> np.ndarray:
        return self.blocks[index // _SIG_BLOCK][index % _SIG_BLOCK]
