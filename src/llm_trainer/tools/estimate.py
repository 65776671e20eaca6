"""`llm-trainer estimate`: parameters, FLOPs and the memory of a training run, before it starts, as a
report: the run's layout resolved as a run would resolve it, its per-device memory, whether it fits,
what to change when it does not, and the layout a cluster of a given size should use
(`tools.layout_advice`). The memory model is `train.memory_estimate` (how it counts, and how it is
checked against the measured peak); `batch_size: auto`'s pick is `train.batch_size`'s. `compare` sets
the estimate beside the measured peak of the configs it is checked on.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import resolve
from ..config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
from ..data.format import PreparedData
from ..data.prepare.build import data_fingerprint
from ..data.prepare.run import find_prepared
from ..data.text.sources import reads_a_store
from ..errors import UsageError
from ..parallel.mesh import Layout, resolve_layout
from ..resolve import activation_checkpointing, sequence_length
from ..train.batch_size import auto_batch_size, measure_peak
from ..train.flops import count_parameters, flops_per_token
from ..train.memory_estimate import SHARDING, GiB, configured_sharding, estimate_memory, max_batch_size
from .layout_advice import advise_layout as advise
from .layout_advice import format_advice


def check_flags(
    *, world_size: int, vocab_size: int | None, batch_size: int | None, device_memory_gb: float | None
) -> None:
    """The numbers `llm-trainer estimate` is given, each in its range (a one-line error naming the flag)."""
    for flag, value in (("--world-size", world_size), ("--vocab-size", vocab_size), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if device_memory_gb is not None and not (math.isfinite(device_memory_gb) and device_memory_gb > 0):
        raise UsageError(f"--device-memory must be a positive number of GiB, got {device_memory_gb}")


def estimate_report(
    experiment: ExperimentConfig,
    *,
    world_size: int | None = None,
    sharding: str | None = None,
    device_memory_gb: float | None = None,
    vocab_size: int | None = None,
    batch_size: int | None = None,
    gradient_checkpointing: bool | None = None,
    nodes: int | None = None,
    gpus_per_node: int = 8,
    advise_layout: bool = False,
    config: str = "CONFIG",
) -> dict:
    """Everything `llm-trainer estimate` prints, as a dict (bytes and FLOPs as numbers). `world_size` and
    `sharding` default to what the config runs (training.world_size, its distributed strategy); `nodes`
    makes the world `nodes` x `gpus_per_node`. With `advise_layout` (or `nodes`), the layout of that
    world that fits `device_memory_gb` (`tools.layout_advice`), launched with `config`."""
    check_flags(world_size=world_size, vocab_size=vocab_size, batch_size=batch_size, device_memory_gb=device_memory_gb)
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if nodes is not None:
        if world_size is not None and world_size != nodes * gpus_per_node:
            raise UsageError(
                f"--world-size {world_size} is not --nodes {nodes} x --gpus-per-node {gpus_per_node}; give one of them"
            )
        world_size, advise_layout = nodes * gpus_per_node, True
    if advise_layout and device_memory_gb is None:
        raise UsageError("estimate: advising a layout needs the devices' memory; give --gpu-memory GiB")
    if world_size is None:
        world_size = experiment.training.world_size or 1
    if sharding is None:
        sharding = configured_sharding(experiment.training)
    if vocab_size is not None:
        vocab, source = vocab_size, "--vocab-size"
    else:
        vocab, source = _vocabulary(experiment)
    try:
        model_config = dataclasses.replace(experiment.model, vocab_size=vocab).resolved()
    except ValueError as exc:  # the vocabulary makes the model larger than any real one
        raise UsageError(f"{source}: {exc}") from None
    device_type = "cpu" if experiment.training.device == "cpu" else "cuda"
    training = resolve.resolve_amp(experiment.training, torch.device(device_type))
    seq_len = sequence_length(experiment)
    # every degree as the run would resolve it (a layout that cannot train is refused in one line)
    layout = resolve_layout(
        experiment.training,
        world_size,
        model=model_config,
        seq_len=seq_len,
        document_mask=experiment.data.document_mask,
    )
    if sharding != "none" and layout.dp_shard == 1:  # ZeRO (DeepSpeed, or --sharding given) over every replica
        layout = dataclasses.replace(layout, dp_replicate=1, dp_shard=layout.dp_replicate)
    counts = count_parameters(model_config)
    fpt = flops_per_token(model_config, seq_len)
    micro = batch_size or training.batch_size
    # the data-parallel replicas read different rows; a replica's tensor, context and pipeline ranks share them
    tokens_per_step = micro * seq_len * training.gradient_accumulation_steps * layout.dp if micro != "auto" else 0
    if micro == "auto":  # the micro-batch the run would pick, in the memory given here
        training = dataclasses.replace(training, device_memory=device_memory_gb or training.device_memory)
        if training.device_memory is None and device_type != "cpu":
            raise UsageError(
                "estimate: training.batch_size auto fills the device's memory; give it with --device-memory "
                "(or training.device_memory), or pass --batch-size"
            )
        training = auto_batch_size(model_config, training, seq_len, layout.dp, torch.device(device_type), probe=False)
        micro, tokens_per_step = training.batch_size, training.total_batch_tokens
    mem = estimate_memory(
        model_config,
        training,
        seq_len=seq_len,
        batch_size=micro,
        world_size=world_size,
        sharding=sharding,
        gradient_checkpointing=gradient_checkpointing,
        device_type=device_type,
        layout=layout,
    )
    report = {
        "parameters": counts.total,
        "non_embedding_parameters": counts.matmul,
        "vocab_size": vocab,
        "vocab_source": source,
        "vocab_rows": model_config.padded_vocab_size,
        "seq_len": seq_len,
        "micro_batch_size": micro,
        "world_size": world_size,
        "sharding": sharding,
        "layout": dataclasses.asdict(layout),
        "pipeline_bubble": mem.pipeline_bubble,
        "pipeline_microbatches": mem.details["microbatches"],
        "stage_parameters": mem.details["stage_parameters"],
        "precision": f"fp32 weights + autocast {training.amp_dtype}" if training.use_amp else "fp32",
        "optimizer": training.optimizer,
        "gradient_checkpointing": mem.details["checkpointing"],
        "flops_per_token": fpt,
        "tokens_per_optimizer_step": tokens_per_step,
        "flops_per_optimizer_step": fpt * tokens_per_step,
        "memory": {
            "params_gb": mem.params_bytes / GiB,
            "grads_gb": mem.grads_bytes / GiB,
            "optimizer_gb": mem.optimizer_bytes / GiB,
            "amp_weight_copies_gb": mem.amp_weight_copies_bytes / GiB,
            "activations_gb": mem.activations_bytes / GiB,
            "output_head_peak_gb": mem.head_peak_bytes / GiB,
            "optimizer_step_temp_gb": mem.optimizer_temp_bytes / GiB,
            "cublas_workspace_gb": mem.workspace_bytes / GiB,
            "peak_gb": mem.peak_bytes / GiB,
            "peak_phase": mem.details["peak_phase"],
        },
    }
    if device_memory_gb is not None:
        report["device_memory_gb"] = device_memory_gb
        report["fits"] = mem.fits(device_memory_gb)
        report["max_micro_batch_size"] = max_batch_size(
            model_config,
            training,
            device_memory_gb,
            seq_len=seq_len,
            world_size=world_size,
            sharding=sharding,
            gradient_checkpointing=gradient_checkpointing,
            device_type=device_type,
            layout=layout,
        )
        if advise_layout:
            numeric = batch_size or (training.batch_size if training.batch_size != "auto" else 1)
            advice = advise(
                model_config,
                experiment.training,
                world_size=world_size,
                device_memory_gb=device_memory_gb,
                seq_len=seq_len,
                gpus_per_node=gpus_per_node,
                batch_size=micro if isinstance(micro, int) else numeric,
                device_type=device_type,
            )
            report["layout_advice"] = advice.to_dict() if advice is not None else None
            report["layout_advice_text"] = format_advice(
                advice, world_size=world_size, device_memory_gb=device_memory_gb, config=config
            )
        if not report["fits"]:
            report["advice"] = _advice(
                model_config,
                training,
                device_memory_gb,
                seq_len,
                layout,
                sharding,
                gradient_checkpointing,
                device_type,
                report["max_micro_batch_size"],
            )
    return report


def _vocabulary(experiment: ExperimentConfig) -> tuple[int, str]:
    """(the model's vocabulary size, where it came from): the tokenizer of the data already prepared for
    this config, when model.vocab_size is unset and that folder is in a local data.cache_dir; else what the
    settings imply (`resolve.vocab_size`). A char or BPE tokenizer's size is only known once it is trained."""
    prepared = None if experiment.model.vocab_size is not None else _prepared_here(experiment.data)
    if prepared is None:
        return resolve.vocab_size(experiment)
    size, _ = resolve.vocab_size(experiment, prepared.tokenizer)
    return size, f"the tokenizer prepared in {prepared.directory}"


def _prepared_here(data: DataConfig) -> PreparedData | None:
    """The finished prepared folder of `data` in its local cache_dir, opened read-only, or None. An estimate
    reads no store: a config whose cache or files are in one is not looked up."""
    try:
        if data.remote_cache_dir or reads_a_store(data):
            return None
        return find_prepared(data.cache_dir, data_fingerprint(data))
    except (UsageError, OSError, ValueError):  # sources missing or unreadable: the run says so itself
        return None


def _advice(model_config, training, device_gb, seq_len, layout, sharding, checkpointing, device_type, max_micro) -> str:
    """What to change so it fits: a smaller micro-batch, checkpointing, then data-parallel sharding over
    more devices (`--nodes` advises tensor and pipeline degrees too: tools/layout_advice.py)."""
    world_size = layout.world_size
    tips = []
    if max_micro:
        tips.append(f"training.batch_size={max_micro} (raise gradient_accumulation_steps to keep the tokens per step)")
        return "; ".join(tips)
    kwargs = dict(seq_len=seq_len, batch_size=1, device_type=device_type)
    if not (checkpointing or activation_checkpointing(training)):
        if estimate_memory(
            model_config, training, sharding=sharding, gradient_checkpointing=True, layout=layout, **kwargs
        ).fits(device_gb):
            return "training.gradient_checkpointing=true with a small training.batch_size"
    # The fewest devices first: the world size given with more sharding than given, then powers of two
    # above it; the least sharding, and checkpointing only where it is needed.
    already = bool(checkpointing or activation_checkpointing(training))
    worlds = [world_size, *(w for w in (2, 4, 8, 16, 32, 64, 128, 256, 512) if w > world_size)]
    for world in (w for w in worlds if w > 1):  # sharding over one device saves nothing
        for mode in SHARDING[SHARDING.index(sharding) + 1 if world == world_size else 1 :]:
            for recompute in dict.fromkeys((already, True)):
                if estimate_memory(
                    model_config, training, world_size=world, sharding=mode, gradient_checkpointing=recompute, **kwargs
                ).fits(device_gb):
                    extra = " with gradient checkpointing" if recompute and not already else ""
                    return f"distributed: --world-size {world} --sharding {mode}{extra}"
    return (
        "does not fit even when sharded over 512 devices; use a smaller model, or see --nodes N for tensor and "
        "pipeline parallel layouts"
    )


def _padding(report: dict) -> str:
    """How many embedding and head rows the model holds, where padding makes them more than the vocabulary."""
    rows = report["vocab_rows"]
    return f", {rows:,} rows (model.vocab_pad_multiple)" if rows != report["vocab_size"] else ""


def format_report(report: dict) -> str:
    m = report["memory"]
    lines = [
        f"parameters        {report['parameters']:,} ({report['non_embedding_parameters']:,} without embedding lookups)",
        f"vocab_size        {report['vocab_size']:,} ({report['vocab_source']}){_padding(report)}",
        f"sequence          {report['seq_len']} tokens, micro-batch {report['micro_batch_size']}, "
        f"world size {report['world_size']}, sharding {report['sharding']}",
        f"mesh              {Layout(**report['layout']).describe()}"
        + (
            f"; pipeline bubble {report['pipeline_bubble']:.0%} ({report['pipeline_microbatches']} micro-batches), "
            f"throughput x {1 - report['pipeline_bubble']:.2f}; the largest stage below"
            if report["layout"]["pp"] > 1
            else ""
        ),
        f"precision         {report['precision']}, optimizer {report['optimizer']}, "
        f"gradient checkpointing {'on' if report['gradient_checkpointing'] else 'off'}",
        f"FLOPs per token   {report['flops_per_token']:.4g} (6N + attention)",
        f"FLOPs per step    {report['flops_per_optimizer_step']:.4g} ({report['tokens_per_optimizer_step']:,} tokens)",
        "memory per device (GiB):",
        f"  parameters      {m['params_gb']:9.3f}",
        f"  gradients       {m['grads_gb']:9.3f}",
        f"  optimizer state {m['optimizer_gb']:9.3f}",
        f"  amp copies      {m['amp_weight_copies_gb']:9.3f}",
        f"  activations     {m['activations_gb']:9.3f}",
        f"  backward        {m['output_head_peak_gb']:9.3f}  (transient: the head's, or a block's)",
        f"  optimizer step  {m['optimizer_step_temp_gb']:9.3f}  (temporaries)",
        *(
            [f"  workspaces      {m['cublas_workspace_gb']:9.3f}  (cuBLAS on CUDA; bf16 kernels on a CPU)"]
            if m["cublas_workspace_gb"]
            else []
        ),
        f"  peak            {m['peak_gb']:9.3f}  ({m['peak_phase'].replace('_', ' ')})",
    ]
    if "fits" in report:
        verdict = "fits" if report["fits"] else "does NOT fit"
        lines.append(
            f"{verdict} in {report['device_memory_gb']:g} GiB; largest micro-batch that fits: "
            f"{report['max_micro_batch_size']}"
        )
        if report.get("advice"):
            lines.append(f"to fit: {report['advice']}")
    if report.get("layout_advice_text"):
        lines.append(report["layout_advice_text"])
    return "\n".join(lines)


# The configs the estimate is checked on (tests/test_estimate_measured.py, bench/estimate_check.py): two
# widths, with and without gradient checkpointing, AdamW and Muon, in float32 (GPT-2 style); then the
# LLaMA style under bf16 autocast. 4 layers, 4,096 tokens of vocabulary, 8 rows of 128 tokens (each
# config's max_seq_len). Last, a narrow model at a long context, where attention's (B, H, T, T) tensors
# (on a CPU in bf16, attention written out) and the loss's chunks of logits outweigh the rest.
SEQ_LEN = 128
CHECKED = [
    (
        f"d{width} {'ckpt' if checkpointing else 'full'} {optimizer} {arch} {'bf16' if amp else 'fp32'}",
        dict(vocab_size=4096, d_model=width, n_heads=4, n_layers=4, max_seq_len=SEQ_LEN, architecture=arch),
        dict(use_amp=amp, batch_size=8, optimizer=optimizer, gradient_checkpointing=checkpointing),
    )
    for width, arch, amp in ((256, "gpt2", False), (512, "gpt2", False), (512, "llama", True))
    for checkpointing in (False, True)
    for optimizer in ("adamw", "muon")
] + [
    (
        f"d64 context 1024 adamw gpt2 {'bf16' if amp else 'fp32'}",
        dict(vocab_size=4096, d_model=64, n_heads=2, n_layers=2, max_seq_len=1024, architecture="gpt2"),
        dict(use_amp=amp, batch_size=16, optimizer="adamw", gradient_checkpointing=False),
    )
    for amp in (False, True)
]


def compare(device: str = "cpu", names: set[str] | None = None) -> list[dict]:
    """Estimated and measured peak of each CHECKED config (those in `names`, when given) on `device`
    ("cpu" or "cuda"), in bytes."""

    rows = []
    for name, model, training in CHECKED:
        if names is not None and name not in names:
            continue
        training = {**training, "device": device}
        measured = measure_peak(model, training, model["max_seq_len"])["peak_bytes"]
        estimate = estimate_memory(
            ModelConfig(**model), TrainingConfig(**training), seq_len=model["max_seq_len"], device_type=device
        )
        rows.append(
            {
                "config": name,
                "device": device,
                "estimated": estimate.peak_bytes,
                "measured": measured,
                "error": estimate.peak_bytes / measured - 1,
                "peak_phase": estimate.details["peak_phase"],
                "params": estimate.params_bytes,
                "grads": estimate.grads_bytes,
                "optimizer": estimate.optimizer_bytes,
                "activations": estimate.activations_bytes,
                "optimizer_temp": estimate.optimizer_temp_bytes,
            }
        )
    return rows
