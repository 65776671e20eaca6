"""How long a sharded (FSDP2) checkpoint stops the training loop: synchronous vs background saves.

Run under torchrun (2 CPU processes with gloo, or GPUs with NCCL):

    torchrun --nproc_per_node=2 bench/sharded_save_stall.py [--d-model 512 --layers 8 --vocab 8192 --repeats 3]

A Trainer with distributed_strategy fsdp around a LLaMA-shaped model whose AdamW state exists (one
step on random gradients) saves the same step three ways, each repeated and the best time kept:

  sync_s           checkpointer.save(background=False): every rank writes its DCP shards, rank 0
                   writes meta.json, renames the folder and replaces `latest`; the loop waits for all
  background_stall_s   checkpointer.save(background=True): how long the loop stops (DCP's copy of each
                   rank's shards into host memory, and the barriers)
  background_durable_s the same save until every rank's writer thread has finished (checkpoint
                   complete, `latest` replaced): how long until it is safe

Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.model import Transformer
from llm_trainer.parallel import distributed
from llm_trainer.train.trainer import Trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder, shared by the ranks)")
    args = parser.parse_args()

    base = Path(args.dir or os.path.join(tempfile.gettempdir(), "sharded_save_stall"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            architecture="llama",
            vocab_size=args.vocab,
            d_model=args.d_model,
            n_heads=max(1, args.d_model // 64),
            n_layers=args.layers,
            max_seq_len=128,
        )
    )
    params = sum(p.numel() for p in model.parameters())
    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    config = TrainingConfig(
        max_steps=1,
        device=device,
        checkpoint_dir=str(base),
        save_total_limit=None,
        report_to=[],
        progress_bar=False,
        distributed_strategy="fsdp",
        use_amp=False,
    )
    trainer = Trainer(model, config, train_dataloader=[batch])
    for p in trainer.parallel.params:  # Adam moments for every parameter, as after a training step
        p.grad = torch.randn_like(p) * 1e-3
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    checkpointer = trainer.checkpointer.__enter__()
    results: dict[str, list[float]] = {"sync_s": [], "background_stall_s": [], "background_durable_s": []}
    for repeat in range(args.repeats):
        trainer.state.step = 2 * repeat + 1
        distributed.barrier()
        start = time.perf_counter()
        checkpointer.save(background=False)
        results["sync_s"].append(time.perf_counter() - start)
        trainer.state.step = 2 * repeat + 2
        distributed.barrier()
        start = time.perf_counter()
        checkpointer.save(background=True)
        results["background_stall_s"].append(time.perf_counter() - start)
        checkpointer.wait_everywhere()
        results["background_durable_s"].append(time.perf_counter() - start)
    checkpointer.__exit__(None, None, None)
    if trainer.dist.is_main:
        report = {
            "benchmark": "sharded_save_stall",
            "world_size": trainer.dist.world_size,
            "device": device,
            "params": params,
            "repeats": args.repeats,
            "seconds": {k: round(min(v), 3) for k, v in results.items()},
            "all_seconds": {k: [round(x, 3) for x in v] for k, v in results.items()},
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        }
        print(json.dumps(report, indent=2))
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
