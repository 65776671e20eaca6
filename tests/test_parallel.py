"""Each parallelism flag takes effect, in one process on the CPU (fast tier): activation checkpointing,
mixed precision, DDP's and FSDP2's gradient sync skipped on accumulation micro-batches, and
`distributed.setup`. A one-process gloo group stands in for a launcher's; the multi-process runs are
in test_distributed.py (slow tier)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import needs_deepspeed, tiny_loaders, tiny_model
from llm_trainer.config import TrainingConfig
from llm_trainer.errors import UsageError
from llm_trainer.parallel.distributed import DistInfo, setup
from llm_trainer.parallel.parallelize import parallelize
from llm_trainer.parallel.strategies import DDP, FSDP, Parallelism
from llm_trainer.resolve import activation_checkpointing, amp_dtype, resolve_amp
from llm_trainer.train.evaluate import batch_nll
from llm_trainer.train.optim import build_optimizer
from llm_trainer.train.step import autocast, train_step

CPU = torch.device("cpu")


# -- the one place that knows how the loop reaches into a Parallelism and how flags become arguments ---


def wrap(model: nn.Module, training: TrainingConfig, dist_info: DistInfo | None = None) -> Parallelism:
    """`parallelize` with the arguments the Trainer derives from `training` (one process by default)."""
    training = resolve_amp(training, CPU)
    return parallelize(
        model,
        config=training,
        dist=dist_info or DistInfo(),
        device=CPU,
        amp_dtype=amp_dtype(training),
        activation_checkpointing=activation_checkpointing(training),
        build_optimizer=lambda module: build_optimizer(module, training, CPU),
    )


def step_module(parallel: Parallelism) -> nn.Module:
    """What the training step calls (wrapped, compiled or an engine)."""
    return parallel.wrapped


def bare_module(parallel: Parallelism) -> nn.Module:
    """The model itself, sharded in place under FSDP."""
    return parallel.module


def micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = tiny_loaders()
    return [train.next_batch() for _ in range(n)]


def backward(parallel: Parallelism, batch, *, last: bool) -> torch.Tensor:
    """One micro-batch's forward and backward as the step runs it (gradient sync only when `last`)."""
    inputs, targets = batch
    with parallel.no_sync(last=last):
        loss = batch_nll(step_module(parallel), inputs, targets) / targets.numel()
    parallel.backward(loss)
    return loss.detach()


def gradients(module: nn.Module) -> list[torch.Tensor | None]:
    """Each parameter's whole gradient (None before any), in parameter order (wrappers keep it)."""

    def whole(grad):
        return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

    return [None if p.grad is None else whole(p.grad) for p in module.parameters()]


@pytest.fixture
def gloo_group(tmp_path):
    """A one-process gloo process group (a FileStore: no port to race for), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def deepspeed_setup(monkeypatch):
    """`distributed.setup` for DeepSpeed in one process without a launcher: it opens the process group
    and sets the launcher's variables itself (undone afterwards, as is the group)."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield lambda training: setup(training, CPU)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- activation checkpointing and mixed precision ---------------------------------------------------


def test_gradient_checkpointing_wraps_each_block_and_recomputes_it_in_backward():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    grads = {}
    for flag in (False, True):
        parallel = wrap(tiny_model(n_layers=2), TrainingConfig(gradient_checkpointing=flag, use_amp=False))
        blocks = list(bare_module(parallel).blocks)
        assert all(isinstance(block, CheckpointWrapper) for block in blocks) is flag
        assert any(isinstance(block, CheckpointWrapper) for block in blocks) is flag
        ran: list[int] = []  # the block of each Linear call
        for i, block in enumerate(blocks):
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    module.register_forward_hook(lambda *_, i=i, ran=ran: ran.append(i))
        inputs, targets = micro_batches(1)[0]
        loss = batch_nll(step_module(parallel), inputs, targets) / targets.numel()
        in_forward = len(ran)
        parallel.backward(loss)
        recomputed = set(ran[in_forward:])
        assert recomputed == (set(range(len(blocks))) if flag else set())  # each block runs again in backward
        grads[flag] = gradients(bare_module(parallel))
    assert len(grads[True]) == len(grads[False])
    for checkpointed, grad in zip(grads[True], grads[False]):
        torch.testing.assert_close(checkpointed, grad)  # recomputing changes no number


def test_amp_losses_differ_from_float32_ones_and_stay_close():
    """The same weights and batch: bf16 autocast changes the loss (it ran in bf16), by little."""
    batch = micro_batches(1)
    losses = {}
    for use_amp in (False, True):
        training = TrainingConfig(use_amp=use_amp, amp_dtype="bfloat16", max_grad_norm=None)
        parallel = wrap(tiny_model(), training)
        step = train_step(parallel, batch, autocast=autocast(CPU, amp_dtype(training)), max_grad_norm=None)
        losses[use_amp] = float(step.loss)
    assert losses[True] != losses[False]
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)


# -- DDP -------------------------------------------------------------------------------------------


def test_ddp_all_reduces_once_per_step_and_never_on_accumulation_micro_batches(gloo_group):
    parallel = wrap(tiny_model(), TrainingConfig(use_amp=False), DistInfo(strategy="ddp"))
    assert isinstance(parallel, DDP)
    reduced = []

    def counting_all_reduce(state, bucket):
        reduced.append(bucket.index())
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

    step_module(parallel).register_comm_hook(None, counting_all_reduce)
    batches = micro_batches(3)
    backward(parallel, batches[0], last=False)
    backward(parallel, batches[1], last=False)
    assert reduced == []  # no_sync: the gradients only accumulate
    backward(parallel, batches[2], last=True)
    per_backward = len(reduced)
    assert per_backward > 0

    reduced.clear()
    train_step(parallel, batches, autocast=autocast(CPU, None), max_grad_norm=1.0)
    assert len(reduced) == per_backward  # three micro-batches, one reduction


# -- FSDP2 -----------------------------------------------------------------------------------------


def test_fsdp_shards_every_block_and_syncs_gradients_only_on_the_last_micro_batch(gloo_group):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    from torch.distributed.tensor import DTensor

    parallel = wrap(
        tiny_model(n_layers=2), TrainingConfig(distributed_strategy="fsdp", use_amp=False), DistInfo(strategy="fsdp")
    )
    assert isinstance(parallel, FSDP)
    model = bare_module(parallel)
    assert all(isinstance(module, fsdp.FSDPModule) for module in [*model.blocks, model])
    assert all(isinstance(p, DTensor) for p in model.parameters())

    batches = micro_batches(2)
    backward(parallel, batches[0], last=False)
    assert all(g is None for g in gradients(model))  # held unsharded, not reduced yet
    backward(parallel, batches[1], last=True)
    sharded = gradients(model)

    plain = tiny_model(n_layers=2)  # the same weights without FSDP: the two micro-batches' summed gradient
    for inputs, targets in batches:
        (batch_nll(plain, inputs, targets) / targets.numel()).backward()
    assert len(sharded) == len(gradients(plain))
    for fsdp_grad, grad in zip(sharded, gradients(plain)):
        torch.testing.assert_close(fsdp_grad, grad)


def test_fsdp_with_amp_gathers_bf16_weights_for_compute_and_keeps_float32_ones(gloo_group):
    """apply_fsdp's mixed-precision policy: blocks compute with bf16 copies of float32 sharded weights."""
    pytest.importorskip("torch.distributed.fsdp")
    inputs, targets = micro_batches(1)[0]
    for use_amp, compute_dtype in ((False, torch.float32), (True, torch.bfloat16)):
        training = TrainingConfig(distributed_strategy="fsdp", use_amp=use_amp)
        parallel = wrap(tiny_model(), training, DistInfo(strategy="fsdp"))
        model = bare_module(parallel)
        seen = []
        linear = next(m for m in model.blocks[0].modules() if isinstance(m, nn.Linear))
        linear.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(module.weight.dtype))
        with autocast(CPU, amp_dtype(training)):
            batch_nll(step_module(parallel), inputs, targets)
        assert seen == [compute_dtype]
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        # gathered shards are never stacked into one matmul's weight (model.project)
        assert not any(block.attn.fuse_projections or block.mlp.fuse_projections for block in model.blocks)


# -- DeepSpeed -------------------------------------------------------------------------------------


@needs_deepspeed
def test_deepspeed_in_one_process_steps_as_one_process_without_it(deepspeed_setup):
    """ZeRO-2 from the DeepSpeed file; DeepSpeed's engine runs backward, clipping and our optimizer's
    step, and two accumulated micro-batches change the weights exactly as the plain loop does."""
    from llm_trainer.parallel import deepspeed_engine
    from llm_trainer.parallel.strategies import DeepSpeed

    requested = TrainingConfig(
        distributed_strategy="deepspeed", use_amp=False, deepspeed_config={"zero_optimization": {"stage": 2}}
    )
    info, _ = deepspeed_setup(requested)
    training = deepspeed_engine.merge_into_training(requested, world_size=1, device=CPU)
    plain_training = dataclasses.replace(training, distributed_strategy="auto", deepspeed_config=None)
    speeded = wrap(tiny_model(), training, info)
    plain = wrap(tiny_model(), plain_training)
    assert isinstance(speeded, DeepSpeed) and deepspeed_engine.zero_stage(step_module(speeded)) == 2
    assert speeded.parameter_count() == plain.parameter_count()

    batches = micro_batches(2)
    steps = [
        train_step(parallel, batches, autocast=autocast(CPU, None), max_grad_norm=training.max_grad_norm)
        for parallel in (speeded, plain)
    ]
    assert float(steps[0].loss) == float(steps[1].loss)
    assert float(steps[0].grad_norm) == pytest.approx(float(steps[1].grad_norm), rel=1e-5)
    for ours, theirs in zip(bare_module(speeded).parameters(), bare_module(plain).parameters()):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.slow  # a fresh interpreter importing DeepSpeed
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("mlflow") is None,
    reason="needs DeepSpeed and mlflow installed (pip install '.[deepspeed,tracking]')",
)
def test_deepspeed_is_imported_without_its_autotuners_mlflow_which_imports_afterwards():
    """DeepSpeed's autotuner imports mlflow (seconds of every rank's start) though training never runs it:
    the import through `_import_deepspeed` leaves mlflow out, and `report_to: mlflow` imports it after."""
    import subprocess
    import sys

    from conftest import src_env

    script = (
        "import sys, torch\n"
        "from llm_trainer.parallel.deepspeed_engine import _import_deepspeed\n"
        "_import_deepspeed(torch.device('cpu'))\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('mlflow' in sys.modules, autotuner.has_mlflow)\n"
        "import mlflow\n"
        "print(mlflow.__name__)\n"
        "import llm_trainer.parallel.deepspeed_engine as engine\n"
        "with engine._mlflow_hidden():\n"  # already imported: left as it is
        "    print(sys.modules['mlflow'] is mlflow)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=src_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "mlflow", "True"]


@pytest.mark.slow  # two DeepSpeed runs in a fresh interpreter
@needs_deepspeed
def test_a_second_deepspeed_run_in_one_process_is_refused_in_one_line(tmp_path):
    """DeepSpeed keeps the process group of its first run for the life of the process: a second training
    there (the API called twice, a notebook) would fail inside DeepSpeed on the ended group. It is refused
    before DeepSpeed starts, saying to give each DeepSpeed run its own process."""
    import subprocess
    import sys

    from conftest import src_env, write_tiny_experiment

    config = write_tiny_experiment(tmp_path, distributed_strategy="deepspeed", use_amp=False, max_steps=2)
    script = (
        "import sys\n"
        "from llm_trainer.cli import main\n"
        f"argv = ['train', '--config', {str(config)!r}]\n"
        "print(main([*argv, 'training.output_dir=first']), main([*argv, 'training.output_dir=second']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=src_env(), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.split() == ["0", "2"], result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "DeepSpeed ran in this process before" in errors[0] and "a process of its own" in errors[0]
    assert (tmp_path / "first" / "checkpoints").is_dir() and not (tmp_path / "second" / "checkpoints").exists()


# -- distributed.setup -----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, word", [("fsdp", "sharded"), ("ddp", "replicated")])
def test_setup_in_one_process_opens_no_group_and_says_what_the_strategy_does_not_do(strategy, word, capsys):
    info, device = setup(TrainingConfig(distributed_strategy=strategy), CPU)
    assert (info, device) == (DistInfo(), CPU) and not dist.is_initialized()
    assert (
        f"distributed_strategy={strategy} in one process: nothing is {word}; launch with torchrun"
        in capsys.readouterr().err
    )


def test_finish_leaves_the_last_barrier_of_every_gloo_group_done_and_held(gloo_group):
    """What gloo's worker threads still hold when a process exits must be freed on the main thread:
    `finish` ends every gloo group (subgroups too) with a barrier it has waited for and keeps."""
    from llm_trainer.parallel import distributed

    subgroup = dist.new_group([0])
    distributed.finish()
    kept = distributed._LAST_BARRIERS
    assert len(kept) == 2 and all(work.is_completed() for work in kept)
    dist.destroy_process_group(subgroup)


def test_setup_refuses_a_world_size_the_launcher_did_not_start():
    with pytest.raises(UsageError, match=r"training.world_size=2 but the launcher started 1 process\(es\)"):
        setup(TrainingConfig(world_size=2), CPU)


def test_setup_opens_a_gloo_group_for_deepspeed_in_one_process(deepspeed_setup):
    """DeepSpeed needs a process group even alone: setup opens one without a launcher's environment."""
    training = TrainingConfig(distributed_strategy="deepspeed")
    info, device = deepspeed_setup(training)
    assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert (info.strategy, info.world_size, device) == ("deepspeed", 1, CPU)
    assert deepspeed_setup(training)[0] == info  # idempotent
