"""The memory a training step of this trainer takes, estimated before it starts (`llm-trainer estimate`
shows it; `batch_size: auto` picks from it).

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
  Where bf16 is emulated (a CPU without AVX512-BF16 or AMX) the iterations run in fp32
  (`optim.muon_iteration_dtype`), a wide matrix's in their Gram form: 21.8 to 23.4 S bytes in all
  measured, 22.5 S counted.
* **Activations**, per token and layer, are the tensors autograd saves for our blocks (pre-norm):
  the block input and the mid-block residual (fp32, for the norms; RMSNorm also keeps its normalised
  fp32 input), the inputs of the attention and MLP projections (under amp one 16-bit copy per projection
  that reads them: autocast casts an activation anew for each matmul), q, k and v as attention reads them
  (with rope: the rotated q and k, not the projections' outputs; with qk_norm also the norms' fp32
  inputs), the attention output (flash / memory-efficient attention: no T x T matrix is kept; bf16 on a CPU: the softmax
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

Checked against measurement (tests/test_estimate_measured.py, `train/memory_probe.py`): the peak of
real training steps on a CPU (resident memory with glibc serving tensors by mmap) for two widths, with
and without gradient checkpointing, AdamW and Muon; on CUDA the same check reads
`torch.cuda.max_memory_allocated` (bench/gpu.sh runs it).
* **Sharding** over the data-parallel shard x context ranks (all `world_size` devices without a
  layout): `zero1` shards optimizer state, `zero2` also gradients, `fsdp` (= ZeRO-3) also parameters,
  plus what FSDP2 keeps gathered: two blocks in flight and the root (embeddings, final norm, head)
  from forward to backward, in bf16 under amp (its mixed-precision policy: then no autocast copies).
  Activations are per device: `training.batch_size` is each data-parallel rank's micro-batch.
* **Tensor parallelism** (parallel/tensor_parallel.py's plan) divides each block's matrices by the
  degree, column-wise biases too, row-wise biases and norms whole; embeddings and head stay whole.
  Sequence parallelism divides every block activation by it except the projections' inputs, which
  attention and the MLP gather whole. **Context parallelism** divides each device's tokens by its
  degree. **Pipeline parallelism** gives each rank n_layers / degree blocks, the embeddings to the
  first stage and the final norm and head to the last (a tied head: a copy of its own), cuts the
  micro-batch into `pipeline_parallel_microbatches`, and under 1F1B the first stage holds one per
  stage in flight; the figures are the largest stage's, and `pipeline_bubble` is its idle fraction.

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
from dataclasses import dataclass, field

import torch

from .. import resolve
from ..config import ModelConfig, TrainingConfig
from ..parallel.mesh import (
    MULTI_STAGE_SCHEDULES,
    V_SCHEDULES,
    Layout,
    compiles_whole_model,
    stacks_projections,
    strategy_of,
)
from ..resolve import activation_checkpointing
from .flops import count_parameters
from .optim import muon_iteration_dtype

GiB = 1024**3

SHARDING = ("none", "zero1", "zero2", "fsdp")

CUBLAS_WORKSPACES_BYTES = 2 * 32 * 2**20  # two handles (forward, backward thread) x the Hopper default
# A CPU's first bf16 matmul (autocast, or Muon's orthogonalization) leaves about this much resident for
# the rest of the process, whatever the shapes (measured at widths 128-512: 16.1-16.3 MB)
CPU_BF16_KERNELS_BYTES = 16 * 10**6


def _precision(training: TrainingConfig, device_type: str) -> TrainingConfig:
    """`training` with use_amp decided as a run on `device_type` here would decide it (`use_amp: auto`)."""
    return resolve.resolve_amp(training, torch.device(device_type))


def _act_bytes(training: TrainingConfig) -> int:
    return 2 if training.use_amp else 4


def _projection_inputs(c: ModelConfig, training: TrainingConfig, fused: bool) -> int:
    """How many copies of a block's normalised input the projections save, per block: one for attention
    and one for the MLP, unless autocast casts it separately for each projection that reads it (q, k, v;
    SwiGLU's gate and up), as it does where they are not one matmul (`model.project`)."""
    if not training.use_amp or fused:
        return 2
    return 3 + (2 if c.activation == "swiglu" else 1)


def activation_bytes_per_token(
    model_config: ModelConfig,
    training: TrainingConfig,
    device_type: str = "cuda",
    seq_len: int | None = None,
    *,
    fused: bool,
) -> dict[str, float]:
    """Bytes autograd keeps per token: `per_layer` (one block), `embedding` (ids, final norm, head input)
    and `head` (the saved fp32 log-softmax); `fused`: the projections run as one matmul (`model.project`).
    Checked against the tensors autograd actually saves."""
    training = _precision(training, device_type)
    c = model_config.resolved()
    d, f, kv = c.d_model, c.d_ff, c.n_kv_heads * c.head_dim
    a, r = _act_bytes(training), 4  # activation bytes; residual stream and norm inputs stay fp32
    stats = 8  # per norm: mean and rstd (LayerNorm) or rstd (RMSNorm), fp32
    norm_extra = d * 4 if c.norm == "rmsnorm" else 0  # RMSNorm also keeps its normalised fp32 input
    layer = 0.0
    layer += 2 * (d * r + stats + norm_extra)  # the two norms (block input, mid-block residual)
    # inputs of the attention and MLP projections (the norms' outputs): one tensor each in fp32; under amp
    # autocast casts it anew for every projection that reads it (q, k, v; SwiGLU's gate and up)
    layer += _projection_inputs(c, training, fused) * d * a
    layer += (d + 2 * kv) * a  # q, k, v as attention reads them (with rope: the rotated q and k only)
    if c.qk_norm:  # each head's RMSNorm keeps its fp32 input and rstd (autocast runs it in fp32)
        layer += (d + kv) * 4 + (c.n_heads + c.n_kv_heads) * 4
    written_out = device_type == "cpu" and training.use_amp and training.amp_dtype == "bfloat16"
    if written_out:
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
    final_norm = d * r + stats + norm_extra  # the final norm's input (split along the sequence under TP)
    return {
        "per_layer": layer,
        # tensor parallelism gathers the projections' inputs whole (attention and the MLP read every
        # position); every other tensor of a block is split: by heads, hidden units or positions
        "per_layer_whole": _projection_inputs(c, training, fused) * d * a,
        "embedding": embedding + final_norm + d * a,  # ids, masks, final norm and the head's (whole) input
        "inputs": embedding,
        "final_norm": final_norm,
        "head_input": d * a,
        "head": 4 * c.vocab_size,
        # what one block's backward holds beside the saved tensors, while the head's is over: written-out
        # attention's float32 gradient of its softmax, (B, H, T, S)
        "block_backward": c.n_heads * (seq_len or c.max_seq_len) * 4 if written_out else 0.0,
    }


@dataclass
class MemoryEstimate:
    """Bytes per device; `peak` is what `torch.cuda.max_memory_allocated` should report."""

    parameters: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    amp_weight_copies_bytes: float
    activations_bytes: float  # saved for backward, whole model, one micro-batch
    head_peak_bytes: float  # the backward's transient: the output head's (beyond the saved log-softmax), or a block's
    optimizer_temp_bytes: float
    peak_bytes: float
    tokens_per_micro_batch: int
    world_size: int = 1
    sharding: str = "none"
    layout: Layout = field(default_factory=Layout)
    pipeline_bubble: float = 0.0  # the schedule's idle fraction: throughput is (1 - bubble) of the devices'
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
    layout: Layout | None = None,
) -> MemoryEstimate:
    """Per-device memory of one training step of our trainer (see the module docstring for the model), on
    the device that holds the most: with pipeline parallelism, the largest stage.

    `layout` gives every degree (then `world_size` is its product); without it the `world_size` devices
    are data parallel, sharded as `sharding` says. Sharded state is split over the data-parallel shard
    and context-parallel ranks together (torchtitan's FSDP mesh); `batch_size` is each data-parallel
    rank's micro-batch, which a pipeline cuts into `training.pipeline_parallel_microbatches`."""
    training = _precision(training, device_type)
    if sharding not in SHARDING:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING)}, got {sharding!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if layout is None:
        layout = Layout(dp_shard=world_size) if sharding != "none" else Layout(dp_replicate=world_size)
    c = model_config.resolved()
    seq_len = int(seq_len or c.max_seq_len)
    batch_size = int(batch_size or training.batch_size)
    checkpointing = activation_checkpointing(training) if gradient_checkpointing is None else gradient_checkpointing
    counts = count_parameters(c)
    n = counts.total
    w = layout.dp_shard * layout.cp if sharding != "none" else 1
    sharded_params = sharding == "fsdp" and w > 1
    microbatches = (training.pipeline_parallel_microbatches or layout.pp) if layout.pp > 1 else 1
    bubble = pipeline_bubble(layout.pp, microbatches, training.pipeline_parallel_schedule)

    muon_n, muon_group = _muon_matrices(c, training) if training.optimizer == "muon" else (0, 0)
    states = {"adamw": 2, "adam": 2, "muon": 2, "sgd": 1 if training.sgd_momentum else 0}[training.optimizer]
    tokens = batch_size * seq_len
    micro_tokens = tokens / microbatches / layout.cp  # one pipeline micro-batch's positions on this device
    # float8's layers run one by one (`model.project` yields to them); under float8 counted as if no group
    # stacked, though its small layers still do (float8's own smaller saved inputs are not counted either)
    fused = sharding == "none" and stacks_projections(strategy_of(training), layout.tp) and not training.float8
    per_token = activation_bytes_per_token(c, training, device_type, seq_len, fused=fused)
    tp = layout.tp
    block_input = c.d_model * 4 / tp  # what a checkpointed block keeps (fp32; split along the sequence under TP)
    per_layer = per_token["per_layer_whole"] + (per_token["per_layer"] - per_token["per_layer_whole"]) / tp
    muon_in_bf16 = training.optimizer == "muon" and muon_iteration_dtype(torch.device(device_type)) == torch.bfloat16
    workspace = CUBLAS_WORKSPACES_BYTES if device_type == "cuda" else 0.0
    if device_type == "cpu" and ((training.use_amp and training.amp_dtype == "bfloat16") or muon_in_bf16):
        workspace = CPU_BF16_KERNELS_BYTES

    results = []
    for stage in _stages(c, layout, training.pipeline_parallel_schedule):
        params = 4.0 * stage.params / (w if sharding == "fsdp" else 1)
        grads = 4.0 * stage.params / (w if sharding in ("zero2", "fsdp") else 1)
        # every sharding mode shards optimizer state; Muon: one state for the matrices
        optimizer = 4.0 * (states * stage.params - muon_n) / w
        if sharded_params:
            # FSDP2 gathers two blocks at a time (current + prefetch) and keeps the root's (embeddings, final
            # norm, head) gathered from forward to backward, in the autocast dtype under its mixed-precision
            # policy: the forward then runs on those copies, and autocast makes no others
            gathered_bytes = 2.0 if training.use_amp else 4.0
            params += gathered_bytes * (2 * stage.block + stage.params - stage.layers * stage.block)
            amp_copies = 0.0
        else:
            amp_copies = 2.0 * stage.matmul_weights if training.use_amp else 0.0
        # 1F1B: the first stage holds as many micro-batches as there are stages, the last one at a time
        in_flight = min(microbatches, layout.pp) if stage.first else 1
        layers = stage.layers * (block_input if checkpointing else per_layer)
        head_grad = 4.0 * stage.head / (w if sharding in ("zero2", "fsdp") else 1)
        head_saved, head_peak = _head_bytes(c, training, int(micro_tokens), head_grad) if stage.head else (0.0, 0.0)
        ends = (per_token["inputs"] if stage.first else 0.0) + (
            per_token["final_norm"] / tp + per_token["head_input"] if stage.head else 0.0
        )
        activations = in_flight * micro_tokens * (layers + ends) + head_saved
        if training.optimizer == "muon":
            # updates + their stack + orthogonalize's iterates (see the docstring)
            optimizer_temp = (15.0 if muon_in_bf16 else 22.5) * muon_group
        elif training.optimizer == "sgd" and states:
            optimizer_temp = 4.0 * stage.params / w  # the foreach step's temporary
        else:
            optimizer_temp = 0.0  # fused AdamW/Adam
        steady = params + optimizer + workspace
        # the backward's transient: the head's first, then each block's, one at a time
        head_peak = max(head_peak, in_flight * micro_tokens * per_token["block_backward"] / tp)
        phases = {
            "forward_backward": steady + amp_copies + activations + head_peak + head_grad,
            # each block's 16-bit weight copies are freed by its own backward, as its gradients appear
            "end_of_backward": steady + grads + (2.0 * stage.block_matmul_weights if training.use_amp else 0.0),
            "optimizer_step": steady + grads + optimizer_temp,
        }
        if checkpointing:  # the lowest block rebuilt, beside all gradients
            rebuilt = block_input + per_layer + ends
            phases["recompute"] = steady + grads + in_flight * micro_tokens * rebuilt
        peak_phase = max(phases, key=phases.get)
        results.append(
            dict(
                peak=phases[peak_phase],
                stage=stage,
                phases=phases,
                peak_phase=peak_phase,
                params=params,
                grads=grads,
                optimizer=optimizer,
                amp_copies=amp_copies,
                activations=activations,
                head_peak=head_peak,
                optimizer_temp=optimizer_temp,
            )
        )
    largest = max(results, key=lambda r: r["peak"])
    return MemoryEstimate(
        parameters=n,
        params_bytes=largest["params"],
        grads_bytes=largest["grads"],
        optimizer_bytes=largest["optimizer"],
        amp_weight_copies_bytes=largest["amp_copies"],
        activations_bytes=largest["activations"],
        head_peak_bytes=largest["head_peak"],
        optimizer_temp_bytes=largest["optimizer_temp"],
        peak_bytes=largest["peak"],
        tokens_per_micro_batch=tokens,
        world_size=layout.world_size,
        sharding=sharding,
        layout=layout,
        pipeline_bubble=bubble,
        workspace_bytes=workspace,
        details={
            "phases": largest["phases"],
            "peak_phase": largest["peak_phase"],
            "checkpointing": checkpointing,
            "per_token": per_token,
            "optimizer_states_per_param": states,
            "stage_parameters": [r["stage"].params for r in results],  # on one device, before sharding
            "peak_stage": results.index(largest),
            "microbatches": microbatches,
        },
    )


def pipeline_bubble(pp: int, microbatches: int, schedule: str) -> float:
    """The fraction of a step each pipeline stage idles: (pp - 1) / (m + pp - 1) for 1F1B and GPipe; a
    schedule with two stages per rank (interleaved, V-shaped) cuts each micro-batch's stage time in two,
    (pp - 1) / (2 m + pp - 1); the zero-bubble schedules fill part of even that."""
    if pp == 1:
        return 0.0
    per_rank = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    return (pp - 1) / (per_rank * microbatches + pp - 1)


@dataclass(frozen=True)
class _Stage:
    """The parameters one pipeline rank holds (elements, after tensor parallelism, before sharding)."""

    params: int
    layers: int
    block: int  # one block's parameters
    block_matmul_weights: int
    matmul_weights: int
    head: int  # the output head's weight, on the last stage
    first: bool  # holds the embeddings (and so the most micro-batches in flight under 1F1B)


def _stages(c: ModelConfig, layout: Layout, schedule: str) -> list[_Stage]:
    """The distinct pipeline ranks' shares: blocks split by layer, the embeddings on the first stage, the
    final norm and head on the last (a tied head: its own copy there). V-shaped schedules put the first
    and last stages on one rank. Tensor parallelism splits the blocks as its plan does; the rest whole."""
    from .flops import meta_model

    model = meta_model(c)
    block = model.blocks[0]
    whole_block = sum(p.numel() for p in block.parameters())
    if layout.tp > 1:
        from ..parallel.tensor_parallel import local_parameter_count

        per_block = local_parameter_count(block, layout.tp)
    else:
        per_block = whole_block
    block_matmul = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear)) // layout.tp
    inputs = model.tok_emb.weight.numel() + (model.pos_emb.weight.numel() if model.pos_emb is not None else 0)
    head = model.lm_head.weight.numel()
    tied = model.lm_head.weight is model.tok_emb.weight
    total = sum(p.numel() for p in model.parameters())
    rest = total - c.n_layers * whole_block - inputs - (0 if tied else head)  # the final norm
    layers = c.n_layers // layout.pp

    def stage(first: bool, last: bool) -> _Stage:
        ends = (inputs if first else 0) + (rest + head if last else 0) - (head if first and last and tied else 0)
        return _Stage(
            params=layers * per_block + ends,
            layers=layers,
            block=per_block,
            block_matmul_weights=block_matmul,
            matmul_weights=layers * block_matmul + (head if last else 0),
            head=head if last else 0,
            first=first,
        )

    if layout.pp == 1:
        return [stage(True, True)]
    if schedule in V_SCHEDULES:
        return [stage(True, True), stage(False, False)]
    return [stage(True, False), stage(False, True)]


def _head_bytes(c: ModelConfig, training: TrainingConfig, tokens: int, head_grad: float) -> tuple[float, float]:
    """(bytes the head + loss keep for backward, bytes they hold beside that and the head's gradient at
    their peak), as `loss.linear_cross_entropy` computes them for `tokens` positions."""
    from ..loss import SMALL_LOGITS, chunk_rows

    vocab, d, a = c.padded_vocab_size, c.d_model, _act_bytes(training)  # the head multiplies every row
    if tokens * vocab <= SMALL_LOGITS:  # whole logits: log-softmax's grad_out and grad_in beside the saved output
        real = c.vocab_size  # the softmax runs on the real vocabulary's columns only
        return tokens * 4.0 * real, tokens * 2 * 4.0 * real
    saved = tokens * (4.0 - a) * d  # the input's fp32 gradient instead of its (16-bit under amp) copy
    accumulator = 4.0 * vocab * d  # the weight's fp32 gradient, summed over the chunks
    # one chunk at its widest: its logits (and their fp32 copy under amp) beside their log-softmax
    rows = chunk_rows(tokens, vocab, compiled=compiles_whole_model(training, strategy_of(training)))
    chunk = rows * vocab * (a + 8 if training.use_amp else 8)
    product = (a + 4.0) * vocab * d if training.use_amp else 4.0 * vocab * d  # the chunk's weight gradient
    # forward: accumulator + chunk + product; backward's start: accumulator + the head's gradient
    return saved, accumulator + max(chunk + product - head_grad, 0.0)


def _muon_matrices(c: ModelConfig, training: TrainingConfig) -> tuple[int, int]:
    """(elements of the matrices Muon steps, elements of its largest same-shape group), from the model's
    shapes on the meta device and the optimizer's own grouping (train/optim.py)."""
    from .flops import meta_model
    from .optim import muon_groups

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
