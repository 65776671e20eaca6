"""Writing a model folder into a path the user names (`export --output`, `consolidate --output`)
without losing what is already there.

Everything is built first in a temporary folder next to the target, so a failure (a full disk, a
refused model) leaves the target as it was. Then:

    no target, or an empty folder   the temporary folder is renamed into place (one atomic step)
    a folder with files             refused, unless `overwrite`: then each new file replaces its
                                    namesake atomically (a rename, which also replaces a symlink
                                    planted there instead of following it), the stale weight files
                                    of an earlier export of another layout are removed (a loader
                                    would pick them up), and every other file is kept
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError

# Weight files of a model folder's other layouts: left beside new weights, a loader could read them instead.
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def check_target(output: Path, source: Path, overwrite: bool) -> None:
    """Refuse, before any work, a target that is a file, that holds the source, or that is not empty
    (without `overwrite`)."""
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


def publish(output: Path, build: Callable[[Path], None], *, source: Path, overwrite: bool) -> Path:
    """Build the folder with `build(tmp)`, then put it at `output` as the module docstring says."""
    output = Path(output)
    check_target(output, source, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        if not output.exists() or not any(output.iterdir()):
            tmp.replace(output)  # an empty folder is replaced by the rename itself
            return output
        new = {path.name for path in tmp.iterdir()}
        for path in sorted(tmp.iterdir(), key=lambda p: p.name in ("config.json", "model_config.json")):
            os.replace(path, output / path.name)  # configs last
        for path in output.iterdir():
            if path.name not in new and WEIGHT_FILE.fullmatch(path.name) and (path.is_file() or path.is_symlink()):
                path.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output
