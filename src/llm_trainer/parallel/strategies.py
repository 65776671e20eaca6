"""What the training loop asks of a parallelism backend, one class per backend.

The loop and the Checkpointer call these methods and never ask which backend runs:

    rows_as_computed(b)  the step's micro-batches as this rank computes them (a share of each row's
                         positions under context parallelism)
    no_sync(last)        gradient reduction only on a step's last micro-batch
    backward(loss)       scaled for fp16 where a GradScaler is in use
    clip(max_norm)       the total gradient norm (clipped when max_norm is set), or None when the
                         backend clips inside its step (DeepSpeed)
    step(finite)         apply the update only where `finite`, clear the gradients; returns the
                         gradient norm when the backend computed it in the step
    full_state_dict()    the whole model's weights gathered from shards (a collective), or None
                         when the module holds them whole
    save_shards(folder)  every rank's own files (FSDP's DCP shards, DeepSpeed's files)
    save_shards_to_store(url)  FSDP's shards straight into a store folder, their records returned;
                         None where a backend writes them locally only (uploaded with the folder)
    load(parts, path)    model and optimizer state from a loaded checkpoint
    scoring_model()      the model downstream scoring runs on this rank: `module`, or a whole copy
                         gathered where the layers are split across ranks (tensor, pipeline parallelism)

`Parallelism` is one process (and the base of the others); `DDP`, `FSDP`, `Pipeline` and `DeepSpeed`
change only what differs.

Under pipeline parallelism (`pipelined`) the loop hands each micro-batch of the step to
`forward_backward(inputs, targets, scale, autocast)`, which runs the schedule's forward and backward
over the stages and returns the batch's summed loss on every rank of the pipeline.

The model, under two names:

    module    the bare model, the user's own object (sharded in place under FSDP, its blocks wrapped for
              activation checkpointing or compiled): state dicts, evaluation, checkpoints
    wrapped   what the training step calls: `module` itself, its DistributedDataParallel wrapper, or
              DeepSpeed's engine

`Trainer.model` is `module`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..checkpoint import layout
from ..checkpoint.fused_projections import refuse_resume
from ..checkpoint.model_folder import clean_name, load_model_state, model_tensors
from ..config import ModelConfig
from ..errors import UsageError
from ..loss import IGNORE_INDEX
from .distributed import DistInfo


class Parallelism:
    """One process: the model as it is."""

    checkpoint_kind = layout.WHOLE  # where its checkpoints hold model and optimizer; meta.json records it
    pipelined = False  # the step runs through `forward_backward` (a pipeline schedule)

    def __init__(
        self,
        module: nn.Module,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dist: DistInfo,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        context_mesh=None,
    ):
        self.module = module  # the bare model (see the module docstring)
        self.context_mesh = context_mesh  # the `cp` ranks that share each row's positions, or None
        self.wrapped = wrapped  # what the step calls
        self.optimizer = optimizer
        self.dist, self.device = dist, device
        self.params = [p for p in module.parameters() if p.requires_grad]
        # fp16 on CUDA needs loss scaling; bf16 and CPU autocast do not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16 and device.type == "cuda")

    def parameter_count(self) -> int:
        """Trainable parameters of the whole model (also where this rank holds only a partition)."""
        return sum(p.numel() for p in self.params)

    # -- the step -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def rows_as_computed(self, micro_batches):
        """The step's micro-batches as this rank computes them, each (inputs, targets, `batch_nll`'s
        keywords): whole rows, or under context parallelism this rank's share of each row's positions,
        with ring attention on until the context ends (`context_parallel.split_rows`)."""
        if self.context_mesh is None:
            yield [(inputs, targets, {"doc_ids": d[0]} if d else {}) for inputs, targets, *d in micro_batches]
            return
        from .context_parallel import split_rows

        with split_rows(micro_batches, self.context_mesh) as parts:
            yield parts

    @contextlib.contextmanager
    def no_sync(self, last: bool):
        yield

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def at_gradients(self, fn: Callable[[float], None]) -> None:
        """Call `fn(scale)` where this step's gradients are complete, before clipping and the update
        (the loop calls this after the last backward): here, now. `scale` is the loss scale the
        gradients still carry (fp16's scaler; 1 otherwise)."""
        fn(float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0)

    def clip(self, max_norm: float | None) -> torch.Tensor | None:
        self.scaler.unscale_(self.optimizer)
        if len({id(getattr(p, "device_mesh", None)) for p in self.params}) > 1:  # tensor parallel: several meshes
            from .grad_norm import clip_grad_norm

            return clip_grad_norm(self.params, max_norm)
        if max_norm:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor

    def step(self, finite: torch.Tensor) -> torch.Tensor | None:
        """Fused Adam/AdamW skip a non-finite step on the device (no host sync); the fp16 scaler skips
        overflowed steps itself (a host sync of its own) and a step the loop withholds (a loss spike: `finite`
        false with finite gradients); other optimizers need one host sync."""
        optimizer = self.optimizer
        if self.scaler.is_enabled():
            if bool(finite):  # update() still reads the overflow check unscale_ recorded in clip()
                self.scaler.step(optimizer)
        elif optimizer.defaults.get("fused"):
            _fused_step_where(optimizer, finite, optimizer.step)
        elif bool(finite):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scaler.update()
        return None

    def scoring_model(self) -> nn.Module:
        """The model downstream scoring (`training.eval_tasks`) runs on this rank (every rank calls it at
        the same point): `module`, whose forward takes a request of any length (whole, or each layer
        gathered in step under FSDP2 and ZeRO-3)."""
        return self.module

    # -- checkpoints ----------------------------------------------------------------------------

    def live_tensors(self) -> tuple[dict[str, torch.Tensor] | None, Any]:
        """(the module's own weights, the optimizer state) as live references, for a checkpoint to copy
        or write; None for a part that `full_state_dict` or `save_shards` supplies instead."""
        return model_tensors(self.module), self.optimizer.state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return None

    def save_shards(self, folder: Path, background: Any = None) -> Callable[[], Any]:
        """Write this rank's own files of the checkpoint into `folder` (a collective). Returns the wait
        for the write: at once, or with `background` (a `sharded.BackgroundShards`, only where
        `checkpoint_kind.weights_in_shards`) once its copy in host memory is written."""
        return _written

    def save_shards_to_store(self, url: str, background: Any = None) -> Callable[[], dict[str, dict]] | None:
        """As `save_shards`, straight into the store folder `url`; the wait returns the records of every
        rank's files there. None where this Parallelism writes its shards to disk only."""
        return None

    def load(self, parts: dict[str, Any], path: Path) -> None:
        kind = parts["meta"].get("kind")
        if kind == layout.DEEPSPEED.name:
            raise UsageError(
                f"{path} was saved with distributed_strategy deepspeed; resume it with that strategy "
                "(its model folder also works as model.init_from for a fresh run)"
            )
        if parts["model"] is None:  # FSDP's shards, from any world size: each tensor read whole
            from ..checkpoint.sharded import load_sharded

            return load_sharded(self.module, self.optimizer, parts["sharded"], parts.get("store"))
        refuse_old_layout(self.module, parts["model"], path)
        load_model_state(self.module, parts["model"], str(path))
        try:
            self.optimizer.load_state_dict(parts["optimizer"])
        except (ValueError, KeyError) as exc:
            raise UsageError(f"optimizer state in {path} does not match this model/optimizer: {exc}") from None


def refuse_old_layout(module: nn.Module, weights: dict, path: Path) -> None:
    """A whole training checkpoint written before the projections were split does not resume (see
    `fused_projections.refuse_resume`)."""
    config = getattr(module, "config", None)
    if isinstance(config, ModelConfig):
        refuse_resume(weights, config, str(path))


class DDP(Parallelism):
    """DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward."""

    def __init__(self, module: nn.Module, wrapped: nn.Module, optimizer, *, ddp: nn.Module, **kwargs):
        super().__init__(module, wrapped, optimizer, **kwargs)
        self.ddp = ddp

    @contextlib.contextmanager
    def no_sync(self, last: bool):
        if last:
            yield
        else:
            with self.ddp.no_sync():
                yield


class FSDP(Parallelism):
    """FSDP2: parameters, gradients and optimizer state sharded; each rank checkpoints its own shards."""

    checkpoint_kind = layout.SHARDED  # every rank writes its shards, with DCP's writer thread in the background

    def __init__(self, module: nn.Module, wrapped: nn.Module, optimizer, *, tensor_parallel: bool = False, **kwargs):
        super().__init__(module, wrapped, optimizer, **kwargs)
        self.tensor_parallel = tensor_parallel  # the blocks' matrices split over the mesh's tp ranks

    def scoring_model(self) -> nn.Module:
        """Under tensor parallelism a whole copy on every rank (`_whole_copy`): sequence parallelism splits
        each request's positions over the tp ranks, which needs their count divisible by the degree, and a
        request has any length (a generation step: one token)."""
        if not self.tensor_parallel:
            return self.module
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return _whole_copy(self.module, state, self.device)

    @contextlib.contextmanager
    def no_sync(self, last: bool):
        # FSDP2 reads the flag in backward, which the step runs after this block: set it for this
        # micro-batch and leave it (each micro-batch sets its own; the last one turns sync back on)
        if hasattr(self.module, "set_requires_gradient_sync"):  # not sharded (tensor parallel alone): nothing to sync
            self.module.set_requires_gradient_sync(last)
        yield

    def live_tensors(self):
        return None, None  # weights gathered by full_state_dict, optimizer state in the DCP shards

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from ..checkpoint.sharded import full_model_state

        return full_model_state(self.module)

    def save_shards(self, folder: Path, background: Any = None) -> Callable[[], None]:
        from ..checkpoint.sharded import save_sharded

        return save_sharded(self.module, self.optimizer, folder, background)

    def save_shards_to_store(self, url: str, background: Any = None) -> Callable[[], dict[str, dict]]:
        from ..checkpoint.sharded import save_sharded_to_store

        return save_sharded_to_store(self.module, self.optimizer, url, background)

    def load(self, parts: dict[str, Any], path: Path) -> None:
        if parts["meta"].get("kind") == layout.DEEPSPEED.name:
            return super().load(parts, path)
        from ..checkpoint.sharded import load_sharded, load_whole

        if parts["model"] is None:
            return load_sharded(self.module, self.optimizer, parts["sharded"], parts.get("store"))
        refuse_old_layout(self.module, parts["model"], path)
        try:  # a whole checkpoint (one process, DDP): each rank takes its shards of every tensor
            load_whole(
                self.module, self.optimizer, parts["model"], parts["optimizer"], str(path), **self._whole_parts()
            )
        except (ValueError, KeyError, IndexError) as exc:
            raise UsageError(f"optimizer state in {path} does not match this model/optimizer: {exc}") from None

    def _whole_parts(self) -> dict[str, Any]:
        """What `load_whole` needs to know of the other processes' parts of the model: nothing here (each
        rank holds shards of every tensor)."""
        return {}


class Pipeline(FSDP):
    """Pipeline parallelism (`pipeline_parallel`): this rank's stages of the model, run by a
    `torch.distributed.pipelining` schedule; FSDP2 within each stage where there are data-parallel
    shards. `module` is the rank view (this rank's parts, under the whole model's names), so the
    optimizer and the DCP checkpoints are FSDP's; `names`: the whole model's parameter names in its
    order, by which a whole checkpoint's optimizer state (numbered in that order) is taken apart."""

    pipelined = True

    def __init__(self, module: nn.Module, optimizer, *, stages, group, config, names: list[str], **kwargs):
        from .mesh import stage_count
        from .pipeline_parallel import build_schedule, stage_owners

        super().__init__(module, module, optimizer, **kwargs)
        self.group = group
        n_stages = stage_count(config, group.size())
        self.is_first = any(s == 0 for s, _ in stages)
        self.is_last = any(s == n_stages - 1 for s, _ in stages)
        self._scale: torch.Tensor | float = 1.0
        self._nll: dict[int, torch.Tensor] = {}  # each loss the schedule backpropagates: its summed nll
        self.stages = dict(stages)
        self.names = names
        self.owners = stage_owners(config.pipeline_parallel_schedule, group.size())
        self.schedule = build_schedule(config, stages, group, self.device, self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one pipeline micro-batch: its summed negative log-likelihood (kept for
        the step's loss), scaled for the backward as the loop scales it."""
        nll = _summed_nll(logits, targets)
        loss = self.scaler.scale(nll * self._scale)
        self._nll[id(loss)] = nll.detach()
        return loss

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, scale, autocast) -> torch.Tensor:
        """Forward and backward of one batch (B rows) through the pipeline, split into the schedule's
        micro-batches; the loss each micro-batch's backward starts from is its summed nll times `scale`.
        Returns the batch's summed nll (detached, float32), the same on every rank of the pipeline.

        The schedule also calls the loss function while it sets itself up (the first step): only the
        micro-batches' losses it returns in `losses` count."""
        self._scale = scale
        self._nll.clear()
        losses: list[torch.Tensor] = []
        with autocast:
            self.schedule.step(
                *((inputs,) if self.is_first else ()),
                target=targets if self.is_last else None,
                losses=losses,
                return_outputs=False,
            )
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += self._nll[id(loss)]
        self._nll.clear()
        torch.distributed.all_reduce(total, group=self.group)  # only the last stage holds it
        return total

    @torch.no_grad()
    def eval_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed nll of one batch, forward only (`pipeline_parallel.forward_only`), on every rank of
        the pipeline."""
        from .pipeline_parallel import forward_only

        logits = forward_only(self.stages, self.owners, self.group, inputs, self.module.config.d_model)
        total = torch.zeros((), device=self.device)
        if logits is not None:
            total += _summed_nll(logits, targets)
        torch.distributed.all_reduce(total, group=self.group)  # only the last stage holds it
        return total

    def parameter_count(self) -> int:
        count = torch.tensor(float(super().parameter_count()), dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(count, group=self.group)  # every stage's own
        return int(count)

    def clip(self, max_norm: float | None) -> torch.Tensor | None:
        from .grad_norm import clip_grad_norm

        self.scaler.unscale_(self.optimizer)
        return clip_grad_norm(self.params, max_norm, stages=self.group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights, gathered whole on rank 0 (a collective); empty on the others."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        mine = {clean_name(name): tensor.detach().cpu() for name, tensor in state.items()}
        everyone: list[Any] | None = [None] * self.dist.world_size if self.dist.is_main else None
        torch.distributed.gather_object(mine, everyone, dst=0)
        return {name: tensor for part in everyone or [] for name, tensor in part.items()}

    def scoring_model(self) -> nn.Module:
        """A whole copy on every rank (`_whole_copy`): each stage's weights gathered whole, then sent to the
        other stages (the stages' ranks hold different layers, so no rank could score a request alone)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        mine = {name: tensor.detach().cpu() for name, tensor in state.items()}
        everyone: list[Any] = [None] * self.group.size()
        torch.distributed.all_gather_object(everyone, mine, group=self.group)
        return _whole_copy(self.module, {name: t for part in everyone for name, t in part.items()}, self.device)

    def _whole_parts(self) -> dict[str, Any]:
        """The tensors the other stages hold (`elsewhere`), and the whole model's parameters in the order
        a whole checkpoint's optimizer state numbers them (`saved_order`: `optim.parameter_groups`' groups
        one after another, each in the model's order), from every stage's own groups (a collective)."""
        by_param = {id(p): clean_name(name) for name, p in self.module.named_parameters()}
        groups = [[by_param[id(p)] for p in group["params"]] for group in self.optimizer.param_groups]
        held = {clean_name(name) for name in self.module.state_dict()}
        everyone: list[Any] = [None] * self.group.size()
        torch.distributed.all_gather_object(everyone, (held, groups), group=self.group)
        position = {name: i for i, name in enumerate(self.names)}
        saved_order = [
            name
            for g in range(len(groups))
            for name in sorted((n for _, theirs in everyone for n in theirs[g]), key=position.__getitem__)
        ]
        return {"saved_order": saved_order, "elsewhere": frozenset().union(*(h for h, _ in everyone)) - held}


class DeepSpeed(Parallelism):
    """DeepSpeed's engine runs forward, backward (its own fp16 loss scaling) and the step of our
    optimizer on its partitions; its own files hold model and optimizer state."""

    checkpoint_kind = layout.DEEPSPEED

    def __init__(self, module: nn.Module, engine, optimizer, **kwargs):
        super().__init__(module, engine, optimizer, **kwargs)
        self.engine = engine
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=False)  # DeepSpeed scales fp16 losses itself

    def parameter_count(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.params)  # ZeRO-3 leaves 0-size partitions

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss is scaled for accumulation already

    def at_gradients(self, fn: Callable[[float], None]) -> None:
        """DeepSpeed reduces the gradients into its partitions inside `engine.step()` (the loop owns the
        accumulation), before its optimizer's step clips and applies them: `fn` runs at the start of that
        optimizer step, on every rank, for the next step only."""
        zero = self.engine.optimizer
        original = zero.step

        def step(*args, **kwargs):
            zero.__dict__.pop("step", None)
            fn(float(getattr(zero, "loss_scale", None) or 1.0))  # fp16: unscaled inside this step, after fn
            return original(*args, **kwargs)

        zero.step = step

    def clip(self, max_norm: float | None) -> None:
        return None  # inside engine.step(), from the config's gradient_clipping

    def step(self, finite: torch.Tensor) -> torch.Tensor:
        try:
            _fused_step_where(self.optimizer, finite, self.engine.step)  # also clears the gradients
        finally:
            self.engine.optimizer.__dict__.pop("step", None)  # an `at_gradients` a skipped step never ran
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32)

    def live_tensors(self):
        from . import deepspeed_engine

        gathered = deepspeed_engine.zero_stage(self.engine) == 3
        return (None if gathered else model_tensors(self.module)), None  # optimizer state: DeepSpeed's files

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from . import deepspeed_engine

        return deepspeed_engine.full_model_state(self.engine)

    def save_shards(self, folder: Path, background: Any = None) -> Callable[[], None]:
        from . import deepspeed_engine

        deepspeed_engine.save(self.engine, folder, self.dist.is_main)
        return _written

    def load(self, parts: dict[str, Any], path: Path) -> None:
        from . import deepspeed_engine

        saved = parts["meta"].get("world_size")
        partitioned = any(name.endswith("optim_states.pt") for name in parts["files"].listed or ())  # ZeRO 1-3
        if partitioned and saved not in (None, self.dist.world_size):
            raise UsageError(
                f"{path} was saved by DeepSpeed ZeRO on {saved} process(es), this run has {self.dist.world_size}: "
                "DeepSpeed reloads ZeRO's partitioned optimizer state only at the world size that wrote it (other "
                f"sizes need its universal checkpoint, which llm-trainer does not write); resume with {saved} "
                f"process(es), or start a new run from its weights with model.init_from={path}"
            )
        deepspeed_engine.load(self.engine, parts["files"])


def _whole_copy(module: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A plain model (no DTensors, every layer) of `module`'s config on `device`, holding `state` (every
    tensor whole): for downstream scoring where the layers are split across ranks. It must fit one device
    for the evaluation; it is dropped after it."""
    from ..model import Transformer

    whole = Transformer.on_meta(module.config)
    whole.to_empty(device=device)
    whole.tie_weights()
    load_model_state(whole, {clean_name(name): tensor for name, tensor in state.items()}, "the gathered weights")
    whole.init_buffers()
    return whole


def _summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed -log p(target) in float32 of a pipeline's last stage's logits (B, T, V)."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _fused_step_where(optimizer: torch.optim.Optimizer, finite: torch.Tensor, step) -> None:
    """Run `step` with the fused kernels' `found_inf` set where not `finite`: the update is skipped on
    the device, with no host sync."""
    optimizer.grad_scale, optimizer.found_inf = None, (~finite).float()
    try:
        step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def _written() -> None:
    """The wait for shards written already."""
