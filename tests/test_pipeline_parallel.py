"""Pipeline parallelism (`torch.distributed.pipelining`): 2 CPU processes with gloo, one stage each (or
two, interleaved). Every rank of the pipeline reads the same batch, so PP=2 must equal one process over
several steps, with gradient accumulation and clipping; its DCP checkpoints resume in one process, and one
process's whole checkpoint resumes in the pipeline."""

import pytest
import torch

from test_distributed import (
    _assert_resumed,
    _assert_same_run,
    _losses,
    _resume,
    _torchrun,
)
from test_distributed import references as references  # one-process runs, once per session
from test_distributed import workdir as workdir  # the experiment's corpus and config

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available"),
    pytest.mark.slow,  # several processes per test: the full tier only
]

LLAMA = ("model.n_kv_heads=2", "model.d_ff=96")
GPT2 = ("model.architecture=gpt2", "model.n_heads=2", "model.n_kv_heads=2", "model.tie_embeddings=false")
STEPS = (
    "training.gradient_accumulation_steps=2",
    "training.batch_size=4",
    "training.max_grad_norm=0.05",
)


@pytest.mark.parametrize(
    ("arch", "schedule"),
    [
        (LLAMA, "1F1B"),
        (GPT2, "GPipe"),
        (LLAMA + ("model.n_layers=4",), "Interleaved1F1B"),  # stages 0, 2 on rank 0; 1, 3 on rank 1
        (LLAMA + ("model.n_layers=4",), "ZBVZeroBubble"),  # stages 0, 3 on rank 0; 1, 2 on rank 1
    ],
    ids=["llama-1f1b", "gpt2-gpipe", "llama-interleaved", "llama-zbv"],
)
def test_pipeline_equals_one_process(workdir, references, arch, schedule):
    """The same losses, validation losses and gradient norms as one process, with accumulation (two
    schedule steps per optimizer step, each of one micro-batch per stage) and a clip that bites."""
    init = references.single(workdir, arch, STEPS, init=True)
    result = _torchrun(
        workdir,
        "training.output_dir=pp",
        "parallelism.pipeline_parallel_degree=2",
        f"parallelism.pipeline_parallel_schedule={schedule}",
        f"model.init_from={init}",
        *STEPS,
    )
    assert "mesh: dp_replicate=1 x dp_shard=1 x pp=2 x cp=1 x tp=1" in result.stderr
    _assert_same_run(workdir / "single", workdir / "pp", grad_norms=True)


def test_pipeline_checkpoints_resume_in_one_process_and_in_the_pipeline(workdir, references):
    """PP=2's DCP checkpoint of step 3 (each stage's weights and optimizer state under the whole model's
    names) resumes in one process and at PP=2 again, and one process's whole checkpoint of step 3 resumes
    at PP=2 with the interleaved schedule (each stage taking its layers, rank 0 the first and third, and
    their optimizer state by name): steps 4-6 equal the uninterrupted run."""
    init = references.single(workdir, LLAMA + ("model.n_layers=4",), STEPS, init=True)
    pp = ("parallelism.pipeline_parallel_degree=2", f"model.init_from={init}", *STEPS)
    _torchrun(workdir, "training.output_dir=pp", *pp)
    _resume(workdir, "pp", "two_to_one", f"model.init_from={init}", *STEPS)
    _resume(workdir, "pp", "two_to_two", *pp, nproc=2)
    _resume(workdir, "single", "one_to_two", *pp, "parallelism.pipeline_parallel_schedule=Interleaved1F1B", nproc=2)
    _assert_resumed(workdir, "two_to_one", "two_to_two", "one_to_two")


@pytest.mark.parametrize(
    ("other", "batch_size", "mesh"),
    [
        ((), 2, "dp_replicate=1 x dp_shard=2 x pp=2 x cp=1 x tp=1"),  # FSDP2 within each stage: 2 replicas
        (("parallelism.tensor_parallel_degree=2",), 4, "dp_replicate=1 x dp_shard=1 x pp=2 x cp=1 x tp=2"),
    ],
    ids=["fsdp", "tp"],
)
def test_pipeline_on_a_2x2_mesh_equals_one_process_and_resumes_in_one(workdir, references, other, batch_size, mesh):
    """PP x FSDP2 and PP x TP on 4 processes equal one process with the same global batch; the step-3
    checkpoint resumes in one process with the uninterrupted run's losses."""
    init = references.single(workdir, LLAMA, STEPS, init=True)
    result = _torchrun(
        workdir,
        "training.output_dir=mesh",
        "parallelism.pipeline_parallel_degree=2",
        *other,
        f"model.init_from={init}",
        "training.gradient_accumulation_steps=2",
        f"training.batch_size={batch_size}",
        "training.max_grad_norm=0.05",
        nproc=4,
    )
    assert f"mesh: {mesh}" in result.stderr
    _assert_same_run(workdir / "single", workdir / "mesh", grad_norms=True)
    _resume(workdir, "mesh", "as_one", f"model.init_from={init}", *STEPS)
    _assert_resumed(workdir, "as_one")


def test_a_fresh_pipeline_starts_from_the_weights_fsdp_draws(workdir):
    """Without model.init_from each stage draws the whole model's parameters in order and keeps its own:
    PP=2 and FSDP on 2 processes (the same global batch) train alike from the first step. The pipeline's
    batch_size is auto: the largest stage's estimate picks the whole global batch of 4 rows, a multiple of
    the 2 micro-batches."""
    steps = ("training.max_steps=2", "training.eval_steps=2", "training.save_steps=2")
    auto = ("training.batch_size=auto", "training.total_batch_tokens=128", "training.device_memory=1")
    result = _torchrun(workdir, "training.output_dir=pp", "parallelism.pipeline_parallel_degree=2", *auto, *steps)
    assert "batch_size auto: 4 rows a micro-batch" in result.stderr
    _torchrun(
        workdir, "training.output_dir=fsdp", "training.distributed_strategy=fsdp", "training.batch_size=2", *steps
    )
    (pp_train, pp_val), (fsdp_train, fsdp_val) = _losses(workdir / "pp"), _losses(workdir / "fsdp")
    assert len(pp_train) == 2 and pp_train == pytest.approx(fsdp_train, rel=1e-5)
    assert pp_val == pytest.approx(fsdp_val, rel=1e-5)


def test_a_stage_checks_a_whole_checkpoint_against_every_stage():
    """A stage takes a whole checkpoint's tensors that other stages hold as theirs to check; a tensor no
    stage holds (a checkpoint of a deeper model) is still refused, in one line."""
    from llm_trainer.checkpoint.model_folder import check_fits
    from llm_trainer.config import ModelConfig, TrainingConfig
    from llm_trainer.errors import UsageError
    from llm_trainer.model import Transformer
    from llm_trainer.parallel.pipeline_parallel import split_model

    config = ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64, tie_embeddings=False)
    whole = Transformer(config).state_dict()
    first, _ = split_model(Transformer(config), TrainingConfig(pipeline_parallel_degree=2), 2, 0)
    elsewhere = frozenset(whole) - set(first.state_dict())
    assert elsewhere and all(name.startswith(("blocks.1.", "norm.", "lm_head.")) for name in elsewhere)
    check_fits(first, whole, "ckpt", elsewhere)
    deeper = {**whole, "blocks.2.attn.q.weight": whole["blocks.0.attn.q.weight"]}
    with pytest.raises(UsageError, match="unexpected blocks.2.attn.q.weight") as info:
        check_fits(first, deeper, "ckpt", elsewhere)
    assert "\n" not in str(info.value)
