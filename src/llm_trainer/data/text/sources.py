"""Where documents come from: files, folders, globs, JSONL, Parquet, Hugging Face datasets, the stdlib.

Each source is read into `Document`s (text + the source's name + where it was read, + a curriculum
score when one is read), in a deterministic order, in constant memory: JSONL line by line, Parquet in
record batches, datasets in batches or as a stream. Several sources are mixed by `mixture.interleave`.

A record (a JSONL line, a Parquet row, a dataset row) is one document. A plain-text file is one
document too, unless it is longer than the `max_chars` filter in force (set, or from the
`quality_filters` preset): then it is a book or a dump rather than a document, and it is cut into
pieces of at most 90% of `max_chars` (cleaning can lengthen text a little: NFC decomposes a few
characters) and about equal size, each at the blank line (paragraph break) nearest its even share,
else at a line break, else at a space (`split_long_text`), instead of being dropped whole. Without a
`max_chars`, a file stays whole, as a single file's split by position expects. Any document longer
than `limits.MAX_DOCUMENT_CHARS` is cut the same way (counted as `long_documents_split` in the data
report), and a JSONL line longer than `limits.MAX_LINE_BYTES` is bad input, never read whole.

A file compressed with gzip, bzip2, xz or zstandard (`.gz`, `.bz2`, `.xz`, `.zst`) is read through its
decompressor, as what its name says without that suffix (`books.txt.gz` as text, `c4.json.gz` as JSON
Lines): the same documents as the file uncompressed. JSON Lines are decompressed as they are read; a
text file, which is read whole, is decompressed whole within `limits.MAX_DECOMPRESSED_TEXT_BYTES` and
`limits.MAX_COMPRESSION_RATIO` (a few kilobytes can hold gigabytes of one repeated byte).

Bad input (a missing file, a binary file, a JSONL line that is not JSON or lacks the column, a
Parquet file without the column, an empty source) goes through `BadInput`: skipped and counted, or a
one-line `UsageError` naming the file and line, as `DataConfig.on_bad_input` says. The default,
`skip_in_folders`, skips what was found by walking a folder or glob (one stray binary in a corpus
folder should not stop a run) and refuses what the user named.
"""

from __future__ import annotations

import bz2
import codecs
import fnmatch
import functools
import glob
import gzip
import io
import itertools
import json
import lzma
import math
import os
import re
import sysconfig
import unicodedata
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple, TypeVar

from ...config import DataConfig, SourceConfig
from ...errors import UsageError, first_line
from ...files.buckets import Location, fetch_file, identity, list_files, looks_like_glob
from ...hf.hub import hub_unreachable, offline_mode_set
from ...limits import MAX_DOCUMENT_CHARS, MAX_LINE_BYTES, decompressed_text_allowance
from .clean import unified_newlines
from .filters import QualityFilter
from .unicode_text import words

BUILTIN_STDLIB = "python-stdlib"
TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".text",
    ".c",
    ".h",
    ".js",
    ".ts",
    ".java",
    ".go",
    ".rs",
    ".html",
    ".tex",
    ".csv",
}
JSONL_SUFFIXES = (".jsonl", ".ndjson")
ARCHIVE_SUFFIXES = (".tar", ".tgz", ".tbz2", ".txz", ".zip", ".7z", ".rar")  # many files in one: never read as one
DEFAULT_SOURCE = "data"  # the name of the one source that data_files / dataset_name make
UTF8_BOM = b"\xef\xbb\xbf"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
SPLIT_SHARE = 0.9  # long text files are cut into pieces of at most this share of max_chars and of max_words
_BATCH_ROWS = 1024  # Parquet / datasets rows read at a time
_CHUNK_BYTES = 16 << 20  # a compressed text file is decompressed this much at a time
_FIELDS_NAMED = 8  # of a JSON record without the text column, in the message


class Document(NamedTuple):
    text: str
    source: str  # the name of the source it came from
    score: float | None = None  # the curriculum_key column's value, when that is a column
    origin: str | None = None  # where it was read (file, file:line, file[row], dataset:split[i]), named in the report


NAMED_SKIPS = 20  # skipped inputs named per kind in data_report.json


@dataclass
class SourceStats:
    """What the readers skipped, by kind (binary_files, bad_json_lines, ...), reported in the manifest,
    and the first `NAMED_SKIPS` of each kind named with the reason, for the report and the console."""

    skipped: Counter = field(default_factory=Counter)
    named: dict[str, list[str]] = field(default_factory=dict)
    # (its local copy, its URL) while a file downloaded from a store is read: what is said of it names the URL
    reading: tuple[str, str] | None = field(default=None, compare=False, repr=False)

    def skip(self, kind: str, what: str) -> None:
        self.skipped[kind] += 1
        names = self.named.setdefault(kind, [])
        if len(names) < NAMED_SKIPS:
            names.append(self.shown(what))

    def shown(self, what: str) -> str:
        """`what`, a message or an origin, with the local copy of a file read from a store named by its URL."""
        if self.reading is None:
            return what
        local, url = self.reading
        return what.replace(local, url)

    def to_json(self) -> dict | None:
        """The counts and names as plain JSON (a task's part file, plan.json); None when nothing was skipped."""
        counts = {kind: n for kind, n in self.skipped.items() if n}
        return {"counts": counts, "named": self.named} if counts else None

    @classmethod
    def from_json(cls, record: dict | None) -> SourceStats:
        return cls(Counter(record["counts"]), record["named"]) if record else cls()

    def take(self) -> SourceStats:
        """What was skipped since the last `take`, handed over and cleared here (a reader keeps this object)."""
        taken = SourceStats(Counter(self.skipped), self.named)
        self.skipped.clear()
        self.named = {}
        return taken

    def update(self, other: SourceStats) -> None:
        """Add `other`'s counts and names (a later phase), keeping at most `NAMED_SKIPS` names per kind."""
        self.skipped.update(other.skipped)
        for kind, names in other.named.items():
            kept = self.named.setdefault(kind, [])
            kept += names[: NAMED_SKIPS - len(kept)]


class BadInput:
    """Skip-and-count or a one-line UsageError, as `on_bad_input` says.

    `in_folder`: the problem is a whole file found by walking a folder or a glob, which the
    default mode skips; lines inside a file and files named explicitly are errors unless mode is skip.
    """

    def __init__(self, mode: str, stats: SourceStats):
        self.mode, self.stats = mode, stats

    def __call__(self, kind: str, message: str, *, fix: str | None = None, in_folder: bool = False) -> None:
        """`message` says what is wrong; `fix`, what to do about it, is said only when it stops the run
        (a skipped file's line in the summary needs no advice on skipping it)."""
        if self.mode == "skip" or (self.mode == "skip_in_folders" and in_folder):
            self.stats.skip(kind, message)
            return
        raise UsageError(self.stats.shown(message if fix is None else f"{message}; {fix}"))


def resolved_sources(config: DataConfig) -> list[SourceConfig]:
    """The sources of the mixture with every setting filled: each `data.sources` entry with its unset
    keys taken from the top-level fields, or the one source that data_files / dataset_name make."""
    common = dict(
        dataset_config=config.dataset_config,
        dataset_split=config.dataset_split,
        text_column=config.text_column,
        include=config.include,
        exclude=config.exclude,
        streaming=config.streaming,
    )
    if not config.sources:
        return [
            SourceConfig(name=DEFAULT_SOURCE, data_files=config.data_files, dataset_name=config.dataset_name, **common)
        ]
    return [
        replace(source, **{k: v for k, v in common.items() if getattr(source, k) is None}) for source in config.sources
    ]


# ----------------------------------------------------------------------------------------------
# files


def stdlib_files() -> list[Path]:
    """The running Python's own standard library sources: real text every machine has, offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}
    found = []
    for folder, subfolders, names in os.walk(root):  # prune while walking: site-packages can be huge
        subfolders[:] = [d for d in subfolders if d not in skip]
        found += [Path(folder) / n for n in names if n.endswith(".py") and n not in skip]
    return sorted(found)


def _hidden(relative: str) -> bool:
    """Whether a path found below a folder (relative to it) is hidden: its name or a folder on the way
    starts with a dot (`.git/`, `.cache/`, `.DS_Store`). Such files are never read from a folder."""
    return any(part.startswith(".") for part in relative.split("/"))


def tool_folders(config: DataConfig) -> tuple[Path, ...]:
    """The folders this tool writes its data into (the prepared-data cache, the stream cache): never
    data, though a folder or glob of data holds them (`data_files: [.]`)."""
    return tuple(Path(folder).resolve() for folder in (config.local_cache_dir, config.stream_cache_dir))


def _tools_output(path: Path, base: Path, ours: tuple[Path, ...], memo: dict[str, bool]) -> bool:
    """Whether a file a folder or glob found is this tool's own output, never data: under one of `ours`
    (`tool_folders`), or in a training run's output folder (its metrics.jsonl beside its config.yaml)
    at or below `base`, where the walk began. `memo` keeps the answer for each folder: a folder of many
    files asks it once."""
    if path.is_symlink() and _under(os.path.realpath(path), ours):
        return True
    return _tools_folder(os.path.dirname(path) or ".", str(base), ours, memo)


def _tools_folder(folder: str, base: str, ours: tuple[Path, ...], memo: dict[str, bool]) -> bool:
    """Whether the files in `folder`, at or below `base`, are this tool's output (`_tools_output`)."""
    if folder not in memo:
        run = os.path.isfile(os.path.join(folder, "metrics.jsonl")) and os.path.isfile(
            os.path.join(folder, "config.yaml")
        )
        parent = os.path.dirname(folder) or "."
        memo[folder] = (
            run
            or _under(os.path.realpath(folder), ours)
            or (folder not in (base, parent) and _tools_folder(parent, base, ours, memo))
        )
    return memo[folder]


def _under(resolved: str, folders: tuple[Path, ...]) -> bool:
    """Whether the resolved path `resolved` is one of `folders` (resolved too) or inside one."""
    return any(resolved == str(folder) or resolved.startswith(os.path.join(folder, "")) for folder in folders)


def _folder_files(folder: Path) -> list[tuple[Path, str]]:
    """Every file below `folder` that is not hidden (`_hidden`), with its path relative to `folder`, in the
    order `sorted` gives Paths (by their parts). Hidden folders are not entered, nor are symbolic links to
    folders (as `Path.rglob` does not)."""
    top = str(folder)
    found = []
    for here, subfolders, names in os.walk(top):
        subfolders[:] = [name for name in subfolders if not _hidden(name)]
        prefix = os.path.relpath(here, top)
        prefix = "" if prefix == "." else prefix.replace(os.sep, "/") + "/"
        found += [prefix + name for name in names if not _hidden(name) and os.path.isfile(os.path.join(here, name))]
    found.sort(key=lambda relative: relative.split("/"))
    return [(folder / relative, relative) for relative in found]


def _pattern_files(pattern: str) -> list[Path]:
    """The files a glob pattern matches (`**` spans folders), sorted."""
    return sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())


def _selected(relative: str, include, exclude) -> bool:
    """include/exclude globs against a path relative to its folder ("*" spans folders) or its file name."""

    def hit(patterns) -> bool:
        name = relative.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(relative, p) or fnmatch.fnmatchcase(name, p) for p in patterns)

    return (not include or hit(include)) and not (exclude and hit(exclude))


def _glob_base(spec: str) -> Path:
    """The folder part of a glob before its first wildcard: include/exclude match below it."""
    static = list(itertools.takewhile(lambda part: not looks_like_glob(part), Path(spec).parts))
    return Path(*static) if static else Path(".")


class InputFile(NamedTuple):
    path: Path  # where it is read: the file, or a store's file's local copy
    explicit: bool  # named by the user (bad input in it is an error under skip_in_folders)
    url: str | None = None  # the store's file that `path` is a copy of: how reports and messages name it


def resolve_files(
    specs,
    include=None,
    exclude=None,
    bad: BadInput | None = None,
    cache: Path | None = None,
    ours: tuple[Path, ...] = (),
) -> list[InputFile]:
    """Expand files, folders and globs into InputFiles, sorted within each spec.

    include/exclude filter the files found in folders and globs; a file named explicitly is always read.
    Folders and globs leave out this tool's own output (`_tools_output`: `ours`, `tool_folders`, and
    training runs' folders). A spec that is a URL is listed in its store and each file is downloaded
    into the local `cache`.
    """
    bad = bad or BadInput("error", SourceStats())
    memo: dict[str, bool] = {}
    if isinstance(specs, str):
        specs = [specs]
    out: list[InputFile] = []
    for spec in specs:
        if Location(spec).url:
            if cache is None:
                raise UsageError(f"data file {spec} is a URL; set data.stream_cache_dir to a local folder for its copy")
            out += [
                InputFile(fetch_file(url, info, cache), explicit, url)
                for url, info, explicit in _remote_files(spec, include, exclude, bad)
            ]
            continue
        expanded = os.path.expanduser(spec)
        path = Path(expanded)
        if looks_like_glob(spec) and not path.exists():  # a path that exists is literal: `data[1].txt`
            base = _glob_base(expanded)
            matches = _listed("pattern", expanded, functools.partial(_pattern_files, expanded))
            chosen = [
                p
                for p in matches
                if _selected(_relative(p, base), include, exclude) and not _tools_output(p, base, ours, memo)
            ]
            if not chosen:
                brackets = " (in a pattern, [ and ] match one character of a set: write [[] for a [ in a name)"
                bad(
                    "missing_files",
                    f"data_files pattern {spec!r} matches no files; check the path and the pattern"
                    + (brackets if "[" in spec else ""),
                )
            out += [InputFile(p, False) for p in chosen]
        elif path.is_dir():
            found = _listed("folder", expanded, functools.partial(_folder_files, path))
            chosen = [
                p
                for p, relative in found
                if _selected(relative, include, exclude) and not _tools_output(p, path, ours, memo)
            ]
            if not chosen:
                bad(
                    "empty_folders", f"data folder {path} has no files" + (" matching include/exclude" if found else "")
                )
            out += [InputFile(p, False) for p in chosen]
        elif path.is_file():
            out.append(InputFile(path, True))
        else:
            bad("missing_files", f"data file {path} not found; fix data.data_files (files, folders or globs)")
    return out


# What each listing of the data's files answered while `one_listing` holds (by kind and folder, pattern
# or URL); None: every look lists anew.
_listings: dict[tuple[str, str], object] | None = None


@contextmanager
def one_listing() -> Iterator[None]:
    """Within it, each folder, pattern and store URL of the data is listed once and every later look
    gets that answer, so that what a prepare fingerprints, reads and records are the same files (one
    added meanwhile is the next prepare's), and a large bucket folder is not listed again for each."""
    global _listings
    outer = _listings
    _listings = {} if outer is None else outer
    try:
        yield
    finally:
        _listings = outer


_Listing = TypeVar("_Listing")


def _listed(kind: str, where: str, list_now: Callable[[], _Listing]) -> _Listing:
    """`list_now()`; while `one_listing` holds, what it answered the first time for (kind, where)."""
    if _listings is None:
        return list_now()
    if (kind, where) not in _listings:
        _listings[kind, where] = list_now()
    return _listings[kind, where]  # type: ignore[return-value]


def _remote_files(spec: str, include, exclude, bad: BadInput) -> list[tuple[str, dict, bool]]:
    """(URL, info, named_explicitly) of each file a URL spec names, filtered as local folders and globs are."""
    found, globbed = _listed("store", spec, functools.partial(list_files, spec))
    if len(found) == 1 and found[0][0].rstrip("/") == spec.rstrip("/"):
        return [(found[0][0], found[0][1], True)]
    base = str(_glob_base(spec.split("://", 1)[1])) if globbed else spec.split("://", 1)[1].rstrip("/")
    chosen = [
        (url, info, False)
        for url, info in found
        if not _hidden(relative := _relative_url(url, base)) and _selected(relative, include, exclude)
    ]
    if not chosen:
        bad("missing_files", f"data_files {spec!r} names no files in its store; check the URL and the pattern")
    return chosen


def _relative_url(url: str, base: str) -> str:
    path = url.split("://", 1)[1]
    return path[len(base) :].lstrip("/") if path.startswith(base + "/") else path


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


@dataclass
class _ReadOptions:
    text_column: str
    score_column: str | None  # the curriculum column, or None
    invalid_utf8: str  # bad_input | replace | drop
    bad: BadInput
    split_chars: int | None = None  # plain-text files longer than this become several documents
    split_words: int | None = None  # ... and so do pieces with more words than this
    cache: Path | None = None  # where files read from URLs are copied (data.stream_cache_dir)
    tool_folders: tuple[Path, ...] = ()  # never read as data (`tool_folders`)


BINARY_SAMPLE = 8192  # the bytes `looks_binary` reads
BINARY_NULS = 0.01  # a larger share of NUL bytes in them is binary data, even where they decode as UTF-8


def looks_binary(raw: bytes) -> bool:
    """Whether a file's bytes are binary data, by its first BINARY_SAMPLE bytes: NUL bytes (no text
    holds many; numbers, images and archives do) that either are more than BINARY_NULS of them or sit
    among bytes that are not UTF-8. A stray NUL in UTF-8 text is a control character, which cleaning
    removes, as it removes one in a JSON record's text."""
    sample = raw[:BINARY_SAMPLE]
    nuls = sample.count(b"\x00")
    if not nuls:
        return False
    if nuls > BINARY_NULS * len(sample):
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=len(raw) <= BINARY_SAMPLE)
    except UnicodeDecodeError:
        return True
    return False


def read_text_file(
    path: Path,
    explicit: bool,
    stats: SourceStats,
    *,
    invalid_utf8: str = "bad_input",
    bad: BadInput | None = None,
    fix: str = "remove it from data.data_files",
) -> str | None:
    """A whole file (decompressed, for a compressed one) as one document, or None when it is skipped
    (binary, not UTF-8, ...). `fix`: what a message about a file named explicitly tells (where the file
    was named: a setting or a flag)."""
    bad = bad or BadInput("skip_in_folders", stats)
    compressed = _without_compression(path.name.lower())[1]
    try:
        raw = _decompressed_whole(path) if compressed else path.read_bytes()
    except _Oversized as exc:
        bad("oversized_files", str(exc), in_folder=not explicit)
        return None
    except _decompression_errors() as exc:
        said = f"could not be decompressed ({exc})" if compressed else f"could not be read ({exc.strerror})"
        bad("unreadable_files", f"{path} {said}", in_folder=not explicit)
        return None
    if raw.startswith(UTF16_BOMS):  # Windows' "Unicode" text: UTF-16 with its byte-order mark, read as such
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError as exc:
            bad(
                "non_utf8_files",
                f"{path} starts as UTF-16 text but is not (bad bytes at offset {exc.start}); convert it to UTF-8",
                in_folder=not explicit,
            )
            return None
    if looks_binary(raw):
        hint = fix if explicit else "exclude it (data.exclude) or set data.on_bad_input: skip"
        bad("binary_files", f"{path} looks like a binary file, not text", fix=hint, in_folder=not explicit)
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if invalid_utf8 == "replace":
            return raw.decode("utf-8", errors="replace")
        if invalid_utf8 == "drop":
            stats.skip("invalid_utf8", f"{path} is not UTF-8 text (dropped: data.invalid_utf8 is drop)")
            return None
        bad(
            "non_utf8_files",
            f"{path} is not UTF-8 text (bad byte at offset {exc.start}); convert it to UTF-8",
            in_folder=not explicit,
        )
        return None


# ----------------------------------------------------------------------------------------------
# compressed files


def _without_compression(name: str) -> tuple[str, str | None]:
    """A file name without its compression suffix (`books.txt.gz` -> `books.txt`), and that suffix (None
    when it has none: `_DECOMPRESSORS` names those read through a decompressor)."""
    for suffix in _DECOMPRESSORS:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return name, None


def _open_decompressed(path: Path):
    """A binary stream of the file's contents, through the decompressor its suffix names (none for others)."""
    suffix = _without_compression(path.name.lower())[1]
    return _DECOMPRESSORS[suffix](path) if suffix else open(path, "rb")


def _open_zstd(path: Path):
    try:
        import zstandard  # noqa: F401  (said here, where the file is named, when it is missing)
    except ImportError:
        raise UsageError(f"reading {path} needs the zstandard package: pip install zstandard") from None
    return io.BufferedReader(_ZstdFrames(open(path, "rb")))


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstandard frames, one after another; a file that ends inside a
    frame raises ZstdError at its end, as gzip, bzip2 and xz raise for a truncated file (zstandard's own
    stream reader ends there quietly, which would read a cut file as a shorter one).

    The compressed bytes go in ZSTD_INPUT at a time: a zstandard block of a few bytes can stand for
    128 KiB, so this bounds what one step decompresses (as the stream reader's reads bound it) whatever
    the file holds."""

    def __init__(self, handle):
        import zstandard

        self.handle, self.zstandard = handle, zstandard
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.in_frame = False  # bytes of the current frame given to it, and its end not yet reached
        self.pending, self.at = b"", 0  # decompressed bytes, and how many of them were read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.pending):
            compressed = self.handle.read(ZSTD_INPUT)
            if not compressed:
                if self.in_frame:
                    raise self.zstandard.ZstdError("the file ends inside a zstandard frame (truncated)")
                return 0
            out = []
            while compressed:
                self.in_frame = True
                out.append(self.frame.decompress(compressed))
                compressed = b""
                if self.frame.eof:  # a frame ended: the next one, if any, starts in its unused data
                    compressed, self.in_frame = self.frame.unused_data, False
                    self.frame = self.zstandard.ZstdDecompressor().decompressobj()
            self.pending, self.at = b"".join(out), 0
        n = min(len(buffer), len(self.pending) - self.at)
        buffer[:n] = memoryview(self.pending)[self.at : self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.handle.close()
        super().close()


ZSTD_INPUT = 2048  # compressed bytes per step of `_ZstdFrames`: at most 64 MiB decompressed at once


_DECOMPRESSORS = {
    ".gz": lambda path: gzip.open(path, "rb"),
    ".bz2": lambda path: bz2.open(path, "rb"),
    ".xz": lambda path: lzma.open(path, "rb"),
    ".zst": _open_zstd,
}


@functools.cache
def _decompression_errors() -> tuple[type[Exception], ...]:
    """What a read of a damaged or truncated compressed file raises, in any of the decompressors (a
    failed read of the file itself is an OSError)."""
    errors: list[type[Exception]] = [OSError, EOFError, zlib.error, lzma.LZMAError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


class _Oversized(Exception):
    """A compressed text file that decompresses to more than it may (the message says which limit)."""


def _decompressed_whole(path: Path) -> bytes:
    """A compressed file's contents, read whole, never more than `decompressed_text_allowance` of its size."""
    allowed, limit = decompressed_text_allowance(path.stat().st_size)
    chunks, size = [], 0
    with _open_decompressed(path) as handle:
        while chunk := handle.read(_CHUNK_BYTES):  # in chunks: read(n) would reserve all n bytes at once
            size += len(chunk)
            if size > allowed:
                raise _Oversized(
                    f"{path} decompresses to more than {allowed:,} bytes, over {limit}; split it into smaller "
                    "files, or write it as JSON Lines, which are read line by line"
                )
            chunks.append(chunk)
    return b"".join(chunks)


def _bounded_lines(handle) -> Iterator[bytes | None]:
    """The lines of a binary stream, none held longer than MAX_LINE_BYTES: a longer line is read past
    in chunks, never whole, and given as None."""
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        yield None  # a reader that refuses it stops here, before the rest is read
        while line and not line.endswith(b"\n"):
            line = handle.readline(1 << 20)


def _read_jsonl(path: Path, explicit: bool, opt: _ReadOptions) -> Iterator[tuple[str, float | None, str]]:
    try:
        handle = _open_decompressed(path)
    except OSError as exc:
        opt.bad("unreadable_files", f"{path} could not be read ({exc.strerror})", in_folder=not explicit)
        return
    with handle:
        line_no, texts = 0, 0
        try:
            for line_no, line in enumerate(_bounded_lines(handle), 1):
                if line is None:
                    opt.bad(
                        "long_lines",
                        f"{path}:{line_no} is longer than {MAX_LINE_BYTES:,} bytes, the limit of one document "
                        "(limits.MAX_LINE_BYTES); split it into several records",
                    )
                    continue
                if line_no == 1 and line.startswith(UTF16_BOMS):
                    opt.bad(
                        "non_utf8_files",
                        f"{path} is UTF-16 text; JSON Lines are UTF-8: convert it (iconv -f UTF-16 -t UTF-8)",
                        in_folder=not explicit,
                    )
                    return
                if not line.strip():
                    continue
                item = _jsonl_record(path, line_no, line, opt, texts_before=texts > 0)
                if item is not None:
                    texts += 1
                    yield item[0], item[1], f"{path}:{line_no}"
        except _decompression_errors() as exc:
            kept = f"; the {texts:,} records before it were read" if texts and not explicit else ""  # (skipped)
            opt.bad(
                "unreadable_files",
                f"{path}:{line_no + 1} could not be decompressed ({exc}){kept}",
                in_folder=not explicit,
            )


def _one_json_document(path: Path) -> str:
    """What is said of a file that is one JSON document (an array of records, or one over many lines)."""
    return (
        f"{path} is one JSON document (an array, or an object over several lines), not JSON Lines (one record "
        f"per line); convert it: jq -c '.[]' {path.name} > {path.stem}.jsonl"
    )


def _jsonl_record(
    path: Path, line_no: int, line: bytes, opt: _ReadOptions, texts_before: bool
) -> tuple[str, float | None] | None:
    """The (text, curriculum score) of one line, or None when it is passed over (said as `opt.bad` says).
    `texts_before`: earlier lines of the file gave texts (a missing field is then that record's fault, not
    the data.text_column's)."""
    if line_no == 1:
        line = line.removeprefix(UTF8_BOM)  # as a text file's: a BOM is no part of the first record
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError:
        if opt.invalid_utf8 == "replace":
            decoded = line.decode("utf-8", errors="replace")
        elif opt.invalid_utf8 == "drop":
            opt.bad.stats.skip(
                "invalid_utf8", f"{path}:{line_no} is not UTF-8 text (dropped: data.invalid_utf8 is drop)"
            )
            return None
        else:
            opt.bad(
                "non_utf8_lines", f"{path}:{line_no} is not UTF-8 text; convert it to UTF-8 or set data.invalid_utf8"
            )
            return None
    try:
        record = json.loads(decoded)
    except (json.JSONDecodeError, RecursionError) as exc:
        deep = isinstance(exc, RecursionError)
        if line_no == 1 and not deep and decoded.lstrip().startswith(("[", "{")):
            opt.bad("bad_json_lines", _one_json_document(path))
            return None
        opt.bad(
            "bad_json_lines",
            f"{path}:{line_no} is " + ("nested too deep" if deep else "not valid JSON"),
            fix="fix or remove this line, or set data.on_bad_input: skip",
        )
        return None
    if line_no == 1 and isinstance(record, list):
        opt.bad("bad_json_lines", _one_json_document(path))
        return None
    if not isinstance(record, dict) or opt.text_column not in record:
        fix = (
            "earlier records have it: fix or remove this one, or set data.on_bad_input: skip"
            if texts_before
            else "set data.text_column"
        )
        opt.bad("missing_column", f"{path}:{line_no} has no {opt.text_column!r} field ({_fields(record)})", fix=fix)
        return None
    score = record.get(opt.score_column) if opt.score_column else None
    document = _record_document(record[opt.text_column], score, f"{path}:{line_no}", opt)
    return document[:2] if document is not None else None


def _fields(record) -> str:
    """What a JSON record holds instead of the text column, for the message that names the setting."""
    if not isinstance(record, dict):
        kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        return f"the line is a JSON {kinds.get(type(record), type(record).__name__)}, not an object"
    if not record:
        return "the object is empty"
    names = [repr(name) for name in list(record)[:_FIELDS_NAMED]]
    more = f" and {len(record) - _FIELDS_NAMED:,} more" if len(record) > _FIELDS_NAMED else ""
    return f"its fields: {', '.join(names)}{more}"


def _text_value(value, origin: str, opt: _ReadOptions) -> str | None:
    """A record's text, or None (counted and named as a skipped record) when it holds no string: a null,
    a number, a list."""
    if isinstance(value, str):
        return value
    what = "null" if value is None else type(value).__name__
    opt.bad.stats.skip("non_text_values", f"{origin}: {opt.text_column!r} holds {what}, not text")
    return None


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _record_document(text, score, origin: str, opt: _ReadOptions) -> tuple[str, float | None, str] | None:
    """(text, curriculum score, origin) of one record, each value checked (`_text_value`, then
    `_score_value`); None when the record is passed over. Every reader of records goes through here."""
    text = _text_value(text, origin, opt)
    if text is None:
        return None
    kept, score = _score_value(score, origin, opt)
    return (text, score, origin) if kept else None


def _score_value(value, origin: str, opt: _ReadOptions) -> tuple[bool, float | None]:
    """(whether the record is kept, its curriculum score): without data.curriculum_key, (True, None); with
    it, a record whose score is no finite number (a null, a string) is passed over as `opt.bad` says, as
    a record without its text is."""
    if opt.score_column is None:
        return True, None
    score = _number(value)
    if score is None:
        opt.bad(
            "missing_column",
            f"{origin} has no numeric {opt.score_column!r} field (data.curriculum_key)",
            fix="give every record a number there, or set data.on_bad_input: skip",
        )
        return False, None
    return True, score


def _read_parquet(path: Path, explicit: bool, opt: _ReadOptions) -> Iterator[tuple[str, float | None, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading Parquet needs pyarrow: pip install 'llm-trainer[hf]'") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        opt.bad(
            "unreadable_files",
            f"{path} is not a readable Parquet file ({first_line(exc, None)})",
            in_folder=not explicit,
        )
        return
    names = file.schema_arrow.names
    columns = [opt.text_column] + ([opt.score_column] if opt.score_column else [])
    for column in columns:
        if column not in names:
            opt.bad(
                "missing_column",
                f"{path} has no column {column!r} (columns: {', '.join(names)}); set data.text_column",
                in_folder=not explicit,
            )
            return
    kind = file.schema_arrow.field(opt.text_column).type
    if not _string_type(kind):
        opt.bad(
            "missing_column",
            f"{path}: column {opt.text_column!r} holds {kind}, not text; set data.text_column to a string column",
            in_folder=not explicit,
        )
        return
    # Record batches, not whole row groups: memory stays flat however large the file's row groups are.
    row = 0
    for batch in file.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
        texts = batch.column(0).to_pylist()
        scores = batch.column(1).to_pylist() if opt.score_column else [None] * len(texts)
        for text, score in zip(texts, scores):
            if (document := _record_document(text, score, f"{path}[{row}]", opt)) is not None:
                yield document
            row += 1


def _string_type(kind) -> bool:
    """Whether an Arrow column type holds text: a string, or a dictionary of strings."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)


def _iter_files(spec: SourceConfig, stats: SourceStats, opt: _ReadOptions) -> Iterator[tuple[str, float | None, str]]:
    for path, explicit, url in resolve_files(
        spec.data_files, spec.include, spec.exclude, opt.bad, opt.cache, opt.tool_folders
    ):
        yield from _read_file(path, explicit, stats, opt, url)


def _read_file(
    path: Path, explicit: bool, stats: SourceStats, opt: _ReadOptions, url: str | None = None
) -> Iterator[tuple[str, float | None, str]]:
    """The records of one file, read as its name says (JSONL, Parquet, text); a local copy of the store's
    file `url` named by that URL in its records' origins and in what is said of it."""
    if url is None:
        yield from _file_records(path, explicit, stats, opt)
        return
    assert opt.bad.stats is stats, "read_options gives the readers the stats they count in"
    stats.reading = (str(path), url)
    try:
        for text, score, origin in _file_records(path, explicit, stats, opt):
            yield text, score, stats.shown(origin)
    finally:
        stats.reading = None


def _file_records(
    path: Path, explicit: bool, stats: SourceStats, opt: _ReadOptions
) -> Iterator[tuple[str, float | None, str]]:
    kind = file_kind(path, explicit)
    if kind == "jsonl":
        yield from _read_jsonl(path, explicit, opt)
    elif kind == "parquet":
        yield from _read_parquet(path, explicit, opt)
    elif kind == "text":
        yield from _text_file_documents(path, explicit, stats, opt)
    elif explicit:  # an archive
        opt.bad("unsupported_files", f"{path} is {unsupported_reason(path)}")
    else:
        stats.skip("unsupported_files", f"{path} (not read: {unsupported_reason(path)})")


def file_kind(path: Path, explicit: bool) -> str | None:
    """How a file is read, by its name: "jsonl", "parquet" or "text"; None for an archive, and for a file
    found in a folder or a glob that is none of these (`unsupported_reason` says why). A compressed file
    is read as what its name says without the compression suffix. A file named on its own (`explicit`)
    is read by its extension too, a `.json` as JSON Lines, and any other as text."""
    inner, compressed = _without_compression(path.name.lower())
    if inner.endswith(ARCHIVE_SUFFIXES):
        return None
    # A .json in a folder is often metadata (dataset_info.json); compressed, a dump of records (C4's).
    if inner.endswith(JSONL_SUFFIXES) or (inner.endswith(".json") and (explicit or compressed)):
        return "jsonl"
    if inner.endswith(".parquet") and not compressed:
        return "parquet"
    suffix = Path(inner).suffix
    if explicit or suffix in TEXT_SUFFIXES or not suffix:
        return "text"
    return None


def unsupported_reason(path: Path) -> str:
    """Why a file found in a folder or a glob is not read (`file_kind`), in the report's words."""
    name = path.name.lower()
    inner, compressed = _without_compression(name)
    if inner.endswith(".json"):
        return "a .json file in a folder is often metadata (dataset_info.json); name it in data.data_files to read its JSON Lines"
    if inner.endswith(ARCHIVE_SUFFIXES):
        return "an archive of files; unpack it and name the folder in data.data_files"
    if inner.endswith(".parquet"):
        return "a compressed Parquet file (Parquet compresses its own columns); decompress it"
    extension = repr(Path(inner).suffix) + (f" (compressed: {compressed})" if compressed else "")
    return (
        f"extension {extension} is not a text, JSONL or Parquet one; name the file in data.data_files "
        "to read it as text"
    )


def _text_file_documents(
    path: Path, explicit: bool, stats: SourceStats, opt: _ReadOptions, *, bad_input: bool = True
) -> Iterator[tuple[str, None, str]]:
    """A plain-text file as one document, or as several when it is longer than `opt.split_chars`."""
    text = read_text_file(path, explicit, stats, invalid_utf8=opt.invalid_utf8, bad=opt.bad if bad_input else None)
    if text is None:
        return
    if opt.split_chars:  # cut where the cleaned text will have its line ends: the same pieces for CRLF and LF
        text = unified_newlines(text)
    pieces = split_long_text(text, opt.split_chars) if opt.split_chars else [text]
    if opt.split_words:  # a piece within max_chars can still hold more than max_words (short words, CJK)
        pieces = [part for piece in pieces for part in _split_by_words(piece, opt.split_words)]
    if len(pieces) == 1:
        yield text, None, str(path)
        return
    for i, piece in enumerate(pieces, 1):
        yield piece, None, f"{path} (part {i} of {len(pieces)})"


def _split_by_words(text: str, limit: int) -> list[str]:
    """`text` cut as `split_long_text` cuts it, into pieces of about `limit` words each (as the max_words
    filter counts them), when it holds more. A text of at most `limit` characters holds at most `limit`
    words, so only a longer one is counted."""
    if len(text) <= limit or (count := words(text).count) <= limit:
        return [text]
    return split_long_text(text, max(1, len(text) * limit // count))


# Where a long text may be cut, best first: after a blank line, after a line break, after a space.
_BREAKS = (re.compile(r"\n[ \t\r\f\v]*\n"), re.compile(r"\n"), re.compile(r"[ \t]"))


def split_long_text(text: str, limit: int) -> list[str]:
    """`text` cut into pieces of at most `limit` characters and about equal size (about len/limit of them),
    each cut at the paragraph break (blank line) nearest its even share, else at a line break, else at a
    space. The pieces joined give `text` back (a break stays at the end of the piece before it)."""
    if len(text) <= limit:
        return [text]
    count = -(-len(text) // limit)
    pieces, start = [], 0
    while len(text) - start > limit:
        share = -(-(len(text) - start) // count)  # an even share of what is left
        end = _cut(text, start, min(start + share, start + limit), start + limit)
        pieces.append(text[start:end])
        start, count = end, max(count - 1, -(-(len(text) - end) // limit))  # a short cut: one more piece
    pieces.append(text[start:])
    return pieces


def _cut(text: str, start: int, target: int, limit: int) -> int:
    """The end of the piece that starts at `start`: the break nearest `target`, never past `limit`."""
    for pattern in _BREAKS:
        ends = [m.end() for m in pattern.finditer(text, start + 1, limit)]
        if ends:
            return min(ends, key=lambda end: abs(end - target))
    end = target  # one unbroken run: cut anywhere, but not inside a character as the reader sees it
    while end > start + 1 and _joined(text, end):
        end -= 1
    return end


_ZWJ = "\u200d"


def _regional(ch: str) -> bool:
    return "\U0001f1e6" <= ch <= "\U0001f1ff"  # a regional indicator: two make a flag


def _joined(text: str, at: int) -> bool:
    """Whether a cut before `text[at]` would split what a reader sees as one character: a letter and its
    combining marks, an emoji sequence (zero-width joiner, skin tone, tag characters), a flag's pair of
    regional indicators."""
    after, before = text[at], text[at - 1]
    if unicodedata.category(after)[0] == "M" or _ZWJ in (after, before):
        return True
    if "\U0001f3fb" <= after <= "\U0001f3ff" or "\U000e0020" <= after <= "\U000e007f":  # skin tones, tags
        return True
    if _regional(after):  # after an odd run of indicators, this one is the second of a flag
        run = 0
        while run < at and _regional(text[at - 1 - run]):
            run += 1
        return run % 2 == 1
    return False


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets


def _require_hub(name: str) -> None:
    """Fail at once, naming data_files, when the Hub cannot be reached (instead of `datasets` retrying for
    tens of seconds). In offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) `datasets` reads its cache."""
    if offline_mode_set():
        return
    why = hub_unreachable()
    if why is not None:
        raise UsageError(
            f"data.dataset_name {name!r} is a Hugging Face Hub name and the Hub cannot be reached ({why}); "
            "use data.data_files with local files (text, .jsonl, .parquet) or a "
            "local dataset folder, or set HF_HUB_OFFLINE=1 to read a copy already in the cache"
        )


def _iter_hf_dataset(spec: SourceConfig, split: str, opt: _ReadOptions) -> Iterator[tuple[str, float | None, str]]:
    try:
        import datasets
    except ImportError:
        raise UsageError(
            f"dataset {spec.dataset_name!r} needs the datasets package: pip install 'llm-trainer[hf]'"
        ) from None
    name = spec.dataset_name
    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():  # a path, not a Hub name
        raise UsageError(
            f"data.dataset_name {name!r} names a local dataset folder, and there is none there; "
            "fix the path (a folder that datasets' save_to_disk wrote)"
        )
    try:
        if Path(name).is_dir() and any((Path(name) / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(name)
            single = not isinstance(loaded, datasets.DatasetDict)
            if not single and split not in loaded:
                setting = "data.dataset_split" if split == spec.dataset_split else "data.validation_split"
                raise UsageError(
                    f"dataset {name!r} has no split {split!r} (its splits: {', '.join(loaded)}); set {setting} "
                    "to one of them"
                )
            ds = loaded if single else loaded[split]
            if spec.streaming:
                ds = ds.to_iterable_dataset()
        else:
            single = False
            if not Path(name).exists():
                _require_hub(name)
            ds = datasets.load_dataset(name, spec.dataset_config, split=split, streaming=spec.streaming)
    except UsageError:
        raise
    except (FileNotFoundError, ValueError, KeyError, ConnectionError, OSError) as exc:
        hint = "; for local files use data.data_files" if isinstance(exc, ConnectionError) else ""
        raise UsageError(f"could not load dataset {name!r} split {split!r}: {first_line(exc, None)}{hint}") from None
    if single and split != spec.dataset_split:  # a saved Dataset is one split: never reuse it for validation
        raise UsageError(
            f"dataset {name!r} is a single split, so it has no split {split!r}; use a fraction for data.validation_split"
        )
    columns = [opt.text_column] + ([opt.score_column] if opt.score_column else [])
    known = ds.column_names  # None for a stream whose features are unknown until read
    for column in columns:
        if known is not None and column not in known:
            opt.bad(
                "missing_column",
                f"dataset {name!r} has no column {column!r} (columns: {', '.join(known)}); set data.text_column",
            )
            return
    if spec.streaming:
        for i, record in enumerate(ds):
            if opt.text_column not in record:
                opt.bad(
                    "missing_column",
                    f"dataset {name!r} record {i} has no {opt.text_column!r} field ({_fields(record)}); set data.text_column",
                )
                continue
            score = record.get(opt.score_column) if opt.score_column else None
            if (document := _record_document(record[opt.text_column], score, f"{name}:{split}[{i}]", opt)) is not None:
                yield document
        return
    row = 0
    for batch in ds.select_columns(columns).iter(
        batch_size=_BATCH_ROWS
    ):  # Arrow-backed: memory-mapped, read in batches
        scores = batch[opt.score_column] if opt.score_column else [None] * len(batch[opt.text_column])
        for text, score in zip(batch[opt.text_column], scores):
            if (document := _record_document(text, score, f"{name}:{split}[{row}]", opt)) is not None:
                yield document
            row += 1


# ----------------------------------------------------------------------------------------------
# one source, all sources


def read_options(config: DataConfig, stats: SourceStats) -> _ReadOptions:
    score = None if config.curriculum_key == "length" else config.curriculum_key
    limits = QualityFilter(config)
    return _ReadOptions(
        config.text_column,
        score,
        config.invalid_utf8,
        BadInput(config.on_bad_input, stats),
        split_chars=None if limits.max_chars is None else max(1, int(limits.max_chars * SPLIT_SHARE)),
        split_words=None if limits.max_words is None else max(1, int(limits.max_words * SPLIT_SHARE)),
        cache=Path(config.stream_cache_dir),
        tool_folders=tool_folders(config),
    )


def iter_source(
    spec: SourceConfig, config: DataConfig, stats: SourceStats, split: str | None = None
) -> Iterator[Document]:
    """Every raw document of one source (of its named split `split`, for a dataset's validation split)."""
    opt = read_options(config, stats)
    opt.text_column = spec.text_column

    def raw() -> Iterator[tuple[str, float | None, str]]:
        if spec.dataset_name == BUILTIN_STDLIB:
            for path in stdlib_files():
                yield from _text_file_documents(path, False, stats, opt, bad_input=False)
        elif spec.dataset_name is not None:
            yield from _iter_hf_dataset(spec, split or spec.dataset_split, opt)
        if spec.data_files is not None and split is None:
            yield from _iter_files(spec, stats, opt)

    count = 0
    for document in _documents(raw(), spec.name, stats):
        yield document
        count += 1
        if spec.max_documents is not None and count >= spec.max_documents:
            return
    if count == 0:
        empty_source(spec, opt.bad)


def empty_source(spec: SourceConfig, bad: BadInput) -> None:
    """A source that gave no document: one line, with what its readers skipped (the likely cause)."""
    skipped = {kind: n for kind, n in bad.stats.skipped.items() if n}
    why = ""
    if skipped:
        kind = max(skipped, key=skipped.get)
        example = bad.stats.named.get(kind, [""])[0]
        why = f" (skipped: {', '.join(f'{k} {n:,}' for k, n in skipped.items())}; e.g. {example})"
    bad("empty_sources", f"data source {spec.name!r} has no documents{why}; check its files, dataset and text_column")


def _documents(records: Iterator[tuple[str, float | None, str]], source: str, stats: SourceStats) -> Iterator[Document]:
    """Records as Documents; one longer than MAX_DOCUMENT_CHARS is cut into several (and counted)."""
    for text, score, origin in records:
        if len(text) > MAX_DOCUMENT_CHARS:  # one document a tokenizer cannot take whole: cut, and say so
            stats.skip("long_documents_split", f"{origin} ({len(text):,} characters, cut into pieces)")
            pieces = split_long_text(text, MAX_DOCUMENT_CHARS)
            documents = [(piece, f"{origin} (part {i} of {len(pieces)})") for i, piece in enumerate(pieces, 1)]
        else:
            documents = [(text, origin)]
        for piece, where in documents:
            yield Document(piece, source, score, where)


class FileUnit(NamedTuple):
    """One input file of one source: the unit a distributed prepare hands to a task."""

    source: int  # index into resolved_sources(config)
    path: str
    explicit: bool  # named by the user (bad input in it is an error under skip_in_folders)
    stdlib: bool  # a file of the built-in corpus (never bad input)
    size: int
    url: str | None = None  # the store's file `path` is a local copy of (`InputFile.url`)


def file_units(config: DataConfig, stats: SourceStats) -> list[FileUnit]:
    """Every input file of every source, in the order `iter_source` reads them (files resolved once, here).
    Hugging Face datasets are not files: refused."""
    only_files(config)
    units: list[FileUnit] = []
    bad = BadInput(config.on_bad_input, stats)
    for index, spec in enumerate(resolved_sources(config)):
        if spec.dataset_name == BUILTIN_STDLIB:
            units += [FileUnit(index, str(p), False, True, p.stat().st_size) for p in stdlib_files()]
        if spec.data_files is not None:
            files = resolve_files(
                spec.data_files, spec.include, spec.exclude, bad, Path(config.stream_cache_dir), tool_folders(config)
            )
            for path, explicit, url in files:
                units.append(FileUnit(index, str(path), explicit, False, path.stat().st_size, url))
    return units


def only_files(config: DataConfig) -> None:
    """Refuse, in one line, a source that is a Hugging Face dataset: a distributed prepare reads files."""
    for spec in resolved_sources(config):
        if spec.dataset_name not in (None, BUILTIN_STDLIB):
            raise UsageError(
                f"data.executor {config.executor} reads files, and source {spec.name!r} is the dataset "
                f"{spec.dataset_name!r}; save it as JSONL or Parquet files and name them in data_files, "
                "or prepare without data.executor"
            )


def iter_unit(unit: FileUnit, config: DataConfig, stats: SourceStats) -> Iterator[Document]:
    """The documents of one file, exactly as `iter_source` reads them within its source."""
    spec = resolved_sources(config)[unit.source]
    opt = read_options(config, stats)
    opt.text_column = spec.text_column
    if unit.stdlib:
        records = _text_file_documents(Path(unit.path), False, stats, opt, bad_input=False)
    else:
        records = _read_file(Path(unit.path), unit.explicit, stats, opt, unit.url)
    return _documents(records, spec.name, stats)


def _file_specs(spec: SourceConfig) -> list[str]:
    """A source's data_files as a list (one string is one entry; none is an empty list)."""
    files = spec.data_files
    return [] if files is None else [files] if isinstance(files, str) else list(files)


def reads_a_store(config: DataConfig) -> bool:
    """Whether a data file is named by a URL: finding it, and so the data's fingerprint, then lists a store."""
    return any(Location(one).url for spec in resolved_sources(config) for one in _file_specs(spec))


def source_fingerprint(config: DataConfig) -> list:
    """What identifies the input: file paths with sizes and times, or the dataset's name and version."""
    items: list = []
    quiet = BadInput("skip", SourceStats())  # errors are reported when reading, not while fingerprinting
    for spec in resolved_sources(config):
        if spec.dataset_name == BUILTIN_STDLIB:
            items.append([BUILTIN_STDLIB, sysconfig.get_python_version(), len(stdlib_files())])
        elif spec.dataset_name is not None:
            items.append([spec.dataset_name, spec.dataset_config, spec.dataset_split])
            local = Path(spec.dataset_name)
            if local.is_dir():  # a local dataset folder changes without changing its name
                for path in sorted(p for p in local.rglob("*") if p.is_file()):
                    stat = path.stat()
                    items.append([os.path.realpath(path), stat.st_size, stat.st_mtime_ns])
        for one in _file_specs(spec):
            if Location(one).url:  # a store's file is identified by its URL, size and ETag (or time)
                items += [
                    [url, *identity(info)] for url, info, _ in _remote_files(one, spec.include, spec.exclude, quiet)
                ]
                continue
            for path, _, _ in resolve_files(one, spec.include, spec.exclude, quiet, ours=tool_folders(config)):
                stat = path.stat()
                items.append([os.path.realpath(path), stat.st_size, stat.st_mtime_ns])
    return items
