"""Per-layer statistics (`training.layer_stats_steps`): where in the model the gradient and the update go.

Every `layer_stats_steps` steps a `kind: "layers"` row holds, for each group of parameters (one per block
and part of a block: `blocks.3.attn`, `blocks.3.mlp_norm`; the embedding, final norm and head each
their own), `layers/<group>/grad_norm` (this step's gradient, before clipping, over the whole step),
`layers/<group>/param_norm` (the weights it was taken at) and `layers/<group>/update_ratio` (the norm of
what the optimizer changed, over param_norm). TensorBoard, W&B and MLflow plot them by those names.
Histograms of each group's gradient and weight values (`layers/<group>/grad`, `layers/<group>/weight`,
`HISTOGRAM_BINS` bins between the group's minimum and maximum) go to TensorBoard and W&B, not to
metrics.jsonl: `histograms()` after the row.

Cost: the norms come from `torch._foreach_norm` over the local tensors; the update needs a copy of the
local weights on those steps only. Under DDP every rank holds the whole (averaged) gradient, so nothing
is exchanged; under FSDP2 each rank holds shards (DTensors), whose squared norms are summed over the
ranks in one all-reduce of a (3, groups) tensor: never a gather of weights (the histograms take two more
small ones: the ranges, then the counts). DeepSpeed keeps gradients and fp32 weights in its own
partitioned buffers (no `param.grad`; under ZeRO-3 not even the weights): there they are read through
DeepSpeed's own accessors, `safe_get_full_grad` and `safe_get_full_fp32_param`, which every rank calls
for every parameter (one all-reduce, ZeRO-3 a gather, per parameter and value, on those steps only), so
every rank holds whole tensors as under DDP.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..logs import log
from ..parallel.distributed import all_reduce_

HISTOGRAM_BINS = 64
WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"}  # names wrappers add


def group_of(name: str) -> str:
    """The group of a parameter: `blocks.3.attn.q.weight` -> `blocks.3.attn`; `tok_emb.weight` -> `tok_emb`."""
    parts = [part for part in name.split(".") if part not in WRAPPERS]
    for i, part in enumerate(parts[:-2]):
        if part.isdigit():
            return ".".join(parts[: i + 2])
    return parts[0] if len(parts) > 1 else "params"


def _copies(tensor: torch.Tensor, world: int) -> int:
    """On how many of the `world` ranks this rank's part of `tensor` lives: 1 for FSDP2's shards; the
    tensor-parallel ranks' count for a tensor they all hold (a Replicate placement, or a plain tensor)."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return world
    replicated = [mesh.size(i) for i, placement in enumerate(tensor.placements) if placement.is_replicate()]
    return world // mesh.size() * math.prod(replicated)


def _reduced(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole on its mesh: a sequence-parallel norm's is a partial sum on each rank (the
    optimizer's update sums it as it reads it), summed here (a collective)."""
    placements = getattr(grad, "placements", ())
    if not any(placement.is_partial() for placement in placements):
        return grad
    from torch.distributed.tensor import Replicate

    return grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in placements])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded: FSDP2's DTensor) tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class LayerStats:
    """Collects one row of per-group norms around one optimizer step (see the module docstring)."""

    def __init__(self, model: nn.Module, every: int | None, histograms: bool = False):
        self.every = every or 0
        self.keep_values = histograms  # a backend draws histograms (TensorBoard, W&B): keep the step's values
        named = [(group_of(name), p) for name, p in model.named_parameters() if p.requires_grad]
        self.groups = list(dict.fromkeys(group for group, _ in named))
        self.params = [p for _, p in named]
        self.sharded = any(hasattr(p, "to_local") for p in self.params)
        # DeepSpeed's engine marks the parameters it partitions (ZeRO-3: ds_id; ZeRO-1/2: _hp_mapping)
        self.deepspeed = any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in self.params)
        self._index = torch.tensor([self.groups.index(group) for group, _ in named], dtype=torch.long)
        # each part's squares count once in the sum over ranks (tensor parallelism leaves some parts on several)
        world = torch.distributed.get_world_size() if self.sharded and torch.distributed.is_initialized() else 1
        self._share = torch.tensor([1.0 / _copies(p, world) for p in self.params]) if world > 1 else None
        self._sums: torch.Tensor | None = None
        self._values: dict[str, list[torch.Tensor]] = {}  # this step's local gradients and weights, for histograms
        self._before: list[torch.Tensor] | None = None
        self._said = False

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _group_sums(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Squared norms of `tensors` summed per group (local parts only)."""
        norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in tensors])
        squares = torch.stack(norms).to(device).float().pow(2)
        if self._share is not None:
            squares = squares * self._share.to(device)
        return torch.zeros(len(self.groups), device=device).index_add_(0, self._index.to(device), squares)

    def _weights(self) -> list[torch.Tensor]:
        """The weights now: this rank's parts, or under DeepSpeed the whole fp32 weights it keeps."""
        if self.deepspeed:
            from deepspeed.utils import safe_get_full_fp32_param

            full = [safe_get_full_fp32_param(p) for p in self.params]  # every rank: a collective each
            return [w.detach() if w is not None else p.detach() for w, p in zip(full, self.params)]
        return [_local(p).detach() for p in self.params]

    def _grads(self) -> list[torch.Tensor | None]:
        """This step's gradients: this rank's parts, or under DeepSpeed the whole averaged gradients."""
        if self.deepspeed:
            from deepspeed.utils import safe_get_full_grad

            return [safe_get_full_grad(p) for p in self.params]  # every rank: a collective each
        return [_local(_reduced(p.grad)) if p.grad is not None else None for p in self.params]

    def before_step(self, scale: float = 1.0) -> None:
        """Gradients complete, weights not yet changed: their norms, and a copy of the weights. `scale`:
        the loss scale the gradients still carry (fp16), divided out."""
        if not self.params:
            return
        grads = self._grads()
        if scale != 1.0:
            grads = [g / scale if g is not None else None for g in grads]
        if all(g is None for g in grads):
            if not self._said:
                self._said = True
                log("layer stats: no parameter has a gradient this step; not written")
            return
        weights = self._weights()
        device = weights[0].device
        none = torch.zeros(1, device=device)  # a parameter this step did not reach
        grads = [g.to(device) if g is not None else none for g in grads]
        self._sums = torch.stack(
            [
                self._group_sums(grads, device),
                self._group_sums(weights, device),
                torch.zeros(len(self.groups), device=device),
            ]
        )
        self._before = [w.clone() for w in weights]
        if self.keep_values:  # copies: clipping scales the gradients and the update changes the weights in place
            self._values = {"grad": [g.clone() for g in grads], "weight": self._before}

    def after_step(self, step: int) -> dict | None:
        """The row for `step` (None when before_step collected nothing); one reduction under FSDP2, one host read."""
        if self._sums is None or self._before is None:
            return None
        sums, before = self._sums, self._before
        self._sums = self._before = None
        with torch.no_grad():
            deltas = [now.float() - old.float() for now, old in zip(self._weights(), before)]
            sums[2] = self._group_sums(deltas, sums.device)
        if self.sharded:
            all_reduce_(sums)  # each rank's shards' squares: the sum is the whole tensor's
        grad, param, update = sums.sqrt().tolist()
        row: dict = {"kind": "layers", "step": int(step)}
        for i, group in enumerate(self.groups):
            row[f"layers/{group}/grad_norm"] = grad[i]
            row[f"layers/{group}/param_norm"] = param[i]
            row[f"layers/{group}/update_ratio"] = update[i] / param[i] if param[i] > 0 else 0.0
        return row

    def histograms(self, step: int) -> dict[str, dict]:
        """Per group, the histograms of the step's gradients and weights (before the update), as TensorBoard's
        raw histogram fields: min, max, num, sum, sum_squares, bucket_limits, bucket_counts. Called after
        `after_step` on the same step; every rank calls it (FSDP2 reduces the shards' counts)."""
        values, self._values = self._values, {}
        if not values:
            return {}
        out: dict[str, dict] = {}
        for what, tensors in values.items():
            flat = [
                torch.cat([t.detach().reshape(-1).float() for t, g in zip(tensors, self._index.tolist()) if g == i])
                for i in range(len(self.groups))
            ]
            device = flat[0].device
            inf = torch.tensor(float("inf"), device=device)
            # per group: (max, -min, ...) reduced with MAX, then counts, sum, squares reduced with SUM
            ranges = torch.stack(
                [torch.stack([f.max() if f.numel() else -inf, -f.min() if f.numel() else -inf]) for f in flat]
            )
            if self.sharded:
                all_reduce_(ranges, op=torch.distributed.ReduceOp.MAX)
            stats = []
            for f, (high, neg_low) in zip(flat, ranges):
                low, high = -neg_low, high
                if not torch.isfinite(low) or not torch.isfinite(high):
                    low, high = torch.zeros((), device=device), torch.zeros((), device=device)
                width = torch.clamp(high - low, min=1e-12)
                index = ((f - low) / width * HISTOGRAM_BINS).long().clamp(0, HISTOGRAM_BINS - 1)
                counts = torch.zeros(HISTOGRAM_BINS, device=device).index_add_(0, index, torch.ones_like(f))
                stats.append(
                    torch.cat(
                        [counts, torch.stack([f.sum(), f.pow(2).sum(), torch.tensor(float(f.numel()), device=device)])]
                    )
                )
            table = torch.stack(stats)
            if self.sharded:
                all_reduce_(table)
            for i, group in enumerate(self.groups):
                low, high = float(-ranges[i, 1]), float(ranges[i, 0])
                row = table[i].tolist()
                edges = torch.linspace(low, max(high, low + 1e-12), HISTOGRAM_BINS + 1)[1:].tolist()
                out[f"layers/{group}/{what}"] = {
                    "min": low,
                    "max": high,
                    "num": row[-1],
                    "sum": row[-3],
                    "sum_squares": row[-2],
                    "bucket_limits": edges,
                    "bucket_counts": row[:HISTOGRAM_BINS],
                }
        return out
