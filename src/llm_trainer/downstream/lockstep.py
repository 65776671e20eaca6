"""The model as the adapter calls it when several processes evaluate: each rank computes its share of the
work, every rank runs as many forwards as the busiest one, and every rank ends with every result.

lm-eval is shown one process (rank 0 of 1), so every rank builds every request exactly as one process
builds them (its few-shot sampler draws per process, in the order the process visits its documents);
the split is ours, by units of work (a batch, a sampled generation): rank r takes units r, r + world,
r + 2 world, ... of a list every rank builds alike.

Under sharded parameters (FSDP2, DeepSpeed ZeRO-3) a forward is a collective: each layer's weights are
gathered from every rank. Before each forward the ranks agree (one all-reduce) whether any of them still
has work; a rank whose share is done joins the others' forwards with a one-token forward whose result
is dropped, until no rank has work. Whole models (one process, DDP, ZeRO-1/2, the copies gathered under
tensor and pipeline parallelism: `Parallelism.scoring_model`) follow the same steps.
The model's `extend` gathers the weights as `forward` does: FSDP2 has it registered as a forward method
(`parallel.parallelize.apply_fsdp`); ZeRO-3's hooks sit on every layer, and the root holds no weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

Unit = TypeVar("Unit")


def _rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Lockstep:
    """`model` (ours: `forward` and `extend`), called in step with the other ranks. Other attributes are
    the model's own (`config`, `parameters`, `eval`: what `llm_trainer.generate` reads)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rank, self.world_size = _rank_and_size()
        self._device = next(model.parameters()).device

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self._any_working(True)
        return self.model(*args, **kwargs)

    def extend(self, *args, **kwargs) -> torch.Tensor:
        self._any_working(True)
        return self.model.extend(*args, **kwargs)

    # -- the split ------------------------------------------------------------------------------

    def mine(self, units: Sequence[Unit]) -> Sequence[Unit]:
        """This rank's share of `units` (the same list on every rank): every world_size-th, from its rank.
        Longest-first lists stay balanced."""
        return units[self.rank :: self.world_size]

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Run this rank's share inside; on leaving, keep joining the others' forwards until every rank's
        share is done (every forward inside must go through this object)."""
        yield
        while self._any_working(False):
            self._idle_forward()

    def gather(self, values: list) -> list:
        """`values` (None where another rank computed the value) completed with every rank's values."""
        if self.world_size == 1:
            return values
        found = {i: value for i, value in enumerate(values) if value is not None}
        shares: list[dict | None] = [None] * self.world_size
        torch.distributed.all_gather_object(shares, found)
        merged = list(values)
        for share in shares:
            for i, value in share.items():
                merged[i] = value
        assert all(value is not None for value in merged), "a request no rank computed"
        return merged

    # -- lockstep -------------------------------------------------------------------------------

    def _any_working(self, working: bool) -> bool:
        """Whether any rank has a forward to run now (a collective every rank calls before each forward)."""
        if self.world_size == 1:
            return working
        flag = torch.tensor([int(working)], device=self._device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _idle_forward(self) -> None:
        """One token through every layer (the weights gathered as the working ranks' forward gathers them);
        its logits are dropped."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self._device)
        sees = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self._device)
        self.model.extend(one, None, one, sees)
