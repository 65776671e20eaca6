"""The options that buy quality per second: Muon, block options, FlexAttention document masks, run
lengths in tokens, stopping at a target validation loss. Each is checked against a reference and for
an exact resume."""

import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from conftest import tiny_model_config, write_tiny_experiment
from llm_trainer import cli
from llm_trainer.checkpoint.model_folder import save_model_folder
from llm_trainer.config import TrainingConfig
from llm_trainer.errors import UsageError
from llm_trainer.model import Transformer, document_attention
from llm_trainer.parallel.distributed import DistInfo
from llm_trainer.resolve import cpu_computes_bf16, token_anchors
from llm_trainer.train import muon
from llm_trainer.train.muon import gram_newton_schulz, newton_schulz, orthogonalize
from llm_trainer.train.optim import build_optimizer, set_learning_rate

# -- Muon --------------------------------------------------------------------------------------------


def test_muon_equals_torch_muon_on_hidden_matrices_and_adamw_elsewhere():
    """Bitwise the same weights as torch.optim.Muon on the blocks' linear weights plus fused AdamW on
    embeddings, head, norms and biases, each at its own peak rate."""
    torch.manual_seed(0)
    ours = Transformer(tiny_model_config(architecture="llama", d_model=32, n_layers=2, vocab_size=61))
    reference = copy.deepcopy(ours)
    config = TrainingConfig(optimizer="muon", learning_rate=1e-3, muon_learning_rate=0.02, weight_decay=0.1)
    optimizer = build_optimizer(ours, config, torch.device("cpu"))
    optimizer.ns_dtype = torch.bfloat16  # as torch's Muon iterates on every device (ours: where bf16 is native)
    muon_group, *adam_groups = optimizer.param_groups
    names = {id(p): n for n, p in ours.named_parameters()}
    hidden = sorted(names[id(p)] for p in muon_group["params"])
    assert hidden == sorted(n for n, p in ours.named_parameters() if n.startswith("blocks.") and p.dim() == 2)
    assert muon_group["lr"] == 0.02 and all(g["lr"] == 1e-3 for g in adam_groups)
    by_name = dict(reference.named_parameters())
    ref_muon = torch.optim.Muon([by_name[n] for n in hidden], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ref_adam = torch.optim.AdamW(
        [
            {"params": [by_name[names[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
            for g in adam_groups
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    x, y = torch.randint(0, 61, (4, 16)), torch.randint(0, 61, (4, 16))
    for _ in range(4):
        for model, optimizers in ((ours, [optimizer]), (reference, [ref_muon, ref_adam])):
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        for a, b in zip(ours.parameters(), reference.parameters()):
            assert torch.equal(a, b)
    set_learning_rate(optimizer, 5e-4)  # the schedule scales both peaks alike
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01) and optimizer.param_groups[1]["lr"] == 5e-4


def test_muon_iterates_in_bf16_only_where_the_device_computes_it():
    """Newton-Schulz in bf16 where bf16 matmuls are native; on a CPU that emulates them (tens of times
    slower than float32) in float32, to the same orthogonalization within bf16's rounding."""
    model = Transformer(tiny_model_config(d_model=16))
    optimizer = build_optimizer(model, TrainingConfig(optimizer="muon"), torch.device("cpu"))
    assert optimizer.ns_dtype == (torch.bfloat16 if cpu_computes_bf16() else torch.float32)
    assert "ns_dtype" not in optimizer.state_dict()["param_groups"][0]  # the device's, never a checkpoint's
    torch.manual_seed(0)
    updates = torch.randn(3, 32, 96)  # (matrices, rows, cols)
    exact = orthogonalize(updates, dtype=torch.float32)
    assert exact.dtype == torch.float32
    torch.testing.assert_close(exact, orthogonalize(updates, dtype=torch.bfloat16), atol=0.03, rtol=0)
    singular = torch.linalg.svdvals(exact)
    assert singular.min() > 0.6 and singular.max() < 1.25


def _with_singular_values(shape: tuple[int, int, int], singular: torch.Tensor) -> torch.Tensor:
    """A float64 stack of random matrices U diag(singular) V^T."""
    n, rows, cols = shape
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(n, rows, k, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, cols, k, dtype=torch.float64))[0]
    return (u * singular) @ v.mT


@pytest.mark.parametrize(
    "spectrum",
    [
        torch.logspace(0, -3, 32, dtype=torch.float64),
        torch.logspace(0, -9, 32, dtype=torch.float64),  # singular values below float32's rounding of the Gram matrix
        torch.cat([torch.logspace(0, -2, 8, dtype=torch.float64), torch.zeros(24, dtype=torch.float64)]),  # rank 8
    ],
    ids=["spread-1e-3", "spread-1e-9", "rank-deficient"],
)
@pytest.mark.parametrize("cols", [64, 128])
def test_the_gram_form_gives_the_direct_iterations_result(spectrum, cols):
    """In float32, the Gram form's result is the direct iterations' (computed in float64) to about
    float32's rounding, for gradients whose singular values span many orders of magnitude, as real
    ones do. Without the restart its error on these was 1e-4 or more, and 1e-5 with it."""
    torch.manual_seed(0)
    stack = _with_singular_values((4, 32, cols), spectrum)
    x = stack / stack.norm(dim=(-2, -1), keepdim=True)
    exact = newton_schulz(x, 5)  # float64
    direct = newton_schulz(x.float(), 5).double()
    gram = gram_newton_schulz(x.float(), 5).double()

    def error(result: torch.Tensor) -> float:
        return ((result - exact).norm() / exact.norm()).item()

    assert error(direct) < 2e-5
    assert error(gram) < 5e-5, (error(gram), error(direct))


def test_orthogonalize_takes_the_gram_form_for_wide_float32_matrices_only():
    """Which form runs: the Gram form for float32 matrices at least twice as wide as tall (either
    orientation), the direct iterations for square-ish ones and in bf16 (torch.optim.Muon's)."""
    torch.manual_seed(0)
    for shape, gram in (((3, 16, 32), True), ((3, 32, 16), True), ((3, 16, 31), False), ((3, 16, 16), False)):
        updates = torch.randn(shape)
        x = updates.mT if shape[1] > shape[2] else updates
        x = x / x.norm(dim=(-2, -1), keepdim=True)
        expected = (gram_newton_schulz if gram else newton_schulz)(x, 5)
        result = orthogonalize(updates, dtype=torch.float32)
        assert torch.equal(result, expected.mT if shape[1] > shape[2] else expected), shape
    updates = torch.randn(3, 16, 64)
    x = updates.bfloat16()
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    assert torch.equal(orthogonalize(updates, dtype=torch.bfloat16), newton_schulz(x, 5).float())


def test_muon_trains_in_float32_as_with_the_direct_iterations_only(monkeypatch):
    """Ten steps of a model whose MLP matrices take the Gram form: the same losses and weights as with
    the direct iterations for every matrix, to float32's rounding."""
    results, gram_calls = [], []

    def counted(x, steps):
        gram_calls.append(tuple(x.shape))
        return gram_newton_schulz(x, steps)

    monkeypatch.setattr(muon, "gram_newton_schulz", counted)
    for gram in (True, False):
        if not gram:
            assert gram_calls == [(4, 32, 128)] * 10  # each block's MLP matrices, in and out, every step
            monkeypatch.setattr(muon, "GRAM_MIN_ASPECT", float("inf"))
        torch.manual_seed(0)
        model = Transformer(tiny_model_config(d_model=32, d_ff=128))
        optimizer = build_optimizer(model, TrainingConfig(optimizer="muon", use_amp=False), torch.device("cpu"))
        optimizer.ns_dtype = torch.float32
        losses = []
        for step in range(10):
            x = torch.randint(0, 61, (4, 24), generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (gram_losses, gram_weights), (direct_losses, direct_weights) = results
    assert len(gram_calls) == 10
    assert gram_losses == pytest.approx(direct_losses, rel=1e-5)
    for a, b in zip(gram_weights, direct_weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_muon_skips_a_nonfinite_step_without_touching_weights_or_state():
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(d_model=16))
    optimizer = build_optimizer(model, TrainingConfig(optimizer="muon"), torch.device("cpu"))
    x = torch.randint(0, 61, (2, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()  # state exists now
    before = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.found_inf = torch.ones(())  # what the loop sets for a non-finite step
    optimizer.step()
    del optimizer.found_inf
    assert all(torch.equal(a, b) for a, b in zip(before[1], model.parameters()))
    after = optimizer.state_dict()["state"]
    for index, state in before[0]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, after[index][key]), (index, key)


def _final_weights(run):
    return load_file(str(sorted((run / "checkpoints").glob("checkpoint-*"))[-1] / "model.safetensors"))


@pytest.mark.parametrize(
    "options",
    [
        ["training.optimizer=muon", "training.muon_learning_rate=0.01"],
        [
            "model.architecture=llama",
            "model.activation=relu2",
            "model.d_ff=32",
            "model.qk_norm=true",
            "model.zero_init_projections=true",
            "model.logit_softcap=15",
        ],
    ],
    ids=["muon", "block-options"],
)
def test_new_options_resume_bitwise(tmp_path, options):
    """8 steps in one go, or a resume from the checkpoint at step 4: the same weights to the bit."""
    config = write_tiny_experiment(tmp_path, max_steps=8, save_steps=4, eval_steps=0, save_total_limit=None)
    whole = tmp_path / "whole"
    assert cli.main(["train", "--config", str(config), f"training.output_dir={whole}", *options]) == 0
    split = tmp_path / "split"
    shutil.copytree(whole / "checkpoints" / "checkpoint-00000004", split / "checkpoints" / "checkpoint-00000004")
    assert (
        cli.main(
            [
                "train",
                "--config",
                str(config),
                f"training.output_dir={split}",
                "training.resume_from_checkpoint=latest",
                *options,
            ]
        )
        == 0
    )
    a, b = _final_weights(whole), _final_weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [json.loads(r)["loss"] for r in (whole / "metrics.jsonl").read_text().splitlines() if '"train"' in r]
    assert losses[-1] < losses[0]  # and it learns


def test_muon_is_refused_where_weights_are_sharded():
    from llm_trainer.parallel.parallelize import parallelize

    model = Transformer(tiny_model_config())
    for strategy in ("fsdp", "deepspeed"):
        with pytest.raises(UsageError, match="muon needs each weight whole"):
            parallelize(
                model,
                config=TrainingConfig(optimizer="muon"),
                dist=DistInfo(world_size=2, strategy=strategy),
                device=torch.device("cpu"),
                amp_dtype=None,
                activation_checkpointing=False,
                build_optimizer=lambda m: None,
            )


# -- block options -----------------------------------------------------------------------------------


def test_zero_initialised_projections_make_each_block_the_identity():
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(zero_init_projections=True))
    x = torch.randn(2, 5, 16)
    for block in model.blocks:
        assert torch.equal(block(x), x)
        assert block.attn.q.weight.abs().sum() > 0  # only the output projections start at zero


def test_logit_softcap_bounds_the_logits():
    torch.manual_seed(0)
    plain = Transformer(tiny_model_config(init_std=2.0))  # large weights: logits far beyond the cap
    capped = Transformer(tiny_model_config(init_std=2.0, logit_softcap=5.0))
    capped.load_state_dict(plain.state_dict())
    x = torch.randint(0, 61, (2, 8))
    raw = plain(x)
    assert raw.abs().max() > 10
    torch.testing.assert_close(capped(x), 5.0 * torch.tanh(raw / 5.0))


@pytest.mark.parametrize("option", ["qk_norm", "logit_softcap", "relu2"])
def test_export_refuses_what_transformers_cannot_express(tmp_path, option):
    pytest.importorskip("transformers")
    from llm_trainer.hf.interop import export_to_hf

    values = {
        "qk_norm": dict(qk_norm=True),
        "logit_softcap": dict(logit_softcap=30.0),
        "relu2": dict(activation="relu2"),
    }[option]
    folder = tmp_path / "model"
    save_model_folder(Transformer(tiny_model_config(**values)), folder)
    with pytest.raises(UsageError, match="cannot export to transformers") as error:
        export_to_hf(folder, tmp_path / "hf")
    assert "\n" not in str(error.value) and not (tmp_path / "hf").exists()


def test_an_export_refusal_names_every_setting_in_the_way_at_once(tmp_path):
    """The speedrun recipe's model: one refusal lists all it would take to export, not one per try."""
    pytest.importorskip("transformers")
    from llm_trainer.hf.gguf import check_gguf_exportable
    from llm_trainer.hf.interop import export_to_hf

    config = tiny_model_config(
        architecture="gpt2", qk_norm=True, logit_softcap=30.0, norm="rmsnorm", activation="relu2"
    )
    folder = tmp_path / "model"
    save_model_folder(Transformer(config), folder)
    with pytest.raises(UsageError) as error:
        export_to_hf(folder, tmp_path / "hf")
    message = str(error.value)
    assert message.startswith("cannot export to transformers: qk_norm and logit_softcap are not part of"), message
    for part in ("norm: rmsnorm", "no activation relu2"):
        assert part in message, message
    with pytest.raises(UsageError) as error:
        check_gguf_exportable(config)
    assert str(error.value).startswith("cannot export to GGUF: qk_norm and logit_softcap") and "relu2" in str(
        error.value
    )


# -- FlexAttention -----------------------------------------------------------------------------------


def test_flex_document_mask_equals_the_dense_mask():
    """Forward (CPU inference): the BlockMask path gives the dense-mask path's logits."""
    torch.manual_seed(0)
    dense = Transformer(tiny_model_config(architecture="llama", n_kv_heads=1)).eval()
    flex = Transformer(tiny_model_config(architecture="llama", n_kv_heads=1, attention_backend="flex")).eval()
    flex.load_state_dict(dense.state_dict())
    x = torch.randint(0, 61, (2, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 20])
    with torch.no_grad():
        torch.testing.assert_close(flex(x, doc_ids=doc_ids), dense(x, doc_ids=doc_ids), atol=1e-5, rtol=1e-5)
    mask, positions = document_attention(doc_ids)
    assert positions[0, 7].item() == 0 and positions[0, 15].item() == 8 and not mask[0, 0, 8, 6]


def test_flex_training_on_cpu_is_refused(tmp_path):
    config = write_tiny_experiment(tmp_path)
    with pytest.raises(UsageError, match="attention_backend flex trains on CUDA only"):
        cli_run = cli.main  # the CLI turns it into a one-line error; the API raises it
        from llm_trainer import load_experiment, train

        train(load_experiment(config, ["model.attention_backend=flex", f"training.output_dir={tmp_path / 'run'}"]))
    assert cli_run(["train", "--config", str(config), "model.attention_backend=flex"]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
def test_flex_document_mask_trains_like_the_dense_mask_on_cuda():
    torch.manual_seed(0)
    dense = Transformer(tiny_model_config(architecture="llama", d_model=32)).cuda()  # FlexAttention: head size >= 16
    flex = Transformer(tiny_model_config(architecture="llama", d_model=32, attention_backend="flex")).cuda()
    flex.load_state_dict(dense.state_dict())
    x = torch.randint(0, 61, (2, 20), device="cuda")
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20], device="cuda")
    grads = []
    for model in (dense, flex):
        F.cross_entropy(model(x, doc_ids=doc_ids).flatten(0, 1), x.flatten()).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# -- run lengths in tokens ---------------------------------------------------------------------------


def test_token_anchors_set_steps_and_accumulation():
    training = TrainingConfig(batch_size=4, total_batch_tokens=4 * 16 * 2 * 3, max_tokens=10_000)
    resolved = token_anchors(training, seq_len=16, world_size=2)
    assert resolved.gradient_accumulation_steps == 3
    assert resolved.max_steps == math.ceil(10_000 / (4 * 16 * 2 * 3)) == 27
    assert resolved.max_tokens is None and resolved.total_batch_tokens is None
    with pytest.raises(UsageError, match="must be a multiple of batch_size x sequence length x processes"):
        token_anchors(TrainingConfig(batch_size=4, total_batch_tokens=100), seq_len=16, world_size=1)
    with pytest.raises(ValueError, match="max_steps or max_tokens"):
        TrainingConfig(max_steps=10, max_tokens=100)


def test_a_run_sized_in_tokens_trains_that_many(tmp_path):
    config = write_tiny_experiment(tmp_path, max_steps=None, eval_steps=0)
    run = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "--config",
                str(config),
                f"training.output_dir={run}",
                "training.max_tokens=500",
                "training.total_batch_tokens=192",
            ]
        )
        == 0
    )
    saved = yaml.safe_load((run / "config.yaml").read_text())["training"]
    assert saved["gradient_accumulation_steps"] == 2 and saved["max_steps"] == 3  # 192 = 4 x 24 x 2; ceil(500 / 192)
    summary = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["tokens_seen"] == 3 * 192


# -- stopping at a target ----------------------------------------------------------------------------


def test_training_stops_at_the_first_full_evaluation_that_reaches_the_target(tmp_path):
    config = write_tiny_experiment(tmp_path, max_steps=60, eval_steps=5, learning_rate=1e-2, eval_batch_size=2)
    probe = tmp_path / "probe"
    assert cli.main(["train", "--config", str(config), f"training.output_dir={probe}"]) == 0
    evals = [r for r in map(json.loads, (probe / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    full_batches = evals[0]["batches"]
    target = evals[len(evals) // 2]["val_loss"] + 1e-9  # reached half-way in the probe run
    first = next(r["step"] for r in evals if r["val_loss"] <= target)

    run = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "--config",
                str(config),
                f"training.output_dir={run}",
                f"training.target_val_loss={target}",
                "training.eval_max_batches=1",
            ]
        )
        == 0
    )
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    summary, run_evals = rows[-1], [r for r in rows if r["kind"] == "eval"]
    assert summary["stopped_early"].startswith("target reached") and first <= summary["step"] < 60
    assert 0 < summary["time_to_target_s"] <= summary["train_runtime_s"]
    # Screening reads one batch; the decision is made on the whole split, whose losses are the probe's.
    probe_loss = {r["step"]: r["val_loss"] for r in evals}
    full = [r for r in run_evals if r["batches"] == full_batches]
    assert full and full[-1]["step"] == summary["step"] and full[-1]["val_loss"] <= target
    assert all(r["val_loss"] == pytest.approx(probe_loss[r["step"]], rel=1e-9) for r in full)
    assert all(r["val_loss"] > target for r in full[:-1])
    assert all(r["batches"] == 1 for r in run_evals if r not in full) and full_batches > 1


# -- bf16 on a CPU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["causal", "mask", "gqa"])
def test_explicit_attention_equals_sdpa(case):
    """The attention the model writes out for bf16 training on a CPU computes what SDPA does (checked in
    float32: values and gradients)."""
    from llm_trainer.model import _explicit_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, requires_grad=True)
    kv_heads = 2 if case == "gqa" else 4
    k, v = (torch.randn(2, kv_heads, 9, 8, requires_grad=True) for _ in range(2))
    kwargs = dict(is_causal=case != "mask", enable_gqa=case == "gqa")
    if case == "mask":
        kwargs["attn_mask"] = document_attention(torch.tensor([[0] * 4 + [1] * 5, [0] * 9]))[0]
    ours = _explicit_attention(q, k, v, **kwargs)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    reference = F.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_use_amp_auto_follows_the_device(monkeypatch):
    import llm_trainer.resolve as resolve

    monkeypatch.setattr(resolve, "cpu_computes_bf16", lambda: True)
    on = resolve.resolve_training(TrainingConfig(use_amp="auto", device="cpu"))
    assert on.use_amp is True and on.amp_dtype == "bfloat16"
    asked = resolve.resolve_training(TrainingConfig(use_amp="auto", device="cpu", amp_dtype="float16"))
    assert asked.use_amp is True and asked.amp_dtype == "float16"  # a dtype the user named is kept
    monkeypatch.setattr(resolve, "cpu_computes_bf16", lambda: False)
    assert resolve.resolve_training(TrainingConfig(use_amp="auto", device="cpu")).use_amp is False
