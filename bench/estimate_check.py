"""`llm-trainer estimate`'s memory prediction against the measured peak of real training steps.

    python bench/estimate_check.py [--device cpu|cuda] [--json]

Each config trains 3 steps in a fresh process (`llm_trainer.train.memory_probe`: resident memory on
a CPU, `torch.cuda.max_memory_allocated` on a GPU); the table gives both peaks in MiB and the error.
tests/test_estimate_measured.py holds every config within 10%.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llm_trainer.tools.estimate import compare  # noqa: E402

MiB = 2**20

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = compare(args.device)
    if args.json:
        print(json.dumps(rows))
        sys.exit(0)
    print(
        "| config | params | grads | optimizer | activations | optimizer temp | estimated peak | measured peak | error | peak phase |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts = [r[k] / MiB for k in ("params", "grads", "optimizer", "activations", "optimizer_temp")]
        print(
            f"| {r['config']} | "
            + " | ".join(f"{p:.1f}" for p in parts)
            + f" | {r['estimated'] / MiB:.1f} | {r['measured'] / MiB:.1f} | {r['error']:+.1%} | {r['peak_phase']} |"
        )
