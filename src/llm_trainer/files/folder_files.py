"""The one rule for every file read from a folder we may not have written: a checkpoint, best_model,
a model folder given to eval/generate/export or to `model.init_from`, and their `sharded/` files.

A name in such a folder is read only when
    - it is a plain relative name (a file name, or `sharded/NAME`): nothing absolute, no `..`;
    - it resolves inside the folder (a symlink may lead to another file of the folder, never out);
    - it is a regular file (not a folder, FIFO or device); and
    - meta.json lists it, when the folder has a meta.json (the listing is what the checksums cover).
Everything else in the folder is never opened: refused when a reader asks for it, ignored otherwise.

`FolderFiles.read` also reads a file once into memory and, where meta.json lists it, checks its size
and checksum on those bytes; the caller parses the same bytes. A file replaced after the folder was
verified is caught, and nothing reads a file twice (once checked, once parsed).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UsageError
from .checksums import data_checksum, meta_checksum

META = "meta.json"  # a checkpoint's or model folder's record of its files (see `layout`)
SHARDED_DIR = "sharded"  # the one subfolder a listed name may have: per-rank files (see `layout`)


def plain_name(name: Any) -> bool:
    """A file name, or one inside the `sharded/` subfolder; nothing that could leave the folder."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    if len(parts) == 2 and parts[0] == SHARDED_DIR:
        parts = parts[1:]
    return len(parts) == 1 and Path(parts[0]).name == parts[0] and parts[0] not in ("", ".", "..")


def path_problem(folder: Path, name: str, listed: Collection[str] | None) -> str | None:
    """None when `folder/name` may be read, else why not. `listed`: the names meta.json lists (None:
    the folder has no meta.json)."""
    if not plain_name(name):
        return f"{name!r} is not a plain file name inside the folder"
    if listed is not None and name not in listed:
        return f"{name} is not listed in meta.json"
    path = Path(folder) / name
    try:
        root, target = Path(folder).resolve(strict=True), path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        return f"{name} is a symlink that leads nowhere" if path.is_symlink() else f"{name} is missing"
    if root != target and root not in target.parents:
        return f"{name} is a symlink that leads out of the folder"
    try:
        regular = stat.S_ISREG(target.stat().st_mode)
    except OSError:
        regular = False
    return None if regular else f"{name} is not a regular file"


def listed_names(meta: dict) -> frozenset[str]:
    files = meta.get("files")
    return frozenset(files) if isinstance(files, dict) else frozenset()


def read_listing(folder: Path) -> dict | None:
    """The folder's meta.json as a dict; None when it has none. A meta.json that is there but unreadable
    lists nothing that could be trusted: refused."""
    file = Path(folder) / META
    if not file.exists() and not file.is_symlink():
        return None
    problem = path_problem(folder, META, None)
    if problem:
        raise CheckpointError(f"{folder} cannot be read: {problem}; refusing it")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{folder} cannot be read: meta.json is corrupt")
    if "meta_sha256" in meta and meta["meta_sha256"] != meta_checksum(meta):
        raise CheckpointError(f"{folder} cannot be read: meta.json does not match its checksum (corrupt)")
    return meta


def refuse_unreadable(folder: Path, names: Iterable[str], error: type[UsageError] = UsageError) -> None:
    """Refuse the folder when any of `names` that is there (a file or a link) may not be read."""
    folder = Path(folder)
    meta = read_listing(folder)
    listed = listed_names(meta) if meta is not None else None
    for name in names:
        if (folder / name).exists() or (folder / name).is_symlink():
            problem = path_problem(folder, name, listed)
            if problem:
                raise error(f"{folder} cannot be read: {problem}; refusing it")


class FolderFiles:
    """Reads files of one folder under the rule above; with a meta.json, each checked against its entry.

    `meta`: the folder's meta.json, parsed once by the caller (verified or not): the listing and the
    checksums every read is checked against. None: the folder has no meta.json (a bare model folder,
    a crafted one), so only the path rule applies.
    """

    def __init__(self, folder: Path, meta: dict | None):
        self.folder, self.meta = Path(folder), meta
        self.listed = listed_names(meta) if meta is not None else None

    @classmethod
    def of(cls, folder: Path) -> FolderFiles:
        return cls(folder, read_listing(folder))

    def path(self, name: str) -> Path:
        """`folder/name` once the rule allows it (for a library that opens the file itself: safetensors)."""
        problem = path_problem(self.folder, name, self.listed)
        if problem:
            raise CheckpointError(f"{self.folder} cannot be read: {problem}; refusing it")
        return self.folder / name

    def read(self, name: str) -> bytes:
        """The file's bytes, read once; with meta.json, of the size and checksum it records."""
        path = self.path(name)
        try:
            handle = os.open(path.resolve(), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with open(handle, "rb") as file:
                if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                    raise CheckpointError(f"{self.folder} cannot be read: {name} is not a regular file; refusing it")
                data = file.read()
        except OSError as exc:
            raise CheckpointError(f"{self.folder / name} could not be read ({exc.strerror or exc})") from None
        if self.meta is not None:
            problem = self._mismatch(name, data)
            if problem:
                raise CheckpointError(f"checkpoint {self.folder} is unusable: {problem}")
        return data

    def check(self, name: str, data: bytes, source: str) -> None:
        """Bytes of `name` read from elsewhere (the store, `source`): listed in meta.json, with the size and
        checksum it records; else refused, naming `source`."""
        if self.meta is None or name not in self.listed:
            raise CheckpointError(f"{source} is not listed in {self.folder / META}; refusing to read it")
        problem = self._mismatch(name, data, shown=source)
        if problem:
            raise CheckpointError(f"{problem}; resume from another checkpoint, or save this one again")

    def _mismatch(self, name: str, data: bytes, shown: str | None = None) -> str | None:
        """Why `data` is not the file meta.json lists as `name` (called `shown` in the message), or None."""
        entry = self.meta["files"][name]
        shown = shown or name
        if self.meta.get("format_version", 1) < 2:  # format 1: a plain sha256 per file
            expected, kind = entry, "sha256"
        else:
            if not isinstance(entry, dict) or entry.get("size") != len(data):
                size = entry.get("size") if isinstance(entry, dict) else None
                return f"{shown} has {len(data):,} bytes, {size!r} expected (it changed since it was written)"
            expected, kind = entry.get("checksum"), self.meta.get("checksum")
        try:
            actual = data_checksum(data, kind)
        except Exception:  # an unknown checksum kind, or xxhash missing: verify() says which
            return f"meta.json records checksums of an unknown kind {kind!r}"
        return None if actual == expected else f"{shown} does not match its checksum (corrupt)"
