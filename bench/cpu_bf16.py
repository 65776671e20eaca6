"""Where bfloat16 autocast pays on this CPU: one training step (forward, backward, clip, AdamW) of our
model in float32 and under `training.use_amp` (bf16), at several widths, alternated in one process.

    python bench/cpu_bf16.py                  # widths 64..512, GPT-2 and LLaMA blocks, ~2 min
    python bench/cpu_bf16.py --widths 128 --steps 20

Context 64, batch 12, 4 layers, head size 32 (nanoGPT's baby GPT at width 128). Also times attention
alone in bf16: SDPA's CPU kernel against the explicit softmax(q k^T) v the model uses when training in
bf16 on a CPU. Prints one JSON object (also bench/out/cpu_bf16.json) with the CPU's bf16 support as
torch detects it, the median milliseconds per step and the bf16 / float32 ratio (< 1: bf16 is faster).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from llm_trainer.config import ModelConfig, TrainingConfig  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402
from llm_trainer.parallel.distributed import DistInfo  # noqa: E402
from llm_trainer.parallel.strategies import Parallelism  # noqa: E402
from llm_trainer.resolve import cpu_computes_bf16  # noqa: E402
from llm_trainer.train.optim import build_optimizer  # noqa: E402
from llm_trainer.train.step import autocast, train_step  # noqa: E402
from run_baby_gpt import emit_report, machine_info  # noqa: E402


def median_ms(fn, steps: int, rounds: int = 5) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps * 1000)
    return times


def alternated_median_ms(fns: dict, steps: int, *, warmup: int, per_round: int, rounds: int = 3) -> dict:
    """{name: median ms per call} of each function, after `warmup` calls each, timed in `rounds` alternated
    rounds (A B A B ...) of `per_round` timings of `steps` calls, so a drift of the machine shows in all."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += median_ms(fn, steps, rounds=per_round)
    return {name: round(sorted(t)[len(t) // 2], 2) for name, t in times.items()}


def step_fn(architecture: str, width: int, amp: bool):
    torch.manual_seed(0)
    config = ModelConfig(
        architecture=architecture, vocab_size=67, d_model=width, n_heads=max(1, width // 32), n_layers=4, max_seq_len=64
    )
    model = Transformer(config)
    optimizer = build_optimizer(model, TrainingConfig(), torch.device("cpu"))
    dtype = torch.bfloat16 if amp else None
    parallel = Parallelism(model, model, optimizer, dist=DistInfo(), device=torch.device("cpu"), amp_dtype=dtype)
    mixed = autocast(torch.device("cpu"), dtype)
    batch = (torch.randint(0, 67, (12, 64)), torch.randint(0, 67, (12, 64)))

    def step():
        float(train_step(parallel, [batch], autocast=mixed, max_grad_norm=1.0).loss)

    return step


def attention_ms(steps: int) -> dict:
    from llm_trainer.model import _explicit_attention

    q, k, v = (torch.randn(12, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    kernels = {"sdpa": F.scaled_dot_product_attention, "explicit": _explicit_attention}
    out = {}
    for name, attend in kernels.items():

        def run(attend=attend):
            attend(q, k, v, is_causal=True).float().sum().backward()

        run()
        out[name] = round(sorted(median_ms(run, steps))[2], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="64,128,256,512")
    parser.add_argument("--architectures", default="gpt2,llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "cpu_bf16.json"))
    args = parser.parse_args()
    results = []
    for architecture in args.architectures.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            steps = {"float32": step_fn(architecture, width, False), "bf16": step_fn(architecture, width, True)}
            ms = alternated_median_ms(steps, args.steps, warmup=3, per_round=2)
            row = {
                "architecture": architecture,
                "d_model": width,
                "ms_per_step": ms,
                "bf16_over_float32": round(ms["bf16"] / ms["float32"], 3),
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report = {
        "benchmark": "cpu_bf16",
        "cpu_computes_bf16": cpu_computes_bf16(),
        "threads": torch.get_num_threads(),
        "machine": machine_info(),
        "steps": results,
        "attention_bf16_ms": attention_ms(args.steps),
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
