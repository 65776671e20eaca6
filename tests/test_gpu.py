"""The CUDA path: mixed precision, loss scaling, pinned background saves, exact resume, the KV cache.

Every test here needs a GPU and skips without one (CI has none); `bench/gpu.sh` runs them on a lent
machine. The tolerances say why they are what they are.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model_config, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.config_loader import load_experiment
from llm_trainer.model import KVCache, Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(tmp_path, name, *overrides):
    config = write_tiny_experiment(tmp_path, max_steps=40, eval_steps=20, learning_rate=3e-3, device="cuda")
    run = tmp_path / name
    assert cli.main(["train", "--config", str(config), f"training.output_dir={run}", *overrides]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], run


def _one_batch_logits(training) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits under `training`'s autocast, the float32 logits) of one model on one batch, as float32:
    a flag that is ignored gives two equal tensors. Logits, not the loss: at initialisation the loss is
    ~ln(vocab) whatever the precision, and fp16's rounding can vanish in its mean."""
    from llm_trainer.resolve import amp_dtype
    from llm_trainer.train.step import autocast

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).to(device)
    inputs = torch.randint(0, 61, (4, 16), device=device)
    with torch.no_grad():
        logits = []
        for dtype in (amp_dtype(training), None):
            with autocast(device, dtype):
                logits.append(model(inputs).float())
    return logits[0], logits[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_trains_like_float32(tmp_path, dtype):
    """use_amp takes effect: the same weights and batch give another loss than float32's, close to it.
    Then 40 steps of a tiny model: the final validation loss within 2% of float32's. bf16 keeps 8 bits of
    mantissa (relative error ~4e-3 per operation) and fp16 10; the loss, the softmax and the weights stay
    float32, so the difference stays at the percent level while training moves the loss by ~20%."""
    overrides = ("training.use_amp=true", f"training.amp_dtype={dtype}")
    config = write_tiny_experiment(tmp_path, device="cuda")
    mixed_logits, float32_logits = _one_batch_logits(load_experiment(config, list(overrides)).training)
    assert not torch.equal(mixed_logits, float32_logits)
    torch.testing.assert_close(mixed_logits, float32_logits, rtol=0.02, atol=0.02 * float(float32_logits.abs().max()))

    reference, _ = _train(tmp_path, "fp32")
    mixed, _ = _train(tmp_path, dtype, *overrides)
    start, end = reference[0]["loss"], reference[-1]["val_loss"]
    assert end < 0.85 * start
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


def test_batches_read_ahead_reach_the_gpu_as_batches_read_in_place():
    """Copied from pinned memory on the worker's side stream, then used on the loop's stream while it is
    busy (as under a step): the values of a copy in place, into the second epoch."""
    from llm_trainer.data.batches.loader import BatchLoader, WindowRows

    tokens = np.random.default_rng(0).integers(0, 50_000, size=2_000_000).astype(np.uint16)
    loaders = [
        BatchLoader(WindowRows(tokens, 1024, seed=1), 32, shuffle=True, seed=2, device="cuda", ahead=ahead)
        for ahead in (False, True)
    ]
    for _ in range(loaders[0].batches_per_epoch() + 3):  # into the second epoch
        torch.cuda._sleep(2_000_000)  # the loop's stream busy for a while
        batch, ahead = loaders[0].next_batch(), loaders[1].next_batch()
        assert ahead[0].device.type == "cuda"
        assert all(torch.equal(a, b) for a, b in zip(batch, ahead))


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


def test_flex_with_a_head_smaller_than_16_is_refused_in_one_line(tmp_path, capsys):
    config = write_tiny_experiment(tmp_path, device="cuda")  # d_model 16 / 2 heads: a head size of 8
    run = ["train", "--config", str(config), "model.attention_backend=flex", f"training.output_dir={tmp_path / 'run'}"]
    assert cli.main(run) == 2
    assert "flex needs a head size of at least 16, got d_model/n_heads = 8" in capsys.readouterr().err
