"""The gradient norm and its clipping over parameters that live on several device meshes.

Under tensor parallelism the sharded matrices are DTensors on the tensor-parallel mesh (on the 2-D
mesh once FSDP2 shards them too) while the embeddings and the head stay replicated: plain tensors, or
DTensors on the data-parallel mesh only. torch's `clip_grad_norm_` needs every gradient on one mesh,
so the norm is taken per mesh, made whole, and summed; each group is then scaled by the same factor.

Under pipeline parallelism each stage holds other parameters: their squared norms are summed over the
pipeline's process group, so every stage clips by the norm of the whole model.
"""

from __future__ import annotations

import torch


def _mesh_of(tensor: torch.Tensor):
    return getattr(tensor, "device_mesh", None)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None, *, stages=None) -> torch.Tensor:
    """The total 2-norm of the gradients of `params` (a plain tensor, the same on every rank), scaling
    them so it is at most `max_norm` when given. `stages`: the process group whose ranks hold the other
    parameters of the model (the pipeline's stages), or None when `params` are all of them."""
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for p in params:
        if p.grad is not None:
            mesh = _mesh_of(p.grad)
            groups.setdefault(id(mesh), (mesh, []))[1].append(p)
    norms = []
    for _, group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if stages is not None:
        device = params[0].device if params else total.device
        squared = total.to(device, torch.float32).square()
        torch.distributed.all_reduce(squared, group=stages)
        total = squared.sqrt()
    if not norms:
        return total
    if max_norm:
        for mesh, group in groups.values():
            shared = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim)
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, shared, foreach=True)
    return total
