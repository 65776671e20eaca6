"""Where the time goes in one training step of the baby-GPT setting on CPU (torch.profiler).

    python bench/profile_cpu.py [--steps 100] [--optimizer fused|foreach]

Runs our Trainer on the Tiny Shakespeare setting and groups the profiler's self CPU time by kind of
work. `--optimizer foreach` reproduces the state before the switch to fused AdamW.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shakespeare  # noqa: E402
from llm_trainer.config import ModelConfig, TrainingConfig  # noqa: E402
from llm_trainer.data.batches.loader import BatchLoader, WindowRows  # noqa: E402
from llm_trainer.model import Transformer  # noqa: E402
from llm_trainer.train import optim  # noqa: E402
from llm_trainer.train.trainer import Trainer  # noqa: E402

GROUPS = [  # (group, substrings of aten op names), first match wins
    ("optimizer", ("adam", "_foreach", "lerp", "addcdiv", "addcmul")),
    ("matmul", ("addmm", "aten::mm", "bmm", "matmul", "linear")),
    ("attention", ("scaled_dot_product", "_flash", "attention")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss")),
    ("norm", ("layer_norm", "rms_norm")),
    ("activation", ("gelu", "silu")),
    ("embedding", ("embedding",)),
    ("grad clipping", ("norm", "clamp", "stack")),
    ("data", ("from_numpy", "copy_", "to")),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--optimizer", choices=["fused", "foreach"], default="fused")
    args = parser.parse_args()

    data = shakespeare.load_data()
    torch.manual_seed(1337)
    model = Transformer(
        ModelConfig(
            architecture="gpt2", vocab_size=len(data.chars) + 2, d_model=128, n_heads=4, n_layers=4, max_seq_len=64
        )
    )
    if args.optimizer == "foreach":  # the state before: foreach AdamW on CPU
        original = optim.build_optimizer

        def foreach_optimizer(model, config, device):
            opt = original(model, config, torch.device("meta"))
            return torch.optim.AdamW(opt.param_groups, lr=config.learning_rate, foreach=True)

        import llm_trainer.train.trainer as trainer_module

        trainer_module.build_optimizer = foreach_optimizer
    import numpy as np

    tokens = np.asarray(data.train_ids, dtype=np.uint16)
    config = TrainingConfig(
        batch_size=12,
        max_steps=args.steps,
        learning_rate=1e-3,
        eval_steps=0,
        save_steps=0,
        logging_steps=50,
        device="cpu",
        report_to=[],
        progress_bar=False,
        output_dir="/tmp/profile_cpu",
        save_total_limit=1,
    )
    trainer = Trainer(
        model, config, train_dataloader=BatchLoader(WindowRows(tokens, 64, seed=0), 12, shuffle=True, seed=0)
    )
    trainer.checkpointer.save = lambda background=False: None  # profile the loop, not the final save
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        name = event.key.lower()
        group = next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")
        totals[group] += event.self_cpu_time_total
    whole = sum(totals.values())
    print(
        json.dumps(
            {
                "optimizer_impl": args.optimizer,
                "steps": args.steps,
                "ms_per_step": round(whole / 1000 / args.steps, 2),
                "share": {k: round(v / whole, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            }
        )
    )


if __name__ == "__main__":
    main()
