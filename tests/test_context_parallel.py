"""Context parallelism: each rank of a replica computes a load-balanced share of every row's positions,
through PyTorch's ring attention.

The ring attention kernels are CUDA's (flash, memory-efficient, cuDNN), so training equal to one
process runs only where two GPUs are; on CPU, what surrounds the kernel is shown with gloo: the
shares, their positions and targets, and the model's forward over given positions."""

import pytest
import torch
import torch.nn.functional as F

from llm_trainer.config import ModelConfig
from llm_trainer.model import Transformer
from test_distributed import workdir as workdir  # the experiment's corpus and config

CUDA_PAIR = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="context parallelism's ring attention runs on CUDA's flash, efficient or cuDNN kernels, one GPU per "
    f"rank: this machine has {torch.cuda.device_count()} GPU(s)",
)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_given_positions_are_the_positions_the_model_reads(arch):
    """0 .. T-1 given equals none given (loss and logits); other distances between positions change the
    result, through RoPE (llama) or the learned position embedding (gpt2)."""
    torch.manual_seed(0)
    config = ModelConfig(architecture=arch, vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_seq_len=32)
    model = Transformer(config).eval()
    idx = torch.randint(0, 64, (3, 16))
    targets = torch.randint(0, 64, (3, 16))
    counting = torch.arange(16).expand(3, 16)
    with torch.no_grad():
        assert torch.equal(model(idx, targets=targets, positions=counting), model(idx, targets=targets))
        assert torch.equal(model(idx, positions=counting), model(idx))
        reversed_ = model(idx, targets=targets, positions=counting.flip(-1))
        assert not torch.equal(reversed_, model(idx, targets=targets))


def test_given_positions_refuse_document_masks():
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=1, max_seq_len=16))
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="cannot be combined with doc_ids"):
        model(idx, doc_ids=torch.zeros_like(idx), positions=torch.arange(8)[None])


def _shares(rank: int, world: int, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Rank `rank` of `world`: the training step's shares of `micro`, as `Parallelism` hands them to the
    model. Cutting the shares needs no collective, so torch's fake process group stands in for the others."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llm_trainer.parallel.distributed import DistInfo
    from llm_trainer.parallel.strategies import Parallelism

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        module = torch.nn.Linear(2, 2)
        parallel = Parallelism(
            module,
            module,
            torch.optim.SGD(module.parameters(), lr=0.1),
            dist=DistInfo(rank=rank, world_size=world, strategy="fsdp"),
            device=torch.device("cpu"),
            amp_dtype=None,
            context_mesh=mesh["cp"],
        )
        plain_attention = F.scaled_dot_product_attention
        with parallel.rows_as_computed(micro) as parts:
            ring_on = F.scaled_dot_product_attention is not plain_attention
            shares = [(inputs, targets, keywords["positions"]) for inputs, targets, keywords in parts]
        return {
            "shares": shares,
            "ring_on": ring_on,
            "ring_off_after": F.scaled_dot_product_attention is plain_attention,
        }
    finally:
        dist.destroy_process_group()


def test_each_rank_computes_its_head_and_tail_share_with_its_positions():
    """Rows of 16 over 2 ranks: rank r holds chunks r and 3 - r of 4 (torch's head-tail balance for
    causal attention), each token with its own position and its own target; together the ranks hold
    every position once. Ring attention is on inside the step only; the loader's batches stay whole."""
    world, length = 2, 16
    rows = torch.arange(3 * length).view(3, length)  # (B, T): each token names its row and position
    micro = [(rows.clone(), rows + 1000), (rows + 2000, rows + 3000)]
    chunk = length // (2 * world)
    seen = []
    for rank in range(world):
        got = _shares(rank, world, micro)
        assert got["ring_on"] and got["ring_off_after"]
        expected = list(range(rank * chunk, (rank + 1) * chunk)) + list(
            range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
        )
        for i, (inputs, targets, positions) in enumerate(got["shares"]):
            assert inputs.shape == targets.shape == positions.shape == (3, length // world)
            assert positions.tolist() == [expected] * 3
            assert torch.equal(inputs, rows[:, expected] + 2000 * i)  # the token at each position ...
            assert torch.equal(targets, rows[:, expected] + 1000 + 2000 * i)  # ... with its own target
        seen += expected
    assert sorted(seen) == list(range(length))
    assert torch.equal(micro[0][0], rows) and micro[1][1].shape == (3, length)  # the loader's batches whole


@CUDA_PAIR
@pytest.mark.slow
def test_context_parallel_equals_one_process_and_resumes_in_one(workdir):
    """Two GPUs, each with half of every row: the losses of one GPU over six steps with accumulation
    and a clip that bites; its step-3 checkpoint resumes in one process with the uninterrupted losses.
    (float32: the memory-efficient kernel, which ring attention replaces; merging the ring's partial
    softmaxes rounds differently from one kernel's, hence 1e-4.)"""
    from test_distributed import _assert_resumed, _initial_weights, _losses, _resume, _single, _torchrun

    steps = ("training.device=cuda", "training.gradient_accumulation_steps=2", "training.batch_size=4")
    steps += ("training.max_grad_norm=0.05",)
    init = _initial_weights(workdir, ("model.n_kv_heads=2",))
    _single(workdir, "training.output_dir=single", f"model.init_from={init}", *steps)
    result = _torchrun(
        workdir, "training.output_dir=cp", "parallelism.context_parallel_degree=2", f"model.init_from={init}", *steps
    )
    assert "mesh: dp_replicate=1 x dp_shard=1 x pp=1 x cp=2 x tp=1" in result.stderr
    (train, val), (split_train, split_val) = _losses(workdir / "single"), _losses(workdir / "cp")
    assert len(split_train) == len(train) == 6
    assert split_train == pytest.approx(train, rel=1e-4) and split_val == pytest.approx(val, rel=1e-4)
    _resume(workdir, "cp", "two_to_one", f"model.init_from={init}", *steps)
    _assert_resumed(workdir, "two_to_one", rel=1e-4)
