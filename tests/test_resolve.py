"""The resolved run: every value decided once, and every entry point getting the same answers."""

import pytest
import torch

from conftest import tiny_model_config, write_tiny_experiment
from llm_trainer import resolve
from llm_trainer.config_loader import load_experiment

# -- RUN engineer: one resolved run for the pipeline, the LR finder, the Trainer and the estimate -------


@pytest.mark.parametrize("native", [False, True], ids=["no-native-bf16", "native-bf16"])
def test_estimate_counts_use_amp_auto_as_the_run_resolves_it(tmp_path, monkeypatch, native):
    """use_amp: auto is bf16 only where the device computes it natively; the estimate says what the run does."""
    from llm_trainer.tools.estimate import estimate_report
    from llm_trainer.train.memory_estimate import estimate_memory

    monkeypatch.setattr(resolve, "cpu_computes_bf16", lambda: native)
    experiment = load_experiment(write_tiny_experiment(tmp_path, use_amp="auto"))
    assert resolve.resolve_training(experiment.training).use_amp is native

    report = estimate_report(experiment, vocab_size=64)
    assert report["precision"] == ("fp32 weights + autocast bfloat16" if native else "fp32")
    assert (report["memory"]["amp_weight_copies_gb"] > 0) is native
    auto = estimate_memory(tiny_model_config(), experiment.training, device_type="cpu")
    decided = experiment.training.__class__(**{**experiment.training.to_dict(), "use_amp": native})
    assert auto.peak_bytes == estimate_memory(tiny_model_config(), decided, device_type="cpu").peak_bytes


def test_pipeline_lr_finder_and_trainer_get_the_same_resolved_run(tmp_path, monkeypatch):
    """build_trainer, the LR finder and a Trainer given the same model and loader resolve alike:
    precision, token anchors turned into steps, sequence length, device."""
    from llm_trainer.api import build_trainer
    from llm_trainer.pipeline import prepare_run
    from llm_trainer.tools import lr_finder
    from llm_trainer.train.batch_size import auto_batch_size
    from llm_trainer.train.trainer import Trainer

    monkeypatch.setattr(resolve, "cpu_computes_bf16", lambda: False)
    config = write_tiny_experiment(
        tmp_path, use_amp="auto", total_batch_tokens=4 * 24 * 2, max_tokens=4 * 24 * 2 * 5, max_steps=None
    )
    experiment = load_experiment(config)

    trainer = build_trainer(experiment)
    run = trainer.run
    assert (run.training.gradient_accumulation_steps, run.training.max_steps, run.seq_len) == (2, 5, 24)
    assert run.training.use_amp is False and run.amp_dtype is None and trainer.total_steps == 5

    found = {}
    real_find_lr = lr_finder.find_lr

    def recording_find_lr(model, loader, **kwargs):
        found.update(kwargs, length=loader.rows.length)
        return real_find_lr(model, loader, **kwargs)

    monkeypatch.setattr(lr_finder, "find_lr", recording_find_lr)
    lr_finder.run_lr_finder(experiment, start_lr=1e-4, end_lr=1e-1, num_steps=3)
    assert found["training"] == run.training and found["device"] == run.device and found["length"] == run.seq_len

    ready = prepare_run(experiment, pick_batch_size=auto_batch_size, local=True)
    loader, _ = ready.loaders()
    own = Trainer(ready.model, experiment.training, train_dataloader=loader)  # a user's own model and loader
    assert own.run.training == run.training and own.run.seq_len == run.seq_len
    assert (own.run.amp_dtype, own.run.device, own.run.activation_checkpointing) == (
        run.amp_dtype,
        run.device,
        run.activation_checkpointing,
    )
    assert own.run.experiment is None and own.experiment_config == {"training": run.training.to_dict()}


def test_a_trainer_given_a_resolved_run_trains_by_its_config(tmp_path):
    from llm_trainer.errors import UsageError
    from llm_trainer.model import Transformer
    from llm_trainer.train.trainer import Trainer

    model = Transformer(tiny_model_config())
    run = resolve.resolve_for_model(model, load_experiment(write_tiny_experiment(tmp_path)).training)
    assert Trainer(model, run=run).config is run.training
    assert Trainer(Transformer(tiny_model_config()), run.training, run=run).config is run.training
    other = run.training.__class__(**{**run.training.to_dict(), "learning_rate": 1.0})
    with pytest.raises(UsageError, match="pass the run alone"):
        Trainer(Transformer(tiny_model_config()), other, run=run)
    assert run.device == torch.device("cpu")
