"""Configs: the documented fields, presets, validation errors, YAML/JSON files and dotted overrides."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_trainer.cli import PRESETS
from llm_trainer.config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.errors import UsageError
from llm_trainer.model import Transformer


def test_public_fields_accept_the_documented_names():
    ModelConfig(
        vocab_size=100,
        d_model=64,
        n_heads=4,
        n_layers=2,
        d_ff=128,
        max_seq_len=32,
        dropout=0.1,
        attention_dropout=0.1,
        activation="relu",
        pre_norm=False,
        gradient_checkpointing=True,
        architecture="gpt2",
        norm="rmsnorm",
        position_embedding="rope",
        n_kv_heads=2,
        tie_embeddings=False,
        rms_norm_eps=1e-6,
    )
    TrainingConfig(
        batch_size=4,
        learning_rate=1e-3,
        weight_decay=0.0,
        num_epochs=2,
        max_steps=10,
        lr_scheduler="wsd",
        min_lr=1e-5,
        warmup_steps=2,
        optimizer="adam",
        adam_beta1=0.8,
        adam_beta2=0.9,
        adam_epsilon=1e-6,
        gradient_accumulation_steps=2,
        use_amp=True,
        amp_dtype="float16",
        max_grad_norm=0.5,
        save_steps=5,
        save_total_limit=1,
        eval_steps=5,
        logging_steps=1,
        checkpoint_dir="c",
        report_to=["jsonl"],
        resume_from_checkpoint="latest",
        early_stopping_patience=2,
        early_stopping_min_delta=0.01,
        compile=False,
        gradient_checkpointing=True,
        seed=1,
        device="cpu",
    )
    DataConfig(
        dataset_name="x",
        dataset_config="y",
        dataset_split="train",
        validation_split="validation",
        data_files=["a.txt"],
        text_column="content",
        max_length=32,
        min_length=5,
        pack_sequences=False,
        packing_strategy="first_fit",
        preprocessing_num_workers=2,
        tokenizer="char",
        tokenizer_vocab_size=1000,
        cache_dir="cache",
    )


def test_architecture_presets_fill_unset_fields():
    gpt2 = ModelConfig(architecture="gpt2").resolved()
    assert (gpt2.norm, gpt2.activation, gpt2.position_embedding, gpt2.bias, gpt2.tie_embeddings) == (
        "layernorm",
        "gelu",
        "learned",
        True,
        True,
    )
    assert gpt2.d_ff == 4 * gpt2.d_model
    llama = ModelConfig(architecture="llama", d_model=4096, n_heads=32).resolved()
    assert (llama.norm, llama.activation, llama.position_embedding, llama.bias, llama.tie_embeddings) == (
        "rmsnorm",
        "swiglu",
        "rope",
        False,
        False,
    )
    assert llama.d_ff == 11008  # LLaMA-7B's hidden size from the 8/3 rule rounded to 256
    assert llama.n_kv_heads == 32
    # An explicit value beats the preset.
    assert ModelConfig(architecture="llama", norm="layernorm").resolved().norm == "layernorm"


def test_replace_rederives_what_the_preset_decided():
    """The fields keep what was asked for, so replace() gives the new architecture's whole preset
    (and sizes derived from the new width), while explicit choices survive."""
    llama = ModelConfig(architecture="llama", d_model=512, n_heads=8)
    gpt2 = dataclasses.replace(llama, architecture="gpt2").resolved()
    assert (gpt2.norm, gpt2.activation, gpt2.position_embedding, gpt2.bias, gpt2.tie_embeddings) == (
        "layernorm",
        "gelu",
        "learned",
        True,
        True,
    )
    assert gpt2.d_ff == 4 * 512
    wider = dataclasses.replace(llama, d_model=1024, n_heads=16).resolved()
    assert wider.d_ff == 2816 and wider.n_kv_heads == 16  # 8/3 x 1024 rounded up to 256; n_kv_heads follows n_heads
    explicit = dataclasses.replace(ModelConfig(architecture="llama", norm="layernorm"), architecture="gpt2")
    assert explicit.resolved().norm == "layernorm"
    # A model records the resolved architecture, and nothing that is not architecture.
    model = Transformer(dataclasses.replace(llama, vocab_size=32, attention_backend="flex"))
    assert model.config.norm == "rmsnorm" and model.config.d_ff == 1536
    recorded = model.config.architecture_dict()
    assert recorded["activation"] == "swiglu" and "attention_backend" not in recorded and "init_from" not in recorded


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=30, n_heads=4), "divisible by n_heads"),
        (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(dropout=1.5), "dropout must be in [0, 1)"),
        (dict(n_layers=0), "n_layers must be positive"),
        (dict(activation="tanh"), "activation must be"),
        (dict(d_model="big"), "d_model must be an integer"),
        (dict(d_model=True), "d_model must be an integer"),
    ],
)
def test_model_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        ModelConfig(**kwargs)


def test_training_and_data_config_errors():
    with pytest.raises(ValueError, match="learning_rate must be positive"):
        TrainingConfig(learning_rate=0)
    with pytest.raises(ValueError, match="min_lr"):
        TrainingConfig(learning_rate=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="lr_scheduler"):
        TrainingConfig(lr_scheduler="step")
    with pytest.raises(ValueError, match="device"):
        TrainingConfig(device="tpu")
    with pytest.raises(ValueError, match="names no training data"):
        DataConfig().check_source()  # where data is read, not on construction
    with pytest.raises(ValueError, match="validation_split"):
        DataConfig(dataset_name="x", validation_split=1.5)
    with pytest.raises(ValueError, match=r"tokenizer_vocab_size must be at least 257 for byte-level BPE .*got 100"):
        DataConfig(dataset_name="x", tokenizer_vocab_size=100)  # the trainer would make 257 without a word
    assert DataConfig(dataset_name="x", tokenizer="char", tokenizer_vocab_size=100).tokenizer == "char"
    with pytest.raises(ValueError, match="target_val_loss must be positive or null, got -1.0"):
        TrainingConfig(target_val_loss=-1.0)  # a loss below 0 is never reached
    with pytest.raises(ValueError, match="early_stopping_patience counts evaluations, but eval_steps is 0"):
        TrainingConfig(early_stopping_patience=2, eval_steps=0)
    with pytest.raises(TypeError):
        TrainingConfig(8)  # keyword-only


def test_ints_are_accepted_for_floats_and_stored_as_floats():
    assert isinstance(TrainingConfig(learning_rate=1).learning_rate, float)


def test_unknown_key_names_the_closest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_modle: 64\ndata:\n  dataset_name: python-stdlib\n")
    with pytest.raises(UsageError, match=r"unknown key model.d_modle; did you mean model.d_model\?"):
        load_experiment(path)
    path.write_text("trainig:\n  batch_size: 2\n")
    with pytest.raises(UsageError, match="did you mean training"):
        load_experiment(path)


def test_yaml_json_and_overrides(tmp_path):
    values = {"model": {"d_model": 64}, "training": {"batch_size": 2}, "data": {"dataset_name": "python-stdlib"}}
    (tmp_path / "c.json").write_text(json.dumps(values))
    exp = load_experiment(
        tmp_path / "c.json",
        ["training.learning_rate=3e-4", "model.n_layers=3", "training.report_to=[jsonl]", "data.validation_split=0.2"],
    )
    assert exp.training.learning_rate == 3e-4 and exp.model.n_layers == 3 and exp.model.d_model == 64
    assert exp.training.report_to == ["jsonl"] and exp.data.validation_split == 0.2
    # one name, or several with commas, as transformers' TrainingArguments takes report_to
    assert load_experiment(tmp_path / "c.json", ["training.report_to=tensorboard"]).training.report_to == [
        "tensorboard"
    ]
    assert TrainingConfig(report_to="tensorboard, mlflow").report_to == ["tensorboard", "mlflow"]
    assert TrainingConfig(report_to="none").report_to == []
    with pytest.raises(UsageError, match="section.key=value"):
        load_experiment(tmp_path / "c.json", ["learning_rate"])
    with pytest.raises(UsageError, match="batch_size must be an integer"):
        load_experiment(tmp_path / "c.json", ["training.batch_size=big"])


def test_an_override_nested_as_the_pretraining_guide_nests_its_yaml(tmp_path):
    """`distributed.fsdp_config.sharding_strategy=...` sets that one entry of the file's mapping (its
    other entries kept), as the YAML `distributed: {fsdp_config: {...}}` would; a typo deep inside is named."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {d_model: 64}\ndata: {dataset_name: python-stdlib}\n"
        "distributed: {strategy: fsdp, fsdp_config: {sharding_strategy: FULL_SHARD, activation_checkpointing: true}}\n"
    )
    assert load_experiment(path).training.fsdp_sharding == "full_shard"
    exp = load_experiment(path, ["distributed.fsdp_config.sharding_strategy=SHARD_GRAD_OP"])
    assert exp.training.fsdp_sharding == "shard_grad_op" and exp.training.gradient_checkpointing is True
    with pytest.raises(UsageError, match="did you mean distributed.fsdp_config.sharding_strategy"):
        load_experiment(path, ["distributed.fsdp_config.sharding_strateg=SHARD_GRAD_OP"])
    with pytest.raises(UsageError, match=r"^command line: TrainingConfig.fsdp_sharding must be"):  # not the file's
        load_experiment(path, ["distributed.fsdp_config.sharding_strategy=NO_SHARD"])


def test_a_combination_the_overrides_make_invalid_is_blamed_on_the_command_line(tmp_path):
    """d_model from the file and n_heads from the command line that do not divide: the file alone is
    valid, so the error is the command line's; a file that is invalid by itself is still named."""
    good, bad = tmp_path / "base.yaml", tmp_path / "bad.yaml"
    good.write_text("model: {d_model: 32, n_heads: 4}\n")
    bad.write_text("model: {d_model: 32, n_heads: 3}\n")
    with pytest.raises(
        UsageError, match=r"^command line: ModelConfig.d_model \(32\) must be divisible by n_heads \(3\)"
    ):
        load_experiment(good, ["model.n_heads=3"])
    with pytest.raises(UsageError, match=rf"^{re.escape(str(bad))}: ModelConfig.d_model \(32\) must be divisible"):
        load_experiment(bad, ["model.n_layers=2"])


def test_switches_spelled_elsewhere_set_the_training_fields(tmp_path):
    """`model.gradient_checkpointing: true` and `training.use_deepspeed: true` (also under `distributed:`)
    are read as training.gradient_checkpointing and distributed_strategy: deepspeed; `false` sets nothing."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {d_model: 32, gradient_checkpointing: true}\ntraining: {use_deepspeed: true}\n"
        "data: {dataset_name: python-stdlib}\n"
    )
    exp = load_experiment(path)
    assert exp.training.gradient_checkpointing is True and exp.training.distributed_strategy == "deepspeed"
    assert "gradient_checkpointing" not in exp.to_dict()["model"] and "use_deepspeed" not in exp.to_dict()["training"]
    # An override replaces the field however the file spelled it.
    assert load_experiment(path, ["training.gradient_checkpointing=false"]).training.gradient_checkpointing is False
    assert load_experiment(path, ["training.use_deepspeed=false"]).training.distributed_strategy == "auto"
    path.write_text(
        "model: {gradient_checkpointing: false}\n"
        "training: {use_deepspeed: false, distributed_strategy: fsdp, gradient_checkpointing: true}\n"
        "distributed: {use_deepspeed: false}\ndata: {dataset_name: python-stdlib}\n"
    )
    exp = load_experiment(path)
    assert exp.training.gradient_checkpointing is True and exp.training.distributed_strategy == "fsdp"
    path.write_text("distributed: {use_deepspeed: true}\ndata: {dataset_name: python-stdlib}\n")
    assert load_experiment(path).training.distributed_strategy == "deepspeed"
    # Disagreements are listed together, naming both spellings.
    path.write_text(
        "model: {gradient_checkpointing: true}\n"
        "training: {gradient_checkpointing: false, use_deepspeed: true, distributed_strategy: ddp}\n"
        "data: {dataset_name: python-stdlib}\n"
    )
    with pytest.raises(UsageError) as error:
        load_experiment(path)
    message = str(error.value)
    assert ": 2 problems: " in message
    assert "training.use_deepspeed ('deepspeed') and training.distributed_strategy ('ddp') both set" in message
    assert "and model.gradient_checkpointing (True) both set training.gradient_checkpointing" in message
    path.write_text("training: {use_deepspeed: yes please}\ndata: {dataset_name: python-stdlib}\n")
    with pytest.raises(UsageError, match="training.use_deepspeed must be true or false"):
        load_experiment(path)
    # A model section on its own cannot hold a training field.
    with pytest.raises(ValueError, match="model.gradient_checkpointing sets training.gradient_checkpointing"):
        ModelConfig.from_dict({"gradient_checkpointing": True}, section="model")
    assert load_experiment(PRESETS / "large.yaml").training.gradient_checkpointing is True


def test_the_same_switches_as_python_keywords():
    """`TrainingConfig(use_deepspeed=True)` and `ModelConfig(gradient_checkpointing=True)`, as the guides
    write them: read by the same rule, not kept as fields; the model's one lands in the experiment's
    training section."""
    training = TrainingConfig(use_deepspeed=True)
    assert training.distributed_strategy == "deepspeed" and "use_deepspeed" not in training.to_dict()
    assert TrainingConfig(use_deepspeed=False, distributed_strategy="fsdp").distributed_strategy == "fsdp"
    with pytest.raises(ValueError, match="use_deepspeed sets distributed_strategy='deepspeed', but distributed_str"):
        TrainingConfig(use_deepspeed=True, distributed_strategy="ddp")
    with pytest.raises(ValueError, match="training.use_deepspeed must be true or false"):
        TrainingConfig(use_deepspeed="yes")
    model = ModelConfig(d_model=32, gradient_checkpointing=True)
    assert "gradient_checkpointing" not in model.to_dict()
    data = DataConfig(dataset_name="python-stdlib")
    experiment = ExperimentConfig(model=model, training=TrainingConfig(), data=data)
    assert experiment.training.gradient_checkpointing is True
    assert "gradient_checkpointing" not in experiment.to_dict()["model"]
    plain = ExperimentConfig(model=ModelConfig(gradient_checkpointing=False), training=TrainingConfig(), data=data)
    assert plain.training.gradient_checkpointing is False
    smaller = dataclasses.replace(model, d_model=16)  # a copy made the dataclass way carries the switch
    assert ExperimentConfig(model=smaller, training=TrainingConfig(), data=data).training.gradient_checkpointing
    assert dataclasses.replace(training, learning_rate=1e-3).distributed_strategy == "deepspeed"
    assert dataclasses.replace(training, distributed_strategy="ddp").distributed_strategy == "ddp"  # its own field


def test_the_models_training_switch_holds_for_a_trainer_of_ones_own_model(tmp_path):
    """The guide's `ModelConfig(gradient_checkpointing=True)`, its model built and handed to a Trainer
    with a TrainingConfig of its own (no ExperimentConfig in between): the blocks are checkpointed."""
    from llm_trainer.train.trainer import Trainer

    config = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_seq_len=16, gradient_checkpointing=True)
    training = TrainingConfig(max_steps=1, device="cpu", output_dir=str(tmp_path / "run"), save_steps=0)
    trainer = Trainer(Transformer(config), training, train_dataloader=[torch.randint(0, 64, (4, 16))] * 4)
    assert trainer.config.gradient_checkpointing is True and trainer.run.activation_checkpointing is True


def test_a_config_is_read_under_our_names_once(monkeypatch):
    """The alias pass runs once per input: each section of an experiment once, each data source once."""
    from llm_trainer import config_aliases

    read = []
    section = config_aliases._section

    def counting(name, values, *args, **kwargs):
        read.append(name)
        return section(name, values, *args, **kwargs)

    monkeypatch.setattr(config_aliases, "_section", counting)
    values = {
        "model": {"hidden_size": 32, "n_heads": 2},
        "training": {"lr": 1e-3},
        "data": {"sources": [{"name": "a", "data_files": "a.txt"}, {"name": "b", "data_files": "b.txt"}]},
    }
    exp = ExperimentConfig.from_dict(values)
    assert exp.model.d_model == 32 and exp.training.learning_rate == 1e-3 and len(exp.data.sources) == 2
    assert sorted(read) == ["DataConfig.sources[0]", "DataConfig.sources[1]", "data", "model", "training"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty"),
        ("model: [1, 2", "could not be parsed"),
        (
            "model:\n  d_model: 32\n\tn_layers: 2\n",
            r"could not be parsed: line 3, column 1: found character '\\t' that cannot start any token",
        ),
        ("model: {d_model: [1, 2}\n", r"line 1, column 23: expected ',' or '\]', but got '}'"),
        # a key twice: YAML keeps the last, which would drop the first section whole
        (
            "model:\n  d_model: 32\ntraining:\n  max_steps: 5\nmodel:\n  n_heads: 4\n",
            r"c.yaml: the key 'model' is written twice in one mapping \(lines 1 and 5\)",
        ),
        ("model: {d_model: 32, d_model: 64}\n", r"the key 'd_model' is written twice in one mapping \(lines 1 and 1\)"),
        ("- a\n- b\n", "must hold a mapping"),
        (
            '{"train_batch_size": 32, "zero_optimization": {"stage": 3}, "bf16": {"enabled": true}}',
            r"is a DeepSpeed config \(train_batch_size, zero_optimization\), not an experiment: pass it as "
            r"training.deepspeed_config=",
        ),
    ],
)
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_experiment(path)
    with pytest.raises(UsageError, match="not found"):
        load_experiment(tmp_path / "missing.yaml")
    with pytest.raises(UsageError, match="is a folder"):
        load_experiment(tmp_path)


def test_a_merge_key_s_entries_may_be_set_again():
    from llm_trainer.config_loader import yaml_load

    text = "base: &b {d_model: 32, n_heads: 2}\nmodel:\n  <<: *b\n  d_model: 64\n"
    assert yaml_load(text)["model"] == {"d_model": 64, "n_heads": 2}


def test_every_preset_loads_and_small_ones_build():
    presets = sorted(PRESETS.glob("*.yaml"))
    assert {p.stem for p in presets} >= {"quickstart", "tiny", "small", "gpt2-small", "large", "llama-7b"}
    for path in presets:
        exp = load_experiment(path)
        model_config = exp.model
        if model_config.vocab_size is None:
            model_config = ModelConfig(**{**model_config.to_dict(), "vocab_size": 50257})
        if model_config.d_model * model_config.n_layers <= 256 * 4:
            model = Transformer(model_config)
            logits = model(torch.zeros(1, 4, dtype=torch.long))
            assert logits.shape == (1, 4, model_config.vocab_size)
    llama = load_experiment(PRESETS / "llama-7b.yaml").model
    with torch.device("meta"):
        n = Transformer(llama).num_parameters()
    assert 6.5e9 < n < 6.9e9  # LLaMA-7B has 6.74B parameters
    with torch.device("meta"):
        gpt2 = Transformer(
            ModelConfig(**{**load_experiment(PRESETS / "gpt2-small.yaml").model.to_dict(), "vocab_size": 50257})
        )
    assert 124e6 < gpt2.num_parameters() < 125e6  # GPT-2 small: 124M


@pytest.mark.slow
def test_cli_bad_config_is_one_line_exit_2(tmp_path):
    """The one real subprocess of the "one line, exit 2" path; the other cases call cli.main in process."""
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  learning_rat: 1.0e-3\ndata:\n  dataset_name: python-stdlib\n")
    result = subprocess.run(
        [sys.executable, "-m", "llm_trainer", "train", "--config", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "did you mean training.learning_rate" in result.stderr and "Traceback" not in result.stderr


def test_a_model_shape_error_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from llm_trainer import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", "tiny", "model.n_heads=3"]) == 2
    err = capsys.readouterr().err
    assert "divisible by n_heads" in err and "Traceback" not in err and err.strip().count("\n") == 0


# -- DeepSpeed config: "auto" filled from TrainingConfig, conflicts refused ---------------------------


def test_deepspeed_config_fills_auto_from_training(tmp_path):
    from llm_trainer.parallel.deepspeed_engine import build_config

    shipped = Path(__file__).resolve().parents[1] / "src" / "llm_trainer" / "configs" / "deepspeed"
    training = TrainingConfig(
        batch_size=4,
        gradient_accumulation_steps=3,
        max_grad_norm=0.5,
        use_amp=True,
        amp_dtype="bfloat16",
        deepspeed_config=str(shipped / "zero3.json"),
    )
    cfg = build_config(training, world_size=2, d_model=64)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (
        4,
        3,
        24,
    )
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    zero = cfg["zero_optimization"]
    assert (
        zero["stage"] == 3
        and zero["reduce_bucket_size"] == 64 * 64
        and zero["stage3_param_persistence_threshold"] == 640
    )
    assert "optimizer" not in cfg and "scheduler" not in cfg  # all "auto": ours stand in for them
    assert cfg["managed_gradient_accumulation"] is False
    assert build_config(TrainingConfig(), world_size=1, d_model=None)["zero_optimization"] == {"stage": 2}


@pytest.mark.parametrize(
    "deepspeed_config, message",
    [
        # a file's own optimizer values are folded into the training config first (merge_into_training);
        # one that still disagrees with it is named with both values
        (
            {"optimizer": {"type": "Adam", "params": {"lr": 0.1}}},
            "optimizer.params.lr=0.1 but training.learning_rate=0.0003",
        ),
        ({"train_micro_batch_size_per_gpu": 16}, "train_micro_batch_size_per_gpu=16 but the training config gives 8"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        (
            {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}},
            'cannot fill "auto" for zero_optimization.sub_group_size',
        ),
        ("missing.json", "missing.json does not exist"),
        ("bad.json", "bad.json is not valid JSON"),
        # sections given as other JSON values than objects (accelerate's `"bf16": true`): named, with an example
        ({"bf16": True}, 'bf16 must be a JSON object such as {"enabled": true}, got True'),
        ({"zero_optimization": "yes"}, 'zero_optimization must be a JSON object such as {"stage": 2}'),
        ({"optimizer": {"type": "AdamW", "params": "x"}}, "optimizer.params must be a JSON object, got 'x'"),
    ],
)
def test_deepspeed_config_errors_name_the_problem(tmp_path, monkeypatch, deepspeed_config, message):
    from llm_trainer.parallel.deepspeed_engine import build_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match=re.escape(message)):
        build_config(TrainingConfig(batch_size=8, deepspeed_config=deepspeed_config), world_size=1, d_model=32)


@pytest.mark.parametrize("given", ["", [" "], ["corpus/", ""]])
def test_an_empty_name_in_data_files_is_refused_rather_than_read_as_the_working_folder(given):
    from llm_trainer.config import DataConfig

    with pytest.raises(ValueError, match=r"DataConfig.data_files holds an empty name .*the working folder is ./"):
        DataConfig(data_files=given)
    with pytest.raises(ValueError, match=r"data source 'web': data_files holds an empty name"):
        DataConfig(sources=[{"name": "web", "data_files": given}])


def test_a_file_url_is_read_as_the_local_path_it_names(tmp_path):
    """`file:///data/x` in any path setting is `/data/x` (it was taken as a relative folder named
    `file:`); one of another machine is refused naming the setting."""
    data = DataConfig(data_files=f"file://{tmp_path}/a%20b.txt", cache_dir=f"file://{tmp_path}/cache")
    assert (data.data_files, data.cache_dir) == (f"{tmp_path}/a b.txt", f"{tmp_path}/cache")
    assert DataConfig(data_files=[f"file://localhost{tmp_path}/x.txt"]).data_files == [f"{tmp_path}/x.txt"]
    training = TrainingConfig(output_dir=f"file://{tmp_path}/run")
    assert training.output_dir == f"{tmp_path}/run" and training.remote_output_dir is None
    with pytest.raises(ValueError, match=r"DataConfig.cache_dir 'file://other/x' names a file on the machine 'other'"):
        DataConfig(cache_dir="file://other/x")


def test_an_override_meant_as_a_list_that_yaml_cannot_read_says_how_to_quote_it(tmp_path):
    """`data.include=[*.md]`: YAML reads *md as an alias, so the list is no list; said with the items
    quoted (it was taken as one string, refused as no list, or used as a pattern '[*.txt]'). One pattern
    given alone is a list of it."""
    path = tmp_path / "c.yaml"
    path.write_text("data: {data_files: [x]}\n")
    for override, quoted in (
        ("data.include=[*.md]", '["*.md"]'),
        ("data.data_files=[*.txt, sub/*]", '["*.txt", "sub/*"]'),
    ):
        with pytest.raises(
            UsageError, match=re.escape(f"(YAML reads *x as an alias): '{override.split('=')[0]}={quoted}'")
        ):
            load_experiment(path, [override])
    assert load_experiment(path, ['data.include=["*.md"]']).data.include == ["*.md"]
    assert load_experiment(path, ["data.exclude=tests/x"]).data.exclude == ["tests/x"]  # one pattern alone


def test_greater_is_better_for_a_loss_is_refused_not_ignored():
    """best_model follows the lowest loss: `greater_is_better: true` beside a loss would be ignored (for
    the mixed loss) or keep the worst model (a source's), so it is refused, naming the metric."""
    for metric in ("val_loss", "eval_loss", "eval/web/loss"):
        with pytest.raises(
            ValueError, match=rf"greater_is_better is true, but metric_for_best_model {metric} is a loss"
        ):
            TrainingConfig(greater_is_better=True, metric_for_best_model=metric)
    assert TrainingConfig(greater_is_better=False).greater_is_better is False


def test_two_spellings_of_one_field_on_the_command_line_are_refused_as_in_a_file(tmp_path):
    """`training.max_steps=1 training.max_iters=2`: the last one won silently; in a file the same pair is
    refused. An override still replaces the file's own spelling of the field it sets."""
    path = tmp_path / "c.yaml"
    path.write_text("training: {max_iters: 5}\ndata: {data_files: [x]}\n")
    with pytest.raises(
        UsageError, match=r"command line: training.max_steps \(1\) and training.max_iters \(2\) both set"
    ):
        load_experiment(path, ["training.max_steps=1", "training.max_iters=2"])
    assert load_experiment(path, ["training.max_steps=3"]).training.max_steps == 3  # over the file's max_iters
