"""How long torch.compile takes over the chunked head + cross-entropy, against the number of chunks it
traces: the compiler unrolls the chunk loop, so its time grows with the chunks, and the chunks grow
with the batch. The default (`loss.COMPILED_MAX_CHUNKS`: larger chunks past it) beside the same loss
with as many chunks as eager takes. Each measurement runs in a fresh process with the compiler's
caches off, so each one compiles from scratch. JSON on stdout.

    python bench/loss_compile_time.py                  # the chunk counts of GPT-2 124M at 12 and 64 x 1024
    python bench/loss_compile_time.py --chunks 25      # the 1.0B LLaMA at 8 x 2048

The head is small (vocabulary 1024, width 64, a chunk budget of 64 positions), so the figures are the
compiler's, not the matmuls': the graph it traces holds as many chunks as GPT-2's real head would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB, WIDTH, ROWS_PER_CHUNK = 1024, 64, 64


def measure(chunks: int, capped: bool) -> dict:
    """Seconds of the first compiled forward + backward (the compilation) and the median of three more."""
    import torch

    from llm_trainer import loss

    loss.CHUNK_LOGITS = ROWS_PER_CHUNK * VOCAB  # eager's chunk count is then `chunks`
    if not capped:
        loss.COMPILED_MAX_CHUNKS = chunks
    rows = chunks * ROWS_PER_CHUNK
    torch.manual_seed(0)
    hidden = torch.randn(rows, WIDTH, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, requires_grad=True)
    targets = torch.randint(0, VOCAB, (rows,))
    step = torch.compile(lambda h, w, t: loss.linear_cross_entropy(h, w, t))
    times = []
    for _ in range(4):
        start = time.perf_counter()
        step(hidden, weight, targets).backward()
        times.append(time.perf_counter() - start)
    traced = rows // loss.chunk_rows(rows, VOCAB, compiled=True)
    return {
        "traced_chunks": traced,
        "compile_s": round(times[0], 1),
        "step_ms": round(1000 * statistics.median(times[1:]), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[19, 99], help="eager's chunk counts to compile")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # CHUNKS capped|uncapped: one measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1] == "capped")))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "PYTHONPATH": str(ROOT / "src")}
    rows = []
    for chunks in args.chunks:
        for way in ("capped", "uncapped"):
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(chunks), way],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"eager_chunks": chunks, "way": "default" if way == "capped" else "as many as eager", **result})
            print(json.dumps(rows[-1]), file=sys.stderr)
    import torch

    print(
        json.dumps(
            {
                "benchmark": "loss_compile_time",
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
