"""Muon for the hidden matrices, AdamW for everything else, as one optimizer with one state.

Muon (Jordan et al. 2024, the modded-nanoGPT speedruns; `torch.optim.Muon`) replaces each 2-D
weight's momentum-smoothed gradient by its nearest semi-orthogonal matrix (5 Newton-Schulz
iterations, in bfloat16 where the device computes it natively, else float32) before the step: every
direction of the update moves at the same rate. In float32 a matrix at least twice as wide as it is
tall (an MLP's) runs the same iterations in their Gram form (`gram_newton_schulz`), on its small side
only. It is meant for the matrices inside the blocks;
embeddings, the output head, norms and biases keep AdamW. Here both live in one
`torch.optim.Optimizer` (groups marked `muon: True/False`), so a checkpoint holds one optimizer state
and a resume is exact.

Each group's learning rate is the schedule's value times the group's `lr_scale` (Muon's groups:
`muon_learning_rate / learning_rate`), so one schedule drives both. `found_inf` (set by the loop's
non-finite-step skip) leaves weights and state untouched without a host sync, as the fused AdamW does.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adam import adam

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan's Muon)


GRAM_MIN_ASPECT = 2  # from this aspect ratio on the Gram form takes fewer multiply-adds (bench/muon_gram.py)
GRAM_RESTART = 2  # iterations after which the Gram form rebuilds X and its Gram matrix (see gram_newton_schulz)


def orthogonalize(
    matrices: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Approximately U V^T for each matrix U S V^T of a (n, rows, cols) stack: singular values pushed into
    about [0.7, 1.2]. A stack of same-shape matrices runs as one batched matmul per iteration. The
    iterations run in `dtype`: bf16 where the device multiplies it natively (a GPU, a CPU with
    AVX512-BF16 or AMX), float32 elsewhere, where bf16 matmuls are emulated and tens of times slower.
    In float32, matrices at least `GRAM_MIN_ASPECT` times as wide as tall take the Gram form, which
    gives the same result to float32's rounding; bf16 keeps the direct form, whose rounding errors the
    Gram form would amplify."""
    x = matrices.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    iterate = (
        gram_newton_schulz if dtype == torch.float32 and x.size(-1) >= GRAM_MIN_ASPECT * x.size(-2) else newton_schulz
    )
    # spectral norm at most 1; passed on, not kept here, so the iterations can free it once replaced
    x = iterate(x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps), steps)
    return (x.mT if tall else x).to(matrices.dtype)


def newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` quintic Newton-Schulz iterations X <- a X + (b G + c G^2) X with G = X X^T, on a (n, rows,
    cols) stack with rows <= cols and spectral norm at most 1."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT  # (n, rows, rows)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x


def gram_newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The iterations of `newton_schulz`, computed on the (rows, rows) Gram matrix (Gram Newton-Schulz,
    Dao AI Lab 2026): each iterate is X_k = Q_k X_0 and each factor Z = a I + b R + c R^2 is a
    polynomial in R_k = X_k X_k^T, so R_{k+1} = Z R_k Z and Q_{k+1} = Z Q_k need only (rows, rows)
    products. The wide X is multiplied at the start and the end, and once in between: after
    `GRAM_RESTART` iterations X is rebuilt and R formed from it again, because R's rounding errors grow
    with every iteration (small singular values come out wrong without it). For a matrix 4 times as
    wide as tall: 30 rows^3 multiply-adds instead of the direct form's 45."""
    a, b, c = NS_COEFFICIENTS
    r = x @ x.mT  # (n, rows, rows)
    q = None  # X_k = Q_k X_0; None for the identity
    for k in range(steps):
        if k == GRAM_RESTART:  # q is set: the first iteration made it
            x, q = q @ x, None  # (n, rows, cols)
            r = x @ x.mT
        z = torch.baddbmm(r, r, r, beta=b, alpha=c)  # b R + c R^2, (n, rows, rows)
        z.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        q = z if q is None else z @ q
        if k + 1 < steps and k + 1 != GRAM_RESTART:  # R is needed next, and not formed again from X
            r = z @ r @ z
    return x if q is None else q @ x


class MuonAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float = 0.95,
        ns_steps: int = 5,
        fused: bool = False,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=0.0,
            momentum=momentum,
            ns_steps=ns_steps,
            muon=False,
            lr_scale=1.0,
            fused=fused,
        )
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # the device's, not a hyperparameter: no part of the checkpointed groups
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups may only hold 2-D weights")
            group["lr"] = lr * group["lr_scale"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set around step() by the loop's non-finite skip
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["muon"]:
                self._muon(group, params, found_inf)
            else:
                self._adamw(group, params, found_inf)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        keep = None if found_inf is None else 1.0 - found_inf  # 0 where the step must not happen
        by_shape: dict[tuple, list[torch.Tensor]] = {}  # wide orientation: a tall matrix is stacked transposed
        for p in params:
            by_shape.setdefault((min(p.shape), max(p.shape)), []).append(p)
        for same in by_shape.values():  # e.g. every block's MLP matrices, in and out: one batched orthogonalization
            updates = []
            for p in same:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum if keep is None else (1 - momentum) * keep)  # keep = 0: unchanged
                update = p.grad.lerp(buf, momentum)  # Nesterov
                updates.append(update.mT if p.size(0) > p.size(1) else update)
            orthogonal = orthogonalize(torch.stack(updates), group["ns_steps"], dtype=self.ns_dtype).unbind(0)
            for p, update in zip(same, orthogonal):
                if p.size(0) > p.size(1):
                    update = update.mT
                scale = lr * math.sqrt(max(1.0, p.size(0) / p.size(1)))  # the same RMS for tall and wide matrices
                if keep is None:
                    p.mul_(1 - lr * decay).add_(update, alpha=-scale)
                else:
                    p.mul_(1 - lr * decay * keep).sub_(update * (scale * keep))

    def _adamw(self, group: dict, params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        moments, squares, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if group["fused"] else "cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            moments.append(state["exp_avg"])
            squares.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(
            params,
            [p.grad for p in params],
            moments,
            squares,
            [],
            steps,
            fused=group["fused"] or None,
            foreach=None if group["fused"] else True,
            found_inf=found_inf if group["fused"] else None,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
