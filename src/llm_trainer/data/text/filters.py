"""Quality filters: each document is kept, or dropped for the first filter it fails (which is counted).

Thresholds come from DataConfig; those left null take the `quality_filters` preset's value (none
under "off"). The presets follow the heuristics of Gopher/C4 style web filtering, loosened where
code differs from prose (code repeats lines, has fewer letters and longer "words").

Measures (letters and words as `unicode_text` defines them, so that every script is measured alike):
  min_length / max_chars        characters
  min_words / max_words         words: whitespace-separated, plus the estimated words of scripts
                                written without spaces (Chinese, Japanese, Thai, ...)
  alpha_fraction                letters (with their combining marks) / non-whitespace characters
  mean_word_length              characters per word of the space-separated words (attached marks
                                such as viramas not counted); skipped when most words are spaceless
  repeated_lines                non-blank lines equal (stripped) to an earlier line / non-blank lines
  duplicate_ngrams              token n-grams equal to an earlier one / all n-grams (case-folded); in
                                spaceless scripts a token is a character and n grows so that an
                                n-gram still spans about n words
  char_entropy                  Shannon entropy of the character histogram, bits per character

`QualityFilter.check` also returns the measured value and the threshold it failed, which
data_report.json names for the first removed documents of each reason.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...config import DataConfig
from .unicode_text import letter_count, mean_word_length, words

PRESETS: dict[str, dict[str, float | int]] = {
    "prose": dict(
        max_chars=1_000_000,
        min_words=50,
        max_words=100_000,
        min_alpha_fraction=0.6,
        min_mean_word_length=3.0,
        max_mean_word_length=10.0,
        max_repeated_line_fraction=0.3,
        max_duplicate_ngram_fraction=0.2,
        min_char_entropy=3.5,
    ),
    "code": dict(
        max_chars=1_000_000,
        min_words=5,
        max_words=200_000,
        min_alpha_fraction=0.25,
        max_mean_word_length=25.0,
        max_repeated_line_fraction=0.6,
        max_duplicate_ngram_fraction=0.6,
        min_char_entropy=3.0,
    ),
}
# The order in which filters are tried (cheapest first); a dropped document counts for the first it fails.
FILTERS = (
    "min_length",
    "max_chars",
    "min_words",
    "max_words",
    "alpha_fraction",
    "mean_word_length",
    "repeated_lines",
    "duplicate_ngrams",
    "char_entropy",
)
_THRESHOLDS = (
    "max_chars",
    "min_words",
    "max_words",
    "min_alpha_fraction",
    "min_mean_word_length",
    "max_mean_word_length",
    "max_repeated_line_fraction",
    "max_duplicate_ngram_fraction",
    "min_char_entropy",
)
_WHITESPACE = " \t\n\r\x0b\x0c"


def char_entropy(text: str) -> float:
    """Shannon entropy (bits per character) of the character histogram; 0 for an empty text."""
    if not text:
        return 0.0
    if text.isascii():
        counts = np.bincount(np.frombuffer(text.encode("ascii"), dtype=np.uint8), minlength=128)
    else:
        _, counts = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), return_counts=True)
    p = counts[counts > 0] / len(text)
    return float(-(p * np.log2(p)).sum())


def whitespace_count(text: str) -> int:
    return sum(text.count(ch) for ch in _WHITESPACE)


def repeated_line_fraction(text: str) -> float:
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    return 1.0 - len(set(lines)) / len(lines) if lines else 0.0


def duplicate_ngram_fraction(words: list[str], n: int) -> float:
    if len(words) < n:
        return 0.0
    folded = [w.casefold() for w in words]
    grams = list(zip(*(folded[i:] for i in range(n))))
    return 1.0 - len(set(grams)) / len(grams)


def duplicate_char_ngram_fraction(chars: str, n: int) -> float:
    """The same on characters, for text without spaces between words: n-grams as 64-bit polynomial hashes
    of their code points (vectorised; a chance collision would need ~2^32 n-grams)."""
    codes = np.frombuffer(chars.casefold().encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    count = len(codes) - n + 1
    if count <= 0:
        return 0.0
    grams = np.zeros(count, dtype=np.uint64)
    for k in range(n):
        grams = grams * np.uint64(0x100000001B3) + codes[k : k + count]
    return 1.0 - len(np.unique(grams)) / count


class Removal(NamedTuple):
    """Why a document was dropped: the filter, what was measured, and the limit it broke (a DataConfig field)."""

    reason: str
    value: float | None = None
    threshold: float | None = None
    setting: str | None = None


class QualityFilter:
    """Thresholds resolved once (explicit field, else preset, else off); `check` names the first failure."""

    def __init__(self, config: DataConfig):
        preset = PRESETS.get(config.quality_filters, {})
        self.min_length = config.min_length
        for name in _THRESHOLDS:
            value = getattr(config, name)
            setattr(self, name, value if value is not None else preset.get(name))
        self.ngram = config.duplicate_ngram_size
        self.needs_words = any(
            getattr(self, n) is not None
            for n in (
                "min_words",
                "max_words",
                "min_mean_word_length",
                "max_mean_word_length",
                "max_duplicate_ngram_fraction",
            )
        )

    def active(self) -> list[str]:
        """The filters that can drop a document under this config (min_length always can: empty text)."""
        checks = {
            "max_chars": self.max_chars,
            "min_words": self.min_words,
            "max_words": self.max_words,
            "alpha_fraction": self.min_alpha_fraction,
            "mean_word_length": self.min_mean_word_length
            if self.min_mean_word_length is not None
            else self.max_mean_word_length,
            "repeated_lines": self.max_repeated_line_fraction,
            "duplicate_ngrams": self.max_duplicate_ngram_fraction,
            "char_entropy": self.min_char_entropy,
        }
        return ["min_length"] + [name for name, value in checks.items() if value is not None]

    def reason(self, text: str) -> str | None:
        removal = self.check(text)
        return removal.reason if removal else None

    def check(self, text: str) -> Removal | None:
        """None if `text` passes every filter, else the first one it fails with the measured value."""
        n = len(text)
        if not text.strip():
            return Removal("min_length")  # empty after cleaning: nothing to measure
        if n < self.min_length:
            return Removal("min_length", n, self.min_length, "min_length")
        if self.max_chars is not None and n > self.max_chars:
            return Removal("max_chars", n, self.max_chars, "max_chars")
        counted = words(text) if self.needs_words else None
        count = counted.count if counted else 0
        if self.min_words is not None and count < self.min_words:
            return Removal("min_words", count, self.min_words, "min_words")
        if self.max_words is not None and count > self.max_words:
            return Removal("max_words", count, self.max_words, "max_words")
        if self.min_alpha_fraction is not None:
            fraction = letter_count(text) / max(1, n - whitespace_count(text))
            if fraction < self.min_alpha_fraction:
                return Removal("alpha_fraction", round(fraction, 4), self.min_alpha_fraction, "min_alpha_fraction")
        if (
            counted
            and 2 * len(counted.spaced) >= counted.count
            and (self.min_mean_word_length is not None or self.max_mean_word_length is not None)
        ):  # a text mostly in a script without spaces has no word length to measure
            mean = mean_word_length(counted.spaced, text)
            if mean is not None and self.min_mean_word_length is not None and mean < self.min_mean_word_length:
                return Removal("mean_word_length", round(mean, 3), self.min_mean_word_length, "min_mean_word_length")
            if mean is not None and self.max_mean_word_length is not None and mean > self.max_mean_word_length:
                return Removal("mean_word_length", round(mean, 3), self.max_mean_word_length, "max_mean_word_length")
        if self.max_repeated_line_fraction is not None:
            fraction = repeated_line_fraction(text)
            if fraction > self.max_repeated_line_fraction:
                return Removal(
                    "repeated_lines", round(fraction, 4), self.max_repeated_line_fraction, "max_repeated_line_fraction"
                )
        if self.max_duplicate_ngram_fraction is not None and counted:
            if counted.chars is None:
                fraction = duplicate_ngram_fraction(counted.spaced, self.ngram)
            else:  # characters, in n-grams as long as `ngram` words
                size = max(self.ngram, round(self.ngram * len(counted.chars) / max(1, counted.count)))
                fraction = duplicate_char_ngram_fraction(counted.chars, size)
            if fraction > self.max_duplicate_ngram_fraction:
                return Removal(
                    "duplicate_ngrams",
                    round(fraction, 4),
                    self.max_duplicate_ngram_fraction,
                    "max_duplicate_ngram_fraction",
                )
        if self.min_char_entropy is not None:
            entropy = char_entropy(text)
            if entropy < self.min_char_entropy:
                return Removal("char_entropy", round(entropy, 4), self.min_char_entropy, "min_char_entropy")
        return None
