"""A new user's first hour: a second run into a finished folder, progress of long commands, messages
that say where a problem came from and what to write instead, and help texts that say what is true."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_loaders, tiny_model, write_tiny_experiment
from llm_trainer.checkpoint.model_folder import load_model_folder
from llm_trainer.cli import build_parser, main
from llm_trainer.config import TrainingConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.errors import UsageError
from llm_trainer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _subparser(name: str):
    parser = build_parser()
    return next(a for a in parser._actions if hasattr(a, "choices") and a.choices and name in a.choices).choices[name]


# -- a second run into a folder that holds one ---------------------------------------------------------------------


def test_a_second_train_into_a_run_folder_is_refused_then_resumes_or_starts_over(tmp_path, capfd):
    config = write_tiny_experiment(tmp_path, max_steps=4, save_steps=2)
    run = tmp_path / "run"
    assert main(["train", "--config", str(config)]) == 0
    before = (run / "metrics.jsonl").read_text()
    capfd.readouterr()

    assert main(["train", "--config", str(config)]) == 2  # a finished run: resuming it would train nothing
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert f"error: {run} holds a finished run (it ended at step 4); choose another training.output_dir" in err
    assert "--overwrite" in err and "raise training.max_steps and resume it" in err
    assert (run / "metrics.jsonl").read_text() == before  # nothing touched

    (run / "metrics.jsonl").write_text("".join(before.splitlines(keepends=True)[:-1]))  # as a kill leaves it
    assert main(["train", "--config", str(config)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert f"error: {run} already holds a run (metrics.jsonl, checkpoints/); resume it with " in err
    assert "training.resume_from_checkpoint=latest" in err and "training.output_dir" in err and "--overwrite" in err
    (run / "metrics.jsonl").write_text(before)

    resume_short = ["train", "--config", str(config), "training.resume_from_checkpoint=latest", "training.max_steps=3"]
    assert main(resume_short) == 2
    err = capfd.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert "checkpoint-00000004 is at step 4, past this run's last step (3)" in err
    assert "raise training.max_steps" in err
    assert (run / "metrics.jsonl").read_text() == before

    assert main(["train", "--config", str(config), "training.resume_from_checkpoint=latest"]) == 2  # nothing left
    err = capfd.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert f"error: {run} holds a finished run (it ended at step 4)" in err
    assert (run / "metrics.jsonl").read_text() == before  # its summary as the run wrote it

    best = run / "checkpoints" / "best_model"  # a model folder: weights without what a resume needs
    assert (
        main(["train", "--config", str(config), f"training.resume_from_checkpoint={best}", "training.max_steps=6"]) == 2
    )
    err = capfd.readouterr().err
    assert f"error: {best} is a model folder: it holds weights but no optimizer state" in err
    assert f"model.init_from={best}" in err and (run / "metrics.jsonl").read_text() == before

    # starting over is refused like any run with a mistake in it, before the earlier run is touched
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    for mistake in ("data.data_files=missing.txt", "data.max_length=999", "data.tokenizer=nope.json"):
        assert main(["train", "--config", str(config), "--overwrite", mistake]) == 2
        err = capfd.readouterr().err
        assert err.count("error:") == 1 and "Traceback" not in err and "starting over" not in err, err
        assert (run / "metrics.jsonl").read_text() == before
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints

    (run / "notes.txt").write_text("mine")  # a file of the user's own
    (run / "plots").mkdir(exist_ok=True)
    assert main(["train", "--config", str(config), "--overwrite", "training.max_steps=2"]) == 0
    err = capfd.readouterr().err
    assert f"overwrite: starting over in {run}; removed metrics.jsonl" in err
    rows = _rows(run)
    assert [r["kind"] for r in rows].count("summary") == 1 and rows[-1]["step"] == 2  # the new run alone
    assert (run / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-00000002"
    ]

    assert main(["train", "--config", str(config), "--overwrite", "--resume_from_checkpoint", "latest"]) == 2
    assert "pass one of them" in capfd.readouterr().err
    assert main(["train", "--config", str(config), "training.resume_from_checkpoint=latest"]) == 0


def test_a_run_killed_after_its_last_checkpoint_resumes_to_a_whole_summary_and_latest_set_right(tmp_path, capfd):
    """Killed after its last checkpoint was written but before `latest` named it and before the summary
    (the files exactly as such a kill leaves them): the resume ends the run with the summary the run
    would have written (its last evaluation's val_loss, that checkpoint) and points `latest` at it; a
    resume of that last checkpoint into another folder has nothing to train and says so."""
    config = write_tiny_experiment(tmp_path, max_steps=6, eval_steps=3, save_steps=3)
    assert main(["train", "--config", str(config)]) == 0
    run = tmp_path / "run"
    whole = _rows(run)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in whole[:-1]))  # no summary
    (run / "checkpoints" / "latest").write_text("checkpoint-00000003")  # not yet moved on
    capfd.readouterr()
    assert main(["train", "--config", str(config), "training.resume_from_checkpoint=latest"]) == 0
    err = capfd.readouterr().err
    assert "which `latest` names: this one was saved after it" in err and "Traceback" not in err
    summary = _rows(run)[-1]
    assert summary["kind"] == "summary" and summary["step"] == 6
    assert summary["val_loss"] == whole[-1]["val_loss"] and summary["perplexity"] == whole[-1]["perplexity"]
    assert summary["checkpoint"] == str(run / "checkpoints" / "checkpoint-00000006")
    assert (run / "checkpoints" / "latest").read_text() == "checkpoint-00000006"
    assert [r["kind"] for r in _rows(run)].count("summary") == 1

    last = run / "checkpoints" / "checkpoint-00000006"
    argv = ["train", "--config", str(config), f"training.resume_from_checkpoint={last}"]
    assert main([*argv, f"training.output_dir={tmp_path / 'other'}"]) == 2
    err = capfd.readouterr().err
    assert f"{last} is at step 6, this run's last step: there is nothing to train; raise training.max_steps" in err
    assert not (tmp_path / "other" / "metrics.jsonl").exists()


def test_init_from_keeps_the_folders_model_with_the_runs_dropout_and_names_what_does_not_apply(tmp_path, capfd):
    """model.init_from with a model section of its own: the weights are the folder's model, so its shape
    settings cannot apply (said in one warning, naming them); dropout, how the model runs, does."""
    import torch

    from llm_trainer.pipeline import prepare_run
    from llm_trainer.train.batch_size import auto_batch_size

    config = write_tiny_experiment(tmp_path, max_steps=2, eval_steps=0, save_steps=2)
    assert main(["train", "--config", str(config)]) == 0
    init = tmp_path / "run" / "checkpoints" / "checkpoint-00000002"
    capfd.readouterr()
    overrides = [f"model.init_from={init}", "model.dropout=0.1", "model.d_model=64", "model.n_layers=1"]
    experiment = load_experiment(config, [*overrides, f"training.output_dir={tmp_path / 'b'}"])
    prepared = prepare_run(experiment, pick_batch_size=auto_batch_size, local=True)
    err = capfd.readouterr().err
    assert f"model.init_from {init}: the model is the folder's, so model.d_model=64 here does not apply" in err
    assert "model.n_layers" not in err  # the folder's model has one layer too: nothing to say
    model = prepared.model
    assert model.config.d_model == 16 and model.config.dropout == 0.1 and prepared.run.experiment.model.dropout == 0.1
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}
    folder = load_model_folder(init)
    assert all(torch.equal(v, folder.state_dict()[k]) for k, v in model.state_dict().items())  # its weights


def test_a_checkpoint_folder_of_its_own_is_cleared_of_checkpoints_only(tmp_path):
    from llm_trainer.train.output_folder import check_output_folder, clear_run_files, run_traces

    checkpoints = tmp_path / "ckpt"
    (checkpoints / "checkpoint-00000003").mkdir(parents=True)
    (checkpoints / "latest").write_text("checkpoint-00000003")
    (checkpoints / "keep.txt").write_text("x")
    training = TrainingConfig(output_dir=str(tmp_path / "out"), checkpoint_dir=str(checkpoints))
    assert run_traces(training) == [f"{checkpoints}/"]
    with pytest.raises(UsageError, match="already holds a run"):
        check_output_folder(training, is_main=True)
    overwrite = TrainingConfig(**{**training.to_dict(), "overwrite_output_dir": True})
    check_output_folder(overwrite, is_main=True)  # accepted; nothing removed before the run starts
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-00000003", "keep.txt", "latest"]
    clear_run_files(overwrite)  # (at the start of the loop)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["keep.txt"]
    assert run_traces(training) == []


# -- progress: a bar on a terminal, lines in a log -------------------------------------------------------------------


def test_eval_and_lr_find_print_progress_lines_when_stderr_is_a_file(monkeypatch, capsys):
    from llm_trainer import logs
    from llm_trainer.tools.lr_finder import find_lr
    from llm_trainer.train.evaluate import evaluate

    monkeypatch.setattr(logs, "LINE_INTERVAL_S", 0.0)  # a line at every update
    _, val = tiny_loaders()
    model = tiny_model()
    evaluate(model, val, progress=True)
    find_lr(model, tiny_loaders()[0], num_steps=3, training=TrainingConfig(device="cpu"), progress=True)
    err = capsys.readouterr().err
    total = len(val)
    assert f"eval: 1/{total} batches ({1 / total:.0%}), " in err
    assert f"eval: {total}/{total} batches (100%)" in err
    assert re.search(r"lr-find: 3/3 steps \(100%\), \d+s, lr [\d.e+-]+, loss \d+\.\d{4}", err), err
    assert "\r" not in err  # no bar redraws in a file


def test_a_log_line_written_while_a_bar_is_shown_keeps_the_bar_whole(capsys):
    from llm_trainer.logs import Progress, log

    with Progress(5, "train", "step", bar=True) as bar:
        bar.update()
        log("checkpoint: removed checkpoint-00000001 (save_total_limit=1)")
        bar.update()
    err = capsys.readouterr().err
    pieces = re.split(r"[\r\n]", err)
    assert "checkpoint: removed checkpoint-00000001 (save_total_limit=1)" in pieces  # a line of its own


def test_the_early_stopping_line_follows_the_evaluation_that_decided_it(tmp_path, capfd):
    from llm_trainer.train.trainer import Trainer

    train, val = tiny_loaders()
    config = TrainingConfig(
        max_steps=10,
        eval_steps=1,
        early_stopping_patience=1,
        early_stopping_min_delta=100.0,  # no evaluation counts as an improvement
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        save_steps=0,
    )
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    lines = capfd.readouterr().err.splitlines()
    stops = [i for i, line in enumerate(lines) if line.startswith("early stopping:")]
    assert len(stops) == 1 and lines[stops[0] - 1].startswith("eval  step       2"), lines


def test_a_curriculum_says_when_each_stage_starts(capsys):
    from llm_trainer.config import CurriculumStage
    from llm_trainer.data.batches.curriculum import CurriculumLoader
    from llm_trainer.data.batches.loader import WindowRows

    rows = WindowRows(np.arange(800, dtype=np.uint16) % 61, 16)
    stages = [CurriculumStage(until_step=2, max_difficulty=9), CurriculumStage(until_step=3, max_difficulty=29)]
    loader = CurriculumLoader(rows, 2, difficulty=np.arange(len(rows), dtype=np.float64), stages=stages, seed=0)
    for _ in range(4):
        loader.next_batch()
    assert capsys.readouterr().err.splitlines() == [
        f"curriculum: stage 1 of 2 from step 0 to 2: 10 of {len(rows)} rows (difficulty <= 9)",
        f"curriculum: stage 2 of 2 from step 2 to 3: 30 of {len(rows)} rows (difficulty <= 29)",
        "curriculum: stages done at step 3; every row from here, in shuffled epochs",
    ]


# -- what is said, where ---------------------------------------------------------------------------------------------


def test_help_texts_presets_and_readme_make_no_time_claims_and_name_the_right_preset():
    overview = build_parser().format_help()
    assert "train the quickstart preset" in overview and "tiny preset" not in overview
    for path in [REPO / "README.md", *sorted((REPO / "src/llm_trainer/configs").glob("*.yaml"))]:
        text = path.read_text()
        assert not re.search(r"about (two|\d+) minutes|under a minute", text), path
    bench = (REPO / "bench" / "README.md").read_text()
    section = bench[bench.index("## How long things take here") :].split("\n## ", 1)[0]
    for command in ("llm-trainer quickstart", "python -m pytest", 'python -m pytest -m "not slow"'):
        row = next(line for line in section.splitlines() if f"`{command}`" in line)
        assert re.search(r"\| [\d.,]+ (s|min)", row), row  # a measured figure, in the one place figures are kept


def test_sweep_and_generate_help_document_their_options():
    sweep = _subparser("sweep").format_help()
    assert "llm_trainer.sweep" not in sweep
    assert "training.learning_rate: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}" in sweep
    assert "model.dropout:          [0.0, 0.1]" in (REPO / "README.md").read_text()
    generate = _subparser("generate")
    undocumented = [a.dest for a in generate._actions if a.help is None]
    assert undocumented == [], undocumented


def test_a_command_line_typo_is_blamed_on_the_command_line(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: {d_model: 32, n_heads: 2}\ndata: {data_files: [x]}\n")
    with pytest.raises(UsageError) as exc:
        load_experiment(path, ["training.learnig_rate=1e-3"])
    assert str(exc.value) == ("command line: unknown key training.learnig_rate; did you mean training.learning_rate?")
    with pytest.raises(UsageError, match="^command line: TrainingConfig.learning_rate must be a number, got 'abc'$"):
        load_experiment(path, ["training.lr=abc"])  # a wrong value too, in any spelling
    path.write_text("model: {d_model: 32, n_heads: 2}\ntraining: {learnig_rate: 1.0e-3}\ndata: {data_files: [x]}\n")
    with pytest.raises(UsageError, match=f"^{re.escape(str(path))}: unknown key training.learnig_rate"):
        load_experiment(path, ["training.max_steps=3"])
    path.write_text("model: {architecture: llama}\ndata: {data_files: [x]}\n")
    assert load_experiment(path, ["model.size=7B"]).model.d_model == 4096  # an alias is no typo


def test_data_sources_in_the_wrong_form_get_a_yaml_example(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {sources: corpus/}\n")
    with pytest.raises(UsageError) as exc:
        load_experiment(path)
    message = str(exc.value)
    assert "DataConfig.sources must be a list of sources, got 'corpus/'" in message
    assert "sources: [{name: web, data_files: 'web/*.jsonl', weight: 3}, {name: code, data_files: code/}]" in message
    assert "\n" not in message
    path.write_text("data: {sources: [a.txt, b.txt]}\n")  # a pipeline's data_sources: paths of one corpus
    with pytest.raises(UsageError, match=r"got paths \['a.txt', 'b.txt'\]; files of one corpus go in data.data_files"):
        load_experiment(path)


def test_keys_the_trainer_does_not_take_are_named_with_the_wandb_setting(tmp_path, capsys):
    from llm_trainer.train.trainer import _training_config

    _training_config({"project_name": "demo", "max_steps": 1})
    err = capsys.readouterr().err
    assert "config: project_name is not a TrainingConfig field; the Trainer does not use it" in err
    assert "WANDB_PROJECT" in err
    _training_config({"a": 1, "b": 2})
    assert "config: a, b are not TrainingConfig fields; the Trainer does not use them\n" in capsys.readouterr().err


def test_a_whole_experiment_given_to_the_trainer_trains_with_its_training_section(tmp_path, capsys):
    """`Trainer(config=experiment.__dict__)` (the Hindi trainer's `config=config.__dict__`), the
    ExperimentConfig itself, or a dict of sections: its training settings, not the defaults, and the
    other sections named once as not used."""
    from llm_trainer.config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
    from llm_trainer.train.trainer import _training_config

    training = TrainingConfig(learning_rate=5e-3, max_steps=3, output_dir=str(tmp_path / "run"))
    experiment = ExperimentConfig(model=ModelConfig(d_model=32, n_heads=2), training=training, data=DataConfig())
    as_dicts = {"model": {"d_model": 32}, "training": {"lr": 5e-3, "max_steps": 3, "output_dir": str(tmp_path / "run")}}
    for given in (experiment, experiment.__dict__, as_dicts):
        assert _training_config(given) == training
        err = capsys.readouterr().err
        assert "config: an experiment's sections; the Trainer takes its training section (model" in err, err


# -- vocabulary, eval's data, checkpoint paths -----------------------------------------------------------------------


def test_eval_from_another_folder_says_where_it_looked_for_the_runs_validation_data(tmp_path, monkeypatch, capsys):
    """A run whose data.cache_dir is relative (the default, data_cache): eval run from elsewhere finds no
    validation split there, and says which folder that was and why."""
    monkeypatch.chdir(tmp_path)
    config = write_tiny_experiment(tmp_path, max_steps=2, eval_steps=0, save_steps=2)
    assert main(["train", "--config", str(config), "data.cache_dir=cache_here"]) == 0
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0  # from the folder it trained in
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert (
        f"is not prepared in cache_here (relative to the current folder: {tmp_path / 'elsewhere' / 'cache_here'})"
        in err
    )
    assert "run the command from the folder the run trained in" in err


def test_eval_of_a_local_checkpoint_whose_validation_data_is_in_a_bucket_says_how_to_read_it(tmp_path, monkeypatch):
    """A run prepared into s3://..., its checkpoint copied here: eval reads a store only for a checkpoint
    in that bucket (a checkpoint's config must not lead it elsewhere), and says so, not "not prepared"."""
    from llm_trainer.api import eval_loader
    from llm_trainer.tokenizer import Tokenizer

    monkeypatch.chdir(tmp_path)
    experiment = {
        "data": {"data_files": ["x"], "cache_dir": "s3://bucket/prepared"},
        "data_fingerprint": "0123456789abcdef",
    }
    with pytest.raises(UsageError, match=r"was prepared in s3://bucket/prepared, and eval reads a store only for a "):
        eval_loader(
            tiny_model(), Tokenizer.build_char("abc"), experiment, batch_size=2, checkpoint=str(tmp_path / "ck")
        )


def test_unused_embedding_rows_jsonl_eval_data_and_the_latest_pointer(tmp_path, capfd):
    config = write_tiny_experiment(tmp_path, max_steps=2, eval_steps=2)
    assert main(["train", "--config", str(config), "model.vocab_size=512"]) == 0
    err = capfd.readouterr().err
    note = re.search(
        r"warning: model.vocab_size is 512 but the tokenizer has (\d+) tokens: the model predicts (\d+) ids", err
    )
    assert note and int(note.group(1)) + int(note.group(2)) == 512, err

    from llm_trainer.api import load_for_inference

    run = tmp_path / "run"
    _, tokenizer, _ = load_for_inference(run)
    texts = ["the cat sat on the mat.", "the dog sat on the mat number 3."]
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "latest"), "--data", str(data), "--json"]) == 0
    result = json.loads(capfd.readouterr().out)
    targets = sum(len(tokenizer.encode(t)) + 1 for t in texts) - 1  # each record, then end-of-text
    assert result["tokens"] == targets

    data.write_text(json.dumps({"body": texts[0]}) + "\n")
    assert main(["eval", "--checkpoint", str(run), "--data", str(data)]) == 2
    assert "has no 'text' field" in capfd.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--text-column", "body", "--json"]) == 0

    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    assert main(["generate", "--checkpoint", str(exported)]) == 2
    err = capfd.readouterr().err
    assert "is a transformers model folder (an export), not a checkpoint of ours to read" in err
    assert "pass the checkpoint, best_model or run folder it was exported from" in err
    # nor to resume from (it said: "incomplete: no meta.json (the save was interrupted)")
    resume = ["train", "--config", str(config), f"training.resume_from_checkpoint={exported}", "training.max_steps=4"]
    assert main(resume) == 2
    err = capfd.readouterr().err
    assert "is a transformers model folder (an export), not a checkpoint of ours to resume from" in err
    assert f"model.init_from={exported}" in err and "interrupted" not in err


# -- estimate ------------------------------------------------------------------------------------------------------


def test_estimate_takes_the_sharding_of_the_config_and_advises_the_fewest_devices(tmp_path, capsys):
    from llm_trainer.tools.estimate import estimate_report
    from llm_trainer.train.memory_estimate import GiB, estimate_memory

    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {d_model: 1024, n_heads: 16, n_layers: 24, vocab_size: 32000, max_seq_len: 256}\n"
        "training: {batch_size: 1}\ndistributed: {strategy: fsdp}\ndata: {data_files: [x]}\n"
    )
    assert main(["estimate", "--config", str(path), "--world-size", "8"]) == 0
    assert "world size 8, sharding fsdp" in capsys.readouterr().out

    experiment = load_experiment(path)
    model, training = experiment.model, experiment.training
    common = dict(seq_len=256, batch_size=1, device_type="cuda")
    zero1 = estimate_memory(model, training, world_size=8, sharding="zero1", **common).peak_bytes
    alone = estimate_memory(model, training, world_size=8, gradient_checkpointing=True, **common).peak_bytes
    device_gb = zero1 * 1.001 / GiB
    assert alone > zero1 * 1.001  # checkpointing alone does not fit; sharding over these 8 does
    report = estimate_report(experiment, world_size=8, sharding="none", device_memory_gb=device_gb)
    assert report["fits"] is False
    assert report["advice"] == "distributed: --world-size 8 --sharding zero1"


def test_a_runs_evaluations_show_progress_lines_in_a_log(tmp_path, monkeypatch, capfd):
    from llm_trainer import logs
    from llm_trainer.train.trainer import Trainer

    monkeypatch.setattr(logs, "LINE_INTERVAL_S", 0.0)
    train, val = tiny_loaders()
    config = TrainingConfig(max_steps=2, eval_steps=2, output_dir=str(tmp_path / "run"), device="cpu", save_steps=0)
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    err = capfd.readouterr().err
    assert f"eval: {len(val)}/{len(val)} batches (100%)" in err and "\r" not in err


# -- export and checkpoints: quiet, and files another user can read ---------------------------------------------------


def test_checkpoint_weights_have_the_mode_of_the_folders_other_files(tmp_path):
    from llm_trainer.train.trainer import Trainer

    train, val = tiny_loaders()
    config = TrainingConfig(max_steps=1, output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False)
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    folder = tmp_path / "run" / "checkpoints" / "checkpoint-00000001"
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert modes["model.safetensors"] == modes["optimizer.safetensors"] == modes["model_config.json"], modes


@pytest.mark.slow  # a child process, as a user runs it (DeepSpeed warns once per process)
def test_export_prints_one_line_and_writes_weights_like_its_other_files(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("transformers")
    from conftest import src_env

    config = write_tiny_experiment(tmp_path, max_steps=1, eval_steps=1)
    assert main(["train", "--config", str(config)]) == 0
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "llm_trainer", "export", "--checkpoint", str(tmp_path / "run"), "--output", str(out)],
        capture_output=True,
        text=True,
        env=src_env(),
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout == f"exported to {out}\n" and done.stderr == "", done.stderr
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_a_warmup_longer_than_the_run_is_said_at_the_start(tmp_path, capsys):
    """warmup_steps 2000 in a run of 6 steps (a training guide's warmup on a short try): the learning
    rate never reaches its peak, which the start says; a warmup inside the run says nothing."""
    config = write_tiny_experiment(tmp_path, warmup_steps=2000)
    assert main(["train", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "warning: training.warmup_steps (2,000) reaches past the run's last step (6): the learning rate" in err
    assert err.count("reaches past") == 1
    # a warmup as long as the run reaches the peak at its last step: nothing to say
    config = write_tiny_experiment(tmp_path, warmup_steps=6, output_dir=str(tmp_path / "run2"))
    assert main(["train", "--config", str(config)]) == 0
    assert "warmup_steps" not in capsys.readouterr().err
    lrs = [row["lr"] for row in _rows(tmp_path / "run2") if row.get("kind") == "train"]
    assert lrs[-1] == pytest.approx(3e-3)  # the peak, training.learning_rate


@pytest.mark.parametrize(
    "spelled", [{"eval_steps": "epoch", "save_steps": "epoch"}, {"eval_strategy": "epoch", "save_strategy": "epoch"}]
)
def test_evaluation_and_checkpoints_at_each_epoch_s_end(tmp_path, spelled):
    """`eval_steps: epoch` (the Hugging Face Trainer's `eval_strategy: epoch`): the seed documents' loop
    validates and keeps the best model after every epoch; so does ours, whatever the epoch's length."""
    train, val = tiny_loaders(n_tokens=1000)
    per_epoch = train.batches_per_epoch()
    config = {"output_dir": str(tmp_path / "run"), "logging_steps": 1, "learning_rate": 3e-3, **spelled}
    trainer = Trainer(model=tiny_model(), config={**config, "save_total_limit": None, "async_checkpoint": False})
    trainer.train(train_dataloader=train, val_dataloader=val, num_epochs=3)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("checkpoint-*"))
    assert saved == [f"checkpoint-{s:08d}" for s in (per_epoch, 2 * per_epoch, 3 * per_epoch)]
    assert (tmp_path / "run" / "checkpoints" / "best_model").is_dir()
    with pytest.raises(ValueError, match=r"save_strategy must be 'no', 'steps' or 'epoch', got 'best'"):
        TrainingConfig(save_strategy="best")


def test_a_config_kept_in_the_output_folder_is_never_replaced_by_the_run_s(tmp_path, capfd):
    """`train --config runs/x/config.yaml` with output_dir runs/x, a folder holding the user's own
    config.yaml (with their comments) or a tokenizer.json but no run: refused in one line, both files as
    they were; --overwrite replaces them, as it says."""
    import yaml

    made = write_tiny_experiment(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    values = yaml.safe_load(made.read_text())
    (run / "config.yaml").write_text("# my comments\n" + yaml.safe_dump(values))
    (run / "tokenizer.json").write_text('{"my": "notes"}')
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "tokenizer.json")}
    assert main(["train", "--config", str(run / "config.yaml")]) == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {run} holds config.yaml and tokenizer.json but no run"), last
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in run.iterdir() if p.name != ".lock") == ["config.yaml", "tokenizer.json"]
    assert main(["train", "--config", str(made), "--overwrite"]) == 0
    assert (run / "config.yaml").read_bytes() != before["config.yaml"] and (run / "metrics.jsonl").is_file()


def test_a_resume_from_an_earlier_checkpoint_says_which_later_ones_it_saves_over(tmp_path, capsys):
    config = write_tiny_experiment(tmp_path, save_steps=2, save_total_limit=None, async_checkpoint=False)
    assert main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    checkpoints = tmp_path / "run" / "checkpoints"
    earlier = checkpoints / "checkpoint-00000002"
    assert (
        main(["train", "--config", str(config), f"training.resume_from_checkpoint={earlier}", "training.max_steps=8"])
        == 0
    )
    err = capsys.readouterr().err
    assert (
        f"warning: resume: checkpoint-00000004, checkpoint-00000006 in {checkpoints} were saved after step 2; "
        "this run saves over them as it passes their steps" in err
    ), err
    assert (
        main(["train", "--config", str(config), "training.resume_from_checkpoint=latest", "training.max_steps=10"]) == 0
    )
    assert "saves over" not in capsys.readouterr().err  # from the newest: nothing later


def test_a_resume_on_other_data_says_which_settings_changed(tmp_path, capsys):
    """The checkpoint's data position names rows of the data it trained on: resumed on other data (here
    fewer documents) the run goes on, with one warning naming the changed settings; on the same data, none."""
    from conftest import write_tiny_experiment
    from llm_trainer import cli

    config = str(write_tiny_experiment(tmp_path, save_steps=3, eval_steps=0))
    assert cli.main(["train", "--config", config]) == 0
    capsys.readouterr()
    resume = ["train", "--config", config, "training.resume_from_checkpoint=latest", "training.max_steps=8"]
    assert cli.main([*resume, "data.max_documents=10"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "other data" in line]
    assert warned == [
        "warning: resume: the checkpoint trained on other data (data.max_documents); its data position names other "
        "rows here, so the run goes on over this data, not as it would have (resume with its data for an exact resume)"
    ]
    assert cli.main([*resume, "data.max_documents=10", "training.max_steps=10"]) == 0
    assert "other data" not in capsys.readouterr().err


def test_a_resume_with_another_architecture_names_the_settings_not_a_fused_layout(tmp_path, capsys):
    """A GPT-2 checkpoint resumed as LLaMA: its separate q, k, v and ungated `mlp.fc` are not taken for
    the old fused layout; the one line names the model settings that differ from the checkpoint's."""
    from conftest import write_tiny_experiment
    from llm_trainer import cli

    config = str(write_tiny_experiment(tmp_path, save_steps=3, eval_steps=0))
    assert cli.main(["train", "--config", config, "model.architecture=gpt2"]) == 0
    capsys.readouterr()
    resume = ["train", "--config", config, "training.resume_from_checkpoint=latest", "training.max_steps=8"]
    assert cli.main([*resume, "model.architecture=llama"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was trained with other model settings (" in last and "model.architecture: gpt2 -> llama" in last, last
    assert "one matrix" not in last
