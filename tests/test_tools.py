"""Tools around training runs: the memory/compute estimator (against tensors actually allocated and
saved), plots, the learning-rate finder, the Optuna sweep (completes, prunes, resumes) and the model
registry, through the Python API and the CLI."""

import hashlib
import json
import math
import random
import re
import sys
import time

import numpy as np
import pytest
import torch
import yaml

from conftest import kill9_when, tiny_model_config, write_tiny_experiment
from llm_trainer.cli import main
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.errors import UsageError
from llm_trainer.model import Transformer
from llm_trainer.train.flops import count_parameters, flops_per_token, peak_flops
from llm_trainer.train.memory_estimate import estimate_memory


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from llm_trainer.api import train
    from llm_trainer.config_loader import load_experiment

    root = tmp_path_factory.mktemp("tools")
    summary = train(load_experiment(write_tiny_experiment(root)))
    return root / "run", summary


# ----------------------------------------------------------------------------------------------
# Estimator


def test_parameter_count_and_flops_per_token_match_gpt2_small_and_llama_7b():
    gpt2 = ModelConfig(
        vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024, vocab_pad_multiple=1
    )
    counts = count_parameters(gpt2)
    assert counts.total == 124_439_808  # Hugging Face gpt2
    assert counts.matmul == 124_439_808 - 1024 * 768 == 123_653_376  # nanoGPT's get_num_params()
    assert flops_per_token(gpt2, 1024) == 6 * 123_653_376 + 12 * 12 * 768 * 1024
    assert flops_per_token(Transformer(tiny_model_config()), 24) == flops_per_token(tiny_model_config(), 24)
    ours = Transformer(tiny_model_config(vocab_pad_multiple=1))
    plain = torch.nn.Sequential(*ours.children())  # any other module: counted from its own parameters
    plain.config = type("Cfg", (), {"n_layer": 2, "n_embd": 16, "n_positions": 24})()
    assert flops_per_token(plain) == flops_per_token(tiny_model_config(vocab_pad_multiple=1), 24)
    with pytest.raises(ValueError):
        flops_per_token(object())
    llama = ModelConfig(
        architecture="llama", vocab_size=32000, d_model=4096, n_heads=32, n_layers=32, d_ff=11008, max_seq_len=4096
    )
    counts = count_parameters(llama)
    assert counts.total == 6_738_415_616  # LLaMA-7B
    assert counts.matmul == counts.total - 32000 * 4096  # untied: the embedding lookup is left out


def test_the_meta_model_is_built_once_per_config_and_follows_every_field():
    """`estimate` reads one config's meta model for every layout it tries: built once, and any changed
    field (even one that does not touch a shape-bearing key) gives a model of its own."""
    from llm_trainer.train.flops import meta_model

    config = tiny_model_config(n_layers=2)
    assert meta_model(config) is meta_model(tiny_model_config(n_layers=2))
    wider = meta_model(tiny_model_config(n_layers=2, d_ff=96))
    assert wider is not meta_model(config) and wider.blocks[0].mlp.fc.weight.shape[0] == 96
    assert meta_model(tiny_model_config(n_layers=2, qk_norm=True)) is not meta_model(config)
    for n in range(3, 10):  # a long search over other configs keeps only the last few
        meta_model(tiny_model_config(n_layers=n))
    assert len(meta_model(config).blocks) == 2


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA H200", torch.float16) == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == 19.5e12
    assert peak_flops("NVIDIA A10", torch.bfloat16) == 125e12
    assert peak_flops("NVIDIA A10G", torch.bfloat16) == 70e12
    assert peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert peak_flops("Tesla V100-SXM2-16GB", torch.float16) == 125e12
    assert peak_flops("Tesla T4", torch.bfloat16) == 8.1e12  # no bf16 tensor cores: the fp32 rate
    assert peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) == 165.2e12
    assert peak_flops("NVIDIA GeForce RTX 3090", torch.bfloat16) == 71e12
    assert peak_flops("cpu", torch.float32) is None and peak_flops("", torch.bfloat16) is None
    assert peak_flops("Some Future Accelerator", torch.bfloat16) is None


def _tensor_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each counted once: tied weights share one, and so do
    the gradients of projections computed as one matmul (`model.project`), views into one buffer."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize(
    "overrides, optimizer",
    [
        (dict(), "adamw"),
        (dict(architecture="llama", n_kv_heads=1), "adamw"),
        (dict(), "sgd"),
    ],
)
def test_parameters_gradients_and_optimizer_state_match_the_measured_allocation(overrides, optimizer):
    from llm_trainer.train.optim import build_optimizer

    config = tiny_model_config(**overrides)
    training = TrainingConfig(device="cpu", optimizer=optimizer)
    model = Transformer(config)
    opt = build_optimizer(model, training, torch.device("cpu"))
    x = torch.randint(0, config.vocab_size, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    params = list(model.parameters())
    measured = {
        "params": _tensor_bytes(params),
        "grads": _tensor_bytes(p.grad for p in params),
        "optimizer": _tensor_bytes(v for state in opt.state.values() for v in state.values()),
    }
    estimate = estimate_memory(config, training, device_type="cpu")
    assert estimate.parameters == sum(p.numel() for p in params) < 10_000
    measured_total = sum(measured.values())
    assert abs(estimate.states_bytes - measured_total) / measured_total < 0.10, (estimate.states_bytes, measured)
    assert estimate.params_bytes == measured["params"] and estimate.grads_bytes == measured["grads"]


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(activation="relu", dropout=0.1),
        dict(architecture="llama", n_kv_heads=1),
        dict(architecture="llama", n_kv_heads=1, qk_norm=True),
    ],
)
def test_activation_estimate_matches_the_tensors_autograd_saves(amp, overrides):
    """Every tensor saved for backward (unique storage, parameters and buffers excluded), one forward."""
    from llm_trainer.train.evaluate import summed_nll

    config = tiny_model_config(d_model=32, n_heads=4, n_layers=2, max_seq_len=32, **overrides)
    training = TrainingConfig(device="cpu", use_amp=amp, batch_size=4)
    model = Transformer(config).train()
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, config.vocab_size, (4, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            summed_nll(model(x), x)
    measured = sum(saved.values())
    est = estimate_memory(config, training, seq_len=32, batch_size=4, device_type="cpu")
    predicted = est.activations_bytes + est.amp_weight_copies_bytes  # autocast's 16-bit weights are saved too
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_sharding_divides_the_sharded_parts():
    config = tiny_model_config(d_model=64, n_heads=4, n_layers=4, vocab_size=1000)
    training = TrainingConfig(device="cpu")
    base = estimate_memory(config, training)
    z1 = estimate_memory(config, training, world_size=4, sharding="zero1")
    z2 = estimate_memory(config, training, world_size=4, sharding="zero2")
    fsdp = estimate_memory(config, training, world_size=4, sharding="fsdp")
    assert z1.optimizer_bytes == base.optimizer_bytes / 4 and z1.grads_bytes == base.grads_bytes
    assert z2.grads_bytes == base.grads_bytes / 4 and z2.params_bytes == base.params_bytes
    assert base.params_bytes / 4 < fsdp.params_bytes < base.params_bytes  # plus the gathered blocks
    assert z1.activations_bytes == base.activations_bytes  # activations are per device
    assert base.peak_bytes > z1.peak_bytes > z2.peak_bytes > fsdp.peak_bytes
    checkpointed = estimate_memory(config, training, gradient_checkpointing=True)
    assert checkpointed.activations_bytes < base.activations_bytes


def test_cublas_workspaces_count_on_cuda_only():
    """Each of the two cuBLAS handles (forward and backward threads) holds its workspace in the caching
    allocator on CUDA, in every phase; a CPU run has none."""
    config = tiny_model_config(d_model=64, n_heads=4, n_layers=2, vocab_size=1000)
    cuda = estimate_memory(config, TrainingConfig(use_amp=False), device_type="cuda")
    cpu = estimate_memory(config, TrainingConfig(use_amp=False), device_type="cpu")
    assert cpu.workspace_bytes == 0 and cuda.workspace_bytes == 2 * 32 * 2**20
    assert all(phase >= cuda.workspace_bytes + cuda.params_bytes for phase in cuda.details["phases"].values())
    assert cuda.peak_bytes - cpu.peak_bytes >= cuda.workspace_bytes * 0.99


def test_estimate_cli(tmp_path, capsys):
    config = write_tiny_experiment(tmp_path)
    assert main(["estimate", "--config", str(config), "--device-memory", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is True and report["max_micro_batch_size"] > 4
    assert (
        report["parameters"]
        == count_parameters(ModelConfig(d_model=16, n_heads=2, n_layers=1, max_seq_len=24, vocab_size=256)).total
    )
    assert main(["estimate", "--config", "llama-7b", "--device-memory", "80"]) == 0
    text = capsys.readouterr().out
    assert "6,738,415,616" in text and "does NOT fit in 80 GiB" in text and "distributed" in text
    assert (
        main(
            [
                "estimate",
                "--config",
                "llama-7b",
                "--device-memory",
                "80",
                "--world-size",
                "8",
                "--sharding",
                "fsdp",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_estimate_takes_the_vocabulary_of_the_tokenizer_already_prepared(tmp_path, capsys):
    """A char tokenizer's size is known once it is trained on the data: an estimate after `prepare` counts
    that tokenizer's rows, not the 256 assumed before, and says where the size came from."""
    config = write_tiny_experiment(tmp_path)
    assert main(["prepare", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["estimate", "--config", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    prepared = next((tmp_path / "cache").glob("*/tokenizer.json"))
    size = len(json.loads(prepared.read_text())["model"]["vocab"])
    assert size < 256 and report["vocab_size"] == size
    assert report["vocab_source"] == f"the tokenizer prepared in {prepared.parent}"
    assert (
        report["parameters"]
        == count_parameters(ModelConfig(d_model=16, n_heads=2, n_layers=1, max_seq_len=24, vocab_size=size)).total
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_memory_prediction_on_gpu_gpt2_small(tmp_path):
    """GPT-2 small, bf16 autocast, fused AdamW: the predicted peak within 15% of max_memory_allocated."""
    from llm_trainer.train.trainer import Trainer

    config = ModelConfig(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024)
    training = TrainingConfig(
        device="cuda",
        use_amp=True,
        batch_size=8,
        max_steps=3,
        save_steps=0,
        eval_steps=0,
        report_to=[],
        progress_bar=False,
        output_dir=str(tmp_path / "run"),
    )
    tokens = torch.randint(0, 50257, (64, 1025))
    loader = [(tokens[i : i + 8, :-1], tokens[i : i + 8, 1:]) for i in range(0, 64, 8)]
    torch.cuda.reset_peak_memory_stats()
    Trainer(Transformer(config), training, train_dataloader=loader).train()
    measured = torch.cuda.max_memory_allocated()
    predicted = estimate_memory(config, training, seq_len=1024).peak_bytes
    assert abs(predicted - measured) / measured < 0.15, (predicted / 2**30, measured / 2**30)


# ----------------------------------------------------------------------------------------------
# Plots


def _fake_run(folder, steps=20, scale=1.0, resumed=False):
    folder.mkdir(parents=True)
    rows = []
    for s in range(2, steps + 1, 2):
        rows.append(
            {
                "step": s,
                "loss": scale * 4 / s**0.3,
                "lr": 1e-3 * min(1, s / 6),
                "tokens_seen": 96 * s,
                "grad_norm": 1.0,
                "tokens_per_s": 1000.0,
            }
        )
        if s % 10 == 0:
            rows.append(
                {
                    "step": s,
                    "val_loss": scale * 4.2 / s**0.3,
                    "perplexity": math.exp(scale * 4.2 / s**0.3),
                    "tokens": 50,
                }
            )
    if resumed:  # a resume from step 10 repeats steps 12.. in the file
        rows += [r for r in rows if r["step"] > 10]
    rows.append({"event": "train_end", "step": steps, "val_loss": 1.0, "perplexity": 2.7})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plots_overlay_runs_with_the_expected_lines(tmp_path):
    pytest.importorskip("matplotlib")
    from llm_trainer.train.plots import make_figures, plot_runs, read_run

    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", steps=30, scale=1.2, resumed=True)
    runs = [read_run(a), read_run(b)]
    assert sorted(runs[1].train) == list(range(2, 31, 2))  # duplicates from the resume collapse
    assert runs[1].tokens_at([10, 11, 30]) == [960, 1056, 2880]
    figures = make_figures(runs)
    assert set(figures) == {f"{q}_vs_{x}" for q in ("loss", "perplexity", "lr") for x in ("steps", "tokens")}
    lines = {name: fig.axes[0].get_lines() for name, fig in figures.items()}
    assert len(lines["loss_vs_steps"]) == 4 and len(lines["perplexity_vs_tokens"]) == 4  # train + val per run
    assert len(lines["lr_vs_steps"]) == 2 and len(lines["lr_vs_tokens"]) == 2
    val_b = [ln for ln in lines["loss_vs_tokens"] if ln.get_label() == "b validation"][0]
    assert list(val_b.get_xdata()) == [960, 1920, 2880]

    # evaluations of part of the split (training.eval_max_batches) and of the whole are lines apart
    c = tmp_path / "c"
    c.mkdir()
    evals = [(2, 3.0, 4), (4, 2.5, 4), (6, 2.9, 20)]  # (step, val_loss, batches of 20)
    c_rows = [{"kind": "train", "step": s, "loss": 3.0, "lr": 1e-3, "tokens_seen": 96 * s} for s in (2, 4, 6)] + [
        {"kind": "eval", "step": s, "val_loss": v, "perplexity": math.exp(v), "batches": n, "batches_total": 20}
        for s, v, n in evals
    ]
    (c / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in c_rows))
    val_c = {ln.get_label(): ln for ln in make_figures([read_run(c)])["loss_vs_steps"].axes[0].get_lines()}
    part, whole = val_c["c validation, first batches (training.eval_max_batches)"], val_c["c validation, whole split"]
    assert (list(part.get_xdata()), list(part.get_ydata())) == ([2, 4], [3.0, 2.5])
    assert (list(whole.get_xdata()), list(whole.get_ydata())) == ([6], [2.9])

    written = plot_runs([a, b], tmp_path / "plots")
    assert len(written) == 6
    for path in written.values():
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image

    assert matplotlib.image.imread(written["loss_vs_steps"]).shape[:2] == (500, 800)


def test_plots_never_raise_by_default_and_the_cli_reports(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from llm_trainer.train.plots import plot_runs

    assert plot_runs([tmp_path / "missing"], tmp_path / "out") == {}  # a warning, no exception
    with pytest.raises(UsageError, match="metrics.jsonl"):
        plot_runs([tmp_path / "missing"], tmp_path / "out", strict=True)
    assert main(["plot", str(tmp_path / "missing")]) == 2
    run = _fake_run(tmp_path / "run")
    assert main(["plot", str(run)]) == 0
    assert len(capsys.readouterr().out.split()) == 6 and (run / "plots" / "lr_vs_tokens.png").is_file()
    assert main(["plot", str(run)]) == 0  # the run's own figures, drawn again
    mine = tmp_path / "figures"  # a folder of the user's: a PNG of the same name is kept unless --overwrite
    mine.mkdir()
    (mine / "loss_vs_steps.png").write_bytes(b"my figure")
    capsys.readouterr()
    assert main(["plot", str(run), "--output", str(mine)]) == 2
    assert "holds loss_vs_steps.png already; choose another folder or pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["loss_vs_steps.png"] and (
        mine / "loss_vs_steps.png"
    ).read_bytes() == b"my figure"
    assert main(["plot", str(run), "--output", str(mine), "--overwrite"]) == 0
    assert (mine / "loss_vs_steps.png").read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_a_finished_run_says_so_once_and_leaves_no_plots_folder(tmp_path, capsys, monkeypatch):
    from llm_trainer.train.plots import plot_runs

    run = _fake_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the [tracking] extra is not installed
    assert plot_runs([run], run / "plots") == {}
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "warning" not in err.lower()
    assert not (run / "plots").exists()


# ----------------------------------------------------------------------------------------------
# LR finder


def test_lr_finder_suggests_a_sane_rate_and_leaves_the_model_untouched():
    from llm_trainer.data.batches.loader import BatchLoader, WindowRows
    from llm_trainer.tools.lr_finder import find_lr

    rng = np.random.default_rng(0)
    tokens = (np.cumsum(rng.integers(1, 3, size=4000)) % 61).astype(np.uint16)
    loader = BatchLoader(WindowRows(tokens, 24, seed=0), 8, shuffle=True, seed=0)
    loader.next_batch()
    position = loader.state_dict()
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before, py_before = torch.get_rng_state(), random.getstate()

    result = find_lr(model, loader, start_lr=1e-5, end_lr=10.0, num_steps=60, training=TrainingConfig(device="cpu"))

    assert result.diverged and len(result.lrs) < 60  # stopped at divergence, before end_lr
    assert result.smoothed[-1] > 4 * min(result.smoothed) or not math.isfinite(result.losses[-1])
    assert 1e-4 < result.suggested_lr < 1.0 and result.suggested_lr <= result.best_lr
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert loader.state_dict() == position
    assert torch.equal(torch.get_rng_state(), rng_before) and random.getstate() == py_before
    # the minimum is read without the moving average's lag: near the lowest raw losses, before the climb
    lowest = result.lrs[int(np.argmin(result.losses))]
    assert lowest / 10 <= result.best_lr <= lowest * 10, (result.best_lr, lowest)
    assert result.best_lr < result.lrs[int(np.argmin(result.smoothed))]  # where the average still falls

    # rates too small to move the loss: no suggestion read from noise, and why
    flat = find_lr(model, loader, start_lr=1e-9, end_lr=1e-8, num_steps=30, training=TrainingConfig(device="cpu"))
    assert flat.suggested_lr is None and flat.no_suggestion.startswith("the loss did not fall between 1.0e-09")


def test_lr_find_cli_writes_the_plot_and_no_run_outputs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    config = write_tiny_experiment(tmp_path)
    plot = tmp_path / "lr.png"
    assert (
        main(
            [
                "lr-find",
                "--config",
                str(config),
                "--num-steps",
                "40",
                "--start-lr",
                "1e-5",
                "--output",
                str(plot),
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert 1e-5 <= out["suggested_lr"] <= 10 and out["plot"] == str(plot)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "run").exists()  # no checkpoints, no metrics, no config: no trace on the run


# ----------------------------------------------------------------------------------------------
# Sweep


def test_search_space_format_and_errors(tmp_path):
    from llm_trainer.tools.sweep import load_search_space, parse_search_space

    path = tmp_path / "space.yaml"
    path.write_text(
        "training.learning_rate: {type: float, low: 1e-4, high: 1e-2, log: true}\n"
        "model.n_layers: {type: int, low: 1, high: 3}\n"
        "model.activation: [gelu, relu]\n"
        "training.warmup_steps: 2\n"
    )
    params = {p.name: p for p in load_search_space(path)}
    assert params["training.learning_rate"].low == 1e-4 and params["training.learning_rate"].log
    grid = parse_search_space({"training.weight_decay": {"type": "float", "low": 0.0, "high": 0.3, "step": 0.1}})
    assert grid[0].step == 0.1  # 0.3 / 0.1 is 2.9999999999999996 in floats: a grid all the same
    assert params["model.n_layers"].kind == "int" and params["model.activation"].choices == ["gelu", "relu"]
    assert params["training.warmup_steps"].kind == "fixed" and params["training.warmup_steps"].value == 2
    for bad, message in [
        ({"learning_rate": {"type": "float", "low": 0, "high": 1}}, "section.key"),
        ({"training.learning_rate": {"type": "float", "low": 0, "high": 1, "log": True}}, "low > 0"),
        ({"training.learning_rate": {"type": "uniform", "low": 0, "high": 1}}, "type must be"),
        ({"training.learning_rate": {"type": "float", "low": 1}}, "needs low and high"),
        ({"training.learning_rate": {"type": "float", "low": 1, "high": 2, "scale": 3}}, "unknown field"),
        ({"training.weight_decay": {"type": "float", "low": 0, "high": 0.2, "step": 0}}, "step must be above 0"),
        ({"model.n_layers": {"type": "int", "low": 1, "high": 3, "step": 0}}, "step must be above 0"),
        ({"training.weight_decay": {"type": "float", "low": 0, "high": 0.2, "step": -0.1}}, "step must be above 0"),
        ({"training.weight_decay": {"type": "float", "low": 0, "high": 0.2, "step": 0.3}}, "does not divide"),
        ({"model.n_layers": {"type": "int", "low": 1, "high": 4, "step": 2}}, "does not divide"),
        ({"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": "false"}}, "true or false"),
        ({"training.learning_rate": {"type": "float", "low": 0, "high": 1, "choices": [1]}}, "choices is not a field"),
        ({"model.activation": {"type": "categorical", "choices": ["gelu"], "low": 1}}, "low is not a field"),
        ({"training.output_dir": ["a", "b"]}, "the sweep sets it for each trial"),
        ({"training.checkpoint_dir": "ckpt"}, "the sweep sets it for each trial"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_search_space(bad)


@pytest.mark.slow
def test_sweep_completes_prunes_and_resumes(tmp_path, capsys):
    optuna = pytest.importorskip("optuna")
    from llm_trainer.tools.status import run_status
    from llm_trainer.tools.sweep import run_sweep

    class PruneTrialOne(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return trial.number == 1

    config = write_tiny_experiment(tmp_path, max_steps=4, eval_steps=2, logging_steps=2)
    space = tmp_path / "space.yaml"
    space.write_text(
        "training.learning_rate: {type: float, low: 1e-3, high: 3e-2, log: true}\nmodel.n_layers: [1, 2]\n"
    )
    result = run_sweep(config, space, 3, pruner=PruneTrialOne())
    trials = result.study.trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert trials[1].intermediate_values == {
        2: pytest.approx(trials[1].intermediate_values[2])
    }  # pruned at its first eval
    assert result.root == tmp_path / "run" / "sweep" and (result.root / "study.db").is_file()
    for t in trials:
        run = result.root / f"trial-{t.number:04d}"
        assert t.user_attrs["output_dir"] == str(run) and (run / "metrics.jsonl").is_file()
        assert f"training.learning_rate={json.dumps(t.params['training.learning_rate'])}" in t.user_attrs["overrides"]
        # The trial trained with what Optuna suggested, and reported its own evaluation.
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["training"]["learning_rate"] == t.params["training.learning_rate"]
        assert saved["model"]["n_layers"] == t.params["model.n_layers"]
        rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
        peak_lr = max(r["lr"] for r in rows if r["kind"] == "train")
        assert peak_lr == pytest.approx(t.params["training.learning_rate"], rel=0.5)  # the schedule peaks at it
        if t.state.name == "COMPLETE":
            assert t.value == [r for r in rows if r["kind"] == "eval"][-1]["val_loss"]
    pruned_rows = (result.root / "trial-0001" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(r)["step"] <= 2 for r in pruned_rows)  # the pruned run stopped at its first evaluation
    assert run_status(str(result.root / "trial-0001"))["state"].startswith(
        "stopped early: pruned by the sweep at step 2 (val_loss "
    )  # not "interrupted", with a resume hint
    assert result.best.value == min(t.value for t in trials if t.state.name == "COMPLETE")

    again = run_sweep(config, space, 3)  # the same command again: nothing left to do
    assert again.ran == 0 and len(again.study.trials) == 3

    assert main(["sweep", "--config", str(config), "--search-space", str(space), "--trials", "4"]) == 0  # extend by one
    out = capsys.readouterr().out
    resumed = optuna.load_study(study_name="exp", storage=f"sqlite:///{tmp_path / 'run' / 'sweep' / 'study.db'}")
    assert [t.number for t in resumed.trials] == [0, 1, 2, 3]
    assert [t.params for t in resumed.trials[:3]] == [t.params for t in trials]  # earlier trials kept as they were
    assert "best trial" in out and "llm-trainer train --config" in out and "training.learning_rate=" in out
    assert len([line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]) == 4  # the table

    # a second study in the same folder numbers its trials on its own, in folders of its own name
    first = (result.root / "trial-0000" / "metrics.jsonl").read_bytes()
    other = run_sweep(config, space, 1, study_name="other")
    assert other.study.trials[0].user_attrs["output_dir"] == str(result.root / "other-trial-0000")
    assert (result.root / "other-trial-0000" / "metrics.jsonl").is_file()
    assert (result.root / "trial-0000" / "metrics.jsonl").read_bytes() == first

    # the study again with another search space, or another base config: refused, the study as it was
    narrower = tmp_path / "narrower.yaml"
    narrower.write_text("training.learning_rate: {type: float, low: 1e-3, high: 3e-3, log: true}\n")
    for argv in (["--search-space", str(narrower)], ["--search-space", str(space), "training.max_steps=6"]):
        assert main(["sweep", "--config", str(config), *argv, "--trials", "5"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "the study 'exp' in sqlite:///" in err and "was run with another" in err, err
    storage = f"sqlite:///{tmp_path / 'run' / 'sweep' / 'study.db'}"
    assert len(optuna.load_study(study_name="exp", storage=storage).trials) == 4


@pytest.mark.slow
def test_an_interrupted_sweep_stops_and_reruns_the_interrupted_trial(tmp_path):
    pytest.importorskip("optuna")
    import os
    import signal

    from llm_trainer.tools.sweep import SweepInterrupted, run_sweep
    from llm_trainer.train.trainer import Callback

    class CtrlC(Callback):
        def on_step_end(self, trainer, row):
            if row["step"] == 2:
                os.kill(os.getpid(), signal.SIGINT)  # the trainer saves at the end of this step and stops

    config = write_tiny_experiment(tmp_path, max_steps=4, eval_steps=2, logging_steps=2)
    space = tmp_path / "space.yaml"
    space.write_text("training.learning_rate: {type: float, low: 1e-3, high: 3e-2, log: true}\n")
    with pytest.raises(SweepInterrupted, match="rerun the same command to resume it from its last checkpoint"):
        run_sweep(config, space, 2, callbacks=[CtrlC()])
    resumed = run_sweep(config, space, 2)
    interrupted, going_on, new = resumed.study.trials
    assert [t.state.name for t in resumed.study.trials] == ["FAIL", "COMPLETE", "COMPLETE"] and resumed.ran == 2
    # the interrupted trial went on: its parameters, its folder, from the checkpoint the signal saved
    assert going_on.params == interrupted.params and going_on.user_attrs["resumes"] == 0
    folder = tmp_path / "run" / "sweep" / "trial-0000"
    assert going_on.user_attrs["output_dir"] == str(folder) and new.user_attrs["output_dir"].endswith("trial-0002")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4]  # steps 1-2, then 3-4 after the resume
    assert going_on.value == [r for r in rows if r["kind"] == "eval"][-1]["val_loss"]


@pytest.mark.slow
def test_a_trial_whose_process_was_killed_is_marked_failed_and_run_again(tmp_path, monkeypatch):
    """SIGKILL (the out-of-memory killer, a lost node) leaves no one to end the trial: it stops beating,
    and the next sweep marks it failed and runs it again, instead of listing it as running for ever."""
    optuna = pytest.importorskip("optuna")
    from llm_trainer.tools import sweep

    config = write_tiny_experiment(tmp_path, max_steps=4, eval_steps=2, logging_steps=2)
    space = tmp_path / "space.yaml"
    space.write_text("training.learning_rate: {type: float, low: 1e-3, high: 3e-2, log: true}\n")
    script = (
        "from llm_trainer.tools import sweep\n"
        "sweep.HEARTBEAT_S, sweep.STALE_AFTER_S = 1, 2\n"
        f"sweep.run_sweep({str(config)!r}, {str(space)!r}, 1)\n"
    )
    trial_metrics = tmp_path / "run" / "sweep" / "trial-0000" / "metrics.jsonl"
    kill9_when(script, trial_metrics.exists, "its first trial's training")
    storage = f"sqlite:///{tmp_path / 'run' / 'sweep' / 'study.db'}"
    assert [t.state.name for t in optuna.load_study(study_name="exp", storage=storage).trials] == ["RUNNING"]

    monkeypatch.setattr(sweep, "HEARTBEAT_S", 1)
    monkeypatch.setattr(sweep, "STALE_AFTER_S", 2)
    time.sleep(3)
    resumed = sweep.run_sweep(config, space, 1)
    assert [t.state.name for t in resumed.study.trials] == ["FAIL", "COMPLETE"] and resumed.ran == 1
    killed, going_on = resumed.study.trials
    assert "error" not in killed.user_attrs  # failed by the kill: not a finished trial
    assert going_on.params == killed.params and going_on.user_attrs["output_dir"] == str(trial_metrics.parent)


@pytest.mark.slow
def test_studies_beside_each_other_never_share_a_trial_folder(tmp_path, capsys):
    """Another config's study in the same sweep folder gets folders of its own name; a study started
    again after its study.db was removed is refused before it trains over the old trials; a config's
    checkpoint_dir holds each trial's checkpoints in a folder of its own; data without a validation
    split is refused before any trial."""
    optuna = pytest.importorskip("optuna")
    from llm_trainer.tools.sweep import run_sweep

    config = write_tiny_experiment(tmp_path, max_steps=2, eval_steps=2, logging_steps=2)
    space = tmp_path / "space.yaml"
    space.write_text("training.learning_rate: {type: float, low: 1e-3, high: 3e-2, log: true}\n")
    root = tmp_path / "sweeps"
    first = run_sweep(config, space, 1, output_dir=root)
    before = (root / "trial-0000" / "metrics.jsonl").read_bytes()

    wider = tmp_path / "exp_v3.yaml"  # the same folder, another config file: another study
    wider.write_text(config.read_text().replace("d_model: 16", "d_model: 32"))
    other = run_sweep(wider, space, 1, output_dir=root)
    assert other.study.trials[0].user_attrs["output_dir"] == str(root / "exp_v3-trial-0000")
    assert (root / "trial-0000" / "metrics.jsonl").read_bytes() == before
    assert [t.user_attrs["output_dir"] for t in first.study.trials] == [str(root / "trial-0000")]

    (root / "study.db").unlink()  # started over: its trial folders are not the new study's
    with pytest.raises(UsageError, match=r"trial-0000 holds a run this study did not start"):
        run_sweep(config, space, 1, output_dir=root)
    assert (root / "trial-0000" / "metrics.jsonl").read_bytes() == before
    assert not optuna.load_study(study_name="exp", storage=f"sqlite:///{root / 'study.db'}").trials

    shared = write_tiny_experiment(tmp_path / "c", max_steps=2, eval_steps=2, checkpoint_dir=str(tmp_path / "ckpt"))
    run_sweep(shared, space, 2, output_dir=tmp_path / "c" / "sweep")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["trial-0000", "trial-0001"]

    unvalidated = write_tiny_experiment(tmp_path / "d", max_steps=2)
    unvalidated.write_text(unvalidated.read_text().replace("validation_split: 0.2", "validation_split: 0.0"))
    with pytest.raises(UsageError, match="sweep needs validation data: set data.validation_split"):
        run_sweep(unvalidated, space, 1, output_dir=tmp_path / "d" / "sweep")
    assert not (tmp_path / "d" / "sweep" / "study.db").exists()


def test_sweep_rejects_unknown_keys_before_running(tmp_path):
    pytest.importorskip("optuna")
    from llm_trainer.tools.sweep import run_sweep

    config = write_tiny_experiment(tmp_path)
    space = tmp_path / "space.yaml"
    space.write_text("training.learning_rte: {type: float, low: 1e-3, high: 1e-2}\n")
    with pytest.raises(
        UsageError, match=r"^search space: unknown key training\.learning_rte; did you mean .*learning_rate"
    ):
        run_sweep(config, space, 2)  # the search space's key, not the command line's
    assert not (tmp_path / "run" / "sweep").exists()


@pytest.mark.parametrize(
    "space, refused",
    [
        ("training.optimizer: [adamw, lion]\n", "training.optimizer='lion'"),  # not the first choice
        ("training.adam_beta2: {type: float, low: 0.9, high: 1.5}\n", "training.adam_beta2=1.5"),  # a range's top
    ],
    ids=["a-later-choice", "the-top-of-a-range"],
)
def test_a_sweep_refuses_a_value_no_trial_could_train_with_before_its_first_trial(tmp_path, space, refused):
    pytest.importorskip("optuna")
    from llm_trainer.tools.sweep import run_sweep

    config = write_tiny_experiment(tmp_path)
    (tmp_path / "space.yaml").write_text(space)
    with pytest.raises(UsageError, match=re.escape(f"search space: {refused} is refused")) as error:
        run_sweep(config, tmp_path / "space.yaml", 3)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run" / "sweep").exists()


# ----------------------------------------------------------------------------------------------
# Registry


def test_registry_round_trip(trained_run, tmp_path):
    from llm_trainer.tools.registry import SQLiteRegistry, parse_ref

    run, summary = trained_run
    registry = SQLiteRegistry(tmp_path / "registry.db")
    v1 = registry.add(run, "tiny")
    v2 = registry.add(run, "tiny", description="second")
    other = registry.add(run, "other")
    assert (v1.version, v2.version, other.version) == (1, 2, 1)

    meta = json.loads((run / "checkpoints" / "best_model" / "meta.json").read_text())
    assert v1.data_fingerprint and v1.data_fingerprint == meta["config"]["data_fingerprint"]
    assert v1.tokenizer_fingerprint == hashlib.sha256((run / "tokenizer.json").read_bytes()).hexdigest()
    assert v1.metrics["val_loss"] == pytest.approx(summary["val_loss"]) and v1.metrics["step"] == 6
    assert v1.config["model"]["d_model"] == 16 and "data_fingerprint" not in v1.config
    assert v1.model_path == str((run / "checkpoints" / "best_model").resolve())
    assert v1.git_commit is None or len(v1.git_commit) == 40
    assert v1.export_path is None and v1.stage == "none"

    assert [(v.name, v.version) for v in registry.list()] == [("other", 1), ("tiny", 1), ("tiny", 2)]
    assert registry.get("tiny").version == 2 and registry.get("tiny", 1).description is None
    registry.promote("tiny", 1, "production")
    assert registry.get(*parse_ref("tiny:production")).version == 1
    registry.promote("tiny", 2, "production")
    assert registry.get("tiny", "production").version == 2 and registry.get("tiny", 1).stage == "archived"
    registry.promote("tiny", 1, "staging")
    assert registry.get("tiny", 2).stage == "production"  # another stage does not touch production
    with pytest.raises(UsageError, match="no model version tiny:9"):
        registry.get("tiny", 9)
    with pytest.raises(UsageError, match="model name"):
        registry.add(run, "bad:name")
    with pytest.raises(UsageError, match="not found"):
        registry.add(tmp_path / "nope", "tiny")


def test_a_version_whose_model_folder_changed_says_so(trained_run, tmp_path, capsys):
    """Versions point at folders: a run trained again into the same folder (--overwrite) leaves the
    version's metrics those of the weights it registered; show and list say the folder changed."""
    import shutil
    import sqlite3

    from llm_trainer.tools.registry import SQLiteRegistry, format_table

    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    db = tmp_path / "registry.db"
    version = SQLiteRegistry(db).add(run, "tiny")
    assert version.model_fingerprint and "changed" not in format_table([version])
    # the loss shown is that of the weights registered: best_model's own evaluation, not the run's last
    best_loss = json.loads((run / "checkpoints" / "best_model" / "meta.json").read_text())["metrics"]["val_loss"]
    assert version.model_path.endswith("best_model") and f" {best_loss:.4f} " in format_table([version])
    version.metrics["val_loss"] = best_loss + 1  # (the run's last evaluation, were it another)
    assert f" {best_loss:.4f} " in format_table([version])
    best, newest = run / "checkpoints" / "best_model", sorted((run / "checkpoints").glob("checkpoint-*"))[0]
    shutil.rmtree(best)
    shutil.copytree(newest, best)  # other weights where the registered ones were
    assert main(["registry", "show", "tiny:1", "--db", str(db)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["version"] == 1
    assert f"tiny:1: its model folder {best.resolve()} holds other weights" in captured.err
    assert "(changed since registered)" in format_table(SQLiteRegistry(db).list())
    assert main(["registry", "promote", "tiny:1", "--stage", "production", "--db", str(db)]) == 2
    assert "holds other weights" in capsys.readouterr().err  # what production would serve is not what was registered
    shutil.rmtree(best)
    assert main(["registry", "show", "tiny", "--db", str(db)]) == 0 and "is gone since" in capsys.readouterr().err
    assert "(gone)" in format_table(SQLiteRegistry(db).list())
    assert main(["registry", "list", "--json", "--db", str(db)]) == 0
    assert json.loads(capsys.readouterr().out)[0]["model_folder"] == "gone"
    assert main(["registry", "promote", "tiny:1", "--stage", "staging", "--db", str(db)]) == 2
    refused = capsys.readouterr().err
    assert "is gone since it was registered" in refused and "it is not promoted to staging" in refused
    assert main(["registry", "promote", "tiny:1", "--stage", "archived", "--db", str(db)]) == 0  # archiving it is fine
    assert capsys.readouterr().out.strip() == "tiny:1 -> archived"
    assert main(["registry", "list", "nosuch", "--db", str(db)]) == 0
    assert capsys.readouterr().out.strip() == "(no model named nosuch; registered: tiny)"
    assert main(["registry", "add", str(run), "--name", "tiny", "--export", str(tmp_path), "--db", str(db)]) == 2
    assert "is not an exported model folder" in capsys.readouterr().err

    old = tmp_path / "old.db"  # a registry written before versions recorded the fingerprint
    with sqlite3.connect(old) as connection:
        connection.execute(
            "CREATE TABLE versions (name TEXT NOT NULL, version INTEGER NOT NULL, stage TEXT NOT NULL DEFAULT 'none', "
            "created_at TEXT NOT NULL, run_dir TEXT, model_path TEXT, export_path TEXT, data_fingerprint TEXT, "
            "tokenizer_fingerprint TEXT, git_commit TEXT, description TEXT, metrics TEXT NOT NULL DEFAULT '{}', "
            "config TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (name, version))"
        )
        connection.execute("INSERT INTO versions (name, version, created_at) VALUES ('old', 1, '2026-01-01')")
    reopened = SQLiteRegistry(old)
    assert reopened.get("old", 1).model_fingerprint is None and reopened.add(trained_run[0], "old").version == 2


def test_registry_cli_round_trip(trained_run, tmp_path, monkeypatch, capsys):
    run, _ = trained_run
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text("{}")
    db = tmp_path / "reg.db"
    monkeypatch.setenv("LLM_TRAINER_REGISTRY", str(db))
    assert main(["registry", "add", str(run), "--name", "tiny", "--export", str(export)]) == 0
    assert "registered tiny:1" in capsys.readouterr().out and db.is_file()
    assert main(["registry", "add", str(run), "--name", "tiny", "--db", str(tmp_path / "elsewhere.db")]) == 0
    assert "registered tiny:1" in capsys.readouterr().out  # a different database numbers on its own
    assert main(["registry", "add", str(run), "--name", "tiny"]) == 0
    assert "registered tiny:2" in capsys.readouterr().out
    assert main(["registry", "promote", "tiny:1", "--stage", "production"]) == 0
    assert capsys.readouterr().out.strip() == "tiny:1 -> production"
    assert main(["registry", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["model", "version", "stage"]
    assert [line.split()[:3] for line in table[1:]] == [["tiny", "1", "production"], ["tiny", "2", "none"]]
    assert main(["registry", "show", "tiny:production"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 1 and shown["export_path"] == str(export.resolve()) and shown["data_fingerprint"]
    assert main(["registry", "show", "tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 2
    assert main(["registry", "show", "tiny:7"]) == 2
    assert "no model version tiny:7" in capsys.readouterr().err
    early = tmp_path / "early"  # a run that crashed before its first checkpoint: nothing to register yet
    early.mkdir()
    (early / "config.yaml").write_text((run / "config.yaml").read_text())
    (early / "metrics.jsonl").write_text("")
    assert main(["registry", "add", str(early), "--name", "early"]) == 2
    assert f"{early} holds no model yet (no checkpoint or best_model in" in capsys.readouterr().err
    assert main(["registry", "promote", "tiny", "--stage", "production"]) == 2
