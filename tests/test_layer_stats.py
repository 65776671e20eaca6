"""Per-layer statistics (training.layer_stats_steps): the logged norms equal a direct computation in one
process, and a 2-process DDP, FSDP2 and DeepSpeed (ZeRO 1, 2, 3) run log what one process of twice the
batch logs."""

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_loaders, tiny_model
from llm_trainer.config import TrainingConfig
from llm_trainer.data.batches.loader import IGNORE_INDEX
from llm_trainer.train.evaluate import batch_nll
from llm_trainer.train.layer_stats import group_of
from llm_trainer.train.trainer import Trainer


def _layer_rows(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "layers"]


def test_parameters_are_grouped_per_block_and_part():
    assert group_of("blocks.3.attn.q.weight") == "blocks.3.attn"
    assert group_of("blocks.3.mlp_norm.weight") == "blocks.3.mlp_norm"
    assert group_of("_orig_mod.blocks.0._checkpoint_wrapped_module.mlp.up.bias") == "blocks.0.mlp"
    assert group_of("tok_emb.weight") == "tok_emb" and group_of("lm_head.weight") == "lm_head"


def test_one_process_equals_a_direct_computation(tmp_path):
    train, _ = tiny_loaders()
    config = TrainingConfig(
        max_steps=1,
        learning_rate=1e-2,
        max_grad_norm=0.1,  # clipped: the statistics are of the gradient before clipping
        logging_steps=1,
        eval_steps=0,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        use_amp=False,
        progress_bar=False,
        report_to=["jsonl", "tensorboard"],
        layer_stats_steps=1,
    )
    trainer = Trainer(tiny_model(n_layers=2), config, train_dataloader=train)
    trainer.train()
    (row,) = _layer_rows(tmp_path / "run")

    model = tiny_model(n_layers=2)  # the same initial weights
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    inputs, targets = tiny_loaders()[0].next_batch()[:2]
    nll = batch_nll(model, inputs, targets)
    (nll / (targets != IGNORE_INDEX).sum()).backward()
    after = dict(trainer.model.named_parameters())
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        groups.setdefault(group_of(name), []).append(name)
    assert len(groups) == 11  # tok_emb, pos_emb, 2 blocks x (attn_norm, attn, mlp_norm, mlp), norm (tied head)
    params = dict(model.named_parameters())
    histograms = _histograms(tmp_path / "run")
    for group, names in groups.items():
        grad = torch.sqrt(sum(params[n].grad.pow(2).sum() for n in names))
        param = torch.sqrt(sum(before[n].pow(2).sum() for n in names))
        update = torch.sqrt(sum((after[n].detach() - before[n]).pow(2).sum() for n in names))
        assert row[f"layers/{group}/grad_norm"] == pytest.approx(float(grad), rel=1e-5), group
        assert row[f"layers/{group}/param_norm"] == pytest.approx(float(param), rel=1e-6), group
        assert row[f"layers/{group}/update_ratio"] == pytest.approx(float(update / param), rel=1e-4), group
        num, total, low, high = histograms[f"layers/{group}/grad"]  # the gradient before clipping, too
        values = torch.cat([params[n].grad.reshape(-1) for n in names])
        assert (num, total, low, high) == pytest.approx(
            (values.numel(), float(values.sum()), float(values.min()), float(values.max())), rel=1e-4, abs=1e-6
        ), group
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values()))
    logged = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert next(r for r in logged if r["kind"] == "train")["grad_norm"] == pytest.approx(float(total), rel=1e-5)


def test_layer_stats_steps_must_be_positive():
    with pytest.raises(ValueError, match="layer_stats_steps must be positive"):
        TrainingConfig(layer_stats_steps=0)


ZERO = {  # DeepSpeed's stages, each as the run's deepspeed_config
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_two_processes_log_what_one_process_of_twice_the_batch_logs(tmp_path, tmp_path_factory, strategy):
    from test_distributed import References, _deepspeed, _torchrun

    if strategy in ZERO:
        pytest.importorskip("deepspeed")
        backend = ["training.distributed_strategy=deepspeed", _deepspeed(ZERO[strategy])]
    else:
        backend = [f"training.distributed_strategy={strategy}"]

    common = [
        "training.layer_stats_steps=2",
        "training.max_steps=4",
        "training.report_to=[jsonl,tensorboard]",  # the histograms too
        "training.save_steps=0",
    ]
    # one process, trained once for every strategy; FSDP builds on the meta device: both runs start
    # from the same initial weights
    init = References(tmp_path_factory).single(tmp_path, run=common, init=True)
    _torchrun(
        tmp_path,
        "training.output_dir=two",
        "training.batch_size=4",
        *backend,
        f"model.init_from={init}",
        *common,
    )
    one, two = _layer_rows(tmp_path / "single"), _layer_rows(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [2, 4]
    for a, b in zip(one, two):
        assert a.keys() == b.keys() and len(a) == 2 + 3 * 11  # kind, step; 3 values x 11 groups (llama: no pos_emb)
        for key in a:
            if key.startswith("layers/"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    hist_one, hist_two = _histograms(tmp_path / "single"), _histograms(tmp_path / "two")
    assert hist_one.keys() == hist_two.keys() and len(hist_one) == 2 * 11
    for tag, (num, total, low, high) in hist_one.items():
        assert hist_two[tag][0] == num  # every value counted once over the shards
        assert hist_two[tag][1:] == pytest.approx((total, low, high), rel=1e-4, abs=1e-6), tag


def _histograms(run: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = {p.parent for p in run.rglob("events.out.tfevents*")}
    events = EventAccumulator(str(folder), size_guidance={"histograms": 0}).Reload()
    out = {}
    for tag in events.Tags()["histograms"]:
        last = events.Histograms(tag)[-1].histogram_value
        out[tag] = (last.num, last.sum, last.min, last.max)
    return out


def test_histograms_of_gradients_and_weights_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, _ = tiny_loaders()
    config = TrainingConfig(
        max_steps=2,
        logging_steps=1,
        eval_steps=0,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        use_amp=False,
        progress_bar=False,
        report_to=["jsonl", "tensorboard"],
        layer_stats_steps=2,
    )
    trainer = Trainer(tiny_model(n_layers=2), config, train_dataloader=train)
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    (folder,) = {p.parent for p in (tmp_path / "run").rglob("events.out.tfevents*")}
    events = EventAccumulator(str(folder), size_guidance={"histograms": 0}).Reload()
    tags = events.Tags()["histograms"]
    assert "layers/blocks.1.mlp/grad" in tags and "layers/tok_emb/weight" in tags
    assert len(tags) == 2 * 11
    (entry,) = events.Histograms("layers/blocks.1.mlp/grad")
    assert entry.step == 2 and entry.histogram_value.num == sum(
        weights[n].numel() for n in weights if n.startswith("blocks.1.mlp.")
    )
    (entry,) = events.Histograms("layers/tok_emb/weight")
    assert sum(entry.histogram_value.bucket) == weights["tok_emb.weight"].numel()
    assert "layers/tok_emb/weight" not in (tmp_path / "run" / "metrics.jsonl").read_text()  # scalars only there


def test_a_loss_scale_the_gradients_still_carry_is_divided_out():
    """fp16's loss scale (GradScaler's, DeepSpeed's) is still on the gradients where they are read."""
    from llm_trainer.train.layer_stats import LayerStats

    model = tiny_model(n_layers=1)
    inputs, targets = tiny_loaders()[0].next_batch()[:2]
    batch_nll(model, inputs, targets).backward()
    plain = LayerStats(model, 1)
    plain.before_step()
    expected = plain.after_step(1)
    model.zero_grad()
    (batch_nll(model, inputs, targets) * 1024.0).backward()
    scaled = LayerStats(model, 1)
    scaled.before_step(1024.0)
    row = scaled.after_step(1)
    assert row.keys() == expected.keys() and row["kind"] == "layers"
    for key, value in expected.items():
        if key.startswith("layers/"):
            assert row[key] == pytest.approx(value, rel=1e-5), key
