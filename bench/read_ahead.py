"""`llm-trainer train` on the baby GPT config with the coming batches read ahead on a worker thread
(`training.read_ahead: true`, what `auto` does on a GPU) against read in the step (`false`, what `auto`
does on a CPU). Runs alternate, round after
round (ABBA), so a shared machine's load falls on both alike; each run is `bench/run_baby_gpt.py`'s run
of ours (a fresh process, its own data cache, evaluation and saves as the config has them). JSON on
stdout and in bench/out/read_ahead.json: each run's loop tokens/s, data-wait share and validation
loss, the medians, and the ratio read ahead / in place.

    python bench/read_ahead.py                      # CPU, 600 steps, 4 rounds (~5 min on 2 cores)
    python bench/read_ahead.py --steps 200 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from run_baby_gpt import CONFIG, emit_report, machine_info, run_ours  # noqa: E402

SIDES = {"ours_read_ahead": "read_ahead", "ours_read_in_place": "in_place"}  # run_baby_gpt's runners


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for runner in list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]:
            result = run_ours(runner, args.steps, False, None, keep=False, shared_eval=False)
            if result.get("error"):
                raise SystemExit(f"error: {runner}: {result['error']}")
            runs.append({key: result.get(key) for key in ("name", "tokens_per_s", "data_wait_fraction", "val_loss")})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    median = {
        side: statistics.median(run["tokens_per_s"] for run in runs if run["name"] == runner)
        for runner, side in SIDES.items()
    }
    report = {
        "benchmark": "read_ahead",
        "machine": machine_info(),
        "config": CONFIG,
        "steps": args.steps,
        "runs": runs,
        "median_tokens_per_s": median,
        "ratio_read_ahead_over_in_place": median["read_ahead"] / median["in_place"],
    }
    return emit_report(report, BENCH_DIR / "out" / "read_ahead.json")


if __name__ == "__main__":
    sys.exit(main())
