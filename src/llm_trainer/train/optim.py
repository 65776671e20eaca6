"""Optimizer with weight-decay groups, and the learning-rate schedule as a pure function of the step.

The schedule is stateless (`learning_rate_at(step)`), so resuming needs only the step: nothing to
serialise, nothing to drift.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..config import TrainingConfig
from ..resolve import native_bf16
from .muon import MuonAdamW


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only matrices of linear layers; norms, biases and embeddings are not decayed."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.dim() >= 2 and id(param) not in embedding_params else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    # Fused kernels on CUDA and CPU (on CPU faster than foreach for small models; bench/README.md); both
    # also let the loop skip a non-finite step on the device, without a host sync (see parallel.strategies).
    fused = device.type in ("cuda", "cpu")
    if config.optimizer == "muon":
        return MuonAdamW(
            muon_groups(model, config),
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            momentum=config.muon_momentum,
            fused=fused,
            ns_dtype=muon_iteration_dtype(device),
        )
    groups = parameter_groups(model, config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.learning_rate, momentum=config.sgd_momentum)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(
        groups,
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        fused=fused or None,
        foreach=None if fused else True,
    )


def muon_iteration_dtype(device: torch.device) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iterations on `device` (`muon.orthogonalize`)."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def muon_groups(model: nn.Module, config: TrainingConfig) -> list[dict]:
    """Muon for the weights of the linear layers inside the model (not the output head, nor a weight
    shared with an embedding); AdamW groups as `parameter_groups` for the rest."""
    head = getattr(model, "lm_head", None)
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = {
        id(m.weight): m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear) and m is not head and id(m.weight) not in embedding and m.weight.requires_grad
    }
    rest = [
        {**group, "params": [p for p in group["params"] if id(p) not in hidden]}
        for group in parameter_groups(model, config.weight_decay)
    ]
    muon = {
        "params": list(hidden.values()),
        "muon": True,
        "weight_decay": config.weight_decay,
        "lr_scale": config.muon_learning_rate / config.learning_rate,
    }
    return [muon, *(group for group in rest if group["params"])]


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate on every group, times the group's `lr_scale` (Muon's matrices have their own peak)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def learning_rate_at(step: int, config: TrainingConfig, total_steps: int) -> float:
    """The learning rate for optimizer step `step` (0-based) of a run of `total_steps`."""
    peak, floor, warmup = config.learning_rate, config.min_lr, config.warmup_steps
    kind = config.lr_scheduler
    if kind == "constant":
        return peak
    if step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant_with_warmup":
        return peak
    if kind == "wsd":  # warmup, a stable plateau, then a linear decay over the last wsd_decay_ratio
        decay_steps = max(1, round(config.wsd_decay_ratio * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return floor + (1.0 - progress) * (peak - floor)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if kind == "linear":
        return floor + (1.0 - progress) * (peak - floor)
    assert kind == "cosine", kind
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)
