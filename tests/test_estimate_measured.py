"""The memory estimate against the measured peak of real training steps (`train/memory_probe.py`):
two widths, with and without gradient checkpointing, AdamW and Muon, fp32 and bf16 autocast, each
within 10%. Six of the probe's twelve configs cover every one of those choices (each is a fresh
process of real steps); `bench/estimate_check.py` runs all twelve."""

import pytest
import torch

SUBSET = {
    "d256 full adamw gpt2 fp32",
    "d256 ckpt muon gpt2 fp32",
    "d512 full muon gpt2 fp32",
    "d512 ckpt adamw gpt2 fp32",
    "d512 full adamw llama bf16",
    "d512 ckpt muon llama bf16",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def test_the_estimated_peak_is_within_10_percent_of_the_measured_one(device):
    from llm_trainer.tools.estimate import compare

    rows = compare(device, SUBSET)
    assert len(rows) == len(SUBSET)
    for row in rows:
        assert abs(row["error"]) < 0.10, row
    assert {row["peak_phase"] for row in rows} >= {"forward_backward"}


def test_muon_state_is_one_buffer_for_the_hidden_matrices_and_two_for_the_rest():
    from llm_trainer.config import ModelConfig, TrainingConfig
    from llm_trainer.model import Transformer
    from llm_trainer.train.memory_estimate import estimate_memory
    from llm_trainer.train.optim import build_optimizer

    config = ModelConfig(vocab_size=300, d_model=32, n_heads=4, n_layers=2, max_seq_len=16)
    training = TrainingConfig(device="cpu", optimizer="muon", use_amp=False)
    model = Transformer(config)
    optimizer = build_optimizer(model, training, torch.device("cpu"))
    x = torch.randint(0, 300, (2, 16))
    model(x).sum().backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    assert estimate_memory(config, training, device_type="cpu").optimizer_bytes == state
