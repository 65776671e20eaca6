"""The speed figures (throughput, step time, data wait, MFU) and the phase timer, exact: each timer
reads a clock the test drives, so how busy the machine is cannot change a figure."""

from __future__ import annotations

import functools
import importlib
import json

import pytest
import torch

from conftest import tiny_loaders, tiny_model
from llm_trainer.config import TrainingConfig
from llm_trainer.data.batches.loader import BatchLoader
from llm_trainer.train import speed
from llm_trainer.train.flops import flops_per_token
from llm_trainer.train.trainer import Trainer


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Batches:
    """A loader whose every batch takes `wait` seconds of `clock` to arrive."""

    def __init__(self, clock: FakeClock, wait: float) -> None:
        self.clock, self.wait = clock, wait

    def next_batch(self):
        self.clock.advance(self.wait)
        return "batch"


def test_speed_monitor_figures_are_exact_over_its_window():
    """A step's time runs to the next step's start: what the loop does between steps (logging, callbacks,
    a GPU finishing the queued steps as the loss is read) is its time, evaluation and checkpoints are not."""
    clock = FakeClock()
    monitor = speed.SpeedMonitor(2, 1000.0, 1e6, torch.device("cpu"), clock=clock)
    timer = speed.PhaseTimer(monitor=monitor)
    assert monitor.metrics() == {}
    for wait, compute, tokens in [(9.0, 9.0, 1), (0.5, 1.5, 100), (0.25, 0.75, 300)]:  # the first leaves the window
        monitor.start_step()
        clock.advance(0.125)  # before the batch: step time, not data wait
        assert monitor.timed_batch(Batches(clock, wait)) == "batch"
        clock.advance(compute)
        monitor.end_step(tokens=tokens, samples=tokens // 10)
        clock.advance(0.0625)  # between steps (the loss read, logging, callbacks): step time
        with timer.count("evaluation"):
            clock.advance(7.0)  # an evaluation: neither
        with timer.count("checkpoint"):
            clock.advance(3.0)
    # read after the last step: its time up to now
    figures = monitor.metrics()
    step_s = (0.125 + 0.5 + 1.5 + 0.0625) + (0.125 + 0.25 + 0.75 + 0.0625)
    assert figures["tokens_per_s"] == 400 / step_s
    assert figures["samples_per_s"] == 40 / step_s
    assert figures["step_time_s"] == step_s / 2
    assert figures["data_wait_fraction"] == 0.75 / step_s
    assert figures["flops_per_token"] == 1000.0
    assert figures["mfu"] == 1000.0 * (400 / step_s) / 1e6
    assert figures["peak_memory_mb"] > 10  # the process's resident memory: torch alone is more than this
    assert timer.seconds == {"evaluation": 21.0, "checkpoint": 9.0}
    # the next step's start closes the last one's time; the window moves on
    monitor.start_step()
    clock.advance(1.0)
    monitor.end_step(tokens=100, samples=10)
    assert monitor.metrics()["tokens_per_s"] == 400 / ((0.125 + 0.25 + 0.75 + 0.0625) + 1.0)


def test_speed_monitor_without_flops_or_peak_reports_no_mfu():
    clock = FakeClock()
    for flops, peak, expected in [(None, 1e6, set()), (1000.0, None, {"flops_per_token"})]:
        monitor = speed.SpeedMonitor(4, flops, peak, torch.device("cpu"), clock=clock)
        monitor.start_step()
        clock.advance(2.0)
        monitor.end_step(tokens=10, samples=1)
        figures = monitor.metrics()
        assert figures["tokens_per_s"] == 5.0 and figures["data_wait_fraction"] == 0.0
        assert set(figures) & {"flops_per_token", "mfu"} == expected


def test_phase_timer_adds_up_the_seconds_of_each_phase():
    clock = FakeClock()
    timer = speed.PhaseTimer(clock=clock)
    for phase, seconds in [("evaluation", 1.5), ("checkpoint", 0.25), ("evaluation", 2.0)]:
        with timer.count(phase):
            clock.advance(seconds)
        clock.advance(10.0)  # outside any phase
    with pytest.raises(RuntimeError), timer.count("checkpoint"):  # a phase that fails still counts
        clock.advance(0.5)
        raise RuntimeError
    assert timer.seconds == {"evaluation": 3.5, "checkpoint": 0.75}


def test_the_trainer_logs_the_monitors_figures_for_its_window(tmp_path, monkeypatch):
    """Through the loop: every batch takes 20 ms to arrive and every forward 30 ms (of the test's clock),
    so each step takes 50 ms with 40% of it waiting for data, whatever the machine does meanwhile."""
    clock = FakeClock()
    loop = importlib.import_module("llm_trainer.train.trainer")  # by name: llm_trainer.train is also a function
    monkeypatch.setattr(loop, "SpeedMonitor", functools.partial(speed.SpeedMonitor, clock=clock))

    class WaitingLoader(BatchLoader):
        def next_batch(self):
            clock.advance(0.02)
            return super().next_batch()

    train, _ = tiny_loaders()
    loader = WaitingLoader(train.rows, 4, shuffle=True, seed=0)
    model = tiny_model(n_layers=2)
    model.register_forward_hook(lambda *_: clock.advance(0.03))
    config = TrainingConfig(
        max_steps=6,
        logging_steps=3,
        eval_steps=0,
        save_steps=0,
        peak_flops=1e9,
        speed_window_size=3,
        output_dir=str(tmp_path / "run"),
        report_to=["jsonl"],
        progress_bar=False,
        device="cpu",
    )
    Trainer(model, config, train_dataloader=loader).train()
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [3, 6]
    row = rows[1]
    assert row["step_time_s"] == pytest.approx(0.05, rel=1e-9)
    assert row["tokens_per_s"] == pytest.approx(4 * 16 / 0.05, rel=1e-9)
    assert row["samples_per_s"] == pytest.approx(4 / 0.05, rel=1e-9)
    assert row["data_wait_fraction"] == pytest.approx(0.4, rel=1e-9)
    expected_flops = 6 * (sum(p.numel() for p in model.parameters()) - 16 * 24) + 12 * 2 * 16 * 16
    assert row["flops_per_token"] == expected_flops == flops_per_token(model.config, 16)  # 6N + 12 L d T
    assert row["mfu"] == pytest.approx(expected_flops * (4 * 16 / 0.05) / 1e9, rel=1e-9)


def test_a_slow_callback_between_steps_counts_in_the_speed_an_evaluation_does_not(tmp_path, monkeypatch):
    """A callback that takes 50 ms after each 50 ms step halves the tokens/s the rows report (and the
    throughput alert reads); an evaluation between steps leaves them as they are."""
    from llm_trainer.train.callbacks import Callback

    clock = FakeClock()
    loop = importlib.import_module("llm_trainer.train.trainer")
    monkeypatch.setattr(loop, "SpeedMonitor", functools.partial(speed.SpeedMonitor, clock=clock))

    class Slow(Callback):
        def on_step_end(self, trainer, row):
            clock.advance(0.05)

    class SlowEvaluation(Callback):
        def on_evaluate(self, trainer, metrics):
            clock.advance(5.0)

    train, val = tiny_loaders()
    model = tiny_model(n_layers=2)
    model.register_forward_hook(lambda module, args, out: clock.advance(0.05) if module.training else None)
    config = TrainingConfig(
        max_steps=6,
        logging_steps=1,
        eval_steps=2,
        save_steps=0,
        speed_window_size=2,
        output_dir=str(tmp_path / "run"),
        report_to=["jsonl"],
        progress_bar=False,
        device="cpu",
    )
    Trainer(model, config, train_dataloader=train, val_dataloader=val, callbacks=[Slow(), SlowEvaluation()]).train()
    rows = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    # at each row: the step before it, with its callback (0.10 s), and this one up to the row (0.05 s)
    assert [r["step_time_s"] for r in rows[1:]] == pytest.approx([0.075] * 5, rel=1e-9)
    assert rows[-1]["tokens_per_s"] == pytest.approx(2 * 4 * 16 / 0.15, rel=1e-9)
