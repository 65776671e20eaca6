"""Training from object storage vs from local disk: the baby-GPT Tiny Shakespeare setting, tokens/s.

    python bench/object_storage.py                          # 2000 steps, 2 rounds
    python bench/object_storage.py --steps 300 --rounds 3
    python bench/object_storage.py --baseline-src ../main/src   # also local disk with another checkout

Starts an S3 server (moto, its own process on 127.0.0.1; fake credentials, nothing leaves the machine),
uploads the corpus into a bucket and runs the runners one at a time, alternated round by round:

  disk      data_files, cache_dir and checkpoints on local disk (the config as it is)
  s3        data_files s3://bench/corpus/input.txt, data.cache_dir s3://bench/prepared and
            training.checkpoint_dir s3://bench/checkpoints-<run>: every run starts with an empty local stream
            cache, so it downloads the prepared folder's small files, streams the training tokens in
            checksummed chunks (read ahead while it trains) through a cache smaller than them
            (data.stream_cache_limit 1.5 MB), and uploads its checkpoints
  baseline  (with --baseline-src) disk, with another checkout's llm_trainer: the local path's cost

Both data folders are prepared once before the timed runs. Tokens/s is the training loop's (from the
run's metrics.jsonl, as bench/run_baby_gpt.py reads it); data_wait is the mean data_wait_fraction of
its train rows (the loop waiting for a chunk shows there); wall_s is the whole process (with the download and the uploads). Prints one JSON
object and writes it to --out (default bench/out/object_storage_steps<N>.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from run_baby_gpt import CONFIG, _loop_throughput, _read_jsonl, emit_report, machine_info  # noqa: I001

CORPUS = REPO_ROOT / "../shared/data/tinyshakespeare/input.txt"
STREAM_CACHE_LIMIT = 1_500_000  # bytes: less than the training tokens (about 2 MB), so chunks are evicted
FAKE = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **FAKE},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the local S3 server did not start")


def run(name: str, args: list[str], env: dict, work: Path, steps: int) -> dict:
    out = work / f"run-{name}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "llm_trainer", "train", "--config", CONFIG, f"training.max_steps={steps}"]
    cmd += [f"training.output_dir={out}", *args]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    trains = [row for row in _read_jsonl(out / "metrics.jsonl") if row.get("kind") == "train"]
    tokens_per_s, loop_s = _loop_throughput(trains) or (None, None)
    waits = [row["data_wait_fraction"] for row in trains if row.get("data_wait_fraction") is not None]
    shutil.rmtree(out, ignore_errors=True)
    caches = [Path(a.split("=", 1)[1]) for a in args if a.startswith("data.stream_cache_dir=")]
    cached = sum(p.stat().st_size for c in caches for p in c.rglob("*") if p.is_file()) if caches else None
    return {
        "stream_cache_bytes": cached,  # the local cache after the run (within data.stream_cache_limit)
        "tokens_per_s": tokens_per_s,
        "loop_s": loop_s,
        "wall_s": wall,
        "data_wait_fraction": statistics.mean(waits) if waits else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline-src", help="another checkout's src/ for a local-disk baseline runner")
    parser.add_argument("--out")
    args = parser.parse_args()
    import s3fs  # noqa: F401  (fail now, not in the first s3 run)

    work = Path(tempfile.mkdtemp(prefix="bench_s3_"))
    proc, endpoint = start_server()
    try:
        src = str(REPO_ROOT / "src")
        env = {**os.environ, **FAKE, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": src}
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="bench", secret="bench")
        fs.mkdir("bench")
        fs.put_file(str(CORPUS.resolve()), "bench/corpus/input.txt")
        disk = [f"data.data_files={CORPUS.resolve()}", f"data.cache_dir={work / 'disk-cache'}"]
        runners = {"disk": (disk, env)}
        if args.baseline_src:
            runners["baseline"] = (disk, {**env, "PYTHONPATH": str(Path(args.baseline_src).resolve())})

        def s3_args(limit: bool = True) -> list[str]:  # each run: an empty local cache, as on a fresh machine
            return [
                *([f"data.stream_cache_limit={STREAM_CACHE_LIMIT}"] if limit else []),
                "data.data_files=s3://bench/corpus/input.txt",
                "data.cache_dir=s3://bench/prepared",
                f"data.stream_cache_dir={work / f'stream-{time.monotonic_ns()}'}",
                f"training.checkpoint_dir=s3://bench/checkpoints-{time.monotonic_ns()}",
            ]

        runners["s3"] = (None, env)
        for extra, runner_env in runners.values():  # prepare each data folder once, untimed
            subprocess.run(
                [sys.executable, "-m", "llm_trainer", "prepare", "--config", CONFIG, *(extra or s3_args(limit=False))],
                cwd=REPO_ROOT,
                env=runner_env,
                check=True,
                capture_output=True,
            )
        results: dict[str, list[dict]] = {name: [] for name in runners}
        for round_ in range(args.rounds):
            order = list(runners) if round_ % 2 == 0 else list(reversed(runners))  # alternated
            for name in order:
                extra, runner_env = runners[name]
                results[name].append(run(name, extra or s3_args(), runner_env, work, args.steps))
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)

    def median(name: str, key: str):
        values = [r[key] for r in results[name] if r[key] is not None]
        return statistics.median(values) if values else None

    summary = {
        name: {k: median(name, k) for k in ("tokens_per_s", "loop_s", "wall_s", "data_wait_fraction")}
        for name in results
    }
    report = {
        "benchmark": "object_storage",
        "config": CONFIG,
        "steps": args.steps,
        "rounds": args.rounds,
        "median": summary,
        "s3_vs_disk_tokens_per_s": summary["s3"]["tokens_per_s"] / summary["disk"]["tokens_per_s"],
        "runs": results,
        "machine": machine_info(),
    }
    if "baseline" in summary:
        report["disk_vs_baseline_tokens_per_s"] = summary["disk"]["tokens_per_s"] / summary["baseline"]["tokens_per_s"]
    return emit_report(report, args.out or BENCH_DIR / "out" / f"object_storage_steps{args.steps}.json")


if __name__ == "__main__":
    raise SystemExit(main())
