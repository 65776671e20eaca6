"""Pipeline parallelism through `torch.distributed.pipelining`: the model's layers split into stages,
one (or two, for the multi-stage schedules) per rank of the mesh's `pp` dimension, as torchtitan's
`pipeline_llama` does.

The whole model is built (on the meta device, or loaded), then each rank keeps what its stages own:

    rank view   the model with only this rank's parts: `blocks` holds its stages' layers under their
                original indices (`StageBlocks`), the embeddings stay on the rank of the first stage,
                the final norm and the head on the rank of the last. Its parameter names are the whole
                model's (`blocks.3.attn.q.weight`), so the optimizer, DCP checkpoints and resumes at
                another layout see the names of every other layout.
    stages      one module per stage: shallow copies of the model, sharing its parameters and buffers
                (materialising or moving the rank view fills them all), each with only that stage's
                layers and ends. Each is handed to a `PipelineStage`.

The embedding and the head live on different ranks, so they cannot be one tied weight (refused in
`mesh`). The last stage's output is the logits; the loss (summed negative log-likelihood, scaled as the
loop scales every backend's) is computed there by the schedule, which splits each batch into
`pipeline_parallel_microbatches` micro-batches. A micro-batch's logits exist whole on the last stage
(the schedule hands the stage's output to the loss function), not chunk by chunk as the model's own
`targets=` forward computes them.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..config import TrainingConfig
from .mesh import MULTI_STAGE_SCHEDULES, microbatch_count, stage_count

# Schedules whose two stages per rank go down and back up (rank r holds stages r and 2 * pp - 1 - r);
# the other multi-stage schedules loop (rank r holds stages r and r + pp).
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


class StageBlocks(nn.ModuleDict):
    """A stage's transformer blocks, keyed by their index in the whole model (so parameter names stay
    `blocks.<index>...`), iterated in order like the model's `nn.ModuleList`."""

    def __iter__(self):
        return iter(self.values())


def stages_of_rank(schedule: str, pp: int, rank: int) -> list[int]:
    """The stage indices pipeline rank `rank` runs, in the order the schedule takes them."""
    if schedule not in MULTI_STAGE_SCHEDULES:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank, rank + pp]


def _keep(module: nn.Module, blocks: list[int], *, first: bool, last: bool) -> None:
    """Leave `module` (a shallow copy of the model) with `blocks` and the ends it owns, in place."""
    module._modules = dict(module._modules)  # its own table of children: the copy's changes stay its own
    whole = module.blocks
    module.blocks = StageBlocks({str(i): whole[i] for i in blocks})  # whole: the model's nn.ModuleList
    if not first:
        module.tok_emb = None
        module.pos_emb = None
    if not last:
        module.norm = None
        module.lm_head = None


def split_model(
    model: nn.Module, config: TrainingConfig, pp: int, rank: int
) -> tuple[nn.Module, list[tuple[int, nn.Module]]]:
    """(the rank view, [(stage index, stage module)]) of `model` for pipeline rank `rank` of `pp`.

    The rank view is `model` itself, its unowned parts removed; the stage modules share its parameters."""
    n_stages = stage_count(config, pp)
    per_stage = len(model.blocks) // n_stages  # divides: mesh.py
    owned = stages_of_rank(config.pipeline_parallel_schedule, pp, rank)
    layers = {s: list(range(s * per_stage, (s + 1) * per_stage)) for s in owned}
    stages = []
    for s in owned:
        stage = copy.copy(model)  # shares the parameter and buffer tables (materialising one fills all)
        _keep(stage, layers[s], first=s == 0, last=s == n_stages - 1)
        stages.append((s, stage))
    every = sorted(i for s in owned for i in layers[s])
    _keep(model, every, first=0 in owned, last=n_stages - 1 in owned)
    return model, stages


def build_schedule(config: TrainingConfig, stages: list[tuple[int, nn.Module]], group, device: torch.device, loss_fn):
    """The `torch.distributed.pipelining` schedule `config.pipeline_parallel_schedule` over this rank's
    `stages`, each batch split into `pipeline_parallel_microbatches` (default: one per stage)."""
    from torch.distributed import pipelining

    pp = group.size()
    n_stages = stage_count(config, pp)
    pipeline_stages = [pipelining.PipelineStage(module, s, n_stages, device, group=group) for s, module in stages]
    schedule_class = getattr(pipelining, f"Schedule{config.pipeline_parallel_schedule}")
    microbatches = microbatch_count(config, pp)
    # the loss is scaled by the loop (per target token of the whole step), so the schedule must not
    # divide the gradients by the micro-batch count again
    if config.pipeline_parallel_schedule in MULTI_STAGE_SCHEDULES:
        return schedule_class(pipeline_stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(pipeline_stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def stage_owners(schedule: str, pp: int) -> dict[int, int]:
    """{stage index: the pipeline rank that runs it}."""
    return {s: rank for rank in range(pp) for s in stages_of_rank(schedule, pp, rank)}


@torch.no_grad()
def forward_only(stages: dict[int, nn.Module], owners: dict[int, int], group, inputs: torch.Tensor, width: int):
    """The last stage's output (logits) for `inputs` (B, T), on the rank that runs the last stage (None
    on the others): the stages one after another, the whole batch at once, each handing its hidden
    states (B, T, `width`, sent as float32) to the next stage's rank.

    Evaluation takes this path, not the schedule's: the zero-bubble schedules cannot run forward only,
    and a schedule's buffers are sized for the training batch's shape."""
    import torch.distributed as dist

    me = group.rank()
    x = inputs
    shape = (*inputs.shape[:2], width)
    for s in range(len(owners)):
        owner = owners[s]
        before = owners.get(s - 1, owner)
        if owner != me:
            if before == me:  # the previous stage ran here: hand its output over
                dist.send(x.float().contiguous(), dist.get_global_rank(group, owner), group=group)
            continue
        if before != me:
            x = torch.empty(shape, dtype=torch.float32, device=inputs.device)
            dist.recv(x, dist.get_global_rank(group, before), group=group)
        x = stages[s](x)
    return x if owners[len(owners) - 1] == me else None
