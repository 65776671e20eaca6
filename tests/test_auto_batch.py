"""training.batch_size: auto: the largest micro-batch whose estimated peak fits the memory budget, with
gradient accumulation making up total_batch_tokens (the global batch stays what the config asked for)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from conftest import write_tiny_experiment
from llm_trainer import cli
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.train.batch_size import auto_batch_size
from llm_trainer.train.memory_estimate import estimate_memory

GiB = 1024**3
MODEL = ModelConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=256)


def _peak(training: TrainingConfig, batch: int) -> float:
    return estimate_memory(MODEL, training, seq_len=128, batch_size=batch, device_type="cpu").peak_bytes / GiB


@pytest.mark.parametrize("world", [1, 2])
def test_auto_picks_the_largest_fitting_divisor_and_keeps_the_global_batch(world):
    training = TrainingConfig(batch_size="auto", total_batch_tokens=128 * 48 * world, use_amp=False, device="cpu")
    budget = (_peak(training, 10) + _peak(training, 11)) / 2  # 10 rows fit, 11 do not
    training = dataclasses.replace(training, device_memory=budget)
    chosen = auto_batch_size(MODEL, training, 128, world, torch.device("cpu"), probe=False)
    assert chosen.batch_size == 8  # the largest of 48's divisors (1, 2, 3, 4, 6, 8, 12, ...) up to 10
    assert _peak(training, 8) <= budget < _peak(training, 11)
    assert chosen.total_batch_tokens == 128 * 48 * world  # accumulation is made from it next (resolve.token_anchors)


def test_auto_under_a_pipeline_counts_the_largest_stage_and_splits_into_its_micro_batches():
    """PP=2 (2 processes, one data-parallel replica), 4 pipeline micro-batches: the estimate is the largest
    stage's, where the whole model's would not fit even the pick, and of the divisors of 48 rows that fit
    (6, 4, ...) the pick is the largest multiple of 4."""
    from llm_trainer.parallel.mesh import Layout

    pipeline = dict(pipeline_parallel_degree=2, pipeline_parallel_microbatches=4, distributed_strategy="fsdp")
    training = TrainingConfig(batch_size="auto", total_batch_tokens=128 * 48, use_amp=False, device="cpu", **pipeline)

    def stage_peak(batch: int) -> float:
        options = dict(layout=Layout(pp=2), world_size=2, sharding="fsdp", device_type="cpu")
        return estimate_memory(MODEL, training, seq_len=128, batch_size=batch, **options).peak_bytes / GiB

    budget = (stage_peak(7) + stage_peak(8)) / 2  # 7 rows fit, 8 do not
    training = dataclasses.replace(training, device_memory=budget)
    chosen = auto_batch_size(MODEL, training, 128, 1, torch.device("cpu"), probe=False)
    assert chosen.batch_size == 4 and stage_peak(6) <= budget
    assert _peak(training, 4) > budget  # the whole model on one device


def test_auto_without_a_global_batch_is_a_config_error():
    with pytest.raises(ValueError, match="batch_size auto keeps the global batch, which total_batch_tokens sets"):
        TrainingConfig(batch_size="auto")


@pytest.mark.slow
def test_the_probe_step_measures_the_pick_and_what_it_keeps_fits():
    """One real step at the estimate's pick, in a fresh process: the pick, scaled by what it measured, fits."""
    from llm_trainer.train.batch_size import measure_peak

    training = TrainingConfig(batch_size="auto", total_batch_tokens=128 * 16, use_amp=False, device="cpu")
    budget = (_peak(training, 8) + _peak(training, 9)) / 2
    training = dataclasses.replace(training, device_memory=budget)
    chosen = auto_batch_size(MODEL, training, 128, 1, torch.device("cpu"))
    assert chosen.batch_size in (8, 4, 2, 1)  # 16's divisors up to the estimate's 8
    model = {f.name: getattr(MODEL, f.name) for f in dataclasses.fields(MODEL) if f.name != "init_from"}
    run = {"batch_size": chosen.batch_size, "max_steps": 1, "use_amp": False, "device": "cpu"}
    assert measure_peak(model, run, 128)["peak_bytes"] / GiB <= budget * 1.05  # within the probe's own noise


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [12, 4, 1])
def test_the_probe_step_runs_a_model_of_any_head_layout(kv_heads):
    """The probe's warm-up model takes the model's settings with a small shape of its own: a model of 12
    heads (the small preset's), with its key/value heads written out, grouped or one, is probed."""
    from llm_trainer.train.batch_size import measure_peak

    config = ModelConfig(architecture="llama", d_model=96, n_heads=12, n_kv_heads=kv_heads, n_layers=1, vocab_size=64)
    model = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "init_from"}
    run = {"batch_size": 2, "max_steps": 1, "use_amp": False, "device": "cpu"}
    assert measure_peak(model, run, 32)["peak_bytes"] > 0


@pytest.mark.slow
def test_auto_in_a_run_keeps_batch_x_accumulation_x_world(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path, batch_size="auto", total_batch_tokens=24 * 12, max_steps=1, use_amp=False)
    assert cli.main(["train", "--config", str(path), "training.device_memory=4"]) == 0
    err = capfd.readouterr().err
    start = re.search(r"effective batch (\d+) = (\d+) x (\d+) accumulation x 1 process", err)
    assert start, err
    assert int(start[1]) == 12 and int(start[2]) * int(start[3]) == 12
    assert f"batch_size auto: {start[2]} rows a micro-batch" in err


def test_nothing_fits_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path, batch_size="auto", total_batch_tokens=24 * 12)
    code = cli.main(["train", "--config", str(path), "training.device_memory=0.0000001"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith("error: training.batch_size auto: no micro-batch fits"), lines[-1]
    assert not (tmp_path / "run").exists()


def test_several_processes_need_one_budget():
    """Each rank's free memory differs; without training.device_memory they could pick different sizes."""
    from llm_trainer.errors import UsageError

    training = TrainingConfig(batch_size="auto", total_batch_tokens=128 * 16, device="cpu")
    with pytest.raises(UsageError, match="over several processes needs training.device_memory"):
        auto_batch_size(MODEL, training, 128, 2, torch.device("cpu"))
