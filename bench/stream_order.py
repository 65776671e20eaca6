"""Does streamed data train as well as local data? Mean validation loss over seeds, local vs streamed.

    OMP_NUM_THREADS=1 nice python bench/stream_order.py                            # 3 seeds, 300 steps
    OMP_NUM_THREADS=1 nice python bench/stream_order.py --baseline-src ../main/src  # also another checkout
    OMP_NUM_THREADS=1 nice python bench/stream_order.py --tokenizer bpe                # 8192 BPE tokens

The baby-GPT Tiny Shakespeare setting (bench/configs/baby_gpt_shakespeare.yaml), each seed trained twice:

  local     data.cache_dir on local disk: no chunk record, the global permutation of the rows
  streamed  data.cache_dir s3://bench/prepared on a local S3 server (moto, 127.0.0.1, fake credentials):
            the training tokens stream through a cache smaller than them (data.stream_cache_limit 1.5 MB),
            in the chunked order of `data/batches/stream.py`

The seed (`training.seed`) sets the model's initialisation and the data order alike. Validation loss (the
whole validation split) is read at every `--eval-every` steps from each run's metrics.jsonl. With
`--baseline-src`, the streamed runs are repeated with another checkout's llm_trainer (its order: the figures
before a change). Prints one JSON object and writes it to --out (default bench/out/stream_order.json):
per runner and step the mean and standard deviation of val loss over the seeds, and streamed minus local.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from object_storage import CORPUS, FAKE, STREAM_CACHE_LIMIT, start_server  # noqa: E402
from run_baby_gpt import CONFIG, DATA_ENV_VAR, _read_jsonl, emit_report, machine_info  # noqa: E402


def _train(args: list[str], env: dict, out: Path, steps: int, eval_every: int, seed: int) -> dict[int, float]:
    """Validation loss by step of one run."""
    cmd = [sys.executable, "-m", "llm_trainer", "train", "--config", CONFIG, f"training.max_steps={steps}"]
    cmd += [f"training.output_dir={out}", f"training.seed={seed}", f"training.eval_steps={eval_every}"]
    cmd += ["training.save_steps=0", "training.checkpoint_dir=null", *args]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = _read_jsonl(out / "metrics.jsonl")
    losses = {row["step"]: row["val_loss"] for row in rows if row.get("kind") == "eval" and "val_loss" in row}
    shutil.rmtree(out, ignore_errors=True)
    return losses


def _summary(runs: list[dict[int, float]]) -> dict[int, dict[str, float]]:
    steps = sorted(set.intersection(*(set(r) for r in runs)))
    return {
        s: {"mean": statistics.mean(r[s] for r in runs), "stdev": statistics.stdev(r[s] for r in runs)} for s in steps
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--baseline-src", help="another checkout's src/: its streamed order as well")
    parser.add_argument("--runners", default="local,streamed", help="of local, streamed (+ streamed_baseline)")
    parser.add_argument("--tokenizer", default="char", help="data.tokenizer: char (the setting's) or bpe")
    parser.add_argument("--corpus", default=os.environ.get(DATA_ENV_VAR, str(CORPUS)), help="Tiny Shakespeare")
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "stream_order.json"))
    args = parser.parse_args()
    import s3fs

    corpus = Path(args.corpus).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench_order_"))
    proc, endpoint = start_server()
    started = time.perf_counter()
    try:
        env = {**os.environ, **FAKE, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(REPO_ROOT / "src")}
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="bench", secret="bench")
        fs.mkdir("bench")
        fs.put_file(str(corpus), "bench/corpus/input.txt")
        local = [
            f"data.data_files={corpus}",
            f"data.cache_dir={work / 'disk-cache'}",
            f"data.tokenizer={args.tokenizer}",
        ]

        def streamed(bucket_folder: str) -> list[str]:  # each run: an empty local cache, as on a fresh machine
            return [
                f"data.stream_cache_limit={STREAM_CACHE_LIMIT}",
                "data.data_files=s3://bench/corpus/input.txt",
                f"data.cache_dir=s3://bench/{bucket_folder}",
                f"data.tokenizer={args.tokenizer}",
                f"data.stream_cache_dir={work / f'stream-{time.monotonic_ns()}'}",
            ]

        runners = {"local": (lambda: local, env), "streamed": (lambda: streamed("prepared"), env)}
        runners = {name: runners[name] for name in args.runners.split(",")}
        if args.baseline_src:
            before = {**env, "PYTHONPATH": str(Path(args.baseline_src).resolve())}
            runners["streamed_baseline"] = (lambda: streamed("prepared-baseline"), before)
        for make, runner_env in runners.values():  # prepare (and upload) each data folder once
            extra = [a for a in make() if not a.startswith("data.stream_cache_limit")]
            cmd = [sys.executable, "-m", "llm_trainer", "prepare", "--config", CONFIG, *extra]
            subprocess.run(cmd, cwd=REPO_ROOT, env=runner_env, check=True, capture_output=True)
        results: dict[str, list[dict[int, float]]] = {name: [] for name in runners}
        for seed in range(1, args.seeds + 1):
            for name, (make, runner_env) in runners.items():
                out = work / f"run-{name}-{seed}"
                results[name].append(_train(make(), runner_env, out, args.steps, args.eval_every, seed))
                print(json.dumps({"runner": name, "seed": seed, "val_loss": results[name][-1]}), flush=True)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)

    summary = {name: _summary(runs) for name, runs in results.items()}
    gaps = {
        name: {s: summary[name][s]["mean"] - summary["local"][s]["mean"] for s in summary[name]}
        for name in summary
        if name != "local" and "local" in summary
    }
    report = {
        "benchmark": "stream_order",
        "config": CONFIG,
        "steps": args.steps,
        "seeds": args.seeds,
        "tokenizer": args.tokenizer,
        "val_loss": summary,
        "minus_local": gaps,
        "runs": {name: [{str(k): v for k, v in r.items()} for r in runs] for name, runs in results.items()},
        "wall_s": time.perf_counter() - started,
        "machine": machine_info(),
    }
    return emit_report(json.loads(json.dumps(report)), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
