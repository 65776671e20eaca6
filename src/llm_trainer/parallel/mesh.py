"""The device mesh's degrees, decided once from the training config, the model and the world size.

A run is `data_parallel_replicate x data_parallel_shard x pipeline x context x tensor` processes
(torchtitan's order, outermost first). Every combination that cannot train is refused here, in one
line, before the process group opens or any memory is allocated (`resolve.resolve_experiment` calls
`resolve_layout` with the model; `parallelize` reads the same `Layout` back). No torch import: the
checks are arithmetic on the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import launcher
from ..config import ModelConfig, TrainingConfig
from ..errors import UsageError

# Schedules that place several (virtual) stages on each pipeline rank: the layers split into 2 x degree stages.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Of those, the V-shaped ones: a rank holds stage r and stage 2 x degree - 1 - r (the first rank both ends).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# The schedules that split each backward into the inputs' and the weights' halves: a compiled block's
# backward cannot be run in two parts (its buffers are donated to the one backward call).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Layout:
    """How many processes each mesh dimension spans; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the model: the ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """The mesh as the run header prints it."""
        names = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
        return " x ".join(f"{name}={getattr(self, name)}" for name in names)


def resolve_layout(
    training: TrainingConfig,
    world: int,
    *,
    model: ModelConfig | None = None,
    seq_len: int | None = None,
    device_type: str | None = None,
    document_mask: bool = False,
) -> Layout:
    """The layout of `world` processes, or a UsageError naming the first setting that cannot work.

    `model`, `seq_len`, `device_type`: checked when given (the model's heads and layers, the rows'
    length, the attention kernel's device); `document_mask`: data.document_mask, which context
    parallelism's kernels and the pipeline's stages cannot apply. The world product and the strategy are always checked."""
    tp, pp, cp = training.tensor_parallel_degree, training.pipeline_parallel_degree, training.context_parallel_degree
    _check_strategy(training, tp, pp, cp)
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise UsageError(
            f"training: tensor_parallel_degree x pipeline_parallel_degree x context_parallel_degree = {tp} x {pp} x "
            f"{cp} = {model_parallel} does not divide the {world} process(es) the launcher started; change a degree "
            "or the process count"
        )
    replicate, shard = _data_parallel(training, world // model_parallel, world)
    layout = Layout(dp_replicate=replicate, dp_shard=shard, pp=pp, cp=cp, tp=tp)
    if model is not None:
        _check_model(training, layout, model.resolved())
    if seq_len is not None:
        _check_sequence(layout, seq_len)
    if cp > 1 and model is not None:
        _check_context_kernel(training, model, device_type, document_mask)
    if pp > 1:
        _check_microbatches(training, layout)
        if document_mask:
            raise UsageError(
                f"data.document_mask does not run under pipeline_parallel_degree={pp} yet (the stages pass hidden "
                "states only); set document_mask: false, or the degree to 1"
            )
    return layout


# Strategies under which each process holds every weight whole, as plain tensors, through forward and
# backward (no gathered shards).
WHOLE_WEIGHT_STRATEGIES = ("single", "ddp")


def stacks_projections(strategy: str, tp: int) -> bool:
    """Whether the blocks may run their projections as one matmul over stacked weights (`model.project`):
    only where every weight is whole, never split by tensor parallelism. What parallelize sets and what
    the memory estimate counts."""
    return strategy in WHOLE_WEIGHT_STRATEGIES and tp == 1


def compiles_whole_model(training: TrainingConfig, strategy: str) -> bool:
    """Whether torch.compile traces the whole model, its loss included: under FSDP2 each block is compiled
    on its own instead (its hooks run between the blocks' graphs). What parallelize applies and what the
    memory estimate counts (the compiled loss's chunks, `loss.chunk_rows`)."""
    return training.compile and strategy != "fsdp"


def strategy_of(training: TrainingConfig) -> str:
    """distributed_strategy with `auto` decided for several processes: fsdp when a data-parallel shard
    degree is given (torchtitan's `data_parallel_shard_degree: -1` included), else ddp."""
    if training.distributed_strategy != "auto":
        return training.distributed_strategy
    sharded = (
        training.data_parallel_shard_degree not in (None, 1)
        or training.tensor_parallel_degree > 1
        or training.pipeline_parallel_degree > 1
        or training.context_parallel_degree > 1
    )
    return "fsdp" if sharded else "ddp"


def _check_strategy(training: TrainingConfig, tp: int, pp: int, cp: int) -> None:
    strategy = training.distributed_strategy
    if strategy == "deepspeed":
        for name, degree in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp)):
            if degree > 1:
                raise UsageError(
                    f"training.{name}={degree} cannot run under distributed_strategy deepspeed (its engine owns the "
                    f"model); use distributed_strategy: fsdp with {name}, or {name}: 1"
                )
        if cp > 1:
            raise UsageError(
                f"training.context_parallel_degree={cp} cannot run under distributed_strategy deepspeed; "
                "use distributed_strategy: fsdp, or context_parallel_degree: 1"
            )
        for name in ("data_parallel_replicate_degree", "data_parallel_shard_degree"):
            if getattr(training, name) not in (None, -1):
                raise UsageError(
                    f"training.{name} does not apply to distributed_strategy deepspeed (its zero_optimization stage "
                    "decides what is sharded); remove it"
                )
    for name, degree in (
        ("tensor_parallel_degree", tp),
        ("pipeline_parallel_degree", pp),
        ("context_parallel_degree", cp),
    ):
        if degree > 1 and strategy_of(training) != "fsdp" and strategy != "deepspeed":
            raise UsageError(
                f"training.{name}={degree} composes with FSDP2 only (DDP would average the ranks' different "
                f"parts); set distributed_strategy: fsdp (or auto), or {name}: 1"
            )
    if cp > 1 and pp > 1:
        raise UsageError(
            f"training.context_parallel_degree={cp} does not compose with pipeline_parallel_degree={pp} (the "
            "pipeline's stages pass whole rows); use one of them"
        )
    if tp > 1 and training.compile and training.gradient_checkpointing:
        raise UsageError(
            f"training.tensor_parallel_degree={tp} with both gradient_checkpointing and compile does not train on "
            "torch's compiler (it saves the tensor-parallel mesh among the checkpointed tensors); turn one of the "
            "two off"
        )
    if pp > 1 and training.compile and training.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise UsageError(
            f"training.pipeline_parallel_schedule {training.pipeline_parallel_schedule} runs each backward in two "
            "halves (inputs', then weights'), which a compiled block's backward cannot do; set training.compile: "
            "false, or a schedule without that split (1F1B, Interleaved1F1B, GPipe, LoopedBFS)"
        )
    if cp > 1 and training.compile:
        raise UsageError(
            f"training.context_parallel_degree={cp} runs its ring attention eagerly, outside torch.compile; set "
            "training.compile: false, or context_parallel_degree: 1"
        )
    if pp > 1 and training.layer_stats_steps:
        raise UsageError(
            f"training.layer_stats_steps does not run under pipeline_parallel_degree={pp} yet (each stage holds "
            "other layers); remove it, or set the degree to 1"
        )
    if tp > 1 and training.float8:
        raise UsageError(
            f"training.float8 with tensor_parallel_degree={tp} is not available yet (its float8 layers need their "
            "own tensor-parallel plan); use one of them"
        )
    if (tp > 1 or pp > 1 or cp > 1) and training.optimizer == "muon":
        raise UsageError(
            "optimizer muon needs each weight whole, and tensor, pipeline or context parallelism splits them; "
            "use optimizer adamw, or set those degrees to 1"
        )


def _data_parallel(training: TrainingConfig, rest: int, world: int) -> tuple[int, int]:
    """(replicate, shard) over the `rest` processes the model-parallel degrees leave."""
    replicate, shard = training.data_parallel_replicate_degree, training.data_parallel_shard_degree
    strategy = strategy_of(training)
    if replicate is None and shard is None and strategy == "fsdp" and training.fsdp_sharding == "hybrid_shard":
        per_node = launcher.local_world_size()  # HSDP by default: replicate across nodes, shard within one
        replicate, shard = (rest // per_node, per_node) if rest % per_node == 0 else (1, rest)
    elif replicate in (None, -1) and shard in (None, -1):
        if replicate == -1 and shard == -1:
            raise UsageError(
                "training.data_parallel_replicate_degree and data_parallel_shard_degree are both -1 (the rest); "
                "set one of them"
            )
        if shard == -1 or (shard is None and replicate is None and strategy == "fsdp"):
            replicate, shard = 1, rest
        else:
            replicate, shard = rest, 1
    elif replicate in (None, -1):
        replicate = rest // shard if rest % shard == 0 else 0
    elif shard in (None, -1):
        shard = rest // replicate if rest % replicate == 0 else 0
    if replicate * shard != rest or replicate == 0:
        raise UsageError(
            f"training: the degrees multiply to data_parallel_replicate {_shown(training.data_parallel_replicate_degree)}"
            f" x data_parallel_shard {_shown(training.data_parallel_shard_degree)} x tensor {training.tensor_parallel_degree} x "
            f"pipeline {training.pipeline_parallel_degree} x context {training.context_parallel_degree}, not the {world} "
            "process(es) the launcher started; make their product the world size (-1 on one data-parallel degree: "
            "the rest)"
        )
    if shard > 1 and strategy != "fsdp":
        raise UsageError(
            f"training.data_parallel_shard_degree={shard} shards the model, which needs distributed_strategy: fsdp "
            f"(it is {strategy}); set it, or data_parallel_shard_degree: 1"
        )
    if replicate > 1 and strategy == "fsdp" and training.fsdp_sharding != "hybrid_shard":
        raise UsageError(
            f"training: data_parallel_replicate_degree={replicate} under distributed_strategy fsdp is HSDP; "
            "set fsdp_sharding: hybrid_shard, or data_parallel_replicate_degree: 1"
        )
    return replicate, shard


def _shown(degree: int | None) -> str:
    """A data-parallel degree as given: unset and -1 both take the rest."""
    return "(the rest)" if degree in (None, -1) else str(degree)


def _check_model(training: TrainingConfig, layout: Layout, model: ModelConfig) -> None:
    """Tensor parallelism splits heads, kv heads, d_model and d_ff; pipeline parallelism splits layers."""
    tp = layout.tp
    for name, size in (
        ("n_heads", model.n_heads),
        ("n_kv_heads", model.n_kv_heads),
        ("d_model", model.d_model),
        ("d_ff", model.d_ff),
    ):
        if size % tp:
            raise UsageError(
                f"training.tensor_parallel_degree={tp} does not divide model.{name} ({size}); "
                f"use a degree that divides it"
            )
    if tp > 1 and (model.dropout or model.attention_dropout):
        raise UsageError(
            f"training.tensor_parallel_degree={tp} needs model.dropout and model.attention_dropout 0 (the ranks of "
            "one replica would draw different masks for the same activations); set them to 0, or the degree to 1"
        )
    if layout.pp > 1 and model.tie_embeddings:
        raise UsageError(
            f"training.pipeline_parallel_degree={layout.pp} puts the embedding on the first stage and the output "
            "head on the last, which cannot share one weight; set model.tie_embeddings: false"
        )
    stages = stage_count(training, layout.pp)
    if model.n_layers % stages:
        each = "" if stages == layout.pp else f" ({training.pipeline_parallel_schedule}: 2 stages per rank)"
        raise UsageError(
            f"training.pipeline_parallel_degree={layout.pp} splits model.n_layers ({model.n_layers}) into {stages} "
            f"stages{each}, which does not divide it; use a degree that divides the layers"
        )


def stage_count(training: TrainingConfig, pp: int) -> int:
    """Pipeline stages the layers split into: one per pipeline rank, two with a multi-stage schedule."""
    return pp * (2 if training.pipeline_parallel_schedule in MULTI_STAGE_SCHEDULES else 1)


def _check_sequence(layout: Layout, seq_len: int) -> None:
    """Context parallelism's load-balanced ring gives each CP rank two chunks of each row; sequence
    parallelism shards a rank's positions (all of them, or its CP share) over the TP ranks."""
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        raise UsageError(
            f"training.context_parallel_degree={layout.cp} needs a sequence length divisible by 2 x {layout.cp}, "
            f"got {seq_len}; change data.max_length or the degree"
        )
    if (seq_len // layout.cp) % layout.tp:
        share = (
            "the sequence length"
            if layout.cp == 1
            else f"each context-parallel rank's {seq_len // layout.cp} positions"
        )
        raise UsageError(
            f"training.tensor_parallel_degree={layout.tp} does not divide {share} ({seq_len // layout.cp}) that "
            "sequence parallelism splits; change data.max_length or the degree"
        )


def _check_context_kernel(
    training: TrainingConfig, model: ModelConfig, device_type: str | None, document_mask: bool
) -> None:
    """Context parallelism's ring attention (`torch.distributed.tensor.experimental.context_parallel`)
    replaces three CUDA kernels of scaled_dot_product_attention only: flash, memory-efficient and cuDNN,
    causal and without a mask tensor. The math kernel, FlexAttention, a CPU and document masks have none."""
    if model.attention_backend != "sdpa":
        raise UsageError(
            f"training.context_parallel_degree needs model.attention_backend: sdpa (ring attention has no "
            f"{model.attention_backend} kernel); use sdpa, or context_parallel_degree: 1"
        )
    if training.sdpa_backend == "math":
        raise UsageError(
            "training.context_parallel_degree needs the flash, efficient or cudnn attention kernel (ring attention "
            "has no math kernel); set training.sdpa_backend to one of them or auto, or context_parallel_degree: 1"
        )
    if document_mask:
        raise UsageError(
            "training.context_parallel_degree cannot apply data.document_mask (ring attention takes causal "
            "attention without a mask tensor); set document_mask: false, or context_parallel_degree: 1"
        )
    if device_type is not None and device_type != "cuda":
        raise UsageError(
            f"training.context_parallel_degree needs CUDA (ring attention runs on CUDA's flash, efficient and cuDNN "
            f"attention kernels), and this run is on {device_type}; use context_parallel_degree: 1"
        )


def microbatch_count(training: TrainingConfig, pp: int) -> int:
    """The micro-batches a pipeline splits each batch into: as given, or one per stage."""
    return training.pipeline_parallel_microbatches or stage_count(training, pp)


def _check_microbatches(training: TrainingConfig, layout: Layout) -> None:
    """Each pipeline stage needs micro-batches to overlap; they split batch_size rows evenly."""
    count, stages = microbatch_count(training, layout.pp), stage_count(training, layout.pp)
    if count < stages:
        raise UsageError(
            f"training.pipeline_parallel_microbatches={count} is fewer than the {stages} pipeline stages; "
            f"use at least {stages}"
        )
    if training.batch_size != "auto" and training.batch_size % count:  # auto picks a multiple of the count
        raise UsageError(
            f"training.batch_size ({training.batch_size}) must split into pipeline_parallel_microbatches ({count}) "
            "equal micro-batches; change one of them"
        )
