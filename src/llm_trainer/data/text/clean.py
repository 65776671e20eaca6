"""Cleaning: one document's text in, its normalised text out (possibly empty, which the filters drop).

In order: byte-order mark removed, lone surrogates replaced, newlines unified, control characters
removed (the line breaks among them, vertical tab, form feed and NEL, become newlines: deleted, they
would join the words on either side), Unicode NFC (or NFKC); then literal end-of-text markers removed
until none is left (a document must not contain the token that separates documents, and each step
before may join the pieces of one), normalising again where a removal has joined a letter to a
combining mark that followed the marker; then boilerplate lines dropped and whitespace normalised,
which also tidies what a removed marker left (a trailing space, a blank line). Control characters go
before the normalisation for the same reason as the markers: one between a letter and its accent would
otherwise keep them apart. So the text that comes out is always normalised, and cleaning it again
changes nothing.

Whitespace normalisation strips trailing spaces (tabs and every Unicode space: the ideographic space
U+3000, the no-break space) and collapses runs of blank lines; it never touches a line's leading
indentation. `collapse_spaces` (prose only; refused for `corpus_type: code`) also collapses runs of
ASCII spaces and tabs inside lines. Every step has a fast path for text that needs no change, because
cleaning runs on every byte of the corpus and must stay cheap next to the tokenizer.
"""

from __future__ import annotations

import re
import unicodedata

from ...config import DataConfig
from ...tokenizer import EOT

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # C0/C1 except \t \n (and \r, unified before)
_LINE_BREAKS = {0x0B: "\n", 0x0C: "\n", 0x85: "\n"}  # vertical tab, form feed, NEL: control characters that end lines
_CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])  # the ASCII part of _CONTROL
_SURROGATES = re.compile("[\ud800-\udfff]")
# Tab and the space separators (Unicode category Zs): what may trail a line, invisibly
SPACES = " \t\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"
_TRAILING = re.compile(f"[{SPACES}]+\n")
_UNICODE_SPACES = SPACES[2:]  # a substring search for each is far faster than the regex over text without them
_BLANK_RUNS = re.compile(r"\n{3,}")
_INNER_SPACES = re.compile(r"(?<=\S)[ \t]{2,}")
# Lines that are navigation or legal chrome rather than content, in English web text.
DEFAULT_BOILERPLATE = [
    r"(?i)(all rights reserved\.?|copyright ©?.{0,80})",
    r"(?i).{0,40}(cookie policy|privacy policy|terms of (use|service)).{0,40}",
    r"(?i)(we use cookies|this (web)?site uses cookies).{0,200}",
    r"(?i)(skip to (main )?content|back to top|share this( article| post)?|click here.{0,60}|read more\.?)",
    r"(?i)(subscribe to our newsletter|sign up for our newsletter|follow us on .{0,40})",
    r"(?i)(home|menu|search|login|log in|sign in|sign up|register)( [|>/·] .{0,30})*",
]


def _has_control(text: str) -> bool:
    if text.isascii():  # bytes.translate runs at memory speed, far faster than a regex search
        raw = text.encode("ascii")
        return len(raw.translate(None, _CONTROL_BYTES)) != len(raw)
    return _CONTROL.search(text) is not None


class Cleaner:
    """Built once from the config (regexes compiled), then called per document; picklable for workers."""

    def __init__(self, config: DataConfig):
        self.normalization = None if config.unicode_normalization == "none" else config.unicode_normalization
        self.control = config.remove_control_chars
        self.whitespace = config.normalize_whitespace
        self.collapse = config.collapse_spaces and config.corpus_type == "prose"
        self.boilerplate = None
        if config.remove_boilerplate:
            patterns = config.boilerplate_patterns if config.boilerplate_patterns is not None else DEFAULT_BOILERPLATE
            self.boilerplate = [re.compile(p) for p in patterns] or None  # separately: each may carry its own flags

    def __call__(self, text: str) -> str:
        if text.startswith("\ufeff"):
            text = text[1:]
        text = self.characters(text)
        while EOT in text:  # until none is left: a removal (or NFKC, or a control character's) can join one
            text = self._normalized(text.replace(EOT, ""))
        if self.boilerplate is not None:
            text = "\n".join(
                line for line in text.split("\n") if not any(p.fullmatch(line.strip()) for p in self.boilerplate)
            )
        if self.whitespace:
            if " \n" in text or "\t\n" in text or (not text.isascii() and any(c in text for c in _UNICODE_SPACES)):
                text = _TRAILING.sub("\n", text)
            text = text.rstrip(SPACES)  # the last line's trailing spaces
            if "\n\n\n" in text:
                text = _BLANK_RUNS.sub("\n\n", text)
            text = text.strip("\n")
        if self.collapse and ("  " in text or "\t" in text):
            text = _INNER_SPACES.sub(" ", text)
        return text  # (no step since the markers' removal joins characters: none can make one again)

    def characters(self, text: str) -> str:
        """The steps that change characters, not lines or the document's edges: lone surrogates replaced,
        newlines unified, control characters removed, Unicode normalised. What a prompt gets (`generate`):
        its end is not a line's end, so its trailing spaces are its own."""
        if not text.isascii():  # isascii is O(1); lone surrogates (e.g. "\ud800" in JSON) cannot be tokenized
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                text = _SURROGATES.sub("\ufffd", text)
        text = unified_newlines(text)
        if self.control and _has_control(text):
            text = _CONTROL.sub("", text.translate(_LINE_BREAKS))
        return self._normalized(text)

    def described(self) -> list[str]:
        """What `characters` does, in words and as Python: for a model card, so text given to an exported
        model outside llm-trainer is read as the training text was."""
        words = ["line ends as `\\n` (CRLF and CR replaced)"]
        code = ['text = text.replace("\\r\\n", "\\n").replace("\\r", "\\n")']
        if self.control:
            words.append("vertical tab, form feed and NEL as `\\n`, other control characters removed (but tab)")
            code.append(f"text = text.translate({_LINE_BREAKS!r})")  # (the one table characters() uses)
            code.append(f'text = re.sub(r"{_CONTROL.pattern}", "", text)')
        if self.normalization:
            words.append(f"Unicode in {self.normalization}")
            code.append(f'text = unicodedata.normalize("{self.normalization}", text)')
        return [", ".join(words), *code]

    def _normalized(self, text: str) -> str:
        if self.normalization and not text.isascii() and not unicodedata.is_normalized(self.normalization, text):
            return unicodedata.normalize(self.normalization, text)
        return text


def unified_newlines(text: str) -> str:
    """Line ends as `\\n`: CRLF and a lone CR replaced (the first step of cleaning, and of cutting a long
    file into documents, so that a file's pieces do not depend on its line ends)."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def cleaner_of_run(experiment: dict) -> Cleaner:
    """The cleaning a run's data went through, from its saved config (`load_for_inference`'s experiment):
    text given to the trained model later (`eval --data`, a prompt) is cleaned as its training text
    was. A saved data section this version cannot read gives the default cleaning."""
    saved = experiment.get("data") if isinstance(experiment, dict) else None
    try:
        return Cleaner(DataConfig.from_dict(saved, section="data") if isinstance(saved, dict) else DataConfig())
    except (TypeError, ValueError):
        return Cleaner(DataConfig())


def clean_text(text: str, config: DataConfig) -> str:
    """Clean one document as `prepare` does (builds the Cleaner each call: for tests and one-offs)."""
    return Cleaner(config)(text)
