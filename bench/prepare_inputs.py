"""What the form of the input costs `llm-trainer prepare`: a folder of many small files, compressed files,
one large file.

    python bench/prepare_inputs.py                 # ~3 minutes on 2 cores
    python bench/prepare_inputs.py --files 100000  # a larger folder
    python bench/prepare_inputs.py --cases book    # one case

1. **Many small files**: a project folder of `--files` text files of one to three lines (in subfolders of
   1,000) beside a hidden `.git` folder of `--git-objects` files, as a repository checkout has, prepared as
   `data_files: [folder]`. Reported: the whole `prepare` process's wall time, and in one process the time
   to find the files (`resolve_files`) and to fingerprint them (`source_fingerprint`), which every
   `prepare` and `train` does before it knows whether the data is prepared already.
2. **Compressed files**: the Python standard library's sources (no download) written as 8 text files of
   about `--mb`/8 MB each, and the same files compressed with gzip, bzip2, xz and zstandard (the last
   when the `zstandard` package is installed). `prepare` of each folder in a fresh process, the forms
   alternated for `--rounds` rounds; the best wall time of each, its ratio to the plain folder's, and
   whether its train.bin is the plain folder's byte for byte.

3. **One large file**: the standard library's sources as one text file of about `--book-mb` MB (at most its ~11 MB), prepared
   with a byte-level BPE tokenizer of 4,096 tokens and `validation_split: 0.05`, as a user prepares a
   book or a dump: too few documents to hold one out, so validation is the end of each one's tokens.
   Reported: the wall time and how validation was taken.

The char tokenizer in the first two, so that the tokenizer's training does not dominate. One JSON object
on stdout and in bench/out/prepare_inputs.json.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from run_baby_gpt import emit_report, machine_info  # noqa: E402

COMPRESSORS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}
try:
    import zstandard

    COMPRESSORS["zst"] = zstandard.ZstdCompressor().compress
except ImportError:
    pass


def prepare(folder: Path, cache: Path, **data) -> tuple[float, Path]:
    """Wall seconds of `llm-trainer prepare` of `folder` (char tokenizer unless `data` sets other keys) in a
    fresh process, and the prepared folder."""
    config = cache.parent / f"{cache.name}.yaml"
    config.write_text(
        yaml.safe_dump({"data": {"data_files": [str(folder)], "tokenizer": "char", "cache_dir": str(cache), **data}})
    )
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "llm_trainer", "prepare", "--config", str(config)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - start
    (manifest,) = cache.glob("*/manifest.json")
    return wall, manifest.parent


def many_files(work: Path, files: int, git_objects: int) -> dict:
    folder = work / "project"
    for i in range(files):
        sub = folder / f"part-{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"note-{i}.txt").write_text(f"note {i}: a short file.\n" * (1 + i % 3))
    objects = folder / ".git" / "objects"
    for i in range(git_objects):
        sub = objects / f"{i % 256:02x}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i:038x}").write_bytes(bytes([i % 256]) * 64)
    finding = (
        "import sys, time; from llm_trainer.config import DataConfig;"
        "from llm_trainer.data.text.sources import resolve_files, source_fingerprint, tool_folders;"
        "c = DataConfig(data_files=[sys.argv[1]], cache_dir=sys.argv[2]);"
        "t = time.perf_counter(); n = len(resolve_files(c.data_files, ours=tool_folders(c)));"
        "r = time.perf_counter() - t; t = time.perf_counter(); source_fingerprint(c);"
        "print(n, r, time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", finding, str(folder), str(work / "cache-find")],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    wall, _ = prepare(folder, work / "cache-many")
    return {
        "files": int(out[0]),
        "git_objects": git_objects,
        "prepare_wall_s": round(wall, 2),
        "resolve_files_s": round(float(out[1]), 3),
        "fingerprint_s": round(float(out[2]), 3),
    }


def compressed(work: Path, mb: float, rounds: int) -> dict:
    from llm_trainer.data.text.sources import stdlib_files

    text, parts = "", []
    for path in stdlib_files():
        text += path.read_text(encoding="utf-8", errors="replace") + "\n"
        if len(text) >= mb * 1e6 / 8:
            parts.append(text)
            text = ""
        if len(parts) == 8:
            break
    folders = {"plain": work / "plain", **{name: work / name for name in COMPRESSORS}}
    for name, folder in folders.items():
        folder.mkdir()
        for i, part in enumerate(parts):
            raw = part.encode()
            if name == "plain":
                (folder / f"part-{i}.txt").write_bytes(raw)
            else:
                (folder / f"part-{i}.txt.{name}").write_bytes(COMPRESSORS[name](raw))
    walls: dict[str, list[float]] = {name: [] for name in folders}
    same: dict[str, bool] = {}
    for r in range(rounds):
        order = list(folders) if r % 2 == 0 else list(reversed(folders))
        for name in order:
            wall, prepared = prepare(folders[name], work / f"cache-{name}-{r}")
            walls[name].append(wall)
            if r == 0:
                same[name] = (prepared / "train.bin").read_bytes()
    plain = min(walls["plain"])
    size = sum(len(p.encode()) for p in parts) / 1e6
    return {
        "mb": round(size, 2),
        "files": len(parts),
        "forms": {
            name: {
                "bytes_on_disk": sum(f.stat().st_size for f in folders[name].iterdir()),
                "best_wall_s": round(min(walls[name]), 2),
                "walls_s": [round(w, 2) for w in walls[name]],
                "wall_ratio_to_plain": round(min(walls[name]) / plain, 3),
                "train_bin_same_as_plain": same[name] == same["plain"],
            }
            for name in folders
        },
    }


def one_large_file(work: Path, mb: float) -> dict:
    from llm_trainer.data.text.sources import stdlib_files

    parts, size = [], 0
    for path in stdlib_files():
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1].encode())
        if size >= mb * 1e6:
            break
    book = work / "book.txt"
    book.write_text("\n".join(parts), encoding="utf-8")
    data = {"tokenizer": "bpe", "tokenizer_vocab_size": 4096, "validation_split": 0.05}
    wall, prepared = prepare(book, work / "cache-book", **data)
    manifest = yaml.safe_load((prepared / "manifest.json").read_text())
    return {
        "mb": round(book.stat().st_size / 1e6, 2),
        "prepare_wall_s": round(wall, 2),
        "validation_split_by": manifest["validation_split_by"],
        "tokens": manifest["tokens"],
    }


CASES = ("many", "compressed", "book")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--git-objects", type=int, default=20000)
    parser.add_argument("--mb", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--book-mb", type=float, default=10.0)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "prepare_inputs.json"))
    args = parser.parse_args()
    cases = args.cases.split(",")
    if not set(cases) <= set(CASES):
        parser.error(f"--cases: {', '.join(sorted(set(cases) - set(CASES)))} is none of {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="prepare_inputs_") as tmp:
        work = Path(tmp)
        report = {"machine": machine_info()}
        if "many" in cases:
            report["many_small_files"] = many_files(work, args.files, args.git_objects)
        if "compressed" in cases:
            report["compressed"] = compressed(work, args.mb, args.rounds)
        if "book" in cases:
            report["one_large_file"] = one_large_file(work, args.book_mb)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
