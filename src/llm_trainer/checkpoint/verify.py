"""Checks of a checkpoint or model folder before anything in it is read: it may not be ours.

A folder is read as untrusted (checksums prove integrity, not origin): meta.json is type-checked
(a crafted meta.json is damage like any other), every file it names must pass `files.folder_files`' rule
(a plain name, inside the folder, a regular file), and every file must have the size and checksum
meta.json records (see `files.checksums`). Loading reads each file again under the same rule, and checks
each pickle's checksum on the bytes it parses (`folder_files.FolderFiles`). A sharded checkpoint
whose shards were written straight into a store names them in meta.json's "in_store": those that are
not on disk are checked as they are read from the store instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..files.checksums import CRC32_TREE, XXH3_TREE, checksum_jobs, combine, meta_checksum, sha256_file, xxhash
from ..files.folder_files import path_problem, plain_name
from .layout import FORMAT_VERSION, KINDS, META, OPTIMIZER_TENSORS, SHARDED_DIR, read_meta

_verified: dict[str, tuple] = {}  # folder -> file signatures when it last verified, so resume hashes once


def _signature(path: Path) -> tuple | None:
    try:
        return tuple(
            (p.name, s.st_size, s.st_mtime_ns, s.st_ino)
            for p in sorted(path.iterdir())
            if p.is_file()
            for s in [p.stat()]
        )
    except OSError:
        return None


def _is_int(value) -> bool:
    """An int that JSON wrote as a number (not a bool, which Python counts as an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


# meta.json fields and the types they must have.
_META_TYPES = {
    "format_version": _is_int,
    "sequence": _is_int,
    "step": _is_int,
    "kind": lambda v: isinstance(v, str),
    "checksum": lambda v: isinstance(v, str),
    "meta_sha256": lambda v: isinstance(v, str),
    "config": lambda v: isinstance(v, dict),
    "metrics": lambda v: isinstance(v, dict),
    "files": lambda v: isinstance(v, dict),
    "world_size": _is_int,
    "in_store": lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
}


def _meta_problem(meta: dict) -> str | None:
    """None when every known field of meta.json has its type, else what is wrong."""
    for name, ok in _META_TYPES.items():
        if name in meta and not ok(meta[name]):
            return f"meta.json is corrupt ({name} is {type(meta[name]).__name__})"
    if "files" not in meta:
        return "meta.json is corrupt"
    plain_sha256 = meta.get("format_version", 1) < 2
    for name, entry in meta["files"].items():
        if plain_sha256:
            good = isinstance(entry, str)
        else:
            good = (
                isinstance(entry, dict)
                and _is_int(entry.get("size"))
                and entry["size"] >= 0
                and isinstance(entry.get("checksum"), str)
            )
        if not good:
            return f"meta.json is corrupt (the entry of {name!r})"
    return None


def verify(path: Path) -> str | None:
    """None if the folder is a complete checkpoint whose files match their sizes and checksums, else the reason."""
    path = Path(path)
    if not (path / META).is_file():
        return "incomplete: no meta.json (the save was interrupted)"
    meta = read_meta(path)
    if meta is None:
        return "meta.json is corrupt"
    problem = _meta_problem(meta)
    if problem:
        return problem
    if "meta_sha256" in meta and meta["meta_sha256"] != meta_checksum(meta):
        return "meta.json does not match its checksum (corrupt)"
    files, kind, version = meta["files"], KINDS.get(meta.get("kind")), meta.get("format_version", 1)
    if version > FORMAT_VERSION:
        return f"unknown checkpoint format {version!r} (this llm-trainer reads up to {FORMAT_VERSION}); upgrade llm-trainer"
    checksum = meta.get("checksum") if version >= 2 else None
    if version >= 2 and checksum not in (CRC32_TREE, XXH3_TREE):
        return f"unknown checksum kind {checksum!r} in meta.json"
    if checksum == XXH3_TREE and xxhash is None:
        return f"its checksums are {XXH3_TREE}, which needs the xxhash package (pip install xxhash)"
    for name in kind.required if kind is not None else ():
        if name not in files and (version >= 2 or name != OPTIMIZER_TENSORS):  # format 1: no optimizer tensors
            return f"meta.json does not list {name}"
    plain_sha256 = version < 2
    for name in files:
        if not plain_name(name):
            return f"meta.json names an invalid file {name!r}"
    for name in meta.get("in_store", ()):
        if name not in files or not name.startswith(f"{SHARDED_DIR}/"):
            return f"meta.json names {name!r} as kept in the store, which is not one of its sharded files"
    remote = {n for n in meta.get("in_store", ()) if not (path / n).exists() and not (path / n).is_symlink()}
    for name in (META, *files):
        problem = path_problem(path, name, None) if name not in remote else None
        if problem:
            return problem
    jobs: dict[str, Any] = {}
    for name, entry in files.items():
        if name in remote:  # in the store only: checked as it is read from there (`sharded.StoreReader`)
            continue
        file = path / name
        if plain_sha256:
            jobs[name] = (entry, None)
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            what = "cut short or replaced" if size < entry["size"] else "grown or replaced"
            return f"{name} is not the file written there ({size:,} bytes, {entry['size']:,} written): {what}"
        jobs[name] = (entry["checksum"], checksum_jobs(file, size, checksum))
    for name, (expected, chunks) in jobs.items():
        actual = sha256_file(path / name) if chunks is None else combine(chunks, checksum)
        if actual != expected:
            return f"{name} does not match its checksum (corrupt)"
    return None


def verify_once(path: Path) -> str | None:
    """verify(), skipped when this process already verified the folder and no file changed since."""
    key = str(Path(path).resolve())
    signature = _signature(Path(path))
    if signature is not None and _verified.get(key) == signature:
        return None
    problem = verify(Path(path))
    if problem is None and signature is not None:
        _verified[key] = signature
    return problem
