"""`prepare` through datatrove's local executor against the in-process prepare, and each stage's MB/s per task.

    python bench/prepare_cluster.py [--mb 40] [--file-mb 5] [--tasks 1 2] [--repeats 3] [--near] [--keep DIR]

1. Generates the JSONL corpus of bench/prepare_throughput.py (English-like text, 5% exact duplicates)
   in files of --file-mb MB, and trains one BPE of 8,192 tokens on it (both sides use that file).
2. Stages, each on one thread over the whole corpus, through the functions prepare calls: read
   (`iter_unit`), clean + filters + exact key (`DocumentProcessor`, exact), MinHash signatures
   (`MinHasher.signature`), tokenize (`encode` with the tokenizer's threads off).
3. End to end, each in a fresh process: the in-process prepare (`data.executor` null) and the datatrove
   pipeline on the local executor for each --tasks (workers = tasks), on the whole corpus and on its
   first half; for each, seconds, MB/s, CPU seconds per MB, the per-file and merge stages' seconds
   (the driver's seconds.json) and the peak RSS of the process and of its largest child (a task run
   in a pool). The whole-corpus runs alternate for --repeats rounds; the best of each is reported.
Prints one JSON object. MB are 10^6 bytes of document text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "src"))

import prepare_throughput  # noqa: E402

_CHILD = """
import json, resource, sys, time
from llm_trainer.config import DataConfig
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.prepare.cluster import tasks_folder

if __name__ == "__main__":
    config = DataConfig(**json.loads(sys.argv[1]))
    start = time.perf_counter()
    prepared = prepare_data(config)
    seconds = time.perf_counter() - start
    report = json.loads((prepared.directory / "data_report.json").read_text())
    stages = tasks_folder(config, prepared.manifest["fingerprint"]) / "seconds.json"
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "bytes_in": report["bytes_in"], "tokens": report["tokens"],
                      "stages": json.loads(stages.read_text()) if stages.is_file() else None,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_child_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def run(files, tokenizer_file: Path, cache: Path, executor: str | None, tasks: int, dedup: str) -> dict:
    settings = dict(
        data_files=[str(f) for f in files],
        tokenizer=str(tokenizer_file),
        cache_dir=str(cache),
        deduplication=dedup,
        progress_bar=False,
        executor=executor,
        executor_tasks=tasks,
        executor_workers=tasks,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("TOKENIZERS_PARALLELISM", None)
    script = cache.parent / "child.py"
    script.write_text(_CHILD)
    # Through sh, so that the child's ru_maxrss is not this (larger) process's, which fork would carry over.
    command = ["/bin/sh", "-c", '"$0" "$@"', sys.executable, str(script), json.dumps(settings)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-4000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["mb_per_s"] = round(result["bytes_in"] / result["seconds"] / 1e6, 3)
    result["cpu_seconds_per_mb"] = round(result["cpu_seconds"] / (result["bytes_in"] / 1e6), 4)
    shutil.rmtree(cache, ignore_errors=True)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


def stages(files, tokenizer_file: Path) -> dict:
    """MB/s of each stage on one thread, through the functions prepare calls."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from llm_trainer.config import DataConfig
    from llm_trainer.data.prepare.workers import DocumentProcessor, encode
    from llm_trainer.data.text.dedup import MinHasher
    from llm_trainer.data.text.sources import FileUnit, SourceStats, iter_unit
    from llm_trainer.tokenizer import Tokenizer

    config = DataConfig(data_files=[str(f) for f in files])
    start = time.perf_counter()
    texts = [d.text for f in files for d in iter_unit(FileUnit(0, str(f), True, False, 0), config, SourceStats())]
    read = time.perf_counter() - start
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    processor = DocumentProcessor(config)
    start = time.perf_counter()
    for i in range(0, len(texts), 256):
        processor(texts[i : i + 256])
    process = time.perf_counter() - start
    hasher = MinHasher(128, 5, 0.8)
    sample = texts[: max(1, len(texts) // 4)]
    sample_mb = sum(len(t.encode()) for t in sample) / 1e6
    start = time.perf_counter()
    for text in sample:
        hasher.signature(text)
    minhash = time.perf_counter() - start
    tokenizer = Tokenizer.load(tokenizer_file)
    start = time.perf_counter()
    for i in range(0, len(sample), 256):
        encode(tokenizer, sample[i : i + 256], "uint16")
    tokenize = time.perf_counter() - start
    return {
        "read_mb_per_s": round(megabytes / read, 2),
        "clean_filter_exact_key_mb_per_s": round(megabytes / process, 2),
        "minhash_signature_mb_per_s": round(sample_mb / minhash, 2),
        "tokenize_one_thread_mb_per_s": round(sample_mb / tokenize, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0)
    parser.add_argument("--file-mb", type=float, default=5.0)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--near", action="store_true", help="near-duplicate detection in the end-to-end runs")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the end-to-end runs")
    parser.add_argument("--keep", help="generate into (and keep) this folder")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="prepare-cluster-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        prepare_throughput.FILE_MB = args.file_mb
        corpus = root / "corpus"
        files = sorted(corpus.glob("*.jsonl")) if corpus.is_dir() else prepare_throughput.make_corpus(corpus, args.mb)
        from llm_trainer.tokenizer import Tokenizer

        texts = prepare_throughput.read_texts(files)
        tokenizer_file = Tokenizer.train_bpe(texts, vocab_size=8192, max_chars=20_000_000).save(root / "tokenizer")
        result: dict = {
            "corpus_mb": round(sum(len(t.encode()) for t in texts) / 1e6, 1),
            "files": len(files),
            "cpu_count": os.cpu_count(),
        }
        del texts
        result["stages_one_thread"] = stages(files, tokenizer_file)
        dedup = "near" if args.near else "exact"
        half = files[: max(1, len(files) // 2)]
        # The configurations alternate, --repeats rounds: on a shared machine the load changes between
        # runs, so each one's fastest run (the least disturbed) is compared, and every run is listed.
        setups = {"in_process": (None, 1)} | {f"local_{t}_tasks": ("local", t) for t in args.tasks}
        runs: dict = {}
        for _ in range(args.repeats):
            for name, (executor, tasks) in setups.items():
                runs.setdefault(name, []).append(run(files, tokenizer_file, root / "cache", executor, tasks, dedup))
        for name, (executor, tasks) in setups.items():  # memory at half the corpus: flat or not
            runs[f"{name}_half"] = [run(half, tokenizer_file, root / "cache", executor, tasks, dedup)]
        result["runs"] = runs
        result["best_mb_per_s"] = {name: max(r["mb_per_s"] for r in rs) for name, rs in runs.items()}
        result["best_cpu_seconds_per_mb"] = {
            name: min(r["cpu_seconds_per_mb"] for r in rs) for name, rs in runs.items()
        }
        result["peak_rss_mb_full_vs_half"] = {
            name: [
                max(max(r["peak_rss_mb"], r["peak_child_rss_mb"]) for r in runs[name]),
                max(max(r["peak_rss_mb"], r["peak_child_rss_mb"]) for r in runs[f"{name}_half"]),
            ]
            for name in setups
        }
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
