"""The device mesh `llm-trainer estimate` advises for a cluster: the cheapest layout whose estimated peak fits.

The search follows torchtitan's advice on composing the degrees: shard with FSDP first (it only adds
all-gathers and reduce-scatters that overlap the compute); then tensor parallelism inside a node (four
collectives per block on the critical path, an all-gather and a reduce-scatter around attention and
around the MLP, which only NVLink-class links hide; degree 1, 2, 4 or 8,
dividing the heads, kv heads and widths); pipeline parallelism across nodes last (its bubble idles a
fraction of every device). Activation checkpointing (a third more compute) is tried at each
(pipeline, tensor) degree before the next degree. Data-parallel sharding takes every rank the others
leave. Each candidate is checked by `mesh.resolve_layout`, the same rules a run is held to, and measured
by `estimate_memory`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig, TrainingConfig
from ..errors import UsageError
from ..parallel.mesh import Layout, resolve_layout
from ..train.memory_estimate import GiB, estimate_memory

TENSOR_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True, kw_only=True)
class LayoutAdvice:
    """One fitting layout, what it costs, and the settings that run it."""

    layout: Layout
    gpus_per_node: int
    gradient_checkpointing: bool
    batch_size: int
    microbatches: int
    peak_gb: float
    device_memory_gb: float
    pipeline_bubble: float

    @property
    def nodes(self) -> int:
        return max(1, self.layout.world_size // self.gpus_per_node)

    def settings(self) -> dict[str, object]:
        """The `training` keys (YAML, or `training.KEY=VALUE` overrides) that give this layout."""
        keys: dict[str, object] = {
            "distributed_strategy": "fsdp",
            "data_parallel_shard_degree": -1,
            "tensor_parallel_degree": self.layout.tp,
            "pipeline_parallel_degree": self.layout.pp,
            "gradient_checkpointing": self.gradient_checkpointing,
            "batch_size": self.batch_size,
        }
        if self.layout.pp > 1:
            keys["pipeline_parallel_microbatches"] = self.microbatches
        return keys

    def command(self, config: str) -> str:
        """The launch line on each node (Slurm's srun starts one per node; README: several machines)."""
        overrides = " ".join(f"training.{k}={str(v).lower()}" for k, v in self.settings().items())
        return (
            f"srun torchrun --nnodes {self.nodes} --nproc_per_node {min(self.gpus_per_node, self.layout.world_size)} "
            f"--rdzv_backend c10d --rdzv_endpoint $head:29500 -m llm_trainer train --config {config} {overrides}"
        )

    def to_dict(self) -> dict:
        return {
            "layout": dataclasses.asdict(self.layout),
            "gradient_checkpointing": self.gradient_checkpointing,
            "batch_size": self.batch_size,
            "pipeline_microbatches": self.microbatches,
            "peak_gb": self.peak_gb,
            "device_memory_gb": self.device_memory_gb,
            "pipeline_bubble": self.pipeline_bubble,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "settings": self.settings(),
        }


def advise_layout(
    model_config: ModelConfig,
    training: TrainingConfig,
    *,
    world_size: int,
    device_memory_gb: float,
    seq_len: int,
    gpus_per_node: int = 8,
    batch_size: int = 1,
    device_type: str = "cuda",
) -> LayoutAdvice | None:
    """The first layout of `world_size` devices, in the order of the module docstring, whose estimated
    peak fits `device_memory_gb`; None when none does. `batch_size` is each data-parallel rank's
    micro-batch; a pipeline cuts it into at least one micro-batch per stage."""
    if gpus_per_node < 1 or world_size < 1:
        raise UsageError(f"--gpus-per-node and the world size must be at least 1, got {gpus_per_node} and {world_size}")
    c = model_config.resolved()
    for pp in (d for d in range(1, c.n_layers + 1) if c.n_layers % d == 0 and world_size % d == 0):
        for tp in (t for t in TENSOR_DEGREES if t <= gpus_per_node and gpus_per_node % t == 0):
            for checkpointing in (False, True):
                advice = _try(
                    c, training, world_size, pp, tp, checkpointing, batch_size, seq_len, device_type, gpus_per_node
                )
                if advice is not None and advice.peak_gb <= device_memory_gb:
                    return dataclasses.replace(advice, device_memory_gb=device_memory_gb)
    return None


def _try(c, training, world, pp, tp, checkpointing, batch, seq_len, device_type, gpus_per_node) -> LayoutAdvice | None:
    """The layout with these degrees and its estimated peak, or None where the mesh rules refuse it."""
    microbatches = max(training.pipeline_parallel_microbatches or pp, pp) if pp > 1 else 1
    rows = -(-max(batch, microbatches) // microbatches) * microbatches  # whole micro-batches
    candidate = dataclasses.replace(
        training,
        distributed_strategy="fsdp",
        fsdp_sharding="full_shard",
        data_parallel_replicate_degree=None,
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        context_parallel_degree=1,
        pipeline_parallel_microbatches=microbatches if pp > 1 else None,
        gradient_checkpointing=checkpointing,
        batch_size=rows,
    )
    try:
        layout = resolve_layout(candidate, world, model=c, seq_len=seq_len)
    except UsageError:
        return None
    mem = estimate_memory(
        c,
        candidate,
        seq_len=seq_len,
        batch_size=rows,
        sharding="fsdp",
        gradient_checkpointing=checkpointing,
        device_type=device_type,
        layout=layout,
    )
    return LayoutAdvice(
        layout=layout,
        gpus_per_node=gpus_per_node,
        gradient_checkpointing=checkpointing,
        batch_size=rows,
        microbatches=microbatches,
        peak_gb=mem.peak_bytes / GiB,
        device_memory_gb=0.0,
        pipeline_bubble=mem.pipeline_bubble,
    )


def format_advice(advice: LayoutAdvice | None, *, world_size: int, device_memory_gb: float, config: str) -> str:
    """The advice as `llm-trainer estimate` prints it."""
    if advice is None:
        return (
            f"no layout of {world_size} devices fits {device_memory_gb:g} GiB each (tensor degree up to 8 within a "
            "node, pipeline degree dividing the layers, checkpointing on); add nodes or shorten the sequence"
        )
    lay = advice.layout
    keys = ", ".join(f"{k}: {str(v).lower()}" for k, v in advice.settings().items())
    return "\n".join(
        [
            f"advised layout for {lay.world_size} devices ({advice.nodes} node(s) x "
            f"{min(advice.gpus_per_node, lay.world_size)}), {device_memory_gb:g} GiB each:",
            f"  mesh            {lay.describe()}, activation checkpointing "
            f"{'on' if advice.gradient_checkpointing else 'off'}, micro-batch {advice.batch_size}",
            f"  peak            {advice.peak_gb:.1f} GiB per device"
            + (" (the largest pipeline stage)" if lay.pp > 1 else ""),
            f"  pipeline bubble {advice.pipeline_bubble:.0%} of each step ({advice.microbatches} micro-batches; more "
            "shrink it)"
            if lay.pp > 1
            else "  pipeline bubble none (no pipeline)",
            f"  YAML            training: {{{keys}}}",
            f"  command         {advice.command(config)}",
            f"  Slurm           sbatch --nodes {advice.nodes} examples/slurm_multinode.sh {config} "
            + " ".join(f"training.{k}={str(v).lower()}" for k, v in advice.settings().items()),
        ]
    )
