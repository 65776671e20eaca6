"""Writing a model folder into a path the user names (`export --output`, `consolidate --output`)
without losing what is already there.

Everything is built first in a temporary folder next to the target (`durable.temporary_folder`), so
a failure (a full disk, a refused model) leaves the target as it was. An existing target is refused
unless it is empty or `overwrite` is given; with `overwrite`, the files of the old folder that the
new one does not write are carried into it (its other files are the user's: a README, a second
tokenizer), except the weight files of another layout (a loader would read them instead of the new
ones). Then the new folder takes the target's place as `best_model/` does (`durable.move_into_place`):
one atomic exchange, so a kill at any instant leaves the old folder or the new one, whole. Leftovers
of a killed run are cleaned (or the old folder put back) at the next one, and only those.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError
from ..filesystem import disk_full, writable_folder
from .durable import first_line, move_into_place, remove_stale, temporary_folder

# Weight files of a model folder's other layouts: left beside new weights, a loader could read them instead.
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def check_target(output: Path, source: Path, overwrite: bool) -> None:
    """Refuse, before any work, a target that is a file, that holds the source, that is not empty
    (without `overwrite`), or whose folder cannot be written."""
    if output.exists() and not output.is_dir():
        raise UsageError(f"{output} exists and is not a folder; choose another output folder")
    out, src = output.resolve(), Path(source).resolve()
    if out == src or out in src.parents:
        raise UsageError(f"the output folder {output} must not contain the model folder {source}")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise UsageError(
            f"{output} is not empty; choose an empty or new folder, or pass --overwrite to replace "
            "the files this command writes there (other files are kept)"
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


def publish(output: Path, build: Callable[[Path], None], *, source: Path, overwrite: bool) -> Path:
    """Build the folder with `build(tmp)`, then put it at `output` as the module docstring says."""
    output = Path(output)
    remove_stale(output.absolute().parent, names={output.name})  # a killed run's leftovers only, before the check
    check_target(output, source, overwrite)
    tmp = temporary_folder(output.absolute())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        build(tmp)
        if output.is_dir():
            for path in output.iterdir():
                if not (tmp / path.name).exists() and not WEIGHT_FILE.fullmatch(path.name):
                    _carry(path, tmp / path.name)
        move_into_place(tmp, output.absolute())
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and _write_failure(exc, output.absolute().parent):
            reason = "disk full" if disk_full(exc, output.absolute().parent) else first_line(exc)
            raise UsageError(f"could not write {output} ({reason}); it is as it was before") from None
        raise
    return output
