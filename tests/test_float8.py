"""training.float8: refused in one line where the hardware or torchao is missing; where torchao is
installed, its float8 linear layers replace exactly the blocks' aligned linear layers and the loss
stays close to the model's own."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import tiny_model_config, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.errors import UsageError
from llm_trainer.model import Transformer
from llm_trainer.parallel.float8 import apply_float8, check_float8


def test_float8_on_a_cpu_is_refused_in_one_line_naming_the_hardware(tmp_path, capsys):
    config = str(write_tiny_experiment(tmp_path))
    assert cli.main(["train", "--config", config, "training.float8=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "training.float8 needs a CUDA GPU of compute capability 8.9 or later" in err
    assert "the device is cpu" in err and "set training.float8: false" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_an_older_gpu_and_a_missing_torchao_are_named(monkeypatch):
    """The device queries answer as an A100's, then as an H100's on a machine without torchao."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(UsageError, match=r"compute capability 8.9 or later .*NVIDIA A100 is 8\.0"):
        check_float8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import` finds where it is not installed
    with pytest.raises(UsageError, match="needs torchao's float8 layers, not installed: pip install torchao"):
        check_float8(torch.device("cuda", 0))


def test_the_blocks_aligned_linear_layers_become_float8_and_the_loss_stays_close():
    """A width of 32 and an MLP of 72 (not a multiple of 16), every size converted (float8_layers all):
    attention's layers convert, the MLP's do not, nor the head; parameter names are unchanged, and loss
    and gradients stay close."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    reference = Transformer(tiny_model_config(d_model=32, d_ff=72, tie_embeddings=False))
    model = Transformer(tiny_model_config(d_model=32, d_ff=72, tie_embeddings=False))
    model.load_state_dict(reference.state_dict())
    swapped, small = apply_float8(model, "all")
    assert swapped == [f"blocks.{i}.attn.{layer}" for i in range(2) for layer in ("q", "k", "v", "proj")]
    assert small == []
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(swapped)
    assert list(model.state_dict()) == list(reference.state_dict())
    x, y = torch.randint(0, 61, (4, 16)), torch.randint(0, 61, (4, 16))
    losses = [m(x, targets=y) / y.numel() for m in (reference, model)]
    for loss in losses:
        loss.backward()
    assert abs(losses[1].item() - losses[0].item()) < 0.05 * losses[0].item()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.isfinite(q.grad).all(), name
        if p.grad.norm() < 1e-9:  # the key bias: the softmax ignores a shift its gradient would make
            continue
        assert torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0) > 0.9, name


def test_by_default_only_layers_large_enough_to_gain_become_float8():
    """float8_layers auto: of a width-32 model with an MLP of 2048, only the MLP's first layer (2048
    outputs) is past torchao's sizes where float8 runs slower; the others stay and are named as small."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")
    model = Transformer(tiny_model_config(d_model=32, d_ff=2048, tie_embeddings=False))
    swapped, small = apply_float8(model)
    assert swapped == ["blocks.0.mlp.fc", "blocks.1.mlp.fc"]
    assert small == [
        f"blocks.{i}.{layer}" for i in range(2) for layer in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.proj")
    ]


def test_a_model_too_small_for_float8_trains_as_without_it_and_says_so(tmp_path, capsys, monkeypatch):
    """On hardware that passes the check (the check answers as an H100's would), a model whose layers
    are all too small converts none, trains, and says why in one warning naming float8_layers."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")
    from llm_trainer import pipeline
    from llm_trainer.parallel import parallelize

    for checker in (pipeline, parallelize):  # where the run checks the hardware, before and after the data
        monkeypatch.setattr(checker, "check_float8", lambda device: None)
    config = str(write_tiny_experiment(tmp_path))
    assert cli.main(["train", "--config", config, "training.float8=true", "training.max_steps=2"]) == 0
    err = capsys.readouterr().err
    assert "is large enough to run faster in float8" in err and "training.float8_layers: all" in err
