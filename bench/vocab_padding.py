"""Training steps (forward, backward, AdamW) of one small model at GPT-2's 50,257-token vocabulary,
unpadded (`model.vocab_pad_multiple: 1`) against padded to 50,304 rows (the default, 128): the same
weights on the real rows, the head multiplying every row, the padding columns masked in the loss.
Both models live in one process and alternate, round after round, so a shared machine's load falls
on both alike. JSON on stdout: each round's tokens/s per variant and the median ratio padded /
unpadded.

    python bench/vocab_padding.py                               # CPU, width 128, 2 layers, 4 x 128 tokens
    python bench/vocab_padding.py --device cuda --width 768 --layers 12 --batch 16 --seq 1024 --bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llm_trainer.config import ModelConfig
from llm_trainer.model import Transformer


def build(multiple: int, args: argparse.Namespace) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=args.vocab,
        vocab_pad_multiple=multiple,
        d_model=args.width,
        n_heads=max(1, args.width // 64),
        n_layers=args.layers,
        max_seq_len=args.seq,
    )
    model = Transformer(config).to(args.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def steps(model: Transformer, optimizer: torch.optim.Optimizer, batches, args: argparse.Namespace) -> float:
    """tokens/s over `args.steps` training steps."""
    device = torch.device(args.device)
    start = time.perf_counter()
    for x, y in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(x, targets=y) / y.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return args.steps * args.batch * args.seq / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device) for _ in range(2))
        for _ in range(args.steps)
    ]
    variants = {"unpadded": build(1, args), "padded": build(128, args)}
    for model, optimizer in variants.values():  # warm-up: allocator, kernels
        steps(model, optimizer, batches[:1], argparse.Namespace(**{**vars(args), "steps": 1}))
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            rounds[name].append(steps(*variants[name], batches, args))
    ratios = [p / u for p, u in zip(rounds["padded"], rounds["unpadded"], strict=True)]
    print(
        json.dumps(
            {
                "args": vars(args),
                "tokens_per_s": rounds,
                "median_ratio_padded_over_unpadded": statistics.median(ratios),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
