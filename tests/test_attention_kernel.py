"""training.sdpa_backend: the run is held to one SDPA kernel, chosen at setup, named in the run header;
a kernel this device cannot run is one line, exit 2."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from conftest import tiny_loaders, tiny_model, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.config import TrainingConfig
from llm_trainer.train.callbacks import Callback
from llm_trainer.train.trainer import Trainer


def _held() -> tuple[SDPBackend, set[SDPBackend]]:
    """The kernel SDPA tries first, and those it may use (the flags `sdpa_kernel` sets; a CPU reads them too)."""
    enabled = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled(),
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
    }
    usable = {backend for backend, on in enabled.items() if on}
    first = next(b for b in map(SDPBackend, torch._C._get_sdp_priority_order()) if b in usable)
    return first, usable


class KernelSeen(Callback):
    """What SDPA may use while the loop runs."""

    def on_train_begin(self, trainer) -> None:
        self.first, self.usable = _held()


def _train(tmp_path, model=None, **training) -> KernelSeen:
    seen = KernelSeen()
    config = TrainingConfig(
        max_steps=1, output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False, report_to=[], **training
    )
    train, val = tiny_loaders()
    Trainer(model or tiny_model(), config, train_dataloader=train, val_dataloader=val, callbacks=[seen]).train()
    return seen


FLASH, MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.MATH


@pytest.mark.parametrize(
    "training, model, header, first",
    [
        ({"use_amp": False}, {}, "attention flash (auto)", FLASH),
        ({"use_amp": False, "sdpa_backend": "math"}, {}, "attention math (training.sdpa_backend)", MATH),
        ({"use_amp": False}, {"attention_dropout": 0.1}, "attention math (auto)", MATH),  # a CPU's flash: no dropout
        (
            {"use_amp": True, "sdpa_backend": "math"},
            {},
            "attention written out (bfloat16 on a CPU); SDPA calls: math (training.sdpa_backend)",
            MATH,
        ),
    ],
    ids=["auto", "math", "auto-dropout", "bf16"],
)
def test_the_run_header_names_the_kernel_and_the_loop_is_held_to_it(tmp_path, capfd, training, model, header, first):
    before = _held()
    seen = _train(tmp_path, tiny_model(**model), **training)
    start = next(line for line in capfd.readouterr().err.splitlines() if "effective batch" in line)
    assert start.endswith(header), start
    assert seen.first == first and seen.usable == {first, MATH}  # math only for calls the kernel cannot take
    assert _held() == before  # released with the loop


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_kernel_this_device_cannot_run_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path, use_amp=False)
    code = cli.main(["train", "--config", str(path), f"training.sdpa_backend={backend}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith(
        "error: training.sdpa_backend " + backend + " does not run this model's attention on cpu"
    )
    assert lines[-1].endswith("use auto, or one that does: flash, math"), lines[-1]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing written


def test_a_kernel_that_cannot_run_the_steps_call_is_refused_at_setup(tmp_path, capsys, monkeypatch):
    """A CPU's flash kernel has no attention dropout: asked for, the run stops before it starts."""
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path, use_amp=False)
    argv = ["train", "--config", str(path), "training.sdpa_backend=flash", "model.attention_dropout=0.1"]
    assert cli.main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "sdpa_backend flash does not run" in last and "attention dropout" in last and last.endswith(": math")


def test_an_unknown_kernel_name_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path)
    assert cli.main(["train", "--config", str(path), "training.sdpa_backend=fastest"]) == 2
    assert "sdpa_backend" in capsys.readouterr().err.strip().splitlines()[-1]
