"""What per-layer statistics (`training.layer_stats_steps`) cost: one optimizer step with and without them.

    python bench/layer_stats_cost.py                      # baby GPT and a wider model, on this machine's device
    python bench/layer_stats_cost.py --device cuda --shape gpt2-small

Each round times `--steps` plain steps, steps that collect the norms only (`train_step` with the
LayerStats hooks, the row read back to the host: `norms_cost_ms`) and steps that also compute the
histograms (what TensorBoard or W&B as a backend adds: `stats_cost_ms`), alternated one by one on the
same model, optimizer and batch, after `--warmup` steps. Costs are medians minus the plain median;
`share_every_100` = stats_cost_ms / (100 x median plain step): the share of step time the statistics
take when logged every 100 steps. One JSON object on stdout and in bench/out/layer_stats_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "src"))

from llm_trainer.config import ModelConfig, TrainingConfig  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402
from llm_trainer.train.layer_stats import LayerStats  # noqa: E402
from llm_trainer.train.step import train_step  # noqa: E402
from llm_trainer.train.trainer import Trainer  # noqa: E402

SHAPES = {
    "baby-gpt": dict(d_model=128, n_heads=4, n_layers=4, max_seq_len=64, vocab_size=65, batch=12),
    "wide": dict(d_model=512, n_heads=8, n_layers=8, max_seq_len=128, vocab_size=8192, batch=8),
    "gpt2-small": dict(d_model=768, n_heads=12, n_layers=12, max_seq_len=1024, vocab_size=50304, batch=8),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(shape: str, device: str, steps: int, warmup: int) -> dict:
    values = dict(SHAPES[shape])
    batch = values.pop("batch")
    model = Transformer(ModelConfig(**values))
    config = TrainingConfig(device=device, output_dir=str(BENCH_DIR / "out" / "layer_stats_run"), max_steps=1)
    trainer = Trainer(model, config)
    parallel, dev = trainer.parallel, trainer.device
    tokens = torch.randint(0, values["vocab_size"], (batch, values["max_seq_len"] + 1), device=dev)
    micro = [(tokens[:, :-1], tokens[:, 1:])]
    stats = LayerStats(trainer.model, 1, histograms=True)

    def step(with_stats: bool) -> float:
        _sync(dev)
        start = time.perf_counter()
        out = train_step(
            parallel,
            micro,
            autocast=trainer.autocast,
            max_grad_norm=1.0,
            inspect=stats.before_step if with_stats else None,
        )
        if with_stats:
            stats.after_step(1)  # the row, read back to the host
            stats.histograms(1)  # computed and read back when kept (drawing them is the backend's)
        float(out.loss)  # both sides read the loss (what logging does)
        _sync(dev)
        return time.perf_counter() - start

    for i in range(warmup):
        step(i % 2 == 1)
    plain, with_stats, norms_only = [], [], []
    for _ in range(steps):
        plain.append(step(False))
        with_stats.append(step(True))
        stats.keep_values = False
        norms_only.append(step(True))
        stats.keep_values = True
    base = statistics.median(plain)
    cost = statistics.median(with_stats) - base
    norms = statistics.median(norms_only) - base
    return {
        "shape": shape,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "groups": len(stats.groups),
        "step_ms": 1000 * base,
        "norms_cost_ms": 1000 * norms,
        "stats_cost_ms": 1000 * cost,
        "share_every_100": cost / (100 * base),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", nargs="+", default=["baby-gpt", "wide"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=6)
    args = parser.parse_args()
    results = [measure(shape, args.device, args.steps, args.warmup) for shape in args.shape]
    out = BENCH_DIR / "out" / "layer_stats_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
