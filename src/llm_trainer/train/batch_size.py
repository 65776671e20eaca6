"""`training.batch_size: auto` made a number, from the memory estimate (`memory_estimate`) and, in one
process, the measured peak of one real step (`memory_probe`, run in a fresh process). The pipeline
resolves a run with it (`Trainer.from_config`, the LR finder); `llm-trainer estimate` shows its pick."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..config import ModelConfig, TrainingConfig
from ..errors import UsageError
from ..logs import log
from ..parallel.mesh import Layout, microbatch_count
from .memory_estimate import GiB, configured_sharding, estimate_memory, max_batch_size


def device_budget_gb(training: TrainingConfig, device: torch.device) -> tuple[float, str]:
    """The memory `batch_size: auto` fills, in GiB, and where the figure comes from: training.device_memory,
    else what the device has free now (a GPU's free memory; on a CPU, the machine's available memory)."""
    if training.device_memory is not None:
        return training.device_memory, "training.device_memory"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / GiB, f"free on {device}"
    from ..limits import available_memory

    available = available_memory()
    if available is None:
        raise UsageError("training.batch_size auto cannot read this machine's free memory; set training.device_memory")
    return available / GiB, "available on this machine"


def auto_batch_size(
    model_config: ModelConfig,
    training: TrainingConfig,
    seq_len: int,
    world_size: int,
    device: torch.device,
    *,
    probe: bool = True,
) -> TrainingConfig:
    """`batch_size: auto` made a number: the largest micro-batch whose peak fits the device's budget and
    that divides the global batch (`total_batch_tokens` = micro-batch x sequence length x accumulation x
    data-parallel processes, `world_size`), so accumulation makes up the rest and the global batch stays
    what was asked. Under pipeline parallelism the peak is the largest stage's (each holds its layers and
    its micro-batches in flight), and the micro-batch must split into the pipeline's micro-batches.

    The estimate picks; with `probe` (one process), one real training step at that size in a fresh process
    (`memory_probe`) measures its peak, and where the measurement is above the estimate the estimates are
    scaled by that ratio to pick again. One step, never a loop of failed runs and restarts."""
    if training.batch_size != "auto":
        return training
    sharding = configured_sharding(training)
    layout = model_parallel_layout(training, world_size, sharding)
    if layout.world_size > 1 and training.device_memory is None:  # each rank's free memory differs: all must pick alike
        raise UsageError(
            "training.batch_size auto over several processes needs training.device_memory (GiB), one budget "
            "every process picks the same micro-batch from"
        )
    budget, source = device_budget_gb(training, device)
    options = dict(seq_len=seq_len, world_size=layout.world_size, sharding=sharding, layout=layout)
    options["device_type"] = device.type

    def peak(batch: int) -> float:
        return estimate_memory(model_config, training, batch_size=batch, **options).peak_bytes / GiB

    pieces = microbatch_count(training, layout.pp) if layout.pp > 1 else 1  # a pipeline splits each micro-batch
    rows, rest = divmod(training.total_batch_tokens, seq_len * world_size)
    divisors = [b for b in range(rows, 0, -1) if not rest and rows % b == 0 and b % pieces == 0]
    fitting = [b for b in divisors if peak(b) <= budget]
    if not fitting:
        largest = max_batch_size(model_config, dataclasses.replace(training, batch_size=1), budget, **options)
        split = f", in multiples of the {pieces} pipeline micro-batches" if pieces > 1 else ""
        raise UsageError(
            f"training.batch_size auto: no micro-batch fits {budget:.2f} GiB ({source}) and divides "
            f"total_batch_tokens {training.total_batch_tokens:,} into rows of {seq_len} x {world_size} process(es)"
            f"{split} (largest that fits: {largest}); use a smaller model or sequence, gradient_checkpointing, more "
            "memory (training.device_memory), or a total_batch_tokens that is a multiple of the sequence length"
        )
    batch, measured = fitting[0], ""
    if probe and layout.world_size == 1 and device.type in ("cpu", "cuda"):
        measured_gb = _probe_peak(model_config, training, batch, seq_len, device)
        ratio = max(1.0, measured_gb / peak(batch))  # an estimate below the measurement: all scaled up by as much
        measured = f", {measured_gb:.3g} measured in one step of {batch}"
        fitting = [b for b in fitting if ratio * peak(b) <= budget]
        if not fitting:
            raise UsageError(
                f"training.batch_size auto: one step of {batch} rows measured {ratio * peak(batch):.2f} GiB, over "
                f"{budget:.2f} GiB ({source}), and no smaller micro-batch divides the global batch; use a smaller "
                "model or sequence, gradient_checkpointing, or more memory (training.device_memory)"
            )
        batch = fitting[0]
    log(
        f"batch_size auto: {batch} rows a micro-batch (estimated peak {peak(batch):.3g} of {budget:.3g} GiB "
        f"{source}{measured}), x {rows // batch} accumulation x {world_size} data-parallel process(es) keeps "
        f"total_batch_tokens {training.total_batch_tokens:,}"
    )
    return dataclasses.replace(training, batch_size=batch)


def model_parallel_layout(training: TrainingConfig, data_parallel: int, sharding: str) -> Layout:
    """The layout the estimate counts: `data_parallel` processes (sharded as `sharding` says, as
    `estimate_memory` counts them without a layout), each replica `training`'s tensor, pipeline and
    context degrees wide."""
    dp = {"dp_shard": data_parallel} if sharding != "none" else {"dp_replicate": data_parallel}
    return Layout(
        **dp,
        pp=training.pipeline_parallel_degree,
        cp=training.context_parallel_degree,
        tp=training.tensor_parallel_degree,
    )


def _probe_peak(model_config: ModelConfig, training: TrainingConfig, batch: int, seq_len: int, device) -> float:
    """The measured peak (GiB) of one training step at `batch` rows, in a fresh process on `device`."""

    model = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.name != "init_from"}
    keep = ("use_amp", "amp_dtype", "optimizer", "gradient_checkpointing", "sgd_momentum", "sdpa_backend")
    run = {name: getattr(training, name) for name in keep} | {"batch_size": batch, "max_steps": 1}
    try:
        result = measure_peak(model, run | {"device": str(device)}, seq_len)
    except (RuntimeError, OSError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"training.batch_size auto: the probe step of {batch} rows failed ({reason[:300]}); "
            "set training.device_memory lower, or a number for batch_size"
        ) from None
    return result["peak_bytes"] / GiB


MMAP_THRESHOLD = 65536


def measure_peak(model: dict, training: dict, seq_len: int, timeout: float = 600) -> dict:
    """Run `train/memory_probe.py` in a fresh process; returns its JSON result. Each allocation of
    MMAP_THRESHOLD bytes or more gets its own mmap there, so a freed tensor leaves the peak it made."""
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    payload = json.dumps({"model": model, "training": training, "seq_len": seq_len})
    done = subprocess.run(
        [sys.executable, "-m", "llm_trainer.train.memory_probe", payload],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
