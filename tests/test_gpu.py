"""The CUDA path: mixed precision, loss scaling, pinned background saves, exact resume, the KV cache.

Every test here needs a GPU and skips without one (CI has none); `bench/gpu.sh` runs them on a lent
machine. The tolerances say why they are what they are.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model_config, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.config import load_experiment
from llm_trainer.model import KVCache, Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(tmp_path, name, *overrides):
    config = write_tiny_experiment(tmp_path, max_steps=40, eval_steps=20, learning_rate=3e-3, device="cuda")
    run = tmp_path / name
    assert cli.main(["train", "--config", str(config), f"training.output_dir={run}", *overrides]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], run


def _one_batch_losses(training) -> tuple[float, float]:
    """(the loss under `training`'s autocast, the float32 loss) of one model on one batch: a flag that is
    ignored gives two equal numbers."""
    from llm_trainer.resolve import amp_dtype
    from llm_trainer.train.evaluate import batch_nll
    from llm_trainer.train.step import autocast

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).to(device)
    inputs, targets = (torch.randint(0, 61, (4, 16), device=device) for _ in range(2))
    with torch.no_grad():
        losses = []
        for dtype in (amp_dtype(training), None):
            with autocast(device, dtype):
                losses.append(float(batch_nll(model, inputs, targets)) / targets.numel())
    return losses[0], losses[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_trains_like_float32(tmp_path, dtype):
    """use_amp takes effect: the same weights and batch give another loss than float32's, close to it.
    Then 40 steps of a tiny model: the final validation loss within 2% of float32's. bf16 keeps 8 bits of
    mantissa (relative error ~4e-3 per operation) and fp16 10; the loss, the softmax and the weights stay
    float32, so the difference stays at the percent level while training moves the loss by ~30%."""
    overrides = ("training.use_amp=true", f"training.amp_dtype={dtype}")
    config = write_tiny_experiment(tmp_path, device="cuda")
    mixed_loss, float32_loss = _one_batch_losses(load_experiment(config, list(overrides)).training)
    assert mixed_loss != float32_loss
    assert mixed_loss == pytest.approx(float32_loss, rel=0.02)

    reference, _ = _train(tmp_path, "fp32")
    mixed, _ = _train(tmp_path, dtype, *overrides)
    start, end = reference[0]["loss"], reference[-1]["val_loss"]
    assert end < 0.8 * start
    assert mixed[-1]["val_loss"] == pytest.approx(end, rel=0.02)


def test_the_grad_scaler_skips_overflowing_steps():
    """fp16 on CUDA: a step whose scaled gradients overflow is skipped (weights untouched) and the scale
    halves; the next finite step goes through."""
    from llm_trainer.config import TrainingConfig
    from llm_trainer.parallel.distributed import DistInfo
    from llm_trainer.parallel.strategies import Parallelism
    from llm_trainer.train.optim import build_optimizer
    from llm_trainer.train.step import autocast, train_step

    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).cuda()
    device = torch.device("cuda")
    parallel = Parallelism(
        model,
        model,
        build_optimizer(model, TrainingConfig(), device),
        dist=DistInfo(),
        device=device,
        amp_dtype=torch.float16,
    )
    assert parallel.scaler.is_enabled()
    batch = tuple(torch.randint(0, 61, (4, 16), device=device) for _ in range(2))
    train_step(parallel, [batch], autocast=autocast(device, torch.float16), max_grad_norm=1.0)
    scale, before = parallel.scaler.get_scale(), [p.detach().clone() for p in model.parameters()]
    parallel.scaler.update(new_scale=2.0**60)  # any gradient overflows fp16 at this scale
    train_step(parallel, [batch], autocast=autocast(device, torch.float16), max_grad_norm=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert parallel.scaler.get_scale() == 2.0**59
    parallel.scaler.update(new_scale=scale)
    train_step(parallel, [batch], autocast=autocast(device, torch.float16), max_grad_norm=1.0)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_pinned_background_saves_equal_synchronous_ones(tmp_path):
    """The host copy of a background save (pinned buffers, non-blocking copies) holds exactly the bytes a
    synchronous save writes."""
    _, background = _train(tmp_path, "background", "training.save_steps=10", "training.async_checkpoint=true")
    _, synchronous = _train(tmp_path, "synchronous", "training.save_steps=10", "training.async_checkpoint=false")
    for folder in sorted((synchronous / "checkpoints").glob("checkpoint-*")):
        twin = background / "checkpoints" / folder.name
        for file in folder.iterdir():
            if file.name != "meta.json":  # it records the time of the save
                assert file.read_bytes() == (twin / file.name).read_bytes(), f"{folder.name}/{file.name}"


def test_resume_on_cuda_is_bitwise(tmp_path):
    _, whole = _train(tmp_path, "whole", "training.save_steps=20", "training.save_total_limit=null")
    split = tmp_path / "split"
    shutil.copytree(whole / "checkpoints" / "checkpoint-00000020", split / "checkpoints" / "checkpoint-00000020")
    _train(tmp_path, "split", "training.save_steps=20", "training.resume_from_checkpoint=latest")
    a = load_file(str(whole / "checkpoints" / "checkpoint-00000040" / "model.safetensors"))
    b = load_file(str(split / "checkpoints" / "checkpoint-00000040" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_generation_with_the_kv_cache_matches_without_on_cuda(architecture):
    torch.manual_seed(0)
    config = tiny_model_config(architecture=architecture, n_kv_heads=1)
    model = Transformer(config).cuda().eval()
    x = torch.randint(0, 61, (2, 12), device="cuda")
    with torch.no_grad():
        full = model(x)
        cache = KVCache.empty(config, 2, config.max_seq_len, "cuda", torch.float32)
        pieces = [model(x[:, :5], cache=cache), model(x[:, 5:6], cache=cache), model(x[:, 6:12], cache=cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=1e-4)  # TF32/flash kernels differ by ~1e-5
