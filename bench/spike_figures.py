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

from test_spikes import losses, trainer  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    runs, summaries = {}, {}
    for name, policy, planted in (
        ("clean", "off", False),
        ("warn", "warn", True),
        ("skip", "skip", True),
        ("rewind", "rewind", True),
    ):
        t = trainer(out / name, policy, planted)
        summaries[name] = t.train()
        runs[name] = losses(out / name)
        if name == "rewind":
            skipped = t.train_loader.skip
    print("| step | clean data | planted, warn | planted, skip | planted, rewind |")
    print("|---|---|---|---|---|")
    for step in [*range(27, 41), 50, 60]:
        print(f"| {step} | " + " | ".join(f"{runs[n][step]:.4f}" for n in ("clean", "warn", "skip", "rewind")) + " |")
    for name in ("warn", "skip", "rewind"):
        s = summaries[name]
        print(f"{name}: loss_spikes {s['loss_spikes']}, rewinds {s['rewinds']}")
    print(f"rewind skipped global sample ranges {skipped} (planted rows: [120, 132))")
