"""Context parallelism: the ranks of a replica's `cp` group each compute a share of every row's
positions, so a sequence too long for one device's activations trains across several.

PyTorch's ring attention does the work (`torch.distributed.tensor.experimental.context_parallel`, as
torchtitan applies it): inside `split_rows`, `scaled_dot_product_attention` takes this rank's queries
and passes the keys and values of every share round the group, on CUDA's flash, memory-efficient or
cuDNN kernel (mesh.py refuses every other kernel, and masks, before anything starts). Only the
training step runs inside it; evaluation, generation and downstream scoring see whole rows and plain
attention, as under FSDP2 alone.

Causal attention gives later positions more keys to attend to, so torch's head-tail balancer cuts each
row into 2 x cp chunks and gives rank r chunks r and 2 x cp - 1 - r (mesh.py checks that the
length divides). Each token keeps its position (`positions`, which the model's position embedding or
RoPE reads), and its target goes with it, so the loss is the sum over the shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

Part = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]  # inputs, targets, the model's keywords


@contextlib.contextmanager
def split_rows(micro_batches: Sequence[tuple[torch.Tensor, ...]], mesh: DeviceMesh) -> Iterator[list[Part]]:
    """Each micro-batch (inputs (B, T), targets (B, T)) as this rank's share: (inputs (B, T/cp),
    targets (B, T/cp), {"positions": (B, T/cp)}), with ring attention on until the context ends.
    The loader's tensors stay whole (the shares are copies)."""
    from torch.distributed.tensor.experimental import context_parallel

    parts: list[Part] = []
    for inputs, targets, *rest in micro_batches:
        assert not rest, "document masks do not run under context parallelism (mesh.py refuses them)"
        rows, length = inputs.shape
        positions = torch.arange(length, device=inputs.device).expand(rows, length).contiguous()  # (B, T)
        parts.append((inputs.clone(), targets.clone(), {"positions": positions}))
    buffers = [tensor for inputs, targets, extra in parts for tensor in (inputs, targets, extra["positions"])]
    # the shares are cut in place, and nothing needs the whole rows back afterwards
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)):
        yield parts
