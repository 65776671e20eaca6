"""What a mid-epoch resume costs, early, in the middle and late in an epoch.

A memory-mapped token file (--tokens uint16 tokens, default 200M: 400 MB) is cut into rows of
--length tokens, read in a seeded shuffled order in batches of --batch-size; a small model trains on
it. For each position (a fraction of the epoch), a checkpoint is saved there with that data position,
then measured:

  resume_s   a fresh Trainer restores the checkpoint (`Checkpointer.load`: files verified, model,
             optimizer, RNG, data position) and reads the first batch after the position: what a
             resume costs before its first step
  seek_s     the data part alone: a fresh loader seeks to the position and reads that batch
  replay_s   what a loader that cannot seek pays instead: a fresh loader reads and discards every
             batch before the position, then reads that batch (the generic-iterable path)

Each is the best of --repeats. resume_s and seek_s should not depend on the position; replay_s
grows with it. One JSON object on stdout and in bench/out/resume_cost.json.

    python bench/resume_cost.py [--tokens 200000000] [--repeats 3] [--dir /tmp/resume_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.data.batches.loader import BatchLoader, WindowRows
from llm_trainer.model import Transformer
from llm_trainer.train.trainer import Trainer

FRACTIONS = (0.05, 0.5, 0.95)


def _tokens(folder: Path, n: int) -> np.ndarray:
    path = folder / f"tokens-{n}.u16"
    if not path.exists() or path.stat().st_size != 2 * n:
        chunk = 1 << 24
        with open(path, "wb") as handle:
            rng = np.random.default_rng(0)
            for start in range(0, n, chunk):
                rng.integers(0, 256, size=min(chunk, n - start), dtype=np.uint16).tofile(handle)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _trainer(tokens: np.ndarray, args, output: Path, max_steps: int | None = None) -> Trainer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=256, d_model=64, n_heads=2, n_layers=2, max_seq_len=args.length))
    loader = BatchLoader(WindowRows(tokens, args.length), args.batch_size, shuffle=True, seed=0)
    config = TrainingConfig(
        output_dir=str(output),
        device="cpu",
        progress_bar=False,
        report_to=[],
        max_steps=max_steps or 10 * loader.batches_per_epoch(),
        batch_size=args.batch_size,
        async_checkpoint=False,
    )
    return Trainer(model, config, train_dataloader=loader)


def _best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000_000)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/resume_bench")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "resume_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = _tokens(folder, args.tokens)
    shutil.rmtree(folder / "run", ignore_errors=True)

    writer = _trainer(tokens, args, folder / "run", max_steps=1)
    batches = writer.train_loader.batches_per_epoch()
    writer.train()  # one real step, so the optimizer has state to save
    checkpoints = []
    for fraction in FRACTIONS:
        position = int(fraction * batches)
        samples = position * args.batch_size
        writer.train_loader.load_state_dict(
            {"epoch": 0, "epoch_samples": samples, "seed": 0, "global_batch": args.batch_size}
        )
        writer.state.step = position  # the checkpoint's name; the loop's counters are not used here
        checkpoints.append((fraction, position, samples, writer.save_checkpoint()))

    rows = []
    for fraction, position, samples, path in checkpoints:
        expected = None

        def resume(path=path) -> None:
            nonlocal expected
            trainer = _trainer(tokens, args, folder / "resumed")
            trainer.checkpointer.load(str(path))
            expected = trainer.train_loader.next_batch()[0]

        def seek(samples=samples) -> None:
            loader = BatchLoader(WindowRows(tokens, args.length), args.batch_size, shuffle=True, seed=0)
            loader.load_state_dict({"epoch": 0, "epoch_samples": samples, "seed": 0, "global_batch": args.batch_size})
            loader.next_batch()

        replayed = None

        def replay(position=position) -> None:
            nonlocal replayed
            loader = BatchLoader(WindowRows(tokens, args.length), args.batch_size, shuffle=True, seed=0)
            for _ in range(position):
                loader.next_batch()
            replayed = loader.next_batch()[0]

        row = {
            "fraction_of_epoch": fraction,
            "batch": position,
            "samples": samples,
            "resume_s": _best(resume, args.repeats),
            "seek_s": _best(seek, args.repeats),
            "replay_s": _best(replay, args.repeats),
        }
        assert torch.equal(expected, replayed), "the seek and the replay read different batches"
        rows.append(row)

    result = {
        "benchmark": "resume_cost",
        "tokens": args.tokens,
        "rows_per_epoch": len(WindowRows(tokens, args.length)),
        "batches_per_epoch": batches,
        "batch_size": args.batch_size,
        "length": args.length,
        "repeats": args.repeats,
        "positions": rows,
        "resume_s_spread": max(r["resume_s"] for r in rows) - min(r["resume_s"] for r in rows),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
