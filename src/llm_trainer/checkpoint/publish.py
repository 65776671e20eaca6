"""Writing a model folder into a path the user names (`export --output`, `consolidate --output`)
without losing what is already there.

Everything is built first in a temporary folder next to the target (`files.atomic.temporary_folder`), so
a failure (a full disk, a refused model) leaves the target as it was. An existing target is refused
unless it is empty or `overwrite` is given; with `overwrite`, the files of the old folder that the
new one does not write are carried into it (its other files are the user's: a README, a second
tokenizer), except the weight files of another layout (a loader would read them instead of the new
ones). Then the new folder takes the target's place as `best_model/` does (`files.atomic.move_into_place`):
one atomic exchange, so a kill at any instant leaves the old folder or the new one, whole. Leftovers
of a killed run are cleaned (or the old folder put back) at the next one, and only those.

A target in a store (s3://...) has no atomic exchange: the folder is built locally and uploaded, its
commit marker (config.json) last. `--overwrite` there replaces only what an earlier upload of ours
wrote, as its `files.json` record lists it: the files the new folder does not write are removed
(never another file), and a target holding files we did not write is refused (`check_remote_target`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError, first_line
from ..files import buckets
from ..files.atomic import move_into_place, temporary_folder, through_link
from ..files.checksums import file_checksum
from ..files.disk import disk_full, writable_folder
from ..files.folder_files import META
from ..logs import log
from .durable import remove_stale
from .layout import CONSOLIDATED_KIND, read_meta

# Weight files of a model folder's other layouts: left beside new weights, a loader could read them instead.
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def check_target(output: Path, source: Path | None, overwrite: bool, overwrite_hint: str = "pass --overwrite") -> None:
    """Refuse, before any work, a target that is a file, that holds the source (a model in memory has
    none), that is not empty (without `overwrite`, which `overwrite_hint` says how to give), or whose
    folder cannot be written."""
    if output.exists() and not output.is_dir():
        raise UsageError(f"{output} exists and is not a folder; choose another output folder")
    out = output.resolve()
    if source is not None and (out == Path(source).resolve() or out in Path(source).resolve().parents):
        raise UsageError(f"the output folder {output} must not contain the model folder {source}")
    # a training checkpoint or best_model/: what a run saved is never replaced (a consolidated folder may be)
    if (output / META).is_file() and (read_meta(output) or {}).get("kind") != CONSOLIDATED_KIND:
        raise UsageError(
            f"{output} holds a run's checkpoint ({META}); it is never replaced by this command: choose another "
            "output folder"
        )
    held = sorted(path.name for path in output.iterdir()) if output.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise UsageError(
            f"{output} is not empty ({shown}); choose an empty or new folder, or {overwrite_hint} to replace "
            "the files this command writes there (other files are kept, but for model weight files of another "
            "layout, which a loader would read instead)"
        )
    writable_folder(output.absolute().parent, "the folder of --output")


def _carry(path: Path, destination: Path) -> None:
    """One entry of the old folder into the new one: a link for a file (nothing copied), a copy of a
    folder, a symlink as a symlink (never followed)."""
    if path.is_symlink():
        os.symlink(os.readlink(path), destination)
    elif path.is_dir():
        shutil.copytree(path, destination, symlinks=True)
    else:
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)


def _write_failure(exc: Exception, folder: Path) -> bool:
    """Whether `exc` says a file could not be written (safetensors and torch wrap the OS error in their own)."""
    return isinstance(exc, OSError) or disk_full(exc, folder) or "os error" in str(exc).lower()


def publish(
    output: Path,
    build: Callable[[Path], None],
    *,
    source: Path | None,
    overwrite: bool,
    overwrite_hint: str = "pass --overwrite",
) -> Path:
    """Build the folder with `build(tmp)`, then put it at `output` as the module docstring says (a symlink:
    at its target, `through_link`)."""
    output = through_link(Path(output))
    # a killed export's leftovers only, before the check
    remove_stale(output.absolute().parent, names={output.name}, writes="export")
    check_target(output, source, overwrite, overwrite_hint)
    tmp = temporary_folder(output.absolute())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        build(tmp)
        replaced = []
        if output.is_dir() and not output.is_symlink():
            tmp.chmod(stat.S_IMODE(output.stat().st_mode))  # a private folder stays private
            for path in output.iterdir():
                if (tmp / path.name).exists() or WEIGHT_FILE.fullmatch(path.name):
                    replaced.append(path.name)
                else:
                    _carry(path, tmp / path.name)
        move_into_place(tmp, output.absolute())
        if replaced:
            log(f"{output}: replaced {', '.join(sorted(replaced))}; its other files are kept")
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and _write_failure(exc, output.absolute().parent):
            reason = "disk full" if disk_full(exc, output.absolute().parent) else first_line(exc)
            raise UsageError(f"could not write {output} ({reason}); it is as it was before") from None
        raise
    return output


# ----------------------------------------------------------------------------------------------
# a target in a store (--output s3://...): the folder is built locally, then uploaded with `buckets.put_folder`


def _remote_names(url: str) -> list[str]:
    """Every file under the folder `url`, by its path inside it."""
    return buckets.files_under(url)


def _record(url: str) -> dict:
    """The `files.json` an earlier upload of ours left in `url` ({} when there is none or it is not ours)."""
    text = buckets.read_text(buckets.join(url, buckets.FILES_RECORD))
    try:
        record = json.loads(text) if text is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) and all(isinstance(v, dict) for v in record.values()) else {}


def check_remote_target(url: str, overwrite: bool) -> None:
    """Refuse, before any work, a target in a store that cannot be written, that holds files (without
    `overwrite`), or that holds files an earlier upload of ours did not write (those are never replaced
    nor deleted: the user's)."""
    buckets.check_writable(url, "--output")
    names = _remote_names(url)
    if not names:
        return
    if not overwrite:
        raise UsageError(
            f"--output {url} holds files already; choose another folder, or pass --overwrite to replace "
            "what an earlier export wrote there"
        )
    ours = set(_record(url)) | {buckets.FILES_RECORD}
    foreign = [name for name in names if name not in ours]
    if foreign:
        raise UsageError(
            f"--output {url} holds files this command did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose another folder, or move them away first"
        )


def publish_remote(folder: Path, url: str, *, marker: str) -> None:
    """Upload the local model folder `folder` to `url` (checked by `check_remote_target`), `marker` last.
    The files an earlier upload of ours wrote there and this one does not are removed first, the old
    marker before them: a reader never takes the old files for part of the new folder. Until the new
    record is written, the old one lists the union, so that a run killed part-way is replaced next time."""
    old = _record(url)
    new = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "checksum": file_checksum(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }
    present = set(_remote_names(url))
    if old:
        buckets.write_text(buckets.join(url, buckets.FILES_RECORD), json.dumps({**old, **new}, sort_keys=True))
    if marker in old and marker in present:
        buckets.remove(buckets.join(url, marker))  # the folder is incomplete until the new one, uploaded last
    for name in old:
        if name not in new and name != marker and name in present:
            buckets.remove(buckets.join(url, name))
    buckets.put_folder(folder, url, last=[marker] if (folder / marker).is_file() else [])
