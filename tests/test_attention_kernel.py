"""training.sdpa_backend: the run is held to one SDPA kernel, chosen at setup, named in the run header;
a kernel this device cannot run is one line, exit 2."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_loaders, tiny_model, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.config import TrainingConfig
from llm_trainer.train.callbacks import Callback
from llm_trainer.train.trainer import Trainer


class FlagsSeen(Callback):
    """What SDPA may use while the loop runs (the flags `sdpa_kernel` sets; the CPU's choice reads them too)."""

    def on_train_begin(self, trainer) -> None:
        self.flash = torch.backends.cuda.flash_sdp_enabled()
        self.math = torch.backends.cuda.math_sdp_enabled()


def _train(tmp_path, **training) -> FlagsSeen:
    seen = FlagsSeen()
    config = TrainingConfig(
        max_steps=1, output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False, report_to=[], **training
    )
    train, val = tiny_loaders()
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val, callbacks=[seen]).train()
    return seen


@pytest.mark.parametrize(
    "training, header, flash, math",
    [
        ({"use_amp": False}, "attention flash (auto)", True, False),
        ({"use_amp": False, "sdpa_backend": "math"}, "attention math (training.sdpa_backend)", False, True),
        (
            {"use_amp": True, "sdpa_backend": "math"},
            "attention written out (bfloat16 on a CPU); SDPA calls: math (training.sdpa_backend)",
            False,
            True,
        ),
    ],
    ids=["auto", "math", "bf16"],
)
def test_the_run_header_names_the_kernel_and_the_loop_is_held_to_it(tmp_path, capfd, training, header, flash, math):
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    seen = _train(tmp_path, **training)
    start = next(line for line in capfd.readouterr().err.splitlines() if "effective batch" in line)
    assert start.endswith(header), start
    assert (seen.flash, seen.math) == (flash, math)
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before  # released


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_kernel_this_device_cannot_run_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path, use_amp=False)
    code = cli.main(["train", "--config", str(path), f"training.sdpa_backend={backend}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(lines), lines
    assert lines[-1].startswith("error: training.sdpa_backend " + backend + " does not run on cpu"), lines[-1]
    assert "use auto, or one this device runs: flash, math" in lines[-1]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing written


def test_an_unknown_kernel_name_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_tiny_experiment(tmp_path)
    assert cli.main(["train", "--config", str(path), "training.sdpa_backend=fastest"]) == 2
    assert "sdpa_backend" in capsys.readouterr().err.strip().splitlines()[-1]
