"""Letters and words in any script: what the quality filters count, defined so every script is measured fairly.

Letters. A letter is a Unicode letter (L*) together with its combining marks (M*: Devanagari and Tamil
vowel signs and viramas, Arabic vowel points, accents) and the zero-width (non-)joiners that sit
inside Indic and Persian words; one after anything but a letter (an emoji's variation selector, a
keycap, the joiner of an emoji sequence) is part of a symbol, not a letter. Counting marks as non-letters, as `str.isalpha` does, scores clean
Hindi or Tamil text far below English on letters per character; with marks they score alike (figures
in bench/README.md, "Text in every script").

Words. Text in scripts written with spaces splits on whitespace. Scripts written without
spaces between words (Han, kana and bopomofo; Thai, Lao, Khmer, Myanmar, Tibetan) have no word
boundaries a regex can find, so their words are estimated from their characters: one word per 1.5
CJK characters (the mean length of Chinese words in running text; the same content has 1.66 Han
characters per English word in NTREX-128) and one per 3 characters of the others (marks excluded;
an estimate, not calibrated on data here). Repetition in such text is measured on characters.

Word length is measured in characters without the marks that attach with a nonzero canonical
combining class (viramas, nuktas, Arabic and Hebrew vowel points, accents): they decorate a letter or
remove its vowel rather than stand for a sound. Indic vowel signs (class 0) count, like the vowels
they are, so word lengths of Indic, Arabic and European text fall in a common range; counting every
code point would put Tamil words far above the others (see bench/README.md, "Text in every script").
A precomposed Hangul syllable counts as the two or three letters (jamo) it is a block of, as decomposed
Korean text counts them: counted as one character, ordinary Korean prose has words of 2.6 to 3
"characters" and falls below the usual minimum mean word length of 3.

All measures have an ASCII fast path, where they are the plain whitespace-based counts.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import NamedTuple

# Scripts without spaces between words: (first, last) code point ranges, and characters per word.
_CJK_RANGES = [
    (0x2E80, 0x2FDF),
    (0x3005, 0x3007),
    (0x3021, 0x3029),
    (0x3031, 0x3035),
    (0x3038, 0x303C),
    (0x3040, 0x30FF),
    (0x3100, 0x312F),
    (0x31A0, 0x31BF),
    (0x31F0, 0x31FF),
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0xFF66, 0xFF9F),
    (0x20000, 0x2FA1F),
    (0x30000, 0x323AF),
]
_SOUTHEAST_RANGES = [
    (0x0E00, 0x0EFF),
    (0x0F00, 0x0FFF),
    (0x1000, 0x109F),
    (0x1780, 0x17FF),
    (0x19E0, 0x19FF),
    (0xA9E0, 0xA9FF),
    (0xAA60, 0xAA7F),
]
CJK_CHARS_PER_WORD = 1.5
SOUTHEAST_CHARS_PER_WORD = 3.0
_JOINERS = "\u200c\u200d"  # zero-width non-joiner / joiner: inside words in Indic and Persian text


def _class(ranges: list[tuple[int, int]]) -> str:
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


def _ranges(codepoints: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for cp in codepoints:
        if out and cp == out[-1][1] + 1:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return out


class _CharClass(NamedTuple):
    """A class of characters as two regexes: Python's regex engine tests a class of BMP characters with a
    bitmap but one with characters past U+FFFF range by range, far more slowly, so those are kept apart
    and searched only in text that has such characters."""

    bmp: re.Pattern
    astral: re.Pattern

    def count(self, text: str) -> int:
        n = len(text) - len(self.bmp.sub("", text))
        if _has_astral(text):
            n += len(self.astral.findall(text))
        return n

    def replace(self, text: str, by: str) -> str:
        text = self.bmp.sub(by, text)
        return self.astral.sub(by, text) if _has_astral(text) else text


def _has_astral(text: str) -> bool:
    """Whether `text` has characters past U+FFFF."""
    return len(text.encode("utf-16-le")) != 2 * len(text)


class _Patterns(NamedTuple):
    marks: _CharClass  # combining marks
    lettered: re.Pattern  # a run of letters with the marks and joiners after them (marks in the BMP)
    lettered_astral: re.Pattern  # the same with every mark (slower: for text with characters past U+FFFF)
    attached: _CharClass  # combining marks with a nonzero combining class
    separators: _CharClass  # non-ASCII punctuation, symbols and spaces (Unicode P*, S*, Z*)
    spaceless: re.Pattern  # any character of a script without spaces
    cjk: re.Pattern  # a CJK character (telling the two spaceless groups apart)
    runs: re.Pattern  # a run of one spaceless group (with its marks), or a run of anything else but whitespace


def _char_class(codepoints: list[int]) -> _CharClass:
    return _CharClass(
        re.compile(f"[{_class(_ranges([c for c in codepoints if c < 0x10000]))}]"),
        re.compile(f"[{_class(_ranges([c for c in codepoints if c >= 0x10000]))}]"),
    )


@functools.cache
def _patterns() -> _Patterns:
    """Built on first use from this Python's Unicode database (~50 ms): classes are scanned, not listed."""
    marks, attached, separators = [], [], []
    for cp in [*range(0x20000), *range(0xE0000, 0xE0200)]:  # no marks, punctuation or symbols elsewhere
        ch = chr(cp)
        category = unicodedata.category(ch)[0]
        if category == "M":
            marks.append(cp)
            if unicodedata.combining(ch):
                attached.append(cp)
        elif category in "PSZ" and cp >= 0x80:
            separators.append(cp)
    mark_class = _class(_ranges(marks))
    cjk, southeast = _class(_CJK_RANGES), _class(_SOUTHEAST_RANGES)
    spaceless = cjk + southeast
    bmp_marks = _class(_ranges([c for c in marks if c < 0x10000]))
    return _Patterns(
        marks=_char_class(marks),
        lettered=re.compile(rf"[^\W\d_]+(?:[{bmp_marks}{_JOINERS}]+[^\W\d_]*)*"),
        lettered_astral=re.compile(rf"[^\W\d_]+(?:[{mark_class}{_JOINERS}]+[^\W\d_]*)*"),
        attached=_char_class(attached),
        separators=_char_class(separators),
        spaceless=re.compile(f"[{spaceless}]"),
        cjk=re.compile(f"[{cjk}]"),
        runs=re.compile(rf"[{cjk}][{cjk}{mark_class}]*|[{southeast}][{southeast}{mark_class}]*|[^\s{spaceless}]+"),
    )


_ASCII_LETTERS = bytes(range(65, 91)) + bytes(range(97, 123))
_LETTERS = re.compile(r"[^\W\d_]+")  # runs of what str.isalpha calls letters (L*, no marks)
_WORDISH = re.compile(r"[^\W_]")  # a letter or digit: a run holding none is punctuation, not a word


def letter_count(text: str) -> int:
    """Letters with their combining marks and joiners (see the module docstring). A mark or joiner
    counts after a letter only: after an emoji or a digit (a variation selector, a keycap, the joiner
    of an emoji sequence) it is part of a symbol."""
    if text.isascii():  # bytes.translate deletes at memory speed
        raw = text.encode("ascii")
        return len(raw) - len(raw.translate(None, _ASCII_LETTERS))
    patterns = _patterns()
    if _has_astral(text):
        lettered = patterns.lettered_astral
    elif patterns.marks.bmp.search(text) is None and not any(joiner in text for joiner in _JOINERS):
        return sum(map(len, _LETTERS.findall(text)))  # letters alone: the faster regex
    else:
        lettered = patterns.lettered
    return len(text) - len(lettered.sub("", text))


def has_spaceless(text: str) -> bool:
    return not text.isascii() and _patterns().spaceless.search(text) is not None


def separators_to_spaces(text: str) -> str:
    """`text` with its non-ASCII punctuation, symbols and spaces (the Arabic comma, the ideographic full
    stop, U+3000) replaced by spaces: where words are compared (near-duplicate shingles), every
    script's punctuation separates them as ASCII punctuation does, rather than sticking to a word."""
    return text if text.isascii() else _patterns().separators.replace(text, " ")


def spaceless_apart(text: str) -> str:
    """`text` with each character of a script written without spaces set apart by spaces: its characters
    stand for words where a measure is made on words (near-duplicate shingles), as `Words.chars` does
    for the quality filters. Text without such scripts is returned as it is."""
    if not has_spaceless(text):
        return text
    return _patterns().spaceless.sub(lambda m: f" {m.group()} ", text)


@dataclass(frozen=True)
class Words:
    """The word measures of one text.

    spaced: the words of scripts written with spaces (whitespace-separated, as str.split gives them
    for text without spaceless scripts). count: those plus the estimated words of spaceless runs.
    chars: for a text with spaceless scripts, its non-whitespace characters, on which repetition is
    measured (there are no words to make n-grams of); None otherwise.
    """

    spaced: list[str]
    count: int
    chars: str | None = None


def words(text: str) -> Words:
    if not has_spaceless(text):
        spaced = text.split()
        return Words(spaced, len(spaced))
    p = _patterns()
    spaced: list[str] = []
    estimated = 0.0
    for run in p.runs.findall(text):
        if p.cjk.match(run):
            estimated += len(run) / CJK_CHARS_PER_WORD
        elif p.spaceless.match(run):
            estimated += (len(run) - p.marks.count(run)) / SOUTHEAST_CHARS_PER_WORD
        elif _WORDISH.search(run):  # "4" or "Python" inside Chinese text; "，" alone is punctuation
            spaced.append(run)
    return Words(spaced, len(spaced) + round(estimated), "".join(text.split()))


def mean_word_length(spaced: list[str], text: str) -> float | None:
    """Mean length of the spaced words of `text` (module docstring), or None when there are none."""
    if not spaced:
        return None
    total = sum(map(len, spaced))
    if not text.isascii():
        joined = "".join(spaced)
        total -= _patterns().attached.count(joined)
        syllables = _HANGUL_SYLLABLE.findall(joined)  # each: an initial and a vowel, and a final where it has one
        total += len(syllables) + sum((ord(s) - _HANGUL_FIRST) % _HANGUL_FINALS != 0 for s in syllables)
    return total / len(spaced)


_HANGUL_FIRST, _HANGUL_FINALS = 0xAC00, 28  # syllable = first + (initial * 21 + vowel) * 28 + final (0: none)
_HANGUL_SYLLABLE = re.compile("[\uac00-\ud7a3]")
