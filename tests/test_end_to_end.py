"""The whole path through the CLI: prepare -> train -> eval -> generate, and the outputs a run leaves."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from llm_trainer import Callback


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "llm_trainer", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.slow
def test_prepare_train_eval_generate(tmp_path, corpus):
    config = {
        "model": {
            "architecture": "llama",
            "d_model": 32,
            "n_heads": 2,
            "n_kv_heads": 1,
            "n_layers": 2,
            "max_seq_len": 32,
        },
        "training": {
            "batch_size": 8,
            "max_steps": 40,
            "learning_rate": 3e-3,
            "warmup_steps": 5,
            "eval_steps": 20,
            "save_steps": 20,
            "logging_steps": 10,
            "output_dir": "run",
            "device": "cpu",
            "progress_bar": False,
        },
        "data": {"data_files": [str(corpus)], "tokenizer": "bpe", "tokenizer_vocab_size": 300, "validation_split": 0.2},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))

    prepared = _cli("prepare", "--config", "exp.yaml", cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    info = json.loads(prepared.stdout)
    assert info["splits"]["train"]["documents"] == 10 and info["splits"]["val"]["documents"] == 2

    trained = _cli("train", "--config", "exp.yaml", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert "reusing" in trained.stderr  # prepare's output was cached
    run = tmp_path / "run"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["vocab_size"] <= 300 and saved["model"]["norm"] == "rmsnorm"
    assert (run / "tokenizer.json").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    eval_rows = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40]
    assert [r["step"] for r in eval_rows] == [20, 40]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert rows[-1]["kind"] == "summary" and rows[-1]["val_loss"] == eval_rows[-1]["val_loss"]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == "checkpoint-00000040"
    assert (checkpoints / "best_model" / "model.safetensors").is_file()

    evaluated = _cli("eval", "--checkpoint", str(checkpoints / "checkpoint-00000040"), "--json", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads(evaluated.stdout)
    assert abs(result["loss"] - eval_rows[-1]["val_loss"]) < 1e-5  # the same number the run reported
    assert abs(result["perplexity"] - 2.718281828 ** result["loss"]) < 1e-3

    text_file = tmp_path / "probe.txt"
    text_file.write_text("the cat sat on the mat number 3.\n" * 5)
    on_file = json.loads(
        _cli("eval", "--checkpoint", str(run), "--data", str(text_file), "--json", cwd=tmp_path).stdout
    )
    assert on_file["tokens"] > 10 and on_file["loss"] < math.log(saved["model"]["vocab_size"]) - 1.0  # text it learned

    generated = _cli(
        "generate",
        "--checkpoint",
        str(checkpoints / "best_model"),
        "--prompt",
        "the cat",
        "--max_new_tokens",
        "12",
        "--temperature",
        "0",
        cwd=tmp_path,
    )
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("the cat") and len(generated.stdout.strip()) > len("the cat")
    again = _cli(
        "generate",
        "--checkpoint",
        str(checkpoints / "best_model"),
        "--prompt",
        "the cat",
        "--max_new_tokens",
        "12",
        "--temperature",
        "0",
        cwd=tmp_path,
    )
    assert again.stdout == generated.stdout


def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    """In process (tests/test_config.py runs the same path once as a real subprocess)."""
    from llm_trainer import cli

    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> tuple[int, str]:
        code = cli.main(list(argv))
        return code, capsys.readouterr().err

    code, err = run("eval", "--checkpoint", str(tmp_path / "nope"))
    assert code == 2 and err.startswith("error:") and "Traceback" not in err
    (tmp_path / "bad.yaml").write_text("data:\n  data_files: [missing.txt]\n")
    code, err = run("train", "--config", "bad.yaml")
    assert code == 2 and "missing.txt not found" in err and "Traceback" not in err
    assert not (tmp_path / "output").exists()  # nothing half-written
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "bin.yaml").write_text(f"data:\n  data_files: [{binary}]\n")
    code, err = run("prepare", "--config", "bin.yaml")
    assert code == 2 and "binary" in err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    (tmp_path / "latin.yaml").write_text(f"data:\n  data_files: [{latin}]\n")
    code, err = run("prepare", "--config", "latin.yaml")
    assert code == 2 and "not UTF-8" in err


def test_document_mask_trains_and_evaluates(tmp_path, corpus):
    """With data.document_mask the loader yields document ids and the loop passes them to the model."""
    from llm_trainer import load_experiment, train

    (tmp_path / "exp.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"architecture": "llama", "d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 32},
                "training": {
                    "batch_size": 4,
                    "max_steps": 30,
                    "learning_rate": 1e-2,
                    "eval_steps": 15,
                    "save_steps": 0,
                    "device": "cpu",
                    "progress_bar": False,
                    "report_to": ["jsonl"],
                    "output_dir": str(tmp_path / "run"),
                },
                "data": {
                    "data_files": [str(corpus)],
                    "tokenizer": "char",
                    "max_length": 32,
                    "document_mask": True,
                    "packing_strategy": "first_fit",
                    "cache_dir": str(tmp_path / "cache"),
                },
            }
        )
    )
    seen = []

    class RecordDocIds(Callback):
        def on_train_begin(self, trainer):
            trainer.model.register_forward_pre_hook(
                lambda module, args, kwargs: seen.append(kwargs.get("doc_ids")), with_kwargs=True
            )

    experiment = load_experiment(tmp_path / "exp.yaml")
    summary = train(experiment, callbacks=[RecordDocIds()])
    vocab = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["vocab_size"]
    assert summary["step"] == 30 and summary["val_loss"] < math.log(vocab) - 0.5  # learned: below a uniform guess
    # Every forward, training and evaluation, got the (B, T) document ids, and packed rows hold several documents.
    assert seen and all(ids is not None and ids.shape[1] == 32 for ids in seen)
    assert max(int(ids.max()) for ids in seen) >= 1


@pytest.mark.slow
def test_eval_refuses_a_corrupt_checkpoint(tmp_path, corpus):
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
        "training": {
            "batch_size": 4,
            "max_steps": 2,
            "save_steps": 0,
            "eval_steps": 0,
            "output_dir": "run",
            "device": "cpu",
            "progress_bar": False,
            "report_to": [],
        },
        "data": {"data_files": [str(corpus)], "tokenizer": "char"},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(config))
    assert _cli("train", "--config", "exp.yaml", cwd=tmp_path).returncode == 0
    weights = tmp_path / "run" / "checkpoints" / "checkpoint-00000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # flip a bit inside the tensor bytes
    weights.write_bytes(bytes(data))
    result = _cli("eval", "--checkpoint", str(weights.parent), "--json", cwd=tmp_path)
    assert result.returncode == 2 and "model.safetensors" in result.stderr and "Traceback" not in result.stderr
