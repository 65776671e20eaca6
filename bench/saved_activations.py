"""What autograd keeps for the backward, eager and with the whole model compiled.

    python bench/saved_activations.py [--device cpu|cuda] [--shapes gpt2,llama] [--batch 4] [--seq 128]
    python bench/saved_activations.py --device cuda --shapes gpt2-124m --batch 12 --seq 1024

`llm-trainer estimate` counts the activations an eager forward saves (tests/test_tools.py holds it
within 5% of them). With `training.compile: true` and no sharding the whole model and its loss are one
compiled graph, and the compiler's partitioner chooses what to keep and what to recompute in the
backward, so the peak moves (bench/README.md, "On an H100"). This measures that choice directly and
cheaply, without a training run: one forward + loss of each config, every tensor saved for the
backward counted once by its storage (parameters and buffers excluded), through
`torch.autograd.graph.saved_tensors_hooks`, which sees a compiled graph's saves too (the head's fp32
weight gradient, which the chunked loss keeps for the backward, included: a fixed size, not per token).

JSON in bench/out/saved_activations.json: per config, the bytes per token saved eager and compiled,
and compiled / eager.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpu_compare import GPT2, LLAMA_1B  # noqa: E402
from llm_trainer.config import ModelConfig  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402


def _model_overrides(overrides: list[str]) -> dict:
    """`model.KEY=VALUE` overrides (bench/gpu_compare.py's shapes) as ModelConfig fields."""
    return {k.removeprefix("model."): yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)}


GPT2_SMALL = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "gpt2-small.yaml").read_text())["model"]
SHAPES = {
    # 4 layers, 256 wide, the vocabulary of bench/estimate_check.py's configs
    "gpt2": dict(architecture="gpt2", d_model=256, n_heads=4, n_layers=4, vocab_size=4096, dropout=0.0),
    "llama": dict(architecture="llama", d_model=256, n_heads=4, n_kv_heads=2, n_layers=4, vocab_size=4096),
    # the GPU runs' shapes (bench/gpu_compare.py: configs/gpt2-small.yaml and its overrides): GPT-2 124M
    # as nanoGPT's, the 1.0B LLaMA
    "gpt2-124m": {**GPT2_SMALL, "vocab_size": 50257, **_model_overrides(GPT2)},
    "llama-1b": {**GPT2_SMALL, "vocab_size": 50257, **_model_overrides(LLAMA_1B)},
}


def saved_bytes(config: ModelConfig, device: str, amp: bool, compiled: bool, batch: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves in one forward + loss (after a warm-up step, so a
    compiled graph is built before it is measured)."""
    torch.manual_seed(0)
    model = Transformer(config).to(device).train()
    if compiled:
        model.compile()
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
        model(x, targets=y).backward()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            loss = model(x, targets=y)
    loss.backward()
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default="gpt2,llama", help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "saved_activations.json"))
    args = parser.parse_args()
    tokens = args.batch * args.seq
    rows = []
    print("| config | saved eager, bytes/token | saved compiled, bytes/token | compiled / eager |\n|---|---|---|---|")
    for name in args.shapes.split(","):
        config = ModelConfig(**{**SHAPES[name], "max_seq_len": args.seq})
        for amp in (False, True) if args.device == "cpu" else (True,):
            eager = saved_bytes(config, args.device, amp, False, args.batch, args.seq)
            compiled = saved_bytes(config, args.device, amp, True, args.batch, args.seq)
            row = {
                "config": f"{name} {'bf16' if amp else 'fp32'}",
                "eager_per_token": eager / tokens,
                "compiled_per_token": compiled / tokens,
                "compiled_over_eager": compiled / eager,
            }
            rows.append(row)
            print(
                f"| {row['config']} | {row['eager_per_token']:,.0f} | "
                f"{row['compiled_per_token']:,.0f} | {row['compiled_over_eager']:.2f} |",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"device": args.device, "batch": args.batch, "seq": args.seq, "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
