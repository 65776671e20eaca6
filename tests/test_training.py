"""The training loop against references: torch.optim.AdamW by hand, one big batch vs accumulation,
known perplexities, schedules, early stopping, callbacks, the Python API with a user's own model."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import tiny_loaders, tiny_model, tiny_model_config
from llm_trainer.config import TrainingConfig
from llm_trainer.data.batches.loader import BatchLoader, DocumentRows, WindowRows
from llm_trainer.generate import generate
from llm_trainer.model import Transformer
from llm_trainer.train.evaluate import evaluate
from llm_trainer.train.optim import learning_rate_at, parameter_groups
from llm_trainer.train.trainer import Callback, Trainer


def _training(tmp_path, **overrides):
    values = dict(
        batch_size=4,
        max_steps=6,
        learning_rate=1e-2,
        warmup_steps=2,
        lr_scheduler="cosine",
        eval_steps=0,
        save_steps=0,
        logging_steps=1,
        output_dir=str(tmp_path / "run"),
        report_to=["jsonl"],
        progress_bar=False,
        device="cpu",
        seed=0,
        use_amp=False,  # compared with float32 references
    )
    values.update(overrides)
    return TrainingConfig(**values)


def _tokens(n=4000, vocab=61, seed=0):
    rng = np.random.default_rng(seed)
    # A learnable stream: mostly "next = previous + 1", with some noise.
    t = np.cumsum(rng.integers(1, 3, size=n)) % vocab
    return t.astype(np.uint16)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_parameter_groups_skip_decay_on_norms_biases_and_embeddings():
    model = Transformer(tiny_model_config())
    decay, no_decay = parameter_groups(model, 0.1)
    decay_ids = {id(p) for p in decay["params"]}
    named = dict(model.named_parameters())
    assert id(named["blocks.0.attn.q.weight"]) in decay_ids
    assert id(named["blocks.1.mlp.proj.weight"]) in decay_ids
    for name in [
        "tok_emb.weight",
        "pos_emb.weight",
        "blocks.0.attn_norm.weight",
        "blocks.0.attn.v.bias",
        "norm.bias",
    ]:
        assert id(named[name]) not in decay_ids
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_schedules_at_chosen_steps():
    cfg = dict(learning_rate=1.0, min_lr=0.1, warmup_steps=10)
    cos = TrainingConfig(lr_scheduler="cosine", **cfg)
    assert learning_rate_at(0, cos, 110) == pytest.approx(0.1)  # (0+1)/10
    assert learning_rate_at(9, cos, 110) == pytest.approx(1.0)
    assert learning_rate_at(10, cos, 110) == pytest.approx(1.0)
    assert learning_rate_at(60, cos, 110) == pytest.approx(0.55)  # halfway: floor + half the range
    assert learning_rate_at(110, cos, 110) == pytest.approx(0.1)
    lin = TrainingConfig(lr_scheduler="linear", **cfg)
    assert learning_rate_at(35, lin, 110) == pytest.approx(0.1 + 0.75 * 0.9)
    assert learning_rate_at(5, TrainingConfig(lr_scheduler="constant", **cfg), 110) == 1.0
    cww = TrainingConfig(lr_scheduler="constant_with_warmup", **cfg)
    assert learning_rate_at(4, cww, 110) == pytest.approx(0.5) and learning_rate_at(100, cww, 110) == 1.0
    wsd = TrainingConfig(lr_scheduler="wsd", wsd_decay_ratio=0.2, **cfg)
    assert learning_rate_at(50, wsd, 100) == 1.0 and learning_rate_at(79, wsd, 100) == 1.0
    assert learning_rate_at(90, wsd, 100) == pytest.approx(0.1 + 0.5 * 0.9)


def test_trainer_matches_a_hand_written_adamw_loop(tmp_path):
    """Our loop == forward, mean CE, backward, clip, torch.optim.AdamW with the same groups and lrs."""
    config = tiny_model_config()
    tokens = _tokens()
    training = _training(tmp_path, max_grad_norm=0.5, weight_decay=0.1)

    torch.manual_seed(0)
    ours = Transformer(config)
    reference = Transformer(config)
    reference.load_state_dict(ours.state_dict())
    loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
    Trainer(ours, training, train_dataloader=loader).train()

    # fused=True as ours uses on CPU: foreach differs only by rounding, which Adam amplifies on tiny gradients.
    optimizer = torch.optim.AdamW(parameter_groups(reference, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ref_loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
    for step in range(6):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step, training, 6)
        x, y = ref_loader.next_batch()
        loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, atol=1e-6, rtol=1e-5)


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """4 micro-batches of 2 == 1 batch of 8, even with padding making micro-batches uneven in tokens."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 17, size=40)
    tokens = rng.integers(1, 61, size=int(lengths.sum())).astype(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    results = []
    for batch, accum in [(8, 1), (2, 4)]:
        torch.manual_seed(0)
        model = Transformer(tiny_model_config())
        rows = DocumentRows(tokens, offsets, 16, pack=False, pad_id=0)
        loader = BatchLoader(rows, batch, shuffle=True, seed=3)
        # SGD: the update is the gradient itself, so the comparison is not blurred by Adam's normalisation
        # (which turns float-rounding noise in near-zero gradients into lr-sized steps).
        training = _training(
            tmp_path / f"{batch}",
            batch_size=batch,
            gradient_accumulation_steps=accum,
            max_steps=3,
            optimizer="sgd",
            learning_rate=0.5,
        )
        summary = Trainer(model, training, train_dataloader=loader).train()
        rows_logged = [json.loads(l) for l in open(tmp_path / f"{batch}" / "run" / "metrics.jsonl")]
        results.append((_weights(model), [r["loss"] for r in rows_logged if r["kind"] == "train"]))
        assert summary["step"] == 3
    (w1, l1), (w2, l2) = results
    assert l1 == pytest.approx(l2, rel=1e-5)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-5)


def test_evaluate_uniform_model_has_perplexity_equal_to_vocab():
    class Uniform(nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape, 50)

    x = torch.randint(0, 50, (3, 7))
    y = x.clone()
    y[0, 4:] = -100  # padding is not counted
    metrics = evaluate(Uniform(), [(x, y), (x[:1], x[:1])])
    assert metrics["tokens"] == 21 - 3 + 7
    assert metrics["val_loss"] == pytest.approx(math.log(50))
    assert metrics["perplexity"] == pytest.approx(50.0)


def test_evaluate_weights_every_token_equally():
    class Confident(nn.Module):  # puts probability 1/2 on token 0, spreads the rest
        def forward(self, x):
            logits = torch.zeros(*x.shape, 4)
            logits[..., 0] = math.log(3.0)
            return logits

    a = torch.zeros(1, 6, dtype=torch.long)  # 6 targets of token 0: nll ln 2 each
    b = torch.ones(1, 2, dtype=torch.long)  # 2 targets of token 1: nll ln 6 each
    metrics = evaluate(Confident(), [(a, a), (b, b)])
    assert metrics["val_loss"] == pytest.approx((6 * math.log(2) + 2 * math.log(6)) / 8)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generation_with_and_without_cache_agree(arch):
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(architecture=arch))
    prompt = [3, 5, 7]
    for kwargs in [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=10, seed=5),
        dict(temperature=0.9, top_p=0.8, seed=1),
    ]:
        cached = generate(model, prompt, max_new_tokens=15, use_cache=True, **kwargs)
        plain = generate(model, prompt, max_new_tokens=15, use_cache=False, **kwargs)
        assert cached == plain and len(cached) == 15
    assert generate(model, prompt, max_new_tokens=5, temperature=1.0, seed=1) == generate(
        model, prompt, max_new_tokens=5, temperature=1.0, seed=1
    )


def test_top_k_one_is_greedy_and_eos_stops():
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    greedy = generate(model, [1, 2], max_new_tokens=8, temperature=0.0)
    assert generate(model, [1, 2], max_new_tokens=8, temperature=1.5, top_k=1, seed=9) == greedy
    stopped = generate(model, [1, 2], max_new_tokens=8, temperature=0.0, eos_token_id=greedy[2])
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]


def test_users_own_model_and_dataloader(tmp_path):
    """Any nn.Module returning logits, or an object with .loss, trains from a plain torch DataLoader."""

    class Bigram(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(61, 61)

        def forward(self, x):
            return self.table(x)

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Bigram()
            self.targets = None

        def forward(self, x):
            return type("Out", (), {"loss": F.cross_entropy(self.inner(x).flatten(0, 1), self.targets.flatten())})()

    rows = torch.from_numpy(_tokens(2000).astype(np.int64)[: 124 * 16].reshape(124, 16))
    data = torch.utils.data.DataLoader(rows, batch_size=8, shuffle=False)
    model = Bigram()
    trainer = Trainer(
        model,
        _training(tmp_path, max_steps=None, num_epochs=3, learning_rate=0.1),
        train_dataloader=data,
        val_dataloader=data,
    )
    before = trainer.evaluate()["val_loss"]
    summary = trainer.train()
    assert summary["step"] == 3 * 16  # 124 rows / 8 = 16 batches per epoch (the last one short)
    assert summary["val_loss"] < before - 0.5

    class Feed(Callback):  # the .loss-only model needs its targets; a callback-free way is a wrapper
        pass

    wrapped = WithLoss()
    original = wrapped.forward

    def forward(x):
        wrapped.targets = torch.roll(x, -1, 1)
        return original(x)

    wrapped.forward = forward
    tuples = [(r[:, :-1], r[:, 1:]) for r in rows.split(8)]
    Trainer(wrapped, _training(tmp_path / "b", max_steps=4), train_dataloader=tuples).train()


def test_a_models_output_is_read_in_every_form_transformers_and_users_return(tmp_path, capsys):
    """Logits as a tensor, a dict, an object, or a transformers ModelOutput give one loss; a loss beside
    the logits is not what trains (the Trainer passes no labels) and says so once; a tuple, or a dict
    with neither, is one line naming what is taken, before any step."""
    from llm_trainer.errors import UsageError
    from llm_trainer.train.evaluate import read_output

    class Bigram(nn.Module):
        def __init__(self, wrap):
            super().__init__()
            torch.manual_seed(0)
            self.table, self.wrap = nn.Embedding(61, 61), wrap

        def forward(self, x):
            return self.wrap(self.table(x))

    rows = torch.from_numpy(_tokens(2000).astype(np.int64)[: 32 * 16].reshape(32, 16))
    batches = [(r[:, :-1], r[:, 1:]) for r in rows.split(8)]

    def losses(wrap, name):
        trainer = Trainer(Bigram(wrap), _training(tmp_path / name, max_steps=3), train_dataloader=batches)
        trainer.train()
        rows = [json.loads(line) for line in open(tmp_path / name / "run" / "metrics.jsonl")]
        return [row["loss"] for row in rows if row.get("kind") == "train"]

    transformers = pytest.importorskip("transformers")
    plain = losses(lambda logits: logits, "tensor")
    assert losses(lambda logits: {"logits": logits}, "dict") == plain
    assert losses(lambda logits: transformers.modeling_outputs.CausalLMOutput(logits=logits), "hf") == plain
    capsys.readouterr()
    both = losses(lambda logits: {"logits": logits, "loss": torch.tensor(123.0)}, "both")
    assert both == plain  # the model's own loss is not what trains, and that is said
    assert capsys.readouterr().err.count("the model's own loss is not used") <= 1  # once a process
    read_output.__globals__["_say_loss_unused"].cache_clear()
    read_output({"logits": torch.zeros(1), "loss": torch.zeros(())})
    assert "the model's own loss is not used" in capsys.readouterr().err
    for returned, said in (((torch.zeros(1),), "tuple"), ({"hidden": torch.zeros(1)}, "dict")):
        with pytest.raises(UsageError, match=rf"^the model returned {said}: the Trainer takes its logits"):
            Trainer(
                Bigram(lambda _, r=returned: r),
                _training(tmp_path / f"bad-{said}", max_steps=2),
                train_dataloader=batches,
            ).train()
        assert not (tmp_path / f"bad-{said}" / "run" / "checkpoints").exists()


def test_a_callback_stops_the_run_through_its_stop_request(tmp_path):
    """`trainer.stop.request(reason)` from a callback (the README's way): the run ends after that step,
    saved and evaluated, and its summary and status say why."""
    from llm_trainer.tools.status import run_status

    class EnoughAtFour(Callback):
        def on_step_end(self, trainer, row):
            if row["step"] == 4:
                trainer.stop.request("the loss is good enough")

    train, val = tiny_loaders()
    config = _training(tmp_path, max_steps=20, save_steps=0, eval_steps=0)
    trainer = Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val, callbacks=[EnoughAtFour()])
    summary = trainer.train()
    assert (summary["step"], summary["stopped_early"]) == (4, "the loss is good enough") and "val_loss" in summary
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("checkpoint-*")] == ["checkpoint-00000004"]
    assert run_status(str(tmp_path / "run"))["state"] == "stopped early: the loss is good enough"


@pytest.mark.parametrize("generator", [False, True], ids=["global-random-state", "own-generator"])
def test_a_shuffling_dataloader_of_ones_own_resumes_exactly_in_a_later_epoch(tmp_path, generator):
    """A torch DataLoader(shuffle=True) draws each pass's order as the pass starts (from torch's random
    state, or its own generator): killed in its second epoch and resumed, the run reads the same order
    and its losses equal the uninterrupted run's."""
    import os
    import signal

    rows = torch.from_numpy(_tokens(3000).astype(np.int64)[: 48 * 17].reshape(48, 17))

    def run(folder, stop_at=None, resume=False):
        kwargs = {"generator": torch.Generator().manual_seed(5)} if generator else {}
        data = torch.utils.data.DataLoader(rows, batch_size=8, shuffle=True, **kwargs)  # 6 batches a pass

        class Term(Callback):
            def on_step_end(self, trainer, row):
                if row["step"] == stop_at:
                    os.kill(os.getpid(), signal.SIGTERM)

        training = _training(folder, max_steps=14, save_steps=100, resume_from_checkpoint="latest" if resume else None)
        torch.manual_seed(0)
        Trainer(Transformer(tiny_model_config()), training, train_dataloader=data, callbacks=[Term()]).train()
        lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r.get("kind") == "train"]

    whole = run(tmp_path / "whole")
    assert run(tmp_path / "cut", stop_at=9)[-1][0] == 9  # in the second pass (steps 7 to 12)
    assert run(tmp_path / "cut", resume=True) == whole


def test_trainer_metrics_holds_what_the_run_logged_and_a_resume_keeps_the_earlier_steps(tmp_path):
    """`trainer.metrics` (other training loops keep such a dict): each series of the run as (step, value),
    equal to metrics.jsonl's rows; other trainers' names (val_loss, learning_rate) read as ours; a
    resumed run's series hold the steps before it too, each step once."""
    train, val = tiny_loaders()
    trainer = Trainer(
        Transformer(tiny_model_config()),
        _training(tmp_path, max_steps=4, eval_steps=2, save_steps=2, logging_steps=1),
        train_dataloader=train,
        val_dataloader=val,
    )
    assert dict(trainer.metrics) == {}
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    evals = [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "eval"]
    metrics = trainer.metrics
    assert metrics["train/loss"] == losses and [s for s, _ in losses] == [1, 2, 3, 4]
    assert metrics["eval/loss"] == metrics["val_loss"] == evals and [s for s, _ in evals] == [2, 4]
    assert metrics["learning_rate"] == metrics["train/lr"]
    with pytest.raises(KeyError, match="'accuracy' was not logged by this run; its series: .*eval/loss"):
        metrics["accuracy"]
    # the other ways a dict is read give the same answers under the other names
    assert "val_loss" in metrics and metrics.get("val_loss") == evals and metrics.get("eval_loss") == evals
    assert "accuracy" not in metrics and metrics.get("accuracy") is None and metrics.get("accuracy", []) == []

    train, val = tiny_loaders()
    resumed = Trainer(
        Transformer(tiny_model_config()),
        _training(tmp_path, max_steps=6, eval_steps=2, save_steps=2, logging_steps=1, resume_from_checkpoint="latest"),
        train_dataloader=train,
        val_dataloader=val,
    )
    resumed.train()
    assert [s for s, _ in resumed.metrics["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert resumed.metrics["train/loss"][:4] == losses


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync-save", "background-save"])
def test_callbacks_and_log_metrics_override(tmp_path, async_checkpoint):
    calls = []

    class Recorder(Callback):
        def on_train_begin(self, trainer):
            calls.append("begin")

        def on_step_end(self, trainer, row):
            calls.append(("step", row["step"]))

        def on_evaluate(self, trainer, metrics):
            calls.append(("eval", trainer.state.step))

        def on_save(self, trainer, path):
            calls.append(("save", path.name))

        def on_train_end(self, trainer, metrics):
            calls.append("end")

    class CustomTrainer(Trainer):
        def _log_metrics(self, row):
            if row["kind"] == "train":
                row = {**row, "custom/loss_x2": 2 * row["loss"]}
            super()._log_metrics(row)

    tokens = _tokens()
    torch.manual_seed(0)
    loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
    val = BatchLoader(WindowRows(tokens[:500], 16, keep_partial=True), 4, shuffle=False, drop_last=False)
    training = _training(
        tmp_path, max_steps=4, eval_steps=2, save_steps=2, logging_steps=2, async_checkpoint=async_checkpoint
    )
    CustomTrainer(
        Transformer(tiny_model_config()), training, train_dataloader=loader, val_dataloader=val, callbacks=[Recorder()]
    ).train()
    expected = [
        "begin",
        ("step", 2),
        ("eval", 2),
        ("save", "checkpoint-00000002"),
        ("step", 4),
        ("eval", 4),
        ("save", "checkpoint-00000004"),
        "end",
    ]
    if async_checkpoint:  # on_save comes once the write is complete: at a later step boundary at the latest
        first_save = calls.index(("save", "checkpoint-00000002"))
        assert first_save > calls.index(("eval", 2)) and first_save < calls.index(("save", "checkpoint-00000004"))
        calls.remove(("save", "checkpoint-00000002"))
        expected.remove(("save", "checkpoint-00000002"))
    assert calls == expected
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(r["custom/loss_x2"] == pytest.approx(2 * r["loss"]) for r in rows if r["kind"] == "train")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert set(train_rows[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s"}
    assert {"step", "val_loss", "perplexity"} <= set(next(r for r in rows if r["kind"] == "eval"))


def test_early_stopping(tmp_path):
    tokens = _tokens()
    loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
    val = BatchLoader(WindowRows(tokens[:400], 16, keep_partial=True), 4, shuffle=False, drop_last=False)
    training = _training(
        tmp_path,
        max_steps=100,
        learning_rate=1e-6,
        lr_scheduler="constant",
        eval_steps=2,
        early_stopping_patience=2,
        early_stopping_min_delta=0.5,
    )
    summary = Trainer(Transformer(tiny_model_config()), training, train_dataloader=loader, val_dataloader=val).train()
    assert summary["step"] == 6  # best at step 2, no improvement >= 0.5 at 4 and 6
    assert "early stopping" in summary["stopped_early"]
    assert (tmp_path / "run" / "checkpoints" / "best_model" / "model.safetensors").is_file()


def test_gradient_checkpointing_and_clipping_and_bf16(tmp_path):
    tokens = _tokens()
    results = {}
    for name, model_kw, train_kw in [
        ("plain", {}, {}),
        ("checkpointed", {"dropout": 0.0}, {"gradient_checkpointing": True}),
    ]:
        torch.manual_seed(0)
        model = Transformer(tiny_model_config(**model_kw))
        loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
        Trainer(model, _training(tmp_path / name, **train_kw), train_dataloader=loader).train()
        results[name] = _weights(model)
    for key in results["plain"]:
        torch.testing.assert_close(results["plain"][key], results["checkpointed"][key], atol=1e-6, rtol=1e-5)

    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
    summary = Trainer(
        model, _training(tmp_path / "bf16", use_amp=True, amp_dtype="bfloat16"), train_dataloader=loader
    ).train()
    assert math.isfinite(summary["tokens_per_s"])
    bf16, fp32 = (
        [r["loss"] for r in map(json.loads, open(tmp_path / name / "run" / "metrics.jsonl")) if r["kind"] == "train"]
        for name in ("bf16", "plain")
    )
    assert all(math.isfinite(loss) for loss in bf16)
    assert bf16[0] != fp32[0] and bf16[0] == pytest.approx(fp32[0], rel=2e-2)  # same weights and batch, in bf16
    # Clipping: with a tiny max norm the logged (pre-clip) norm exceeds it but the update stays small.
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    before = _weights(model)
    loader = BatchLoader(WindowRows(tokens, 16), 4, shuffle=True, seed=0)
    Trainer(
        model,
        _training(
            tmp_path / "clip",
            optimizer="sgd",
            max_steps=1,
            warmup_steps=0,
            lr_scheduler="constant",
            learning_rate=1.0,
            max_grad_norm=1e-3,
            weight_decay=0.0,
        ),
        train_dataloader=loader,
    ).train()
    delta = torch.sqrt(
        sum(((model.state_dict()[k] - v) ** 2).sum() for k, v in before.items() if k != "lm_head.weight")
    )
    assert delta.item() == pytest.approx(1e-3, rel=1e-3)  # SGD step of lr 1 moves by exactly the clipped norm


def test_save_checkpoint_before_data_says_what_is_missing(tmp_path):
    """The checkpointer exists from construction; a checkpoint records the loader's position, so saving
    before any data is a one-line error, and the same Trainer saves once the data is there."""
    from llm_trainer.errors import UsageError

    trainer = Trainer(Transformer(tiny_model_config()), _training(tmp_path))
    assert trainer.checkpointer is not None and trainer.total_steps == 6
    with pytest.raises(UsageError, match="save_checkpoint needs the training data"):
        trainer.save_checkpoint()
    trainer.train(train_dataloader=BatchLoader(WindowRows(_tokens(), 16), 4, shuffle=True, seed=0), num_epochs=1)
    saved = trainer.save_checkpoint()
    assert saved.name.endswith("00000006") and (saved / "model.safetensors").is_file()
    with pytest.raises(UsageError, match=r"save_checkpoint\(\) takes no positional arguments \(got 2\)"):
        trainer.save_checkpoint(1, 3.2)  # another trainer's save_checkpoint(epoch, val_loss)


def test_blocks_are_checkpointed_then_compiled_in_place_before_any_wrapper(tmp_path):
    """parallelize's order: activation checkpointing, then torch.compile (in place: the parameter names
    stay; without sharding the whole model, head and loss included), then data parallelism; the
    Trainer's model is the user's own object."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = Transformer(tiny_model_config())
    names = list(model.state_dict())
    trainer = Trainer(model, _training(tmp_path, compile=True, gradient_checkpointing=True))
    assert trainer.model is model and trainer.parallel.module is model and trainer.parallel.wrapped is model
    for block in model.blocks:
        assert isinstance(block, CheckpointWrapper) and block._compiled_call_impl is None
    assert model._compiled_call_impl is not None  # one graph: embeddings, blocks, head and loss
    assert list(model.state_dict()) == names


def test_under_fsdp_each_block_is_compiled_between_the_shards_hooks():
    """With sharding, FSDP2's hooks run between the blocks, so each block is compiled on its own."""
    from llm_trainer.parallel.parallelize import apply_compile

    model = Transformer(tiny_model_config())
    apply_compile(model, per_block=True)
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None


@pytest.mark.parametrize("at_step", [2, 6])
def test_a_signal_stops_the_run_and_the_summary_names_it(tmp_path, at_step, capsys):
    """SIGTERM mid-run: the step finishes, a checkpoint is saved, and the summary carries the signal as
    data (the CLI's exit status 128 + its number comes from it); the run does not then evaluate the
    whole validation split, which it would at its end (a preempted job's grace period is short). At the
    last step, its checkpoint saved, the run is complete: the summary is a finished run's."""
    import os
    import signal

    class Term(Callback):
        def on_step_end(self, trainer, row):
            if row["step"] == at_step:
                os.kill(os.getpid(), signal.SIGTERM)

    loader = BatchLoader(WindowRows(_tokens(), 16), 4, shuffle=True, seed=0)
    val = BatchLoader(WindowRows(_tokens()[:600], 16, keep_partial=True), 4, shuffle=False, drop_last=False)
    trainer = Trainer(
        Transformer(tiny_model_config()),
        _training(tmp_path, eval_steps=100),
        train_dataloader=loader,
        val_dataloader=val,
        callbacks=[Term()],
    )
    summary = trainer.train()
    assert summary["step"] == at_step and summary["checkpoint"]
    if at_step == 2:
        assert summary["stopped_by_signal"] == "SIGTERM" and summary["stopped_early"] == "received SIGTERM"
        assert "eval/loss" not in trainer.metrics and "val_loss" not in summary
    else:
        assert "stopped_by_signal" not in summary and summary["stopped_early"] is None and "val_loss" in summary
        assert "SIGTERM came as the run reached its last step" in capsys.readouterr().err
    plain = Trainer(Transformer(tiny_model_config()), _training(tmp_path / "plain", max_steps=2)).train(loader)
    assert "stopped_by_signal" not in plain
