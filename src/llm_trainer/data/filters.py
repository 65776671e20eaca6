"""Quality filters: each document is kept, or dropped for the first filter it fails (which is counted).

Thresholds come from DataConfig; those left null take the `quality_filters` preset's value (none
under "off"). The presets follow the heuristics of Gopher/C4 style web filtering, loosened where
code differs from prose (code repeats lines, has fewer letters and longer "words").

Measures, all language-agnostic except the word-based ones (words = whitespace-separated):
  min_length / max_chars        characters
  min_words / max_words         words
  alpha_fraction                letters / non-whitespace characters
  mean_word_length              non-whitespace characters / words
  repeated_lines                non-blank lines equal (stripped) to an earlier line / non-blank lines
  duplicate_ngrams              word n-grams equal to an earlier one / all n-grams (case-folded)
  char_entropy                  Shannon entropy of the character histogram, bits per character
"""

from __future__ import annotations

import re

import numpy as np

from ..config import DataConfig

PRESETS: dict[str, dict[str, float | int]] = {
    "prose": dict(
        max_chars=1_000_000, min_words=50, max_words=100_000, min_alpha_fraction=0.6, min_mean_word_length=3.0,
        max_mean_word_length=10.0, max_repeated_line_fraction=0.3, max_duplicate_ngram_fraction=0.2, min_char_entropy=3.5,
    ),
    "code": dict(
        max_chars=1_000_000, min_words=5, max_words=200_000, min_alpha_fraction=0.25, max_mean_word_length=25.0,
        max_repeated_line_fraction=0.6, max_duplicate_ngram_fraction=0.6, min_char_entropy=3.0,
    ),
}
# The order in which filters are tried (cheapest first); a dropped document counts for the first it fails.
FILTERS = ("min_length", "max_chars", "min_words", "max_words", "alpha_fraction", "mean_word_length",
           "repeated_lines", "duplicate_ngrams", "char_entropy")
_THRESHOLDS = ("max_chars", "min_words", "max_words", "min_alpha_fraction", "min_mean_word_length", "max_mean_word_length",
               "max_repeated_line_fraction", "max_duplicate_ngram_fraction", "min_char_entropy")
_LETTER = re.compile(r"[^\W\d_]+")  # runs of Unicode letters
_ASCII_LETTERS = bytes(range(65, 91)) + bytes(range(97, 123))
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


def letter_count(text: str) -> int:
    if text.isascii():  # bytes.translate deletes at memory speed
        raw = text.encode("ascii")
        return len(raw) - len(raw.translate(None, _ASCII_LETTERS))
    return sum(len(run) for run in _LETTER.findall(text))


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


class QualityFilter:
    """Thresholds resolved once (explicit field, else preset, else off); `reason` names the first failure."""

    def __init__(self, config: DataConfig):
        preset = PRESETS.get(config.quality_filters, {})
        self.min_length = config.min_length
        for name in _THRESHOLDS:
            value = getattr(config, name)
            setattr(self, name, value if value is not None else preset.get(name))
        self.ngram = config.duplicate_ngram_size
        self.needs_words = any(getattr(self, n) is not None for n in (
            "min_words", "max_words", "min_mean_word_length", "max_mean_word_length", "max_duplicate_ngram_fraction"))

    def active(self) -> list[str]:
        """The filters that can drop a document under this config (min_length always can: empty text)."""
        checks = {
            "max_chars": self.max_chars, "min_words": self.min_words, "max_words": self.max_words,
            "alpha_fraction": self.min_alpha_fraction,
            "mean_word_length": self.min_mean_word_length if self.min_mean_word_length is not None else self.max_mean_word_length,
            "repeated_lines": self.max_repeated_line_fraction, "duplicate_ngrams": self.max_duplicate_ngram_fraction,
            "char_entropy": self.min_char_entropy,
        }
        return ["min_length"] + [name for name, value in checks.items() if value is not None]

    def reason(self, text: str) -> str | None:
        n = len(text)
        if n < self.min_length or not text.strip():
            return "min_length"
        if self.max_chars is not None and n > self.max_chars:
            return "max_chars"
        words = text.split() if self.needs_words else []
        if self.min_words is not None and len(words) < self.min_words:
            return "min_words"
        if self.max_words is not None and len(words) > self.max_words:
            return "max_words"
        nonspace = n - whitespace_count(text) if (self.min_alpha_fraction is not None or self.needs_words) else 0
        if self.min_alpha_fraction is not None and letter_count(text) < self.min_alpha_fraction * max(1, nonspace):
            return "alpha_fraction"
        if words and (self.min_mean_word_length is not None or self.max_mean_word_length is not None):
            mean = nonspace / len(words)
            if (self.min_mean_word_length is not None and mean < self.min_mean_word_length) or (
                self.max_mean_word_length is not None and mean > self.max_mean_word_length
            ):
                return "mean_word_length"
        if self.max_repeated_line_fraction is not None and repeated_line_fraction(text) > self.max_repeated_line_fraction:
            return "repeated_lines"
        if self.max_duplicate_ngram_fraction is not None and (
            duplicate_ngram_fraction(words, self.ngram) > self.max_duplicate_ngram_fraction
        ):
            return "duplicate_ngrams"
        if self.min_char_entropy is not None and char_entropy(text) < self.min_char_entropy:
            return "char_entropy"
        return None

