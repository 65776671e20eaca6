"""The sweep of bad command-line and config inputs: each is refused in one line (`error: ...`), exit
status 2, no traceback, through `cli.main` in this process. Fast: tiny model folders written
directly, no training."""

import errno
import gzip
import json
import lzma
import os
from pathlib import Path

import pytest

from conftest import tiny_model
from llm_trainer import cli

READ_ONLY = Path("/sys/kernel")  # a folder even root cannot create files in


def read_only_folder() -> Path:
    if not READ_ONLY.is_dir() or (os.access(READ_ONLY, os.W_OK) and os.getuid() != 0):
        pytest.skip("needs a folder this user cannot write")
    return READ_ONLY


def model_folder(root: Path, *, meta_config=None) -> Path:
    """A one-layer model folder with a char tokenizer; with `meta_config`, a best_model-like folder whose
    meta.json (checksums and all) records that experiment config."""
    from llm_trainer.checkpoint.durable import text_writer, write_folder_atomically
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.tokenizer import Tokenizer

    folder = root / ("best" if meta_config is not None else "model")
    tokenizer = Tokenizer.build_char(["the cat sat on the mat"])
    model = tiny_model()
    if meta_config is None:
        save_model_folder(model, folder)
        tokenizer.save(folder)
        return folder
    writers = [lambda tmp: save_model_folder(model, tmp), text_writer("tokenizer.json", tokenizer.to_json())]
    return write_folder_atomically(folder, writers, {"kind": "best_model", "config": meta_config})


def model_config_file(root: Path, text: str) -> Path:
    folder = model_folder(root)
    (folder / "model_config.json").write_text(text)
    return folder


def run_folder(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "tokens_seen": 64 * s} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def text_file(root: Path, name: str, text: str) -> Path:
    (root / name).write_text(text)
    return root / name


def packed_file(root: Path, name: str, data: bytes) -> Path:
    (root / name).write_bytes(data)
    return root / name


def sweep(root: Path, *options: str) -> list[str]:
    """`llm-trainer sweep` of one trial over a one-parameter search space, with `options`."""
    return ["sweep", *TINY, "--search-space", str(text_file(root, "ss.yaml", SPACE)), "--trials", "1", *options]


def deep_json(levels: int = 100_000) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip("abcdefgh", "bcdefghi")
)
# Merge keys that copy the same mapping eight times, eleven levels deep: 8**11 entries where each merge is
# copied (PyYAML up to 6.0.3), a dozen small mappings where repeated merges collapse (6.0.4 and later).
REPEATED_MERGES = "a0: &a0 {k: 1, j: 2}\n" + "".join(
    f"a{i}: &a{i} {{<<: [{', '.join([f'*a{i - 1}'] * 8)}], x{i}: 1}}\n" for i in range(1, 12)
)
# Six mappings of 2,000 keys each, each merging the one before: the last holds 12,000 distinct entries in any
# PyYAML version, over the merge limit.
MERGES = "".join(
    f"a{i}: &a{i} {{{'<<: *a' + str(i - 1) + ', ' if i else ''}{', '.join(f'k{i}_{j}: 1' for j in range(2000))}}}\n"
    for i in range(6)
)

TINY = ["--config", "tiny"]
SPACE = "training.learning_rate: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}\n"
DEEP_RECORD = '{"text": ' + deep_json() + "}\n"

# (name, argv built from tmp_path, a fragment of the one error line)
CASES = [
    ("estimate world size 0", lambda t: ["estimate", *TINY, "--world-size", "0"], "--world-size must be at least 1"),
    ("estimate world size -2", lambda t: ["estimate", *TINY, "--world-size", "-2"], "--world-size must be at least 1"),
    ("estimate vocab 0", lambda t: ["estimate", *TINY, "--vocab-size", "0"], "--vocab-size must be at least 1"),
    ("estimate batch 0", lambda t: ["estimate", *TINY, "--batch-size", "0"], "--batch-size must be at least 1"),
    ("estimate memory -1", lambda t: ["estimate", *TINY, "--device-memory", "-1"], "--device-memory must be"),
    ("estimate memory nan", lambda t: ["estimate", *TINY, "--device-memory", "nan"], "--device-memory must be"),
    ("estimate d_model 1e12", lambda t: ["estimate", *TINY, "model.d_model=1e12"], "d_model"),
    ("estimate d_model 10**12", lambda t: ["estimate", *TINY, f"model.d_model={10**12}"], "over the limit"),
    ("estimate n_layers 10**9", lambda t: ["estimate", *TINY, f"model.n_layers={10**9}"], "n_layers"),
    (
        "learning rate 1e308",
        lambda t: ["estimate", *TINY, "training.learning_rate=1e308"],
        "learning_rate must be at most",
    ),
    ("lr-find 0 steps", lambda t: ["lr-find", *TINY, "--num-steps", "0"], "num_steps must be at least 2"),
    ("lr-find start 0", lambda t: ["lr-find", *TINY, "--start-lr", "0"], "0 < start_lr < end_lr"),
    (
        "lr-find start > end",
        lambda t: ["lr-find", *TINY, "--start-lr", "1", "--end-lr", "0.1"],
        "0 < start_lr < end_lr",
    ),
    ("lr-find end nan", lambda t: ["lr-find", *TINY, "--end-lr", "nan"], "0 < start_lr < end_lr"),
    ("lr-find output a folder", lambda t: ["lr-find", *TINY, "--output", str(t)], "is a folder"),
    (
        "lr-find read-only folder",
        lambda t: ["lr-find", *TINY, "--output", str(read_only_folder() / "lr.png")],
        "cannot write into",
    ),
    (
        "plot output a file",
        lambda t: ["plot", str(run_folder(t)), "--output", str(text_file(t, "f.png", "x"))],
        "is a file",
    ),
    (
        "plot read-only folder",
        lambda t: ["plot", str(run_folder(t)), "--output", str(read_only_folder() / "plots")],
        "cannot write into",
    ),
    (
        "consolidate read-only folder",
        lambda t: ["consolidate", "--checkpoint", str(model_folder(t)), "--output", str(read_only_folder() / "m")],
        "cannot write into",
    ),
    (
        "export read-only folder",
        lambda t: ["export", "--checkpoint", str(model_folder(t)), "--output", str(read_only_folder() / "m")],
        "cannot write into",
    ),
    ("deep JSON config", lambda t: ["estimate", "--config", str(text_file(t, "c.json", deep_json()))], "nested more"),
    (
        "deep YAML config",
        lambda t: ["estimate", "--config", str(text_file(t, "c.yaml", "a: " + "[" * 10_000 + "]" * 10_000))],
        "nested more",
    ),
    (
        "nested YAML config",
        lambda t: ["estimate", "--config", str(text_file(t, "c.yaml", "a: " + "[" * 80 + "]" * 80))],
        "nested more",
    ),
    ("YAML aliases", lambda t: ["estimate", "--config", str(text_file(t, "c.yaml", LAUGHS))], "expands to more than"),
    ("YAML merge keys", lambda t: ["estimate", "--config", str(text_file(t, "c.yaml", MERGES))], "merges more than"),
    ("deep override", lambda t: ["estimate", *TINY, "model.d_model=" + "[" * 100 + "]" * 100], "nested more"),
    (
        "deep model_config.json",
        lambda t: ["generate", "--checkpoint", str(model_config_file(t, deep_json()))],
        "nested more",
    ),
    (
        "model_config.json with a billion layers",
        lambda t: [
            "generate",
            "--checkpoint",
            str(model_config_file(t, json.dumps({"vocab_size": 61, "d_model": 16, "n_heads": 2, "n_layers": 10**9}))),
        ],
        "n_layers (1,000,000,000) is over the limit",
    ),
    (
        "model_config.json larger than this machine",
        lambda t: [
            "generate",
            "--checkpoint",
            str(
                model_config_file(t, json.dumps({"vocab_size": 61, "d_model": 16384, "n_heads": 16, "n_layers": 4000}))
            ),
        ],
        "more than this machine's",
    ),
    (
        "meta.json config.training a string",
        lambda t: [
            "eval",
            "--checkpoint",
            str(model_folder(t, meta_config={"training": "fast"})),
            "--data",
            str(text_file(t, "v.txt", "the cat sat on the mat " * 20)),
        ],
        "config.training is not a mapping",
    ),
    (
        "meta.json batch_size a string",
        lambda t: [
            "eval",
            "--checkpoint",
            str(model_folder(t, meta_config={"training": {"batch_size": "eight"}})),
            "--data",
            str(text_file(t, "v.txt", "the cat sat on the mat " * 20)),
        ],
        "not a positive integer",
    ),
    (
        "meta.json batch_size negative",
        lambda t: [
            "eval",
            "--checkpoint",
            str(model_folder(t, meta_config={"training": {"batch_size": -3}})),
            "--data",
            str(text_file(t, "v.txt", "the cat sat on the mat " * 20)),
        ],
        "not a positive integer",
    ),
    (
        "eval --data a folder",
        lambda t: ["eval", "--checkpoint", str(model_folder(t)), "--data", str(t)],
        "is a folder; name one file of text, JSONL or Parquet",
    ),
    (
        "eval --data a binary file",
        lambda t: ["eval", "--checkpoint", str(model_folder(t)), "--data", str(text_file(t, "b.dat", "GIF\x00\x01"))],
        "looks like a binary file, not text; pass a text file to --data",
    ),
    (
        "eval --data JSONL with a bad record: fixed in the file (eval has no data.on_bad_input)",
        lambda t: [
            "eval",
            "--checkpoint",
            str(model_folder(t)),
            "--data",
            str(text_file(t, "r.jsonl", '{"text": "hello world"}\n' * 3 + '{"other": "x"}\n')),
        ],
        "r.jsonl:4 has no 'text' field (its fields: 'other'); earlier records have it: fix or remove this one",
    ),
    (
        "eval --data JSONL without the text field: named by its flag",
        lambda t: [
            "eval",
            "--checkpoint",
            str(model_folder(t)),
            "--data",
            str(text_file(t, "r.jsonl", '{"body": "hello world"}\n')),
        ],
        "r.jsonl:1 has no 'text' field (its fields: 'body'); pass --text-column NAME",
    ),
    (
        "eval --data a URL",
        lambda t: ["eval", "--checkpoint", str(model_folder(t)), "--data", "s3://bucket/held_out.txt"],
        "--data s3://bucket/held_out.txt is a URL; --data takes a local file: copy it here first",
    ),
    (
        "eval --data an archive",
        lambda t: ["eval", "--checkpoint", str(model_folder(t)), "--data", str(packed_file(t, "texts.tar.gz", b"x"))],
        "texts.tar.gz is an archive of files; unpack it and pass one of its files",
    ),
    (
        "eval --data a damaged compressed file",
        lambda t: [
            "eval",
            "--checkpoint",
            str(model_folder(t)),
            "--data",
            str(packed_file(t, "v.txt.gz", gzip.compress(b"the cat sat on the mat " * 20)[:-9])),
        ],
        "v.txt.gz could not be decompressed",
    ),
    (
        "eval --checkpoint a file",
        lambda t: ["eval", "--checkpoint", str(text_file(t, "notes.txt", "mine"))],
        "notes.txt is a file, not a checkpoint folder",
    ),
    ("status of a file", lambda t: ["status", str(text_file(t, "n.txt", "x"))], "is a file, not a folder"),
    (
        "learning rate under the preset's min_lr",
        lambda t: ["estimate", "--config", "gpt2-small", "training.learning_rate=1e-12"],
        "command line: TrainingConfig.min_lr (6e-05) must be between 0 and TrainingConfig.learning_rate (1e-12); set "
        "training.min_lr with it",
    ),
    (
        "sweep storage of an unknown kind",
        lambda t: sweep(t, "--storage", "foo://x", "--output-dir", str(t / "sw")),
        "--storage foo://x cannot hold the study (",
    ),
    (
        "sweep output folder that is a file",
        lambda t: sweep(t, "--output-dir", str(text_file(t, "f.txt", "x"))),
        "--output-dir",
    ),
    ("plot of a folder that is not there", lambda t: ["plot", str(t / "nope")], "nope not found; pass a run's"),
    ("plot of a folder without a run", lambda t: ["plot", str(t)], "has no metrics.jsonl: it holds no run"),
    ("unknown spike policy", lambda t: ["estimate", *TINY, "training.on_loss_spike=rewnd"], "on_loss_spike must be"),
    (
        "profile steps after the run",
        lambda t: ["estimate", *TINY, "training.max_steps=10", "training.profile_steps=[20,25]"],
        "ends after the run's last step",
    ),
    ("profile steps reversed", lambda t: ["estimate", *TINY, "training.profile_steps=[5,3]"], "1 <= first <= last"),
    (
        "spike window of 10**10 steps",
        lambda t: ["estimate", *TINY, "training.on_loss_spike=warn", f"training.loss_spike_window={10**10}"],
        "loss_spike_window (10,000,000,000) is over the limit",
    ),
    (
        "rewind without checkpoints",
        lambda t: ["estimate", *TINY, "training.on_loss_spike=rewind", "training.save_steps=0"],
        "no periodic checkpoints",
    ),
    (
        "deep JSONL line",
        lambda t: ["prepare", *TINY, f"data.data_files={text_file(t, 'd.jsonl', DEEP_RECORD)}"],
        "nested too deep",
    ),
]


@pytest.mark.parametrize("build, fragment", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_and_exit_2(build, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # presets' relative folders (data cache, runs) land here
    argv = build(tmp_path)
    if argv[0] == "export":
        pytest.importorskip("transformers")
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines, err
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    assert code == 2, err
    assert fragment in lines[-1], lines[-1]


def test_eval_datas_messages_name_no_setting_eval_does_not_take(tmp_path, capsys):
    """`eval --data` reads records as `prepare` does, but takes no data.* settings: its fixes are its own."""
    records = {"bad_record.jsonl": '{"text": "hello world"}\n{"other": "x"}\n', "body.jsonl": '{"body": "hi"}\n'}
    records["latin.jsonl"] = b'{"text": "caf\xe9"}\n'
    for name, content in records.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        assert cli.main(["eval", "--checkpoint", str(model_folder(tmp_path)), "--data", str(path)]) == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert name in message and "data." not in message, message


def test_eval_data_reads_a_compressed_file_as_the_file_uncompressed(tmp_path, capsys):
    folder = model_folder(tmp_path)
    text = "the cat sat on the mat\r\n  the mat sat on the cat  \n\n\n" * 30
    plain = packed_file(tmp_path, "held-out.txt", text.encode())
    packed = packed_file(tmp_path, "held-out.txt.xz", lzma.compress(text.encode()))
    scores = []
    for data in (plain, packed):
        assert cli.main(["eval", "--checkpoint", str(folder), "--data", str(data), "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[0]["tokens"] > 0 and scores[1] == scores[0]


def test_repeated_yaml_merges_are_one_line_whatever_the_pyyaml_version(tmp_path, capsys):
    """Where PyYAML copies each merge, the merge limit refuses the document before it grows; where it collapses
    repeated merges, the document is a dozen small unknown sections. Either way: one line, exit 2."""
    code = cli.main(["estimate", "--config", str(text_file(tmp_path, "c.yaml", REPEATED_MERGES))])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and code == 2, err
    assert "merges more than" in lines[0] or "unknown section 'a11'" in lines[0], lines[0]


def test_meta_json_nested_too_deep_is_a_corrupt_folder(tmp_path, capsys):
    folder = model_folder(tmp_path, meta_config={})
    (folder / "meta.json").write_text(deep_json())
    code = cli.main(["generate", "--checkpoint", str(folder), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "meta.json" in err.strip().splitlines()[-1], err


def test_export_on_a_full_disk_leaves_the_target_as_it_was(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from llm_trainer.hf import interop

    source = model_folder(tmp_path)
    target = tmp_path / "export"
    assert cli.main(["export", "--checkpoint", str(source), "--output", str(target)]) == 0
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(interop, "_model_card", full)  # the last file the export writes
    code = cli.main(["export", "--checkpoint", str(source), "--output", str(target), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "disk full" in err.strip().splitlines()[-1], err
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_registry_listing_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "nonexistent" / "x"
    assert cli.main(["registry", "list", "--db", f"mlflow:{missing}"]) == 0
    assert cli.main(["registry", "list", "--db", str(missing / "registry.db")]) == 0
    assert not (tmp_path / "nonexistent").exists()
    assert "no models registered" in capsys.readouterr().out


def test_a_registry_never_writes_into_another_program_s_database(tmp_path, capsys):
    """`registry list --db study.db` (a sweep's Optuna file) or `add` into it: refused in one line, the
    file byte for byte as it was; a folder given as --db says so."""
    import sqlite3

    foreign = tmp_path / "study.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE studies (study_id INTEGER PRIMARY KEY, study_name TEXT)")
        db.execute("INSERT INTO studies VALUES (1, 'mine')")
    before = foreign.read_bytes()
    assert cli.main(["registry", "list", "--db", str(foreign)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: registry {foreign} is another program's database (its tables: studies); give the registry a "
        "file of its own with --db"
    )
    assert foreign.read_bytes() == before
    assert cli.main(["registry", "list", "--db", str(tmp_path)]) == 2
    assert "is a folder; --db takes the path of a file" in capsys.readouterr().err


def test_a_full_disk_anywhere_in_a_command_is_one_line(tmp_path, capsys, monkeypatch):
    from llm_trainer.checkpoint import model_folder as folders

    source = model_folder(tmp_path)

    def full(*args, **kwargs):  # what safetensors raises when the disk fills under it
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(folders, "save_model_folder", full)
    # consolidate writes inside the folder it builds; export first writes a model folder of its own
    for command in ("consolidate", "export"):
        if command == "export":
            pytest.importorskip("transformers")
        code = cli.main([command, "--checkpoint", str(source), "--output", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
        assert "disk full" in err and not (tmp_path / "out").exists()


def test_a_one_line_error_quotes_the_first_line_of_a_failure_that_says_something():
    """`errors.first_line`, the rule every one-line error quotes a failure below it by: a message may open
    with blank or indented lines (a library's), or be empty (its type then)."""
    from llm_trainer.errors import first_line

    failure = RuntimeError("\n   I/O error: No space left on device (os error 28)\n  at serialize()")
    assert first_line(failure) == "I/O error: No space left on device (os error 28)"
    assert first_line(failure, 9) == "I/O error"
    assert first_line(ValueError()) == first_line(ValueError(" \n ")) == "ValueError"
    assert first_line(ValueError("x" * 300)) == "x" * 200 and first_line(ValueError("x" * 300), None) == "x" * 300


@pytest.mark.parametrize(
    "env, overrides, message",
    [
        ({"WORLD_SIZE": "abc"}, [], "the environment variable WORLD_SIZE='abc' is not a count"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, [], "RANK=1 with WORLD_SIZE=1: ranks count from 0 below the world size"),
        ({"WORLD_SIZE": "2"}, [], "WORLD_SIZE=2 is set but MASTER_ADDR is not, so no launcher started this process"),
        ({}, ["training.seed=-1"], "TrainingConfig.seed must be from 0 to 4,294,967,295, got -1"),
        ({}, ["data.seed=18446744073709551617"], "DataConfig.seed must be from 0 to 4,294,967,295"),
        ({}, ["training.device=mps"], "training.device=mps but MPS (Apple's GPU) is not available here"),
    ],
)
def test_a_stale_launcher_variable_a_seed_or_a_device_not_here_is_one_line(
    tmp_path, capsys, monkeypatch, env, overrides, message
):
    import torch

    from conftest import write_tiny_experiment

    if (
        "training.device=mps" in overrides
        and getattr(torch.backends, "mps", None)
        and torch.backends.mps.is_available()
    ):
        pytest.skip("this machine has MPS")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = write_tiny_experiment(tmp_path)
    assert cli.main(["train", "--config", str(config), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tokenizer_json_that_cannot_encode_text_is_one_line(tmp_path, capsys):
    """A WordLevel tokenizer.json whose vocabulary lacks its own [UNK]: loading it raised the library's
    bare Exception from the probe; now one line naming the file."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from conftest import write_tiny_experiment

    broken = HFTokenizer(models.WordLevel({"the": 0, "cat": 1}, unk_token="[UNK]"))
    broken.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "nounk.json"
    path.write_text(broken.to_str())
    config = write_tiny_experiment(tmp_path)
    assert cli.main(["prepare", "--config", str(config), f"data.tokenizer={path}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last
        == f"error: {path} cannot encode text (WordLevel error: Missing [UNK] token from the vocabulary); fix or replace it"
    )


def test_a_model_folder_with_weights_that_are_not_finite_is_one_line(tmp_path, capsys):
    """A model folder whose weights hold a NaN (no meta.json: nothing checksums it): generate raised in
    the sampler, eval printed `loss nan`, export succeeded; each is now refused in one line."""
    from safetensors.torch import load_file, save_file

    folder = model_folder(tmp_path)
    weights = folder / "model.safetensors"
    state = load_file(weights)
    name = sorted(state)[1]
    state[name][0] = float("nan")
    save_file(state, weights)
    for argv in (
        ["generate", "--checkpoint", str(folder), "--prompt", "the"],
        ["eval", "--checkpoint", str(folder), "--data", str(text_file(tmp_path, "t.txt", "the cat sat " * 20))],
        ["export", "--checkpoint", str(folder), "--output", str(tmp_path / "out")],
    ):
        assert cli.main(argv) == 2, argv
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"error: {weights}: the weights of {name} are not finite (NaN or infinity)"), last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--tasks", "llmt_choice", "--data", "x.txt"],
            "--data goes with the loss on a file, and --tasks runs benchmarks",
        ),
        (["--output", "r.json"], "--output set how benchmarks run (--tasks), and no --tasks was given"),
        (["--num_fewshot", "3", "--limit", "5"], "--num_fewshot, --limit set how benchmarks run (--tasks)"),
        (["--text-column", "body"], "--text-column names the field of --data's records, and no --data was given"),
    ],
)
def test_eval_options_of_the_other_mode_are_refused_not_ignored(tmp_path, capsys, options, message):
    folder = model_folder(tmp_path)
    assert cli.main(["eval", "--checkpoint", str(folder), *options]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "r.json").exists()


def test_an_export_named_as_a_gguf_file_asks_for_the_format(tmp_path, capsys):
    folder = model_folder(tmp_path)
    assert cli.main(["export", "--checkpoint", str(folder), "--output", str(tmp_path / "m.gguf")]) == 2
    assert "is named as a GGUF file: pass --format gguf" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
