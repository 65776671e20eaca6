"""Checkpoints in object storage (training.checkpoint_dir a URL), with the promises they keep on disk.

A store has no atomic rename, so a checkpoint is first written on local disk as always (atomically,
checksummed: `local.save_checkpoint`), then uploaded file by file: the data files, `files.json` (size
and checksum of each), `meta.json`, and `latest` last, naming it. A crash at any point of an upload
leaves `latest` naming the previous checkpoint, complete. Rotation in the store deletes only folders
named like our checkpoints, never the one `latest` names nor the best one. best_model/ is replaced with
a complete copy beside it until the new one is complete (`upload_best`).

A resume downloads the checkpoint `latest` names into the local checkpoint folder (unless the copy
there is the same checkpoint, by the store's record of its meta.json: `same_as_store`; each file checked
against `files.json` on arrival, no path outside the folder) and then reads it there with the same
rules as any folder on disk: meta.json's checksums, allow-listed unpickling, no symlinks out.

FSDP's shards skip the local disk: every rank writes its own straight into the checkpoint's
`sharded/` in the store, before rank 0 uploads the rest, and meta.json names them under "in_store"
(`sharded`). `files.json` lists them with the rest; a resume downloads every other file and each rank
reads the shards it needs from the store (`sharded.StoreReader`), checked against meta.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import CheckpointError, UsageError
from ..files import buckets
from ..files.checksums import file_checksum
from ..files.folder_files import SHARDED_DIR, plain_name
from ..logs import log, warn
from .layout import BEST, CHECKPOINTS_DIR, LATEST, META, PREFIX, list_checkpoints, read_meta, step_of
from .verify import verify_once

_NAME = re.compile(rf"{PREFIX}\d{{1,18}}")  # a step fits in 64 bits; a longer name is not a checkpoint of ours
SPARE = f"{BEST}.new"  # the new best model, complete beside the old one while best_model/ is replaced


def check_target(remote: str, *, resuming: bool, overwrite: bool) -> None:
    """Before a run: `remote` can be written, and holds no other run's checkpoints unless this run
    continues them (a resume) or starts over (--overwrite); a fresh run would replace its `latest`
    and rotate them away."""
    buckets.check_writable(remote, "training.checkpoint_dir")
    if resuming or overwrite:
        return
    held = held_checkpoints(remote)
    if held:
        raise CheckpointError(
            f"training.checkpoint_dir {remote} holds checkpoints already ({', '.join(held[:3])}); continue them "
            "with --resume_from_checkpoint latest, choose another training.checkpoint_dir, or pass --overwrite"
        )


def held_checkpoints(remote: str) -> list[str]:
    """What runs save into the checkpoint folder `remote` that it holds: checkpoints, `latest`, best_model."""
    return [n for n in buckets.children(remote) if _NAME.fullmatch(n) or n in (LATEST, BEST, SPARE)]


def remove_checkpoints(remote: str) -> list[str]:
    """Delete what runs save into `remote` (`held_checkpoints`), `latest` first; every other object stays."""
    held = sorted(held_checkpoints(remote), key=lambda n: n != LATEST)
    for name in held:
        buckets.remove(buckets.join(remote, name))
    return held


def upload_checkpoint(path: Path, remote: str, keep_last: int | None, protect: set[str]) -> None:
    """Upload the local checkpoint folder `path` into `remote`, `latest` last; then rotate the store's.
    Shards the ranks wrote into the store already ("in_store") are listed in files.json, not uploaded."""
    meta = read_meta(path) or {}
    present = {name: meta["files"][name] for name in meta.get("in_store", ())}
    buckets.put_folder(path, buckets.join(remote, path.name), last=[META], present=present)
    buckets.write_text(buckets.join(remote, LATEST), path.name)
    log(f"checkpoint: uploaded {path.name} to {remote}")
    if keep_last is not None:
        _rotate(remote, path.parent, keep_last, protect | {path.name})


def upload_best(folder: Path, remote: str) -> None:
    """The best model folder as the store's best_model/, replaced so that a complete best model is in
    the store at every moment: the new one uploaded beside the old (`SPARE`, its meta.json last), then
    best_model/'s meta.json removed (readers take the spare from then on), best_model/ rewritten, meta.json
    last, and the spare removed. A switch cut short leaves best_model/ without meta.json: the next one
    writes straight into it, the spare staying the complete copy until it is done."""
    best, spare = buckets.join(remote, BEST), buckets.join(remote, SPARE)
    last = [META] if (folder / META).is_file() else []
    if complete(best):
        buckets.remove(spare)
        buckets.put_folder(folder, spare, last=last)
        buckets.remove(buckets.join(best, META))
    stale = set(buckets.files_under(best))
    record = buckets.put_folder(folder, best, last=last)
    for name in sorted(stale - set(record) - {buckets.FILES_RECORD}):
        buckets.remove(buckets.join(best, name))  # an older best model's file the new one does not have
    buckets.remove(spare)


def complete(url: str) -> bool:
    """Whether the folder `url` was uploaded to the end: its record and its meta.json (written last) are there."""
    return buckets.exists(buckets.join(url, buckets.FILES_RECORD)) and buckets.exists(buckets.join(url, META))


def _rotate(remote: str, local_root: Path, keep_last: int, protect: set[str]) -> None:
    """Delete the store's checkpoints that are neither among the newest `keep_last` (by step) nor kept
    locally nor protected (the new one, the best one, the one `latest` names)."""
    names = [n for n in buckets.children(remote) if _NAME.fullmatch(n)]
    named = buckets.read_text(buckets.join(remote, LATEST))
    keep = set(sorted(names, key=lambda n: step_of(Path(n)), reverse=True)[:keep_last])
    keep |= {p.name for p in list_checkpoints(local_root)} | protect | {(named or "").strip()}
    for name in names:
        if name not in keep:
            buckets.remove(buckets.join(remote, name))
            log(f"checkpoint: removed {name} from {remote} (save_total_limit={keep_last})")


def ensure_uploaded(path: Path, remote: str, keep_last: int | None) -> None:
    """After a resume from the local checkpoint `path`: upload it when the store's `latest` does not name
    it (a run killed after the local write, before its upload completed, loses nothing)."""
    named = buckets.read_text(buckets.join(remote, LATEST))
    if (named or "").strip() != path.name:
        upload_checkpoint(path, remote, keep_last, {path.name})


def fetch_latest(remote: str, local_root: Path) -> None:
    """Bring the checkpoint the store's `latest` names into `local_root` (unless an intact copy is there).
    Nothing when the store holds no checkpoint yet."""
    named = buckets.read_text(buckets.join(remote, LATEST))
    if named is None:
        return
    name = named.strip()
    if not _NAME.fullmatch(name):
        raise CheckpointError(f"{buckets.join(remote, LATEST)} names {name[:40]!r}, not a checkpoint; fix or remove it")
    fetch(buckets.join(remote, name), local_root / name)


def local_copy(url: str, local_root: Path) -> Path:
    """Where `fetch_named` puts what `url` names: a checkpoint folder's copy, or the checkpoints folder."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return local_root / name if _NAME.fullmatch(name) else local_root


def fetch_named(url: str, local_root: Path) -> None:
    """Download what a resume from `url` continues from into `local_root`: the checkpoint folder `url`
    names, or the one the `latest` of the checkpoints folder it names names."""
    target = local_copy(url, local_root)
    if target == local_root:
        fetch_latest(url, local_root)
    else:
        fetch(url, target)


def same_as_store(local: Path, url: str) -> bool:
    """Whether the local folder `local` is an intact copy of the folder `url` as the store holds it now:
    its meta.json (which holds every other file's checksum, checked by `verify_once`) has the size and
    checksum the store's `files.json` records. A folder of the same name written by another run (after
    `train --overwrite` into the same URL) differs there."""
    if not (local / META).is_file() or verify_once(local) is not None:
        return False
    try:
        record = buckets.read_record(url)
    except buckets.UnverifiedFolder:
        return False
    if record is None or META not in record:
        return False
    return record[META] == ((local / META).stat().st_size, file_checksum(local / META))


def fetch(url: str, local: Path) -> Path:
    """The checkpoint folder at `url` as the local folder `local` (downloaded unless a copy of the same
    checkpoint is there)."""
    if local.is_dir() and same_as_store(local, url):
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    if not buckets.get_folder(url, local, last=[META], skip=in_store(url)):
        warn(f"{url} is not a complete checkpoint in the store; resuming from the local checkpoints")
        return local
    log(f"resume: downloaded {url} into {local}")
    return local


def remote_parent(url: str) -> str:
    """The folder that holds the folder `url`."""
    return url.rstrip("/").rsplit("/", 1)[0]


def in_store(url: str) -> list[str]:
    """The files the checkpoint folder `url` keeps in the store only: the shards its ranks wrote there,
    which its meta.json names (read from the store) and each rank reads from there. Used only to leave
    them out of a download: the local copy is verified and read as any other."""
    text = buckets.read_text(buckets.join(url, META))
    try:
        names = json.loads(text).get("in_store") if text is not None else None
    except (ValueError, AttributeError, RecursionError):
        return []  # a damaged meta.json: the download's checks say so
    if not isinstance(names, list):
        return []
    return [n for n in names if plain_name(n) and n.startswith(f"{SHARDED_DIR}/")]


def store_shards(checkpoint_url: str, meta: dict) -> str | None:
    """The URL of the `sharded/` folder whose shards a resume reads from the store: where meta.json names
    some "in_store" (None when it names none)."""
    return buckets.join(checkpoint_url, SHARDED_DIR) if meta.get("in_store") else None


def fetch_for_reading(url: str, cache: Path) -> Path:
    """What `url` names, as a local folder under `cache` that eval, generate and export read as any
    folder on disk: a checkpoint or best_model folder, or a checkpoints or run folder meaning the
    checkpoint its `latest` names (as `find.find_checkpoint` takes a local path). Each file is checked
    against the store's `files.json` on arrival; the reader then verifies meta.json as on disk."""
    base = url.rstrip("/")
    name = base.rsplit("/", 1)[-1]
    if name == LATEST:
        base, name = base.rsplit("/", 1)[0], ""
    if not (_NAME.fullmatch(name) or name == BEST):
        for folder in (base, buckets.join(base, CHECKPOINTS_DIR)):
            named = buckets.read_text(buckets.join(folder, LATEST))
            if named is not None:
                name = named.strip()
                if not _NAME.fullmatch(name):
                    raise CheckpointError(
                        f"{buckets.join(folder, LATEST)} names {name[:40]!r}, not a checkpoint; fix or remove it"
                    )
                base = buckets.join(folder, name)
                break
        else:
            raise UsageError(
                f"{url} holds no checkpoint in its store (no latest, no checkpoints/latest); pass the URL of a "
                "checkpoint, best_model, checkpoints or run folder"
            )
    if name == BEST and not complete(base) and complete(buckets.join(remote_parent(base), SPARE)):
        base = buckets.join(remote_parent(base), SPARE)  # a replacement of best_model/ under way, or cut short
    local = cache / buckets.mirror_name(base)
    if local.is_dir() and same_as_store(local, base):
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    if not buckets.get_folder(base, local, last=[META]):
        raise UsageError(
            f"{base} is not a complete checkpoint in its store (no files.json or meta.json); pass another "
            "checkpoint, or the checkpoints folder (its latest)"
        )
    log(f"downloaded {base} into {local}")
    return local
