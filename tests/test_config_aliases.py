"""Other tools' names for our settings: nanoGPT and Hugging Face keys in an experiment file, YAML's
unquoted words as values, and a DeepSpeed JSON file mapped onto our training config."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from llm_trainer import build_model
from llm_trainer.config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.errors import UsageError


def test_the_seed_documents_early_stopping_and_interval_names_are_ours(tmp_path):
    """EarlyStopping's `patience`/`min_delta` (Keras, Lightning; the Hugging Face callback's threshold),
    Megatron's `save_interval`, DeepSpeed's `steps_per_print`; a W&B project key says where it goes."""
    path = tmp_path / "seeds.yaml"
    path.write_text(
        "training: {patience: 3, min_delta: 0.01, save_interval: 40, steps_per_print: 5, eval_steps: 20}\n"
        "data: {data_files: [x]}\n"
    )
    t = load_experiment(path).training
    assert (t.early_stopping_patience, t.early_stopping_min_delta, t.save_steps, t.logging_steps) == (3, 0.01, 40, 5)
    assert TrainingConfig(early_stopping_threshold=0.5).early_stopping_min_delta == 0.5
    path.write_text("training: {project_name: demo}\ndata: {data_files: [x]}\n")
    with pytest.raises(UsageError, match=r"unknown key training.project_name; W&B .* WANDB_PROJECT"):
        load_experiment(path)


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


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("bf16: false, fp16: false", (False, "bfloat16")),  # HF's float32
        ("bf16: false", (False, "bfloat16")),  # HF's fp16 defaults to false
        ("bf16: false, fp16: true", (True, "float16")),  # the true one decides; no conflict
        ("fp16: false, bf16: true", (True, "bfloat16")),
        ("bf16: false, use_amp: true", (True, "bfloat16")),  # our own field wins over a false flag
        ("amp_dtype: float16", (True, "float16")),  # a dtype named beside use_amp: auto is that dtype
        ("use_amp: false, amp_dtype: float16", (False, "float16")),
    ],
)
def test_hf_precision_flags_and_a_named_dtype_run_as_asked_on_any_device(tmp_path, monkeypatch, flags, expected):
    """An HF config's `bf16: false` (with no `fp16: true`) trains in float32 as HF does, not in what
    `use_amp: auto` would pick; `amp_dtype: float16` is never replaced by bf16. On a CPU that computes
    bf16 natively, where auto alone is bf16."""
    from llm_trainer import resolve

    monkeypatch.setattr(resolve, "cpu_computes_bf16", lambda: True)
    path = tmp_path / "hf.yaml"
    path.write_text(f"training: {{{flags}}}\ndata: {{data_files: [x]}}\n")
    decided = resolve.resolve_amp(load_experiment(path).training, torch.device("cpu"))
    assert (decided.use_amp, decided.amp_dtype) == expected
    auto = resolve.resolve_amp(TrainingConfig(), torch.device("cpu"))
    assert (auto.use_amp, auto.amp_dtype) == (True, "bfloat16")  # the default, for contrast


def test_constructors_take_the_names_a_file_takes_and_a_wrong_one_names_the_closest():
    """`ModelConfig(hidden_size=768, ...)` as transformers users type it: the alias table, as in YAML."""
    config = ModelConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        dropout_rate=0.1,
    )
    assert config == ModelConfig(
        vocab_size=30522, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=512, dropout=0.1
    )
    assert ModelConfig(architecture="llama", size="7B").d_model == 4096  # a named shape, as `size: 7B`
    with pytest.raises(ValueError, match=r"architecture must be 'gpt2' or 'llama', got 'mistral'"):
        ModelConfig(architecture="mistral", size="7B")  # the architecture is what is wrong, not the size
    with pytest.raises(ValueError, match=r"model.size '9B' is not a known llama size; known: 7B, 13B, 70B"):
        ModelConfig(architecture="llama", size="9B")
    with pytest.raises(
        ValueError, match=r"model.size '70B' sets n_kv_heads=8, .*; with n_heads set yourself, set n_kv"
    ):
        ModelConfig(architecture="llama", size="70B", num_attention_heads=4)  # the preset's half named as such
    assert ModelConfig(architecture="llama", size="70B", n_heads=16, n_kv_heads=4).n_kv_heads == 4
    training = TrainingConfig(lr=1e-3, gradient_clipping=0.5, per_device_train_batch_size=2, bf16=True)
    assert (training.learning_rate, training.max_grad_norm, training.batch_size) == (1e-3, 0.5, 2)
    assert (training.use_amp, training.amp_dtype) == (True, "bfloat16")
    with pytest.raises(
        ValueError,
        match=r"^ModelConfig: unknown key model\.hiden_size; did you mean model\.hidden_size \(= model\.d_model\)\?$",
    ):
        ModelConfig(hiden_size=768)
    with pytest.raises(ValueError, match=r"model\.hidden_size \(768\) and model\.d_model \(256\) both set"):
        ModelConfig(hidden_size=768, d_model=256)
    with pytest.raises(ValueError, match=r"unknown key training\.learning_rat; did you mean training\.learning_rate\?"):
        TrainingConfig(learning_rat=1e-3)
    with pytest.raises(TypeError):
        TrainingConfig(8)  # still keyword-only


def test_a_setting_of_another_section_is_named_there_in_python_and_in_yaml(tmp_path):
    """The lesson's ModelConfig holds its training parameters too: each is named where it belongs."""
    with pytest.raises(ValueError) as error:
        ModelConfig(hidden_size=768, learning_rate=5e-5, batch_size=16, gradient_clipping=1.0)
    message = str(error.value)
    assert "unknown key model.learning_rate; it is a setting of another section: training.learning_rate" in message
    assert "model.batch_size; it is a setting of another section: training.batch_size" in message  # not block_size
    assert "training.gradient_clipping (= training.max_grad_norm)" in message and len(message.splitlines()) == 1
    path = tmp_path / "c.yaml"
    path.write_text("model: {hidden_size: 64, learning_rate: 0.1}\ndata: {data_files: [x]}\n")
    with pytest.raises(UsageError, match=r"model\.learning_rate; it is a setting of another section: training\."):
        load_experiment(path)
    # a file without sections (the Hindi trainer's base_config.yaml): where each of its settings goes
    path.write_text("learning_rate: 3e-4\nbatch_size: 32\nnum_epochs: 10\nhidden_size: 64\ndata_files: [x]\nfoo: 1\n")
    with pytest.raises(UsageError) as error:
        load_experiment(path)
    assert (
        "settings go under their section, not at the top level of the file: put learning_rate, batch_size, "
        "num_epochs under training:; put hidden_size under model:; put data_files under data:" in str(error.value)
    )
    assert "unknown section 'foo'" in str(error.value) and "unknown section 'learning_rate'" not in str(error.value)


def test_the_hf_names_read_back_on_the_configs_and_say_which_field_to_set():
    config = ModelConfig(architecture="llama", d_model=256, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=99)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 2, 4)
    assert (config.max_position_embeddings, config.vocab_size, config.model_type) == (64, 99, "llama")
    # unset preset fields read as the preset gives them, as a transformers config holds them
    assert (config.intermediate_size, config.num_key_value_heads, config.tie_word_embeddings) == (768, 4, False)
    assert (config.n_embd, config.n_layer, config.block_size) == (256, 2, 64)  # nanoGPT's names too
    with pytest.raises(AttributeError, match="reads ModelConfig.d_model; set d_model instead"):
        config.hidden_size = 512
    assert "hidden_size" not in config.to_dict()  # not a field: nothing saved twice
    # the lesson's training loop reads config.gradient_clipping, config.learning_rate, config.num_epochs
    training = TrainingConfig(max_grad_norm=0.5, learning_rate=1e-3, num_epochs=2)
    assert (training.gradient_clipping, training.lr, training.num_train_epochs) == (0.5, 1e-3, 2)
    with pytest.raises(AttributeError, match="reads TrainingConfig.max_grad_norm; set max_grad_norm instead"):
        training.gradient_clipping = 1.0


def test_a_model_configs_gradient_checkpointing_trains_with_it_from_python(tmp_path, monkeypatch):
    """The guide's `ModelConfig(..., gradient_checkpointing=True)`, a training setting given to the model
    section, reaches the run built from the three configs (and `train(ExperimentConfig(...))`'s)."""
    from conftest import write_corpus
    from llm_trainer import Trainer, train

    monkeypatch.chdir(tmp_path)
    model = ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=32, gradient_checkpointing=True)
    training = TrainingConfig(batch_size=4, max_steps=2, eval_steps=0, save_steps=0, output_dir=str(tmp_path / "a"))
    data = DataConfig(data_files=[str(write_corpus(tmp_path / "corpus"))], tokenizer="char")
    trainer = Trainer.from_config(model, training, data)
    assert trainer.config.gradient_checkpointing and type(trainer.model.blocks[0]).__name__ == "CheckpointWrapper"
    assert trainer.train()["step"] == 2
    experiment = ExperimentConfig(
        model=model, training=dataclasses.replace(training, output_dir=str(tmp_path / "b")), data=data
    )
    assert experiment.training.gradient_checkpointing and train(experiment)["step"] == 2


def test_a_name_assigned_after_construction_is_checked_as_the_constructor_checks_it():
    """The lesson builds its config by assignment (`config.learning_rate = ...`): a name that is no field
    must not be kept beside the fields and never read."""
    config = ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=32, vocab_size=100)
    config.n_layers = 6
    assert build_model(config).config.n_layers == 6
    with pytest.raises(
        ValueError, match=r"^ModelConfig: unknown key model\.num_layers; did you mean model\.n_layers\?$"
    ):
        config.num_layers = 4
    with pytest.raises(ValueError, match=r"model\.learning_rate; it is a setting of another section: training\."):
        config.learning_rate = 5e-5
    with pytest.raises(ValueError, match=r"^ModelConfig\.n_layers must be an integer, got '6'$"):
        config.n_layers = "6"
    assert not hasattr(config, "num_layers") and not hasattr(config, "learning_rate") and config.n_layers == 6
    training = TrainingConfig()
    training.learning_rate = 1  # a number field keeps a float, as when constructed
    assert training.learning_rate == 1.0 and isinstance(training.learning_rate, float)
    with pytest.raises(ValueError, match=r"training\.num_train_epoch; did you mean training\.num_train_epochs"):
        training.num_train_epoch = 3
    with pytest.raises(ValueError, match=r"TrainingConfig\.fp16 is another framework's name.*set use_amp=True"):
        training.fp16 = True
    experiment = ExperimentConfig(model=config, training=training, data=DataConfig(data_files=["x"]))
    with pytest.raises(ValueError, match="learning_rate is training.learning_rate: set it there"):
        experiment.learning_rate = 1e-3
    experiment.training = TrainingConfig(max_steps=3)
    assert experiment.training.max_steps == 3
    with pytest.raises(ValueError, match="ExperimentConfig.model must be a ModelConfig .*, got TrainingConfig"):
        experiment.model = TrainingConfig()
    with pytest.raises(ValueError, match="ExperimentConfig.data must be a DataConfig .*, got ModelConfig"):
        ExperimentConfig(model=config, training=training, data=config)
    from_mappings = ExperimentConfig(model={"hidden_size": 32, "n_heads": 2}, training={"lr": 1e-3}, data={})
    assert (from_mappings.model.d_model, from_mappings.training.learning_rate) == (32, 1e-3)
    copied = copy.deepcopy(experiment)  # copies and pickles are built without the checks, and keep them
    assert pickle.loads(pickle.dumps(copied)).model.n_layers == 6
    with pytest.raises(ValueError, match="unknown key model.num_layers"):
        copied.model.num_layers = 4


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


def test_an_all_auto_deepspeed_section_of_another_type_says_it_stands_for_the_training_configs(capsys):
    """An HF-style file with `WarmupDecayLR` and every param "auto" runs the training config's schedule
    (the README: all-"auto" sections stand for it); since the file reads as linear decay, the start says so."""
    from llm_trainer.parallel.deepspeed_engine import merge_into_training

    auto = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}
    config = {
        "scheduler": {"type": "WarmupDecayLR", "params": auto},
        "optimizer": {"type": "Lamb", "params": {"lr": "auto"}},
    }
    training = TrainingConfig(use_deepspeed=True, deepspeed_config=config)
    assert merge_into_training(training, world_size=1, device=torch.device("cpu")) == training
    err = capsys.readouterr().err
    assert (
        "scheduler.type 'WarmupDecayLR' has only \"auto\" params, so it stands for the training config's "
        "training.lr_scheduler: cosine (set training.lr_scheduler: linear for the file's)" in err
    )
    assert (
        "optimizer.type 'Lamb' has only \"auto\" params, so it stands for the training config's training.optimizer: adamw"
        in err
    )
    same = TrainingConfig(use_deepspeed=True, deepspeed_config=config, lr_scheduler="linear", optimizer="adamw")
    config["optimizer"]["type"] = "AdamW"
    merge_into_training(same, world_size=1, device=torch.device("cpu"))
    assert "stands for" not in capsys.readouterr().err  # the file and the training config agree: nothing to say
    for shipped in ("zero2.json", "zero3.json"):  # ours say nothing to a run at the defaults
        path = Path(__file__).parents[1] / "src" / "llm_trainer" / "configs" / "deepspeed" / shipped
        merge_into_training(
            TrainingConfig(use_deepspeed=True, deepspeed_config=str(path)), world_size=1, device=torch.device("cpu")
        )
        assert "stands for" not in capsys.readouterr().err


def test_a_deepspeed_file_alone_turns_deepspeed_on_and_beside_another_strategy_is_refused(tmp_path):
    """The HF Trainer's `deepspeed=ds.json` alone runs DeepSpeed: so does `training.deepspeed_config`
    under distributed_strategy auto. Beside ddp or fsdp it would be ignored: refused in one line."""
    shipped = Path(__file__).resolve().parents[1] / "configs" / "deepspeed" / "zero2.json"
    assert TrainingConfig(deepspeed_config=str(shipped)).distributed_strategy == "deepspeed"
    for strategy in ("ddp", "fsdp"):
        with pytest.raises(
            ValueError, match=rf"read under distributed_strategy deepspeed, and this run's is {strategy}"
        ):
            TrainingConfig(deepspeed_config=str(shipped), distributed_strategy=strategy)
    path = tmp_path / "exp.yaml"
    path.write_text(f"training: {{deepspeed_config: {shipped}}}\ndata: {{data_files: [x]}}\n")
    assert load_experiment(path).training.distributed_strategy == "deepspeed"
