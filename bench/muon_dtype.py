"""What Muon's Newton-Schulz iterations cost in bf16 and in float32 on this CPU: one training step
(forward, backward, clip, Muon + AdamW) of our model as users get it (`training.optimizer: muon`, the
iterations in `optim.muon_iteration_dtype`'s choice) and with the iterations held to bf16, alternated
in one process.

    python bench/muon_dtype.py                  # widths 128 (the speedrun recipe's) and 256, ~2 min
    python bench/muon_dtype.py --widths 128 --steps 20

Context 64, batch 12, 4 layers, head size 32, float32 training (what `use_amp: auto` gives on a CPU
without native bf16). A CPU without AVX512-BF16 or AMX emulates bf16 matmuls, so the default there is
float32; on one that has them the default is bf16 and both columns time the same thing. Prints one
JSON object (also bench/out/muon_dtype.json): the CPU's bf16 support as torch detects it, the
default's dtype, the median milliseconds per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from cpu_bf16 import alternated_median_ms  # noqa: E402
from llm_trainer.config import ModelConfig, TrainingConfig  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402
from llm_trainer.parallel.distributed import DistInfo  # noqa: E402
from llm_trainer.parallel.strategies import Parallelism  # noqa: E402
from llm_trainer.resolve import cpu_computes_bf16  # noqa: E402
from llm_trainer.train.optim import build_optimizer, muon_iteration_dtype  # noqa: E402
from llm_trainer.train.step import autocast, train_step  # noqa: E402
from run_baby_gpt import emit_report, machine_info  # noqa: E402


def step_fn(width: int, iterations: torch.dtype | None):
    """One training step with Muon; `iterations` None: the default's dtype, else that dtype."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=67, d_model=width, n_heads=max(1, width // 32), n_layers=4, max_seq_len=64)
    model = Transformer(config)
    optimizer = build_optimizer(model, TrainingConfig(optimizer="muon"), torch.device("cpu"))
    if iterations is not None:
        optimizer.ns_dtype = iterations
    parallel = Parallelism(model, model, optimizer, dist=DistInfo(), device=torch.device("cpu"), amp_dtype=None)
    batch = (torch.randint(0, 67, (12, 64)), torch.randint(0, 67, (12, 64)))

    def step():
        float(train_step(parallel, [batch], autocast=autocast(torch.device("cpu"), None), max_grad_norm=1.0).loss)

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="128,256")  # at 512 a bf16 step takes minutes where it is emulated
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "muon_dtype.json"))
    args = parser.parse_args()
    results = []
    for width in (int(w) for w in args.widths.split(",")):
        steps = {"default": step_fn(width, None), "bf16": step_fn(width, torch.bfloat16)}
        ms = alternated_median_ms(steps, args.steps, warmup=1, per_round=1)
        row = {"d_model": width, "ms_per_step": ms, "bf16_over_default": round(ms["bf16"] / ms["default"], 2)}
        results.append(row)
        print(row, file=sys.stderr, flush=True)
    report = {
        "benchmark": "muon_dtype",
        "cpu_computes_bf16": cpu_computes_bf16(),
        "default_iterations": str(muon_iteration_dtype(torch.device("cpu"))).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "machine": machine_info(),
        "steps": results,
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
