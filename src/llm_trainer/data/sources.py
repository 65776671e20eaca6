"""Where documents come from: files, folders, globs, JSONL, Parquet, Hugging Face datasets, the Python stdlib.

Each reader yields plain strings, one per document, in a deterministic order. A file the user named
explicitly that cannot be read is an error; a bad file found while walking a folder is skipped and
counted, because one stray binary in a corpus folder should not stop a run.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..config import DataConfig
from ..errors import UsageError

BUILTIN_STDLIB = "python-stdlib"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".html", ".tex", ".csv"}
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")


@dataclass
class SourceStats:
    """What the readers skipped, reported in the manifest."""

    skipped: Counter = field(default_factory=Counter)


def stdlib_files() -> list[Path]:
    """The running Python's own standard library sources: real text every machine has, offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}
    found = []
    for folder, subfolders, names in os.walk(root):  # prune while walking: site-packages can be huge
        subfolders[:] = [d for d in subfolders if d not in skip]
        found += [Path(folder) / n for n in names if n.endswith(".py") and n not in skip]
    return sorted(found)


def resolve_files(specs: list[str] | str) -> list[tuple[Path, bool]]:
    """Expand files, folders and globs into (path, named_explicitly) pairs, sorted within each spec."""
    if isinstance(specs, str):
        specs = [specs]
    out: list[tuple[Path, bool]] = []
    for spec in specs:
        path = Path(os.path.expanduser(spec))
        if any(ch in spec for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
            if not matches:
                raise UsageError(f"data_files pattern {spec!r} matches no files; check the path and the pattern")
            out += [(p, False) for p in matches]
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not found:
                raise UsageError(f"data folder {path} has no files")
            out += [(p, False) for p in found]
        elif path.is_file():
            out.append((path, True))
        else:
            raise UsageError(f"data file {path} not found; fix data.data_files (files, folders or globs)")
    return out


def read_text_file(path: Path, explicit: bool, stats: SourceStats) -> str | None:
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        if explicit:
            raise UsageError(f"{path} looks like a binary file, not text; remove it from data.data_files")
        stats.skipped["binary_files"] += 1
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if explicit:
            raise UsageError(f"{path} is not UTF-8 text (bad byte at offset {exc.start}); convert it to UTF-8") from None
        stats.skipped["non_utf8_files"] += 1
        return None


def _read_jsonl(path: Path, text_column: str) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_no, line in _checked_lines(path, handle):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"{path}:{line_no} is not valid JSON") from None
            if not isinstance(record, dict) or text_column not in record:
                raise UsageError(f"{path}:{line_no} has no {text_column!r} field; set data.text_column")
            if isinstance(record[text_column], str):
                yield record[text_column]


def _checked_lines(path: Path, handle) -> Iterator[tuple[int, str]]:
    """Numbered lines; undecodable bytes or a broken .gz are a one-line UsageError naming the file."""
    try:
        yield from enumerate(handle, 1)
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text; convert it to UTF-8") from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise UsageError(f"{path} is not a readable gzip file ({exc})") from None


def _read_parquet(path: Path, text_column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading Parquet needs pyarrow: pip install 'llm-trainer[hf]'") from None
    file = pq.ParquetFile(path)
    if text_column not in file.schema_arrow.names:
        raise UsageError(f"{path} has no column {text_column!r} (columns: {', '.join(file.schema_arrow.names)}); set data.text_column")
    for group in range(file.num_row_groups):  # one row group at a time keeps memory flat
        for text in file.read_row_group(group, columns=[text_column]).column(0).to_pylist():
            if isinstance(text, str):
                yield text


def _iter_files(config: DataConfig, stats: SourceStats) -> Iterator[str]:
    for path, explicit in resolve_files(config.data_files):
        name = path.name.lower()
        if name.endswith(JSONL_SUFFIXES):
            yield from _read_jsonl(path, config.text_column)
        elif name.endswith(".parquet"):
            yield from _read_parquet(path, config.text_column)
        elif explicit or path.suffix.lower() in TEXT_SUFFIXES or not path.suffix:
            text = read_text_file(path, explicit, stats)
            if text is not None:
                yield text
        else:
            stats.skipped["unsupported_files"] += 1


def _iter_hf_dataset(config: DataConfig, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise UsageError(f"dataset {config.dataset_name!r} needs the datasets package: pip install 'llm-trainer[hf]'") from None
    name = config.dataset_name
    try:
        if Path(name).is_dir() and any((Path(name) / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(name)
            single = not isinstance(loaded, datasets.DatasetDict)
            ds = loaded if single else loaded[split]
        else:
            single, ds = False, datasets.load_dataset(name, config.dataset_config, split=split)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise UsageError(f"could not load dataset {name!r} split {split!r}: {str(exc).splitlines()[0]}") from None
    if single and split != config.dataset_split:  # a saved Dataset is one split: never reuse it for validation
        raise UsageError(f"dataset {name!r} is a single split, so it has no split {split!r}; use a fraction for data.validation_split")
    if config.text_column not in ds.column_names:
        raise UsageError(f"dataset {name!r} has no column {config.text_column!r} (columns: {', '.join(ds.column_names)}); set data.text_column")
    for text in ds[config.text_column]:
        if isinstance(text, str):
            yield text


def iter_documents(config: DataConfig, stats: SourceStats, split: str | None = None) -> Iterator[str]:
    """Every raw document of the configured sources (or of one named split of a HF dataset)."""
    if config.dataset_name == BUILTIN_STDLIB:
        for path in stdlib_files():
            text = read_text_file(path, False, stats)
            if text is not None:
                yield text
    elif config.dataset_name is not None:
        yield from _iter_hf_dataset(config, split or config.dataset_split)
    if config.data_files is not None:
        yield from _iter_files(config, stats)


def source_fingerprint(config: DataConfig) -> list:
    """What identifies the input: file paths with sizes and times, or the dataset's name and version."""
    items: list = []
    if config.dataset_name == BUILTIN_STDLIB:
        items.append([BUILTIN_STDLIB, sysconfig.get_python_version(), len(stdlib_files())])
    elif config.dataset_name is not None:
        items.append([config.dataset_name, config.dataset_config, config.dataset_split])
        local = Path(config.dataset_name)
        if local.is_dir():  # a local dataset folder changes without changing its name
            for path in sorted(p for p in local.rglob("*") if p.is_file()):
                stat = path.stat()
                items.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    if config.data_files is not None:
        for path, _ in resolve_files(config.data_files):
            stat = path.stat()
            items.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return items
