"""Checkpoint I/O against the raw speed of safetensors, at GPT-2-small size.

A GPT-2-small shaped model (our Transformer, the gpt2-small preset, vocab 50257: 124M parameters)
and its AdamW state after one step (exp_avg and exp_avg_sq: 2 x 124M more floats) are written and
read back three ways:

  ours        checkpoint.save_checkpoint (atomic: temp folder, checksums, fsync, rename, `latest`)
              and resolve_checkpoint + load_checkpoint (checksums verified, optimizer through the
              weights_only loader) -- everything a resume does with the files
  ours_background_stall   a Trainer's background save (training.async_checkpoint, the default):
              how long the training thread stops -- copying model and optimizer state to host
              memory and handing it to the writer thread
  ours_background_durable the same save until its writer thread has finished (fsynced, renamed,
              `latest` updated): how long until it is safe
  raw         the same tensors written with one safetensors.torch.save_file call and read with one
              load_file call: no checksums, no fsync, no atomic rename (the floor)
  raw_fsync   raw plus one fsync of the file (what any durable write has to pay)
  raw_read    one sequential read of every byte of the raw file (load_file only maps the file, so
              raw_load reads nothing; a load that verifies checksums cannot beat reading each byte)
  raw_load_touch  load_file, then every byte of every tensor read once (hashed with XXH3, which runs
              at memory speed: the cheapest way to read each byte from Python, and a torch sum is
              ~20x slower): the raw equivalent of a verified load, which must read each byte

Ratios are printed against each baseline. `ratio_stall_vs_raw` is what a training run feels: the
time it stops for a checkpoint against one save_file call. `ratio_save_vs_raw` and `ratio_load_vs_raw` are the
issue's literal target (one save_file / load_file call), but neither does what a checkpoint must:
save_file leaves the bytes in the page cache (not on disk: a power cut loses them) and load_file
maps the file without reading it (a flipped bit goes unnoticed). `ratio_save_vs_raw_fsync` and
`ratio_load_vs_raw_touch` compare with raw calls that do the same physical work as ours (put the
bytes on disk; read every byte): those are the fair ratios. `fsync_floor_vs_raw` (raw_fsync_save /
raw_save) shows how far the literal save target is out of reach of any durable write.

Each is repeated (--repeats) and the best time is kept. Prints one JSON object:
times in seconds, the bytes written, and ratios ours/raw (the target is <= 1.3).

    python bench/checkpoint_io.py [--repeats 3] [--dir /tmp/ckpt_bench] [--vocab 50257]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from llm_trainer.checkpoint import layout, local
from llm_trainer.checkpoint.find import resolve_checkpoint
from llm_trainer.config import ModelConfig
from llm_trainer.model import Transformer


def build(vocab: int) -> tuple[Transformer, torch.optim.Optimizer]:
    """The gpt2-small preset shape, and AdamW after one step on random gradients."""
    torch.manual_seed(0)
    config = ModelConfig(
        architecture="gpt2", vocab_size=vocab, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024
    )
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def background_checkpointer(model: Transformer, root: Path):
    """The Checkpointer of a Trainer around a copy of the model (one dummy batch) with its optimizer's
    state, saving to `root`, with its writer thread running and host buffers reserved."""
    from llm_trainer.config import TrainingConfig
    from llm_trainer.train.trainer import Trainer

    batch = (torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    config = TrainingConfig(
        max_steps=1, device="cpu", checkpoint_dir=str(root), save_total_limit=None, report_to=[], progress_bar=False
    )
    trainer = Trainer(model, config, train_dataloader=[batch])
    for p in model.parameters():  # Adam moments for every parameter, as after a training step
        p.grad = torch.randn_like(p) * 1e-3
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    checkpointer = trainer.checkpointer.__enter__()  # what train() does: the writer thread starts
    checkpointer.poll()  # what train() does after its first step: host buffers allocated ahead
    checkpointer.wait()
    return checkpointer


def flat_tensors(model: torch.nn.Module, optimizer_state: dict) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, under unique names, for the single raw safetensors file."""
    from llm_trainer.checkpoint.model_folder import model_state_dict

    out = {f"model.{k}": v for k, v in model_state_dict(model).items()}
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"optimizer.{index}.{key}"] = value.contiguous()
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn) -> float:
    """Seconds fn takes, started with no dirty pages in the page cache (else the kernel may throttle
    this write for data an earlier one left behind, and the order of the runs would decide)."""
    if hasattr(os, "sync"):
        os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--vocab", type=int, default=50257)
    args = parser.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    base.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, optimizer = build(args.vocab)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    opt_state = optimizer.state_dict()
    tensors = flat_tensors(model, opt_state)
    n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

    root = base / "checkpoints"
    raw_file = base / "raw.safetensors"
    results: dict[str, list[float]] = {
        k: []
        for k in (
            "ours_save",
            "ours_load",
            "raw_save",
            "raw_load",
            "raw_load_touch",
            "raw_read",
            "raw_fsync_save",
            "ours_background_stall",
            "ours_background_durable",
        )
    }
    checkpointer = background_checkpointer(copy.deepcopy(model), base / "background")

    def ours_save():
        local.save_checkpoint(
            root,
            1,
            model=model,
            optimizer_state=opt_state,
            train_state={"step": 1},
            rng_tensors={"torch": torch.get_rng_state()},
            config={"bench": True},
            tokenizer_json=None,
        )

    def ours_load():
        path = resolve_checkpoint("latest", root)
        parts = local.load_checkpoint(path)
        assert len(parts["model"]) > 0 and len(parts["optimizer"]["state"]) > 0

    def raw_save():
        save_file(tensors, str(raw_file))

    def raw_fsync_save():
        save_file(tensors, str(raw_file))
        _fsync(raw_file)

    def raw_load():
        assert len(load_file(str(raw_file))) == len(tensors)

    def raw_load_touch():
        loaded = load_file(str(raw_file))
        for tensor in loaded.values():  # read every byte once, at memory speed (XXH3 beats a torch sum)
            xxhash.xxh3_64_intdigest(tensor.reshape(-1).view(torch.uint8).numpy())
        assert len(loaded) == len(tensors)

    def raw_read():
        buffer = memoryview(bytearray(1 << 20))
        with open(raw_file, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass

    def ours_background():
        start = time.perf_counter()
        checkpointer.save(background=True)
        stalled = time.perf_counter() - start
        checkpointer.wait()
        return stalled, time.perf_counter() - start

    # Every timed write starts right after the same amount of data was deleted: on a VM, writing into
    # freshly freed page-cache memory is much faster than into memory new to the guest, and the
    # order of the runs must not decide the comparison.
    for _ in range(args.repeats):
        shutil.rmtree(root, ignore_errors=True)
        raw_file.unlink(missing_ok=True)
        results["raw_save"].append(timed(raw_save))
        results["raw_load"].append(timed(raw_load))
        results["raw_load_touch"].append(timed(raw_load_touch))
        results["raw_read"].append(timed(raw_read))
        raw_file.unlink(missing_ok=True)
        results["raw_fsync_save"].append(timed(raw_fsync_save))
        raw_file.unlink(missing_ok=True)
        results["ours_save"].append(timed(ours_save))
        results["ours_load"].append(timed(ours_load))
        shutil.rmtree(base / "background", ignore_errors=True)
        if hasattr(os, "sync"):
            os.sync()
        stall, durable = ours_background()
        results["ours_background_stall"].append(stall)
        results["ours_background_durable"].append(durable)

    best = {k: min(v) for k, v in results.items()}
    checkpointer.__exit__(None, None, None)
    checkpoint_bytes = sum(p.stat().st_size for p in layout.list_checkpoints(root)[0].iterdir())
    report = {
        "benchmark": "checkpoint_io",
        "params": n_params,
        "tensor_bytes": n_bytes,
        "checkpoint_bytes": checkpoint_bytes,
        "repeats": args.repeats,
        "build_s": round(build_s, 2),
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "all_seconds": {k: [round(x, 3) for x in v] for k, v in results.items()},
        "ratio_save_vs_raw": round(best["ours_save"] / best["raw_save"], 3),
        "ratio_save_vs_raw_fsync": round(best["ours_save"] / best["raw_fsync_save"], 3),
        "ratio_stall_vs_raw": round(best["ours_background_stall"] / best["raw_save"], 3),
        "ratio_background_durable_vs_raw_fsync": round(best["ours_background_durable"] / best["raw_fsync_save"], 3),
        "ratio_load_vs_raw": round(best["ours_load"] / best["raw_load"], 3),
        "ratio_load_vs_raw_touch": round(best["ours_load"] / best["raw_load_touch"], 3),
        "ratio_load_vs_raw_read": round(best["ours_load"] / best["raw_read"], 3),
        "fsync_floor_vs_raw": round(best["raw_fsync_save"] / best["raw_save"], 3),
        "target": 1.3,
        "save_GB_per_s": round(n_bytes / best["ours_save"] / 1e9, 3),
        "load_GB_per_s": round(n_bytes / best["ours_load"] / 1e9, 3),
        "directory": str(base),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "checkpoint_module": local.__file__,
    }
    print(json.dumps(report, indent=2))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
