"""The device mesh's settings (parallel/mesh.py): the names users arrive with, the layout each world
size gets, and every combination that cannot train refused in one line before anything is allocated."""

from __future__ import annotations

import pytest
import yaml

from llm_trainer.cli import _dotted_options, main
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.errors import UsageError
from llm_trainer.parallel.mesh import Layout, resolve_layout

# swiglu's d_ff for d_model 48 is 128: every degree up to 4 divides every split dimension
MODEL = ModelConfig(architecture="llama", d_model=48, n_heads=4, n_kv_heads=2, n_layers=4)


def _layout(world: int, **training) -> Layout:
    return resolve_layout(TrainingConfig(**training), world, model=MODEL, seq_len=32, device_type="cpu")


def _write(tmp_path, text: str):
    path = tmp_path / "exp.yaml"
    path.write_text(text + "data: {dataset_name: python-stdlib}\n")
    return path


def test_torchtitan_parallelism_section_and_megatron_names_are_read_as_ours(tmp_path):
    path = _write(
        tmp_path,
        "parallelism: {data_parallel_shard_degree: -1, tensor_parallel_degree: 2, pipeline_parallel_schedule: "
        "Interleaved1F1B}\ntraining: {pipeline_model_parallel_size: 2, context_parallel_size: 2}\n",
    )
    training = load_experiment(path, ["parallelism.pipeline_parallel_microbatches=4"]).training
    assert training.data_parallel_shard_degree == -1 and training.tensor_parallel_degree == 2
    assert training.pipeline_parallel_degree == 2 and training.context_parallel_degree == 2
    assert training.pipeline_parallel_schedule == "Interleaved1F1B" and training.pipeline_parallel_microbatches == 4
    megatron = TrainingConfig.from_dict({"tensor_model_parallel_size": 2}, section="training")
    assert megatron.tensor_parallel_degree == 2
    # torchtitan's own command-line form
    assert _dotted_options(["--parallelism.tensor_parallel_degree", "2"]) == ["parallelism.tensor_parallel_degree=2"]


def test_misspelled_and_conflicting_parallelism_keys_are_one_message(tmp_path):
    path = _write(
        tmp_path,
        "parallelism: {tensor_paralel_degree: 2}\ntraining: {tensor_model_parallel_size: 4, tensor_parallel_degree: 2}\n",
    )
    with pytest.raises(UsageError) as info:
        load_experiment(path)
    message = str(info.value)
    assert "did you mean parallelism.tensor_parallel_degree?" in message
    assert "tensor_model_parallel_size (4) and training.tensor_parallel_degree (2) both set" in message
    with pytest.raises(ValueError, match="pipeline_parallel_schedule"):
        TrainingConfig(pipeline_parallel_schedule="zigzag")
    with pytest.raises(ValueError, match="tensor_parallel_degree must be at least 1"):
        TrainingConfig(tensor_parallel_degree=0)


@pytest.mark.parametrize(
    "world, training, expected",
    [
        (4, {}, Layout(dp_replicate=4)),  # ddp (auto): every process a replica
        (4, {"distributed_strategy": "fsdp"}, Layout(dp_shard=4)),
        (4, {"data_parallel_shard_degree": -1}, Layout(dp_shard=4)),  # torchtitan's default: auto shards
        (4, {"distributed_strategy": "fsdp", "tensor_parallel_degree": 2}, Layout(dp_shard=2, tp=2)),
        (2, {"tensor_parallel_degree": 2}, Layout(tp=2)),
        (
            8,
            {
                "distributed_strategy": "fsdp",
                "fsdp_sharding": "hybrid_shard",
                "data_parallel_replicate_degree": 2,
                "data_parallel_shard_degree": -1,
                "tensor_parallel_degree": 2,
            },
            Layout(dp_replicate=2, dp_shard=2, tp=2),
        ),
        (4, {"pipeline_parallel_degree": 2, "batch_size": 4}, Layout(dp_shard=2, pp=2)),  # fsdp (auto)
        (2, {"pipeline_parallel_degree": 2, "batch_size": "auto", "total_batch_tokens": 1024}, Layout(pp=2)),
    ],
)
def test_the_degrees_left_go_to_data_parallelism_as_the_strategy_says(world, training, expected):
    layout = _layout(world, **training)
    assert layout == expected and layout.world_size == world


@pytest.mark.parametrize(
    "world, training, seq_len, message",
    [
        (3, {"tensor_parallel_degree": 2}, 32, "= 2 does not divide the 3 process(es)"),
        (4, {"distributed_strategy": "fsdp", "data_parallel_shard_degree": 3}, 32, "not the 4 process(es)"),
        (6, {"tensor_parallel_degree": 3}, 30, "does not divide model.n_heads (4)"),
        (4, {"tensor_parallel_degree": 4}, 32, "does not divide model.n_kv_heads (2)"),
        (2, {"tensor_parallel_degree": 2}, 31, "does not divide the sequence length (31)"),
        (
            2,
            {"tensor_parallel_degree": 2, "distributed_strategy": "deepspeed"},
            32,
            "under distributed_strategy deepspeed",
        ),
        (2, {"tensor_parallel_degree": 2, "optimizer": "muon"}, 32, "optimizer muon needs each weight whole"),
        (8, {"pipeline_parallel_degree": 8}, 32, "splits model.n_layers (4) into 8 stages"),
        (4, {"pipeline_parallel_degree": 4, "pipeline_parallel_schedule": "ZBVZeroBubble"}, 32, "2 stages per rank"),
        (2, {"pipeline_parallel_degree": 2, "batch_size": 3}, 32, "equal micro-batches"),
        (2, {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatches": 1}, 32, "fewer than the 2 pipeline"),
        (
            2,
            {
                "pipeline_parallel_degree": 2,
                "pipeline_parallel_schedule": "DualPipeV",
                "pipeline_parallel_microbatches": 2,
            },
            32,
            "fewer than the 4 pipeline stages",
        ),
        (2, {"context_parallel_degree": 2}, 30, "divisible by 2 x 2"),
        (2, {"context_parallel_degree": 2}, 32, "needs CUDA"),
        (2, {"context_parallel_degree": 2, "distributed_strategy": "ddp"}, 32, "composes with FSDP2 only"),
        (4, {"context_parallel_degree": 2, "pipeline_parallel_degree": 2}, 32, "does not compose with pipeline"),
        (2, {"context_parallel_degree": 2, "compile": True}, 32, "set training.compile: false"),
        *(
            (
                2,
                {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": schedule, "compile": True},
                32,
                f"pipeline_parallel_schedule {schedule} runs each backward in two halves",
            )
            for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
        ),
        (
            2,
            {"tensor_parallel_degree": 2, "compile": True, "gradient_checkpointing": True},
            32,
            "with both gradient_checkpointing and compile",
        ),
        (2, {"data_parallel_shard_degree": 2, "distributed_strategy": "ddp"}, 32, "needs distributed_strategy: fsdp"),
        (
            4,
            {"distributed_strategy": "fsdp", "data_parallel_replicate_degree": 2},
            32,
            "set fsdp_sharding: hybrid_shard",
        ),
    ],
)
def test_every_layout_that_cannot_train_is_one_line(world, training, seq_len, message):
    with pytest.raises(UsageError) as info:
        resolve_layout(TrainingConfig(**training), world, model=MODEL, seq_len=seq_len, device_type="cpu")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_bring_your_own_model_is_checked_before_the_process_group_opens(monkeypatch):
    from llm_trainer.model import Transformer
    from llm_trainer.resolve import resolve_for_model

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = Transformer.on_meta(ModelConfig(**{**MODEL.to_dict(), "vocab_size": 64, "n_kv_heads": 1}))
    with pytest.raises(UsageError, match="does not divide model.n_kv_heads"):
        resolve_for_model(model, TrainingConfig(device="cpu", tensor_parallel_degree=2))


def test_estimate_refuses_layouts_that_cannot_train():
    """The estimate resolves the layout as a run would: a bad one is refused in one line, a good one
    (tensor parallelism included) is counted with its degrees."""
    from llm_trainer.config import DataConfig, ExperimentConfig
    from llm_trainer.tools.estimate import estimate_report

    def report(world: int, **training):
        experiment = ExperimentConfig(
            model=ModelConfig(**{**MODEL.to_dict(), "vocab_size": 64}),
            training=TrainingConfig(**training),
            data=DataConfig(dataset_name="python-stdlib", max_length=32),
        )
        return estimate_report(experiment, world_size=world)

    assert report(2, distributed_strategy="fsdp")["world_size"] == 2
    # torchtitan's shard degree makes `auto` FSDP: the estimate shards as the run will
    assert report(2, data_parallel_shard_degree=-1)["sharding"] == report(2, distributed_strategy="fsdp")["sharding"]
    assert report(2, data_parallel_shard_degree=-1)["sharding"] != report(2)["sharding"]
    with pytest.raises(UsageError, match="does not divide model.n_heads"):
        report(6, tensor_parallel_degree=3)
    split = report(2, distributed_strategy="fsdp", tensor_parallel_degree=2)  # counted, not refused
    assert split["layout"]["tp"] == 2 and split["memory"]["params_gb"] < report(1)["memory"]["params_gb"]


def test_context_parallelism_needs_the_sdpa_kernel():
    flex = ModelConfig(architecture="llama", d_model=48, n_heads=4, n_layers=4, attention_backend="flex")
    with pytest.raises(UsageError, match="needs model.attention_backend: sdpa"):
        resolve_layout(TrainingConfig(context_parallel_degree=2), 2, model=flex, seq_len=32, device_type="cuda")
    llama = ModelConfig(architecture="llama", d_model=48, n_heads=4, n_layers=4)
    with pytest.raises(UsageError, match="needs the flash, efficient or cudnn attention kernel"):
        resolve_layout(
            TrainingConfig(context_parallel_degree=2, sdpa_backend="math"),
            2,
            model=llama,
            seq_len=32,
            device_type="cuda",
        )
    with pytest.raises(UsageError, match="cannot apply data.document_mask"):
        resolve_layout(
            TrainingConfig(context_parallel_degree=2),
            2,
            model=llama,
            seq_len=32,
            device_type="cuda",
            document_mask=True,
        )
    for kernel in ("auto", "flash", "efficient", "cudnn"):  # what torch's ring attention replaces
        layout = resolve_layout(
            TrainingConfig(context_parallel_degree=2, sdpa_backend=kernel),
            2,
            model=llama,
            seq_len=32,
            device_type="cuda",
        )
        assert layout.cp == 2
    both = resolve_layout(
        TrainingConfig(context_parallel_degree=2, tensor_parallel_degree=2),
        8,
        model=llama,
        seq_len=32,
        device_type="cuda",
    )
    assert both.describe() == "dp_replicate=1 x dp_shard=2 x pp=1 x cp=2 x tp=2"
    with pytest.raises(UsageError, match="does not divide each context-parallel rank's 18 positions"):
        resolve_layout(
            TrainingConfig(context_parallel_degree=2, tensor_parallel_degree=4),
            8,
            model=llama,
            seq_len=36,
            device_type="cuda",
        )


def _train(tmp_path, monkeypatch, capsys, world: int, *overrides: str) -> tuple[int, str]:
    """`llm-trainer train` in this process as rank 0 of `world` under a launcher; nothing may be written."""
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat.\n" * 50)
    experiment = {
        "model": {"architecture": "llama", "d_model": 48, "n_heads": 4, "n_kv_heads": 2, "n_layers": 4},
        "training": {"device": "cpu", "max_steps": 1, "output_dir": "out", "report_to": ["jsonl"]},
        "data": {"data_files": ["corpus.txt"], "tokenizer": "char", "max_length": 32},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(experiment))
    monkeypatch.chdir(tmp_path)
    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", str(world)),
        ("LOCAL_WORLD_SIZE", str(world)),
    ):
        monkeypatch.setenv(name, value)
    code = main(["train", "--config", "exp.yaml", *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ["--parallelism.tensor_parallel_degree", "3"], "does not divide the 4 process(es)"),
        (2, ["training.tensor_model_parallel_size=2", "model.n_kv_heads=1"], "does not divide model.n_kv_heads (1)"),
        (2, ["parallelism.context_parallel_degree=2"], "needs CUDA"),
        (2, ["parallelism.pipeline_parallel_degree=2", "model.n_layers=3"], "splits model.n_layers (3) into 2"),
        (2, ["parallelism.pipeline_parallel_degree=2", "model.tie_embeddings=true"], "model.tie_embeddings: false"),
        (2, ["parallelism.pipeline_parallel_degree=2", "training.distributed_strategy=ddp"], "composes with FSDP2"),
        (2, ["parallelism.pipeline_parallel_degree=2", "parallelism.pipeline_parallel_microbatches=1"], "fewer than"),
        (2, ["parallelism.pipeline_parallel_degree=2", "training.layer_stats_steps=2"], "layer_stats_steps does not"),
        (2, ["parallelism.pipeline_parallel_degree=2", "data.document_mask=true"], "document_mask does not run"),
        (
            2,
            ["parallelism.pipeline_parallel_degree=2", "training.distributed_strategy=deepspeed"],
            "pipeline_parallel_degree=2 cannot run under distributed_strategy deepspeed",
        ),
        (2, ["parallelism.tensor_parallel_degree=2", "training.distributed_strategy=ddp"], "composes with FSDP2 only"),
        (2, ["parallelism.tensor_parallel_degree=2", "model.dropout=0.1"], "needs model.dropout and"),
        (
            2,
            [
                "training.distributed_strategy=deepspeed",
                "training.deepspeed_config={tensor_parallel: {autotp_size: 2}}",
            ],
            "tensor_parallel_degree=2 cannot run under distributed_strategy deepspeed",
        ),
    ],
)
def test_bad_layouts_exit_2_in_one_line_before_the_process_group_or_data(
    tmp_path, monkeypatch, capsys, world, overrides, message
):
    code, err = _train(tmp_path, monkeypatch, capsys, world, *overrides)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".cache").exists()
