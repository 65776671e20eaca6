"""The memory estimate against the measured peak of real training steps (`train/memory_probe.py`):
two widths, with and without gradient checkpointing, AdamW and Muon, fp32 and bf16 autocast, and a
narrow model at a long context, each within 10%. Eight of the probe's fourteen configs cover every one
of those choices (each is a fresh process of real steps); `bench/estimate_check.py` runs all fourteen. bf16 is checked where the device
computes it (`EMULATED_BF16`)."""

import pytest
import torch

from llm_trainer.resolve import cpu_computes_bf16

SUBSET = {
    "d256 full adamw gpt2 fp32",
    "d256 ckpt muon gpt2 fp32",
    "d512 full muon gpt2 fp32",
    "d512 ckpt adamw gpt2 fp32",
    "d512 full adamw llama bf16",
    "d512 ckpt muon llama bf16",
    "d64 context 1024 adamw gpt2 fp32",
    "d64 context 1024 adamw gpt2 bf16",
}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# A CPU without AVX512-BF16 or AMX computes bf16 in slow emulation (a probe of these shapes then takes
# minutes); `use_amp: auto` never trains in bf16 there, so its estimate is checked where bf16 is real.
EMULATED_BF16 = pytest.mark.skipif(
    not cpu_computes_bf16(),
    reason="this CPU emulates bf16 (no AVX512-BF16 or AMX): the bf16 rows are checked on CPUs that compute it and on CUDA",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "device, precision",
    [
        ("cpu", "fp32"),
        pytest.param("cpu", "bf16", marks=EMULATED_BF16),
        pytest.param("cuda", "fp32", marks=CUDA),
        pytest.param("cuda", "bf16", marks=CUDA),
    ],
)
def test_the_estimated_peak_is_within_10_percent_of_the_measured_one(device, precision):
    from llm_trainer.tools.estimate import compare

    names = {name for name in SUBSET if name.endswith(precision)}
    rows = compare(device, names)
    assert len(rows) == len(names) == 3 + 2 * (precision == "fp32")
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
