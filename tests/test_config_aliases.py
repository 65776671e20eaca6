"""Other tools' names for our settings: nanoGPT and Hugging Face keys in an experiment file, YAML's
unquoted words as values, and a DeepSpeed JSON file mapped onto our training config."""

from __future__ import annotations

import pytest
import torch

from llm_trainer.config import TrainingConfig, load_experiment
from llm_trainer.errors import UsageError


def test_nanogpt_and_hf_names_are_aliases_and_conflicts_are_reported(tmp_path):
    path = tmp_path / "nano.yaml"
    path.write_text(
        "model: {n_embd: 64, n_head: 4, n_layer: 3, block_size: 128, bias: false, dropout: 0.1}\n"
        "training: {max_iters: 50, grad_clip: 0.5, lr: 1.0e-3, warmup_iters: 5, eval_interval: 10, eval_iters: 2, out_dir: o}\n"
        "data: {data_files: [x]}\n"
    )
    exp = load_experiment(path)
    assert (
        exp.model.d_model,
        exp.model.n_heads,
        exp.model.n_layers,
        exp.model.max_seq_len,
        exp.model.bias,
        exp.model.dropout,
    ) == (64, 4, 3, 128, False, 0.1)
    t = exp.training
    assert (
        t.max_steps,
        t.max_grad_norm,
        t.learning_rate,
        t.warmup_steps,
        t.eval_steps,
        t.eval_max_batches,
        t.output_dir,
    ) == (50, 0.5, 1e-3, 5, 10, 2, "o")
    # an override replaces the field however the file spelled it
    assert load_experiment(path, ["model.d_model=32", "training.max_grad_norm=1.0"]).model.d_model == 32

    path.write_text("model: {hidden_size: 64, d_model: 32, n_embd: 64}\ndata: {data_files: [x]}\n")
    with pytest.raises(
        UsageError, match=r"model.hidden_size \(64\) and model.d_model \(32\) both set model.d_model; keep one"
    ):
        load_experiment(path)


def test_quality_filters_off_unquoted_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  data_files: [x]\n  quality_filters: off\n  deduplication: no\n")
    data = load_experiment(path).data
    assert (data.quality_filters, data.deduplication) == ("off", "none")


def test_deepspeed_conflicts_are_listed_in_one_message(tmp_path):
    """Every disagreement between the file and the training config at once, with both values."""
    from llm_trainer.parallel.deepspeed_engine import merge_into_training

    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 2},
    }
    config["scheduler"] = {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}
    training = TrainingConfig(
        use_deepspeed=True, deepspeed_config=config, learning_rate=1e-3, batch_size=4, weight_decay=0.01
    )
    with pytest.raises(UsageError) as error:
        merge_into_training(training, world_size=1, device=torch.device("cpu"))
    message = str(error.value)
    assert "\n" not in message and message.count("(") >= 3
    for part in (
        "train_micro_batch_size_per_gpu=2 but training.batch_size=4",
        "optimizer.params.lr=0.0001 but training.learning_rate=0.001",
        "scheduler.type 'OneCycle' is not supported",
        "train_batch_size=8 but batch_size x gradient_accumulation_steps x world size = 4 x 4 x 1 = 16",
    ):
        assert part in message, message
    assert "weight_decay" not in message  # it agrees


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
            {"lr_scheduler": "constant_with_warmup", "warmup_steps": 10, "learning_rate": 1e-4},
        ),
        (
            {
                "type": "WarmupDecayLR",
                "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 1e-4, "warmup_num_steps": 5, "total_num_steps": 50},
            },
            {"lr_scheduler": "linear", "warmup_steps": 5, "max_steps": 50, "min_lr": 1e-6},
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 40, "warmup_num_steps": 4, "cos_min_ratio": 0.1}},
            {"lr_scheduler": "cosine", "warmup_steps": 4, "max_steps": 40, "min_lr": pytest.approx(1e-5)},
        ),
    ],
)
def test_deepspeed_schedulers_map_onto_ours_and_a_missing_accumulation_is_derived(scheduler, expected):
    from llm_trainer.parallel.deepspeed_engine import merge_into_training

    config = {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 2,
        "scheduler": scheduler,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    merged = merge_into_training(
        TrainingConfig(use_deepspeed=True, deepspeed_config=config), world_size=3, device=torch.device("cpu")
    )
    assert merged.gradient_accumulation_steps == 2  # 12 = 2 x 2 x 3
    assert {key: getattr(merged, key) for key in expected} == expected
