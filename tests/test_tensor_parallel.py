"""Tensor parallelism with sequence parallelism (DTensor), alone and under FSDP2: 2 or 4 CPU processes
with gloo. The ranks of one replica read the same batch, so TP=2 must equal one process over several
steps, with gradient accumulation and clipping; its DCP checkpoints resume at another layout."""

import pytest
import torch

from test_distributed import (
    _assert_resumed,
    _assert_same_run,
    _resume,
    _torchrun,
)
from test_distributed import references as references  # one-process runs, once per session
from test_distributed import workdir as workdir  # the experiment's corpus and config

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available"),
    pytest.mark.slow,  # several processes per test: the full tier only
]

GPT2 = (
    "model.architecture=gpt2",
    "model.n_heads=2",
    "model.n_kv_heads=2",
)
LLAMA = ("model.n_kv_heads=2", "model.d_ff=96")  # each split in two
STEPS = (
    "training.gradient_accumulation_steps=2",
    "training.batch_size=4",
    "training.max_grad_norm=0.05",
    "training.layer_stats_steps=2",
)


# compile on top of TP, in parallelize's order (each TP block compiled)
WRAPPED = ("training.compile=true",)


@pytest.mark.parametrize("arch, wrapped", [((), ()), (GPT2, WRAPPED)], ids=["llama", "gpt2-compiled"])
def test_tensor_parallel_equals_one_process(workdir, references, arch, wrapped):
    """LLaMA (SwiGLU, RoPE, RMSNorm) and GPT-2 (learned positions, biases, LayerNorm, tied head): the same
    losses as one eager process, with accumulation and a clip that bites; GPT-2's TP blocks also
    compiled."""
    arch = arch or LLAMA
    init = references.single(workdir, arch, STEPS, init=True)
    result = _torchrun(
        workdir,
        "training.output_dir=tp",
        "parallelism.tensor_parallel_degree=2",
        f"model.init_from={init}",
        *STEPS,
        *wrapped,
    )
    assert "mesh: dp_replicate=1 x dp_shard=1 x pp=1 x cp=1 x tp=2" in result.stderr
    _assert_same_run(workdir / "single", workdir / "tp", grad_norms=True)
    single, tp = _layer_rows(workdir / "single"), _layer_rows(workdir / "tp")
    assert len(single) == 3 and single.keys() == tp.keys()  # steps 2, 4, 6
    for step, row in single.items():  # each rank's shards and the whole tensors counted once
        assert tp[step] == pytest.approx(row, rel=1e-4)


def _layer_rows(run_dir) -> dict:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("layers/")} for r in rows if r["kind"] == "layers"}


def test_tensor_parallel_checkpoints_resume_at_another_layout(workdir, references):
    """TP=2's DCP checkpoint of step 3 resumes in one process, and one process's whole checkpoint of
    step 3 resumes at TP=2 (each rank taking its shards of model and optimizer): steps 4-6 equal the
    uninterrupted run."""
    init = references.single(workdir, LLAMA, STEPS, init=True)
    tp = ("parallelism.tensor_parallel_degree=2", f"model.init_from={init}", *STEPS)
    _torchrun(workdir, "training.output_dir=tp", *tp)
    _resume(workdir, "tp", "two_to_one", f"model.init_from={init}", *STEPS)
    _resume(workdir, "single", "one_to_two", *tp, nproc=2)
    _assert_resumed(workdir, "two_to_one", "one_to_two")


def test_fsdp_by_tensor_parallel_equals_one_process_and_resumes_as_fsdp(workdir, references):
    """A 2 x 2 mesh (FSDP2 over dp_shard, TP over tp) equals one process; its step-3 checkpoint resumes
    under FSDP alone on 4 processes with the uninterrupted run's losses."""
    init = references.single(workdir, LLAMA, STEPS, init=True)
    accumulation = ("training.gradient_accumulation_steps=2", "training.max_grad_norm=0.05", f"model.init_from={init}")
    result = _torchrun(
        workdir,
        "training.output_dir=mesh",
        "parallelism.tensor_parallel_degree=2",
        "training.batch_size=2",
        *accumulation,
        nproc=4,
    )
    assert "mesh: dp_replicate=1 x dp_shard=2 x pp=1 x cp=1 x tp=2" in result.stderr
    assert "effective batch 8 = 2 x 2 accumulation x 2 replica(s) of 4 processes (fsdp)" in result.stderr
    _assert_same_run(workdir / "single", workdir / "mesh")
    as_fsdp = ("training.distributed_strategy=fsdp", "training.batch_size=1", *accumulation)
    _resume(workdir, "mesh", "as_fsdp", *as_fsdp, nproc=4)
    _assert_resumed(workdir, "as_fsdp")
