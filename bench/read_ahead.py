"""`llm-trainer train` on the baby GPT config with the coming batches read ahead on a worker thread (the
default, `training.read_ahead: true`) against read in the step (`false`). Runs alternate, round after
round (ABBA), so a shared machine's load falls on both alike; each run is a fresh process on one
prepared data folder, with evaluation and periodic saves left as the config has them. JSON on stdout:
each run's loop tokens/s and data-wait share, the medians, and the ratio read ahead / in place
(also in bench/out/read_ahead.json).

    python bench/read_ahead.py                      # CPU, 600 steps, 4 rounds (~4 min on 2 cores)
    python bench/read_ahead.py --steps 200 --rounds 2 --config bench/configs/baby_gpt_shakespeare.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from run_baby_gpt import CONFIG, _loop_throughput, _read_jsonl, emit_report, machine_info  # noqa: E402


def run(config: str, steps: int, ahead: bool, cache: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="read_ahead_"))
    cmd = [
        sys.executable,
        "-m",
        "llm_trainer",
        "train",
        "--config",
        config,
        f"training.output_dir={out}",
        f"training.max_steps={steps}",
        f"training.read_ahead={str(ahead).lower()}",
        f"data.cache_dir={cache}",
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    rows = _read_jsonl(out / "metrics.jsonl")
    trains = [row for row in rows if row.get("kind") == "train"]
    tokens_per_s, seconds = _loop_throughput(trains)
    return {
        "read_ahead": ahead,
        "tokens_per_s": tokens_per_s,
        "loop_s": seconds,
        "data_wait_fraction": statistics.median(row["data_wait_fraction"] for row in trains),
        "val_loss": next(row for row in reversed(rows) if row.get("kind") == "summary").get("val_loss"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="read_ahead_data_"))
    runs = []
    for round_ in range(args.rounds):
        for ahead in (True, False) if round_ % 2 == 0 else (False, True):
            runs.append(run(args.config, args.steps, ahead, cache))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    median = {
        name: statistics.median(r["tokens_per_s"] for r in runs if r["read_ahead"] is ahead)
        for name, ahead in (("read_ahead", True), ("in_place", False))
    }
    report = {
        "benchmark": "read_ahead",
        "machine": machine_info(),
        "config": args.config,
        "steps": args.steps,
        "runs": runs,
        "median_tokens_per_s": median,
        "ratio_read_ahead_over_in_place": median["read_ahead"] / median["in_place"],
    }
    return emit_report(report, BENCH_DIR / "out" / "read_ahead.json")


if __name__ == "__main__":
    sys.exit(main())
