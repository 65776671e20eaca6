"""The command line's own forms: overrides wherever they stand, what `train`/`eval` say they covered,
where `lr-find` writes, `registry add` of one run twice, and one-line refusals of `generate`/`export`."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import tiny_loaders, tiny_model, write_tiny_experiment
from llm_trainer.cli import main
from llm_trainer.config import TrainingConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.train.trainer import Trainer


def test_overrides_after_an_option_and_the_double_dash_dotted_form(tmp_path, capsys):
    """`--json training.batch_size=2` and litgpt/torchtitan's `--model.n_layers 3` are overrides too."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {d_model: 32, n_heads: 2, n_layers: 1, vocab_size: 100}\ndata: {data_files: [x]}\n")
    assert main(["estimate", "--config", str(path), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "estimate",
                "--config",
                str(path),
                "--json",
                "training.batch_size=2",
                "--model.n_layers",
                "3",
                "--model.d_ff=64",
            ]
        )
        == 0
    )
    three = json.loads(capsys.readouterr().out)
    assert three["parameters"] > one["parameters"] and three != one
    assert load_experiment(path, ["model.n_layers=3", "model.d_ff=64"]).model.n_layers == 3
    assert main(["estimate", "--config", str(path), "--json", "--bogus"]) == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --bogus; see llm-trainer estimate --help\n"


@pytest.mark.parametrize(
    "given, override",
    [
        (["--max_steps", "5"], "training.max_steps=5 (or --training.max_steps 5)"),
        (["--max_iters=100"], "training.max_steps=100 (or --training.max_steps 100)"),  # nanoGPT's name
        (["--learning-rate", "1e-3"], "training.learning_rate=1e-3"),
        (["--num_train_epochs", "1"], "training.num_epochs=1"),  # the Hugging Face Trainer's
        (["--hidden_size=64"], "model.d_model=64"),
        (["--text_column"], "data.text_column=VALUE"),
    ],
)
def test_a_setting_given_as_an_option_names_its_override_in_one_line(tmp_path, capsys, given, override):
    """`train --max_steps 5`, as the Hugging Face and nanoGPT scripts take settings: one line, exit 2,
    naming the override that sets it, instead of argparse's usage block."""
    path = write_tiny_experiment(tmp_path)
    assert main(["train", "--config", str(path), *given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {given[0]} is not an option of llm-trainer train"), err
    assert override in err
    assert not (tmp_path / "run").exists()


def test_training_evaluation_and_eval_command_say_what_they_covered(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_tiny_experiment(tmp_path, eval_max_batches=1, max_steps=4, eval_steps=2)
    assert main(["train", "--config", str(config)]) == 0
    err = capfd.readouterr().err
    periodic, last = [x for x in err.splitlines() if x.startswith("eval  step")]
    assert re.search(r"\(first 1 of (\d+) batches, [\d,]+ tokens: training.eval_max_batches\)", periodic), periodic
    total = int(re.search(r"first 1 of (\d+)", periodic).group(1))
    assert f"(all {total} batches, " in last  # the run's last evaluation covers the whole split
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    out = capfd.readouterr().out
    assert f"(all {total} batches, " in out and "of the run's validation split)" in out
    assert re.search(r"val_loss (\d+\.\d+)", last).group(1) == re.search(r"loss (\d+\.\d+)", out).group(1)  # one number


def test_lr_find_writes_its_plot_into_the_run_folder(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    config = write_tiny_experiment(tmp_path)
    assert main(["lr-find", "--config", str(config), "--num-steps", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(tmp_path / "run" / "lr_find.png")
    assert (tmp_path / "run" / "lr_find.png").is_file() and not (tmp_path / "lr_find.png").exists()
    for named, said in (("notes.txt", "must name a .png file"), ("plots/", "is a folder; give the file's path")):
        assert main(["lr-find", "--config", str(config), "--num-steps", "12", "--output", f"{tmp_path}/{named}"]) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "notes.txt").exists() and not (tmp_path / "plots").exists()
    mine = tmp_path / "precious.png"  # a file of the user's at --output: kept unless --overwrite
    mine.write_text("my precious")
    assert main(["lr-find", "--config", str(config), "--num-steps", "12", "--output", str(mine)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: --output {mine} exists; choose another file or pass --overwrite to replace it"
    )
    assert mine.read_text() == "my precious"
    assert main(["lr-find", "--config", str(config), "--num-steps", "12", "--output", str(mine), "--overwrite"]) == 0
    assert mine.read_bytes().startswith(b"\x89PNG")


def test_registry_add_of_the_same_run_twice_is_one_version(tmp_path, capsys):
    run = tmp_path / "run"
    train, val = tiny_loaders()
    config = TrainingConfig(max_steps=2, eval_steps=2, output_dir=str(run), device="cpu", progress_bar=False)
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    db = str(tmp_path / "reg.db")
    assert main(["registry", "add", str(run), "--name", "tiny", "--db", db]) == 0
    assert "registered tiny:1" in capsys.readouterr().out
    assert main(["registry", "add", str(run), "--name", "tiny", "--db", db]) == 0
    assert "already registered as tiny:1" in capsys.readouterr().out
    assert main(["registry", "list", "--db", db, "--json"]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)] == [1]


class Bigram(torch.nn.Module):
    """A user's own model: any module returning logits trains."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(61, 61)

    def forward(self, x):
        return self.table(x)


def test_generate_and_export_say_in_one_line_why_they_cannot_take_a_checkpoint(tmp_path, capsys):
    """The HF-style path takes any module; a checkpoint of one that is not our Transformer, or without a
    tokenizer it could save, gets a one-line reason from generate/export (exit 2)."""

    train, _ = tiny_loaders()
    for name, model, tokenizer, reason in [
        ("own", Bigram(), None, "holds a test_cli.Bigram model, not llm-trainer's Transformer"),
        ("notok", tiny_model(), object(), "has no tokenizer.json: the Trainer that saved it was given no tokenizer"),
    ]:
        config = {"max_steps": 1, "output_dir": str(tmp_path / name), "device": "cpu", "progress_bar": False}
        Trainer(model=model, tokenizer=tokenizer, config=config).train(train_dataloader=train)
        capsys.readouterr()
        checkpoint = str(tmp_path / name / "checkpoints" / "checkpoint-00000001")
        for command in (
            ["generate", "--checkpoint", checkpoint],
            ["export", "--checkpoint", checkpoint, "--output", "x"],
        ):
            if command[0] == "export":
                pytest.importorskip("transformers")
            assert main(command) == 2
            err = capsys.readouterr().err
            assert reason in err and err.count("\n") == 1, err


@pytest.mark.slow  # a short quickstart, end to end: training, evaluation, a sample and the offline tasks
def test_the_quickstart_runs_every_step_to_its_last_line(tmp_path, monkeypatch, capsys):
    """The README's first command: each of its steps calls another command with that command's own
    arguments, so a flag added to one (eval's --dtype) is never missing from the quickstart's call."""
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)
    assert main(["quickstart", "training.max_steps=4", "training.eval_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "sample:" in out and "downstream (lm-eval, the shipped offline tasks):" in out
    assert "llmt_choice" in out and "skipped:" not in out
    assert out.rstrip().splitlines()[-1] == "outputs in runs/quickstart/ (metrics.jsonl, config.yaml, checkpoints/)"


def test_a_consolidated_folder_cleans_text_as_its_run_did_and_is_checked(tmp_path, capsys):
    """`consolidate` writes what best_model holds: the run's config, so generate and eval --data clean
    text as the training text was cleaned (here NFKC: full-width letters read as ASCII ones), and
    checksums, so a damaged weight file is refused; --overwrite replaces an earlier consolidation."""
    config = write_tiny_experiment(tmp_path, max_steps=2, eval_steps=0)
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "data.unicode_normalization=NFKC"]) == 0
    out = tmp_path / "consolidated"
    assert main(["consolidate", "--checkpoint", str(run), "--output", str(out)]) == 0
    text = tmp_path / "wide.txt"
    text.write_text("ｔｈｅ ｑｕｉｃｋ ｆｏｘ\n", encoding="utf-8")
    capsys.readouterr()
    losses = []
    for folder in (run, out):
        assert main(["eval", "--checkpoint", str(folder), "--data", str(text), "--json"]) == 0
        losses.append(json.loads(capsys.readouterr().out))
    assert losses[0] == losses[1]
    assert main(["consolidate", "--checkpoint", str(run), "--output", str(out), "--overwrite"]) == 0
    weights = out / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--data", str(text)]) == 2
    assert "is unusable" in capsys.readouterr().err


def test_generate_never_ends_in_half_a_character(tmp_path, capsys):
    """A byte-level BPE model of Hindi text: --max_new_tokens cuts its continuation inside a character's
    bytes for some lengths, which decode as U+FFFD; what is printed ends at the last whole character."""
    from llm_trainer.api import load_for_inference
    from llm_trainer.generate import generate, without_cut_character

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text("नमस्ते दुनिया, यह एक परीक्षा है। मैं हिंदी में लिखता हूँ।\n" * 20, encoding="utf-8")
    config = write_tiny_experiment(tmp_path, max_steps=2, eval_steps=0)
    overrides = [f"data.data_files=[{corpus}]", "data.tokenizer=bpe", "data.tokenizer_vocab_size=300"]
    assert main(["train", "--config", str(config), *overrides]) == 0
    model, tokenizer, _ = load_for_inference(tmp_path / "run")
    # the continuation the model samples: byte tokens of Devanagari, cut by the limit inside characters
    whole = generate(model, tokenizer.encode("नमस्ते"), max_new_tokens=12, temperature=1.0, seed=3)
    cut = [n for n in range(1, 13) if tokenizer.decode(whole[:n]).count("\ufffd") == 1]
    assert cut and all(tokenizer.decode(whole[:n]).endswith("\ufffd") for n in cut)  # the case arises here
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "नमस्ते", "--seed", "3"]
    for n in range(1, 13):
        assert main([*argv, "--temperature", "1", "--max_new_tokens", str(n)]) == 0
        printed = capsys.readouterr().out.rstrip("\n")
        assert printed == "नमस्ते" + without_cut_character(tokenizer, whole[:n])
        if n in cut:  # one character's first part, at the end
            assert not printed.endswith("\ufffd")


def test_a_checkpoint_that_is_not_there_is_named_with_the_fix_of_its_command(tmp_path, capsys):
    """generate of a missing path says what it takes; a resume from one also names `latest`."""
    missing = tmp_path / "nowhere"
    assert main(["generate", "--checkpoint", str(missing), "--prompt", "a"]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"error: checkpoint {missing} not found; pass a checkpoint, best_model or output folder"
    config = write_tiny_experiment(tmp_path, max_steps=2)
    assert main(["train", "--config", str(config), f"training.resume_from_checkpoint={missing}"]) == 2
    assert capsys.readouterr().err.strip().endswith("(or resume_from_checkpoint=latest: this run's newest)")
