"""Memory and compute estimates for a training run, before it starts.

Everything here follows how *this* trainer runs a model, so the numbers can be checked against it:

* **Parameters** are counted exactly, by building the model on the meta device (no memory used).
* **Precision.** Parameters, gradients and optimizer state are always fp32 (4 bytes): the trainer
  keeps fp32 weights and, with `use_amp`, runs the forward under `torch.autocast` (bf16/fp16). There
  is no separate "master copy": the fp32 parameters *are* the master weights. Autocast casts every
  matmul weight to the 16-bit type once per forward and keeps the copy alive until its backward, so
  amp adds 2 bytes per matmul parameter, and activations that feed or leave a matmul are 16-bit;
  the residual stream and the norms' inputs stay fp32.
* **Optimizer state**: AdamW/Adam keep two fp32 moments (8 bytes/param), SGD with momentum one
  (4 bytes/param) and plain SGD none; Muon one momentum buffer for the hidden matrices and AdamW's two
  moments for the rest. The fused AdamW/Adam step (CUDA and CPU) adds no full-size temporary; SGD's
  foreach step makes about one fp32 temporary per parameter. Muon orthogonalizes each group of
  same-shape matrices as one stack (train/muon.py): for the largest group of S elements the step holds
  the fp32 Nesterov updates and their stack (4 + 4 bytes) while `orthogonalize` runs, which adds the bf16
  iterates, the Gram matrices and the fp32 result: 6.7 S bytes measured on a CPU, 7 S counted here.
* **Activations**, per token and layer, are the tensors autograd saves for our blocks (pre-norm):
  the block input and the mid-block residual (fp32, for the norms; RMSNorm also keeps its normalised
  fp32 input), the inputs of the attention and MLP projections, the q/k/v outputs, the rotary q/k (LLaMA), the
  attention output (flash / memory-efficient attention: no T x T matrix is kept; bf16 on a CPU: the softmax
  over the keys, see model._explicit_attention), the MLP hidden
  (GELU/SiLU: input and output; SwiGLU: the gate/up pair, SiLU output and product; ReLU: the output
  only) and dropout masks when dropout > 0 (one byte on CUDA, the activation's size on CPU). The
  output head and the loss run in chunks (`loss.linear_cross_entropy`): they keep the gradient of the
  head's input (fp32, 4 d bytes a token) and an fp32 gradient of the head's weight (4 V d bytes),
  and while the forward runs, one chunk's logits, log-softmax and gradient (at most `CHUNK_LOGITS`
  logits). Logits below `SMALL_LOGITS` in all are computed whole instead: the fp32 log-softmax is kept
  (4 V bytes a token) and the backward briefly holds two more V-sized fp32 tensors.
  With gradient checkpointing a block keeps only its fp32 input, and one block's activations are
  rebuilt at a time during backward, once the head's backward is over: the head's peak and a rebuilt
  block never coexist, but the rebuilt block of the lowest layer coexists with (nearly) all gradients.
* **Peak** = parameters + optimizer state + the largest of four phases: the end of the forward /
  start of the backward (amp weight copies, all activations, the head's backward, the head's
  gradient), with gradient checkpointing the recomputation of the lowest block (all gradients, its
  input and rebuilt activations), the end of the backward (all gradients, one block's amp copies), the
  optimizer step (all gradients, plus the step's temporaries). Gradients are freed after each step
  (`zero_grad(set_to_none=True)`).

Checked against measurement (tests/test_estimate_measured.py, `tools/memory_probe.py`): the peak of
real training steps on a CPU (resident memory with glibc serving tensors by mmap) for two widths, with
and without gradient checkpointing, AdamW and Muon; on CUDA the same check reads
`torch.cuda.max_memory_allocated` (bench/gpu.sh runs it).
* **Sharding** over `world_size` devices: `zero1` shards optimizer state, `zero2` also gradients,
  `fsdp` (= ZeRO-3) also parameters (plus two gathered blocks in flight, fp32, the way our trainer
  keeps weights). Activations are per device: `training.batch_size` is the per-device micro-batch.

* **bf16 kernels on a CPU**: the first bf16 matmul (autocast, or Muon's orthogonalization) leaves
  about 16 MB resident for the rest of the process, at any width; counted where a step runs one.
* **cuBLAS workspaces** (CUDA only): PyTorch gives each cuBLAS handle a workspace from its caching
  allocator, so `max_memory_allocated` counts it. Training uses two handles, the forward's thread and
  autograd's backward thread, each with the Hopper default of 32 MiB (earlier GPUs take less, so this
  bounds them). On an H100 this is what separated a small model's measured peak from the rest of the
  model (bench/README.md, GPU).

Not modelled: the CUDA context (~0.3-0.5 GiB outside `max_memory_allocated`), allocator
fragmentation, torch.compile workspaces, attention kernels that materialise T x T (the math path:
attention dropout, or a document mask for packed rows), communication buffers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import resolve
from ..config import ExperimentConfig, ModelConfig, TrainingConfig
from ..errors import UsageError
from ..logs import log
from ..parallel.mesh import refuse_unavailable, resolve_layout, strategy_of
from ..resolve import activation_checkpointing, sequence_length
from ..train.flops import count_parameters, flops_per_token

GiB = 1024**3

SHARDING = ("none", "zero1", "zero2", "fsdp")

CUBLAS_WORKSPACES_BYTES = 2 * 32 * 2**20  # two handles (forward, backward thread) x the Hopper default
# A CPU's first bf16 matmul (autocast, or Muon's orthogonalization) leaves about this much resident for
# the rest of the process, whatever the shapes (measured at widths 128-512: 16.1-16.3 MB)
CPU_BF16_KERNELS_BYTES = 16 * 10**6


# ----------------------------------------------------------------------------------------------
# Memory


def _precision(training: TrainingConfig, device_type: str) -> TrainingConfig:
    """`training` with use_amp decided as a run on `device_type` here would decide it (`use_amp: auto`)."""
    return resolve.resolve_amp(training, torch.device(device_type))


def _act_bytes(training: TrainingConfig) -> int:
    return 2 if training.use_amp else 4


def activation_bytes_per_token(
    model_config: ModelConfig, training: TrainingConfig, device_type: str = "cuda", seq_len: int | None = None
) -> dict[str, float]:
    """Bytes autograd keeps per token: `per_layer` (one block), `embedding` (ids, final norm, head input)
    and `head` (the saved fp32 log-softmax). Checked against the tensors autograd actually saves."""
    training = _precision(training, device_type)
    c = model_config.resolved()
    d, f, kv = c.d_model, c.d_ff, c.n_kv_heads * c.head_dim
    a, r = _act_bytes(training), 4  # activation bytes; residual stream and norm inputs stay fp32
    stats = 8  # per norm: mean and rstd (LayerNorm) or rstd (RMSNorm), fp32
    norm_extra = d * 4 if c.norm == "rmsnorm" else 0  # RMSNorm also keeps its normalised fp32 input
    layer = 0.0
    layer += 2 * (d * r + stats + norm_extra)  # the two norms (block input, mid-block residual)
    layer += 2 * d * a  # inputs of the attention and MLP projections (the norms' outputs, 16-bit under amp)
    layer += (d + 2 * kv) * a  # q, k, v outputs (saved by attention)
    if c.position_embedding == "rope":
        layer += (d + kv) * a  # rotated q and k
    if device_type == "cpu" and training.use_amp and training.amp_dtype == "bfloat16":
        # bf16 on a CPU: attention written out (model._explicit_attention) keeps each head's softmax over the
        # keys, in float32 for its backward and in bf16 for the product with v
        layer += d * a + c.n_heads * (seq_len or c.max_seq_len) * (4 + 2)
    else:
        layer += d * a + c.n_heads * 4  # attention output (already (B, T, H, D): it is proj's input), logsumexp
    layer += {"swiglu": 4 * f, "relu": f}.get(c.activation, 2 * f) * a  # MLP hidden
    mask = 1 if device_type == "cuda" else a  # dropout masks: bool on CUDA, the input's dtype on CPU
    if c.dropout > 0:
        layer += 2 * d * mask  # the two residual dropouts
    embedding = 8 + (d * (1 if device_type == "cuda" else 4) if c.dropout > 0 else 0)  # ids (int64), mask
    final = d * r + stats + norm_extra + d * a  # final norm and the head's input
    return {"per_layer": layer, "embedding": embedding + final, "head": 4 * c.vocab_size}


@dataclass
class MemoryEstimate:
    """Bytes per device; `peak` is what `torch.cuda.max_memory_allocated` should report."""

    parameters: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    amp_weight_copies_bytes: float
    activations_bytes: float  # saved for backward, whole model, one micro-batch
    head_peak_bytes: float  # output head's backward transient (beyond the saved log-softmax)
    optimizer_temp_bytes: float
    peak_bytes: float
    tokens_per_micro_batch: int
    world_size: int = 1
    sharding: str = "none"
    workspace_bytes: float = 0.0  # cuBLAS workspaces (CUDA), bf16 kernels (CPU)
    details: dict = field(default_factory=dict)

    @property
    def states_bytes(self) -> float:
        """Parameters + gradients + optimizer state: the activation-free part."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def fits(self, device_memory_gb: float, reserve_gb: float = 0.0) -> bool:
        return self.peak_bytes <= (device_memory_gb - reserve_gb) * GiB

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["states_bytes"] = self.states_bytes
        return out


def estimate_memory(
    model_config: ModelConfig,
    training: TrainingConfig,
    *,
    seq_len: int | None = None,
    batch_size: int | None = None,
    world_size: int = 1,
    sharding: str = "none",
    gradient_checkpointing: bool | None = None,
    device_type: str = "cuda",
) -> MemoryEstimate:
    """Per-device memory of one training step of our trainer (see the module docstring for the model)."""
    training = _precision(training, device_type)
    if sharding not in SHARDING:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING)}, got {sharding!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    c = model_config.resolved()
    seq_len = int(seq_len or c.max_seq_len)
    batch_size = int(batch_size or training.batch_size)
    checkpointing = activation_checkpointing(training) if gradient_checkpointing is None else gradient_checkpointing
    counts = count_parameters(c)
    n = counts.total
    w = world_size if sharding != "none" else 1

    params = 4.0 * n / (w if sharding == "fsdp" else 1)
    grads = 4.0 * n / (w if sharding in ("zero2", "fsdp") else 1)
    muon_n, muon_group = _muon_matrices(c, training) if training.optimizer == "muon" else (0, 0)
    states = {"adamw": 2, "adam": 2, "muon": 2, "sgd": 1 if training.sgd_momentum else 0}[training.optimizer]
    optimizer = 4.0 * (states * n - muon_n) / w  # every sharding mode shards optimizer state; Muon: one for matrices
    if sharding == "fsdp" and w > 1:
        params += 2 * 4.0 * counts.per_block  # two fp32 blocks gathered at a time (current + prefetch)
    amp_copies = 2.0 * counts.matmul_weights if training.use_amp else 0.0

    tokens = batch_size * seq_len
    per_token = activation_bytes_per_token(c, training, device_type, seq_len)
    block_input = c.d_model * 4  # what a checkpointed block keeps (fp32)
    layers = c.n_layers * (block_input if checkpointing else per_token["per_layer"])
    head_grad = 4.0 * counts.head / (w if sharding in ("zero2", "fsdp") else 1)
    head_saved, head_peak = _head_bytes(c, training, tokens, head_grad)
    activations = tokens * (layers + per_token["embedding"]) + head_saved
    if training.optimizer == "muon":
        optimizer_temp = 15.0 * muon_group  # updates + their stack + orthogonalize (see the docstring)
    elif training.optimizer == "sgd" and states:
        optimizer_temp = 4.0 * n / w  # the foreach step's temporary
    else:
        optimizer_temp = 0.0  # fused AdamW/Adam

    workspace = CUBLAS_WORKSPACES_BYTES if device_type == "cuda" else 0.0
    if device_type == "cpu" and (
        (training.use_amp and training.amp_dtype == "bfloat16") or training.optimizer == "muon"
    ):
        workspace = CPU_BF16_KERNELS_BYTES
    steady = params + optimizer + workspace
    phases = {
        "forward_backward": steady + amp_copies + activations + head_peak + head_grad,
        # each block's 16-bit weight copies are freed by its own backward, as its gradients appear
        "end_of_backward": steady + grads + (2.0 * counts.block_matmul_weights if training.use_amp else 0.0),
        "optimizer_step": steady + grads + optimizer_temp,
    }
    if checkpointing:  # the lowest block rebuilt, beside all gradients
        phases["recompute"] = steady + grads + tokens * (block_input + per_token["per_layer"] + per_token["embedding"])
    peak_phase = max(phases, key=phases.get)
    return MemoryEstimate(
        parameters=n,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=optimizer,
        amp_weight_copies_bytes=amp_copies,
        activations_bytes=activations,
        head_peak_bytes=head_peak,
        optimizer_temp_bytes=optimizer_temp,
        peak_bytes=phases[peak_phase],
        tokens_per_micro_batch=tokens,
        world_size=world_size,
        sharding=sharding,
        workspace_bytes=workspace,
        details={
            "phases": phases,
            "peak_phase": peak_phase,
            "checkpointing": checkpointing,
            "per_token": per_token,
            "optimizer_states_per_param": states,
        },
    )


def _head_bytes(c: ModelConfig, training: TrainingConfig, tokens: int, head_grad: float) -> tuple[float, float]:
    """(bytes the head + loss keep for backward, bytes they hold beside that and the head's gradient at
    their peak), as `loss.linear_cross_entropy` computes them for `tokens` positions."""
    from ..loss import SMALL_LOGITS, chunk_rows

    vocab, d, a = c.vocab_size, c.d_model, _act_bytes(training)
    if tokens * vocab <= SMALL_LOGITS:  # whole logits: log-softmax's grad_out and grad_in beside the saved output
        return tokens * 4.0 * vocab, tokens * 2 * 4.0 * vocab
    saved = tokens * (4.0 - a) * d  # the input's fp32 gradient instead of its (16-bit under amp) copy
    accumulator = 4.0 * vocab * d  # the weight's fp32 gradient, summed over the chunks
    # one chunk at its widest: its logits (and their fp32 copy under amp) beside their log-softmax
    chunk = chunk_rows(tokens, vocab) * vocab * (a + 8 if training.use_amp else 8)
    product = (a + 4.0) * vocab * d if training.use_amp else 4.0 * vocab * d  # the chunk's weight gradient
    # forward: accumulator + chunk + product; backward's start: accumulator + the head's gradient
    return saved, accumulator + max(chunk + product - head_grad, 0.0)


def _muon_matrices(c: ModelConfig, training: TrainingConfig) -> tuple[int, int]:
    """(elements of the matrices Muon steps, elements of its largest same-shape group), from the model's
    shapes on the meta device and the optimizer's own grouping (train/optim.py)."""
    from ..train.flops import meta_model
    from ..train.optim import muon_groups

    groups = muon_groups(meta_model(c), training)
    matrices = [p for group in groups if group.get("muon") for p in group["params"]]
    by_shape: dict[tuple[int, int], int] = {}
    for p in matrices:
        key = (min(p.shape), max(p.shape))
        by_shape[key] = by_shape.get(key, 0) + p.numel()
    return sum(p.numel() for p in matrices), max(by_shape.values(), default=0)


def max_batch_size(model_config: ModelConfig, training: TrainingConfig, device_memory_gb: float, **kwargs) -> int:
    """The largest per-device micro-batch whose estimated peak fits `device_memory_gb` (0 if none)."""

    def fits(b: int) -> bool:
        return estimate_memory(model_config, training, batch_size=b, **kwargs).fits(device_memory_gb)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


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
    processes), so accumulation makes up the rest and the global batch stays what was asked.

    The estimate picks; with `probe` (one process), one real training step at that size in a fresh process
    (`memory_probe`) measures its peak, and where the measurement is above the estimate the estimates are
    scaled by that ratio to pick again. One step, never a loop of failed runs and restarts."""
    if training.batch_size != "auto":
        return training
    if world_size > 1 and training.device_memory is None:  # each rank's free memory differs: all must pick alike
        raise UsageError(
            "training.batch_size auto over several processes needs training.device_memory (GiB), one budget "
            "every process picks the same micro-batch from"
        )
    budget, source = device_budget_gb(training, device)
    options = dict(seq_len=seq_len, world_size=world_size, sharding=configured_sharding(training))
    options["device_type"] = device.type

    def peak(batch: int) -> float:
        return estimate_memory(model_config, training, batch_size=batch, **options).peak_bytes / GiB

    rows, rest = divmod(training.total_batch_tokens, seq_len * world_size)
    divisors = [b for b in range(rows, 0, -1) if not rest and rows % b == 0]
    fitting = [b for b in divisors if peak(b) <= budget]
    if not fitting:
        largest = max_batch_size(model_config, dataclasses.replace(training, batch_size=1), budget, **options)
        raise UsageError(
            f"training.batch_size auto: no micro-batch fits {budget:.2f} GiB ({source}) and divides "
            f"total_batch_tokens {training.total_batch_tokens:,} into rows of {seq_len} x {world_size} process(es) "
            f"(largest that fits: {largest}); use a smaller model or sequence, gradient_checkpointing, more "
            "memory (training.device_memory), or a total_batch_tokens that is a multiple of the sequence length"
        )
    batch, measured = fitting[0], ""
    if probe and world_size == 1 and device.type in ("cpu", "cuda"):
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
        f"{source}{measured}), x {rows // batch} accumulation x {world_size} process(es) keeps total_batch_tokens "
        f"{training.total_batch_tokens:,}"
    )
    return dataclasses.replace(training, batch_size=batch)


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


# ----------------------------------------------------------------------------------------------
# The report behind `llm-trainer estimate`


def check_flags(
    *, world_size: int, vocab_size: int | None, batch_size: int | None, device_memory_gb: float | None
) -> None:
    """The numbers `llm-trainer estimate` is given, each in its range (a one-line error naming the flag)."""
    for flag, value in (("--world-size", world_size), ("--vocab-size", vocab_size), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if device_memory_gb is not None and not (math.isfinite(device_memory_gb) and device_memory_gb > 0):
        raise UsageError(f"--device-memory must be a positive number of GiB, got {device_memory_gb}")


def configured_sharding(training: TrainingConfig) -> str:
    """What the run's distributed strategy shards, as one of `SHARDING`: FSDP's full (and hybrid) shard
    is ZeRO-3 (`fsdp`), its shard_grad_op keeps whole parameters through the step (`zero2`); DeepSpeed
    shards as its ZeRO stage says; DDP and one process shard nothing."""
    if strategy_of(training) == "fsdp":
        return "zero2" if training.fsdp_sharding == "shard_grad_op" else "fsdp"
    if training.distributed_strategy == "deepspeed":
        from ..parallel.deepspeed_engine import load_user_config

        stage = load_user_config(training.deepspeed_config).get("zero_optimization", {}).get("stage", 0)
        return dict(enumerate(SHARDING)).get(stage, "none")
    return "none"


def estimate_report(
    experiment: ExperimentConfig,
    *,
    world_size: int | None = None,
    sharding: str | None = None,
    device_memory_gb: float | None = None,
    vocab_size: int | None = None,
    batch_size: int | None = None,
    gradient_checkpointing: bool | None = None,
) -> dict:
    """Everything `llm-trainer estimate` prints, as a dict (bytes and FLOPs as numbers). `world_size` and
    `sharding` default to what the config runs (training.world_size, its distributed strategy)."""
    check_flags(world_size=world_size, vocab_size=vocab_size, batch_size=batch_size, device_memory_gb=device_memory_gb)
    if world_size is None:
        world_size = experiment.training.world_size or 1
    if sharding is None:
        sharding = configured_sharding(experiment.training)
    if vocab_size is not None:
        vocab, source = vocab_size, "--vocab-size"
    else:
        vocab, source = resolve.vocab_size(experiment)
    try:
        model_config = dataclasses.replace(experiment.model, vocab_size=vocab).resolved()
    except ValueError as exc:  # the vocabulary makes the model larger than any real one
        raise UsageError(f"{source}: {exc}") from None
    device_type = "cpu" if experiment.training.device == "cpu" else "cuda"
    training = _precision(experiment.training, device_type)
    seq_len = sequence_length(experiment)
    # the figures below assume whole weights on every data-parallel rank: other layouts are refused, not misreported
    resolve_layout(experiment.training, world_size, model=model_config, seq_len=seq_len)
    refuse_unavailable(experiment.training)
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(experiment.training, name) > 1:
            raise UsageError(
                f"estimate: training.{name}={getattr(experiment.training, name)} splits the weights and "
                f"activations, which its figures do not count yet; estimate with {name}: 1"
            )
    counts = count_parameters(model_config)
    fpt = flops_per_token(model_config, seq_len)
    micro = batch_size or training.batch_size
    tokens_per_step = micro * seq_len * training.gradient_accumulation_steps * world_size if micro != "auto" else 0
    if micro == "auto":  # the micro-batch the run would pick, in the memory given here
        training = dataclasses.replace(training, device_memory=device_memory_gb or training.device_memory)
        if training.device_memory is None and device_type != "cpu":
            raise UsageError(
                "estimate: training.batch_size auto fills the device's memory; give it with --device-memory "
                "(or training.device_memory), or pass --batch-size"
            )
        training = auto_batch_size(model_config, training, seq_len, world_size, torch.device(device_type), probe=False)
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
    )
    report = {
        "parameters": counts.total,
        "non_embedding_parameters": counts.matmul,
        "vocab_size": vocab,
        "vocab_source": source,
        "seq_len": seq_len,
        "micro_batch_size": micro,
        "world_size": world_size,
        "sharding": sharding,
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
        )
        if not report["fits"]:
            report["advice"] = _advice(
                model_config,
                training,
                device_memory_gb,
                seq_len,
                world_size,
                sharding,
                gradient_checkpointing,
                device_type,
                report["max_micro_batch_size"],
            )
    return report


def _advice(
    model_config, training, device_gb, seq_len, world_size, sharding, checkpointing, device_type, max_micro
) -> str:
    """What to change so it fits: a smaller micro-batch, checkpointing, then sharding over more devices."""
    tips = []
    if max_micro:
        tips.append(f"training.batch_size={max_micro} (raise gradient_accumulation_steps to keep the tokens per step)")
        return "; ".join(tips)
    kwargs = dict(seq_len=seq_len, batch_size=1, device_type=device_type)
    if not (checkpointing or activation_checkpointing(training)):
        if estimate_memory(
            model_config, training, world_size=world_size, sharding=sharding, gradient_checkpointing=True, **kwargs
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
    return "does not fit even when sharded over 512 devices; use a smaller model"


def format_report(report: dict) -> str:
    m = report["memory"]
    lines = [
        f"parameters        {report['parameters']:,} ({report['non_embedding_parameters']:,} without embedding lookups)",
        f"vocab_size        {report['vocab_size']:,} ({report['vocab_source']})",
        f"sequence          {report['seq_len']} tokens, micro-batch {report['micro_batch_size']}, "
        f"world size {report['world_size']}, sharding {report['sharding']}",
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
        f"  head backward   {m['output_head_peak_gb']:9.3f}",
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
    return "\n".join(lines)


# The configs the estimate is checked on (tests/test_estimate_measured.py, bench/estimate_check.py): two
# widths, with and without gradient checkpointing, AdamW and Muon, in float32 (GPT-2 style); then the
# LLaMA style under bf16 autocast. 4 layers, 4,096 tokens of vocabulary, 8 rows of 128 tokens.
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
]


def compare(device: str = "cpu", names: set[str] | None = None) -> list[dict]:
    """Estimated and measured peak of each CHECKED config (those in `names`, when given) on `device`
    ("cpu" or "cuda"), in bytes."""

    rows = []
    for name, model, training in CHECKED:
        if names is not None and name not in names:
            continue
        training = {**training, "device": device}
        measured = measure_peak(model, training, SEQ_LEN)["peak_bytes"]
        estimate = estimate_memory(
            ModelConfig(**model), TrainingConfig(**training), seq_len=SEQ_LEN, device_type=device
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


MMAP_THRESHOLD = 65536


def measure_peak(model: dict, training: dict, seq_len: int, timeout: float = 600) -> dict:
    """Run `tools/memory_probe.py` in a fresh process; returns its JSON result. Each allocation of
    MMAP_THRESHOLD bytes or more gets its own mmap there, so a freed tensor leaves the peak it made."""
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    payload = json.dumps({"model": model, "training": training, "seq_len": seq_len})
    done = subprocess.run(
        [sys.executable, "-m", "llm_trainer.tools.memory_probe", payload],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
