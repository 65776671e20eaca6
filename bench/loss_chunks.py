"""The output head + cross-entropy, forward and backward: whole logits (`F.linear` then
`F.cross_entropy` on a float32 copy, as the step computed it before) against `loss.linear_cross_entropy`
(chunks, gradients computed in the forward). Each measurement runs in a fresh process, so its peak
resident memory is its own; the two ways alternate, round after round, so a shared machine's load
falls on both alike. JSON on stdout.

    python bench/loss_chunks.py                          # GPT-2 vocabulary, 4 x 512 positions, width 256
    python bench/loss_chunks.py --rows 768 --vocab 65 --width 128   # the baby GPT's character head
    python bench/loss_chunks.py --device cuda --rows 16384 --width 768 --compile   # GPT-2 124M's head, 16 x 1024

On CUDA the memory figure is the peak the allocator saw above the inputs (`torch.cuda.max_memory_allocated`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(way: str, rows: int, vocab: int, width: int, repeats: int, bf16: bool, device: str, compiled: bool) -> dict:
    """Median ms of one forward + backward, and how far the steps raised the process's peak resident
    memory above what the inputs took (MiB)."""
    import torch
    import torch.nn.functional as F

    from llm_trainer.loss import linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(rows, width, device=device, requires_grad=True)
    weight = (torch.randn(vocab, width, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=device)
    cuda = device.startswith("cuda")

    def loss_of(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            if way == "whole":
                return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
            return linear_cross_entropy(hidden, weight, targets)

    forward = torch.compile(loss_of) if compiled else loss_of

    def step() -> None:
        forward(hidden, weight, targets).backward()
        hidden.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()

    before = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()  # warm-up: allocator, kernels (and the compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grown = (peak - before) / 2**20
    return {"way": way, "ms": statistics.median(times), "peak_growth_mib": grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048, help="positions (B x T)")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--float32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the head + loss (both ways)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.rows, args.vocab, args.width, args.repeats, not args.float32, args.device, args.compile)
    if args.child:
        print(json.dumps(measure(args.child, *shape)))
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results: dict[str, list[dict]] = {"whole": [], "chunked": []}
    for _ in range(args.rounds):
        for way in ("whole", "chunked"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", way, *sys.argv[1:]],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            results[way].append(json.loads(out.stdout.splitlines()[-1]))
    ratios = [w["ms"] / c["ms"] for w, c in zip(results["whole"], results["chunked"])]
    summary = {
        "shape": {"rows": args.rows, "vocab": args.vocab, "width": args.width, "bf16": not args.float32},
        "device": args.device,
        "compiled": args.compile,
        "rounds": results,
        "whole_over_chunked_time": ratios,
        "peak_growth_mib": {way: max(r["peak_growth_mib"] for r in rs) for way, rs in results.items()},
        "load_average": os.getloadavg(),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
