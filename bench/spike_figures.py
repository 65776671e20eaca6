"""The loss-spike test's runs side by side (tests/test_spikes.py): a period-64 token sequence learnt by
heart, random tokens planted in rows 120..131 (the batches of steps 31-33), learning rate 3e-2.

    python bench/spike_figures.py [OUT_DIR]

Prints each policy's training loss by step around the planted rows, and what rewind skipped.
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from test_spikes import policy_runs  # noqa: E402

if __name__ == "__main__":
    runs = policy_runs(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()))
    print("| step | clean data | planted, warn | planted, skip | planted, rewind |")
    print("|---|---|---|---|---|")
    names = ("clean", "warn", "skip", "rewind")
    for step in [*range(27, 41), 50, 60]:
        print(f"| {step} | " + " | ".join(f"{runs[n][0][step]:.4f}" for n in names) + " |")
    for name in names[1:]:
        summary = runs[name][2]
        print(f"{name}: loss_spikes {summary['loss_spikes']}, rewinds {summary['rewinds']}")
    print(f"rewind skipped global sample ranges {runs['rewind'][1].train_loader.skip} (planted rows: [120, 132))")
