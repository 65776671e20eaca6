"""Muon's float32 iterations in their Gram form (what users get) against the direct iterations: the
time of one training step and of each stack the optimizer orthogonalizes, and how far each result is
from the direct iterations computed in float64.

    python bench/muon_gram.py                   # ~3 min on 2 cores
    python bench/muon_gram.py --widths 128 --steps 5 --rounds 2

Float32 iterations are what a CPU without native bf16 runs (`optim.muon_iteration_dtype`); there a
matrix at least `muon.GRAM_MIN_ASPECT` times as wide as tall takes the Gram form
(`muon.gram_newton_schulz`). The direct form is had by raising that threshold out of reach, which is
all that differs between the two columns. Training steps: forward, backward, clip, Muon + AdamW,
context 64, batch 12, 4 layers, float32; width 128 is the speedrun recipe's model
(`configs/speedrun-shakespeare.yaml`). Stacks: same-shape matrices as the optimizer stacks them (an
MLP's in and out matrices together), random values with singular values spread over three orders of
magnitude. Prints one JSON object (also bench/out/muon_gram.json): medians of alternated rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from cpu_bf16 import alternated_median_ms  # noqa: E402
from llm_trainer.config import ModelConfig, TrainingConfig  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402
from llm_trainer.parallel.distributed import DistInfo  # noqa: E402
from llm_trainer.parallel.strategies import Parallelism  # noqa: E402
from llm_trainer.train import muon  # noqa: E402
from llm_trainer.train.optim import build_optimizer  # noqa: E402
from llm_trainer.train.step import autocast, train_step  # noqa: E402
from run_baby_gpt import emit_report, machine_info  # noqa: E402

RECIPE = BENCH_DIR.parent / "configs" / "speedrun-shakespeare.yaml"
# (matrices, rows, cols): a stack the optimizer orthogonalizes at once, and what it is
STACKS = [
    ((8, 128, 512), "the speedrun recipe's MLP matrices (4 blocks, in and out)"),
    ((8, 128, 256), "an MLP twice as wide as the model"),
    ((8, 256, 1024), "GPT-2 style MLP at width 256"),
    ((6, 256, 682), "SwiGLU MLP at width 256 (8/3 wide)"),
    ((2, 768, 3072), "one GPT-2 124M block's MLP matrices"),
]


def direct_form(fn):
    """`fn` with every matrix taking the direct iterations."""

    def run():
        kept = muon.GRAM_MIN_ASPECT
        muon.GRAM_MIN_ASPECT = float("inf")
        try:
            return fn()
        finally:
            muon.GRAM_MIN_ASPECT = kept

    return run


def training_step(width: int):
    """One float32 training step with Muon; width 128 is the speedrun recipe's model."""
    torch.manual_seed(0)
    if width == 128:
        values = yaml.safe_load(RECIPE.read_text())["model"]
        config = ModelConfig(**{**values, "vocab_size": 128})
    else:
        config = ModelConfig(vocab_size=128, d_model=width, n_heads=width // 32, n_layers=4, max_seq_len=64)
    model = Transformer(config)
    optimizer = build_optimizer(model, TrainingConfig(optimizer="muon", use_amp=False), torch.device("cpu"))
    optimizer.ns_dtype = torch.float32
    parallel = Parallelism(model, model, optimizer, dist=DistInfo(), device=torch.device("cpu"), amp_dtype=None)
    batch = (torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64)))

    def step():
        float(train_step(parallel, [batch], autocast=autocast(torch.device("cpu"), None), max_grad_norm=1.0).loss)

    return step


def spread_stack(shape: tuple[int, int, int]) -> torch.Tensor:
    """A float64 stack whose singular values run from 1 down to 1e-3."""
    n, rows, cols = shape
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(n, rows, k, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, cols, k, dtype=torch.float64))[0]
    return (u * torch.logspace(0, -3, k, dtype=torch.float64)) @ v.mT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="128,256")
    parser.add_argument("--steps", type=int, default=15)  # a timing: this many steps
    parser.add_argument("--rounds", type=int, default=8)  # alternated timings of each (the machine's drift)
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "muon_gram.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    steps = []
    for width in (int(w) for w in args.widths.split(",")):
        step = training_step(width)
        ms = alternated_median_ms(
            {"gram": step, "direct": direct_form(step)}, args.steps, warmup=2, per_round=1, rounds=args.rounds
        )
        row = {"d_model": width, "ms_per_step": ms, "direct_over_gram": round(ms["direct"] / ms["gram"], 3)}
        steps.append(row)
        print(row, file=sys.stderr, flush=True)
    stacks = []
    for shape, what in STACKS:
        exact = spread_stack(shape)
        stack = exact.float()

        def orthogonalize(stack=stack):
            return muon.orthogonalize(stack, dtype=torch.float32)

        reps = max(1, 20 * 128**3 // (shape[1] ** 2 * shape[2]))
        ms = alternated_median_ms(
            {"gram": orthogonalize, "direct": direct_form(orthogonalize)}, reps, warmup=1, per_round=1
        )
        reference = muon.orthogonalize(exact, dtype=torch.float64)

        def error(result, reference=reference):
            return float((result.double() - reference).norm() / reference.norm())

        row = {
            "stack": list(shape),
            "what": what,
            "ms": ms,
            "direct_over_gram": round(ms["direct"] / ms["gram"], 3),
            "error_vs_float64": {"gram": error(orthogonalize()), "direct": error(direct_form(orthogonalize)())},
        }
        stacks.append(row)
        print(row, file=sys.stderr, flush=True)
    report = {
        "benchmark": "muon_gram",
        "gram_min_aspect": muon.GRAM_MIN_ASPECT,
        "threads": torch.get_num_threads(),
        "machine": machine_info(),
        "training_steps": steps,
        "stacks": stacks,
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
