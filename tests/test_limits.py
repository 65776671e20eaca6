"""Limits a real input never reaches and a crafted one always does (`llm_trainer.limits`), and a data
source named on the command line winning over the config file's."""

import json
import time
import zipfile

import pytest
import torch

from llm_trainer import limits
from llm_trainer.cli import resolve_config_path
from llm_trainer.config import DataConfig, ModelConfig
from llm_trainer.config_loader import load_experiment
from llm_trainer.data.text import sources
from llm_trainer.errors import UsageError

# -- compressed archives ----------------------------------------------------------------------------------


def test_a_deflate_bomb_is_refused_before_loading_and_a_real_rng_file_passes(tmp_path):
    real = tmp_path / "rng.pt"
    torch.save({"torch": torch.get_rng_state()}, real)
    assert limits.check_archive(real) == real

    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data/0", "w") as entry:
            for _ in range(16):
                entry.write(bytes(1 << 20))
    assert bomb.stat().st_size < 100_000
    with pytest.raises(UsageError, match="compression ratio limit"):
        limits.check_archive(bomb)
    with pytest.raises(UsageError, match="over the limit of 10 for this file"):
        limits.check_archive(real, max_bytes=10)


# -- model dimensions ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, key",
    [
        ({"n_layers": 10**9}, "n_layers"),
        ({"max_seq_len": 10**9}, "max_seq_len"),
        ({"d_model": 2**40, "n_heads": 1}, "d_model"),
        ({"vocab_size": 10**12, "d_model": 1024, "n_heads": 8}, "vocab_size"),
    ],
)
def test_model_dimensions_past_any_real_model_are_refused_at_once(values, key):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=key):
        ModelConfig(**values)
    assert time.perf_counter() - start < 0.5


def test_a_small_model_config_file_cannot_make_us_build_a_huge_model(tmp_path):
    from llm_trainer.checkpoint.model_folder import read_model_config

    (tmp_path / "model_config.json").write_text(
        json.dumps({"vocab_size": 50257, "d_model": 8192, "n_heads": 64, "n_layers": 9000})
    )
    assert (tmp_path / "model_config.json").stat().st_size < 500
    start = time.perf_counter()
    with pytest.raises(UsageError, match="more than this machine's"):
        read_model_config(tmp_path)
    assert time.perf_counter() - start < 0.5


# -- nesting and aliases ---------------------------------------------------------------------------------


def test_structure_limits_count_aliases_without_expanding_them():
    shared = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9
    start = time.perf_counter()
    with pytest.raises(UsageError, match="expands to more than"):
        limits.check_structure({"a": shared}, "x")
    assert time.perf_counter() - start < 0.5
    loop: list = []
    loop.append(loop)
    with pytest.raises(UsageError, match="refers to itself"):
        limits.check_structure(loop, "x")
    nested: list = []
    for _ in range(limits.MAX_NESTING + 1):
        nested = [nested]
    with pytest.raises(UsageError, match="nested more than"):
        limits.check_structure(nested, "x")
    assert limits.check_structure({"model": {"d_model": 64}, "data": {"sources": [{"name": "a"}]}}, "x")


def test_deep_json_is_one_line():
    with pytest.raises(UsageError, match="nested more than"):
        limits.parse_json("[" * 100_000 + "]" * 100_000, "meta.json")


# -- documents -------------------------------------------------------------------------------------------


def read(config: DataConfig):
    stats = sources.SourceStats()
    spec = sources.resolved_sources(config)[0]
    return list(sources.iter_source(spec, config, stats)), stats


def test_a_jsonl_line_past_the_limit_is_never_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a" * 5000}) + "\n" + json.dumps({"text": "short"}) + "\n")
    with pytest.raises(UsageError, match="d.jsonl:1 is longer than 1,000 bytes"):
        read(DataConfig(data_files=str(path)))
    documents, stats = read(DataConfig(data_files=str(path), on_bad_input="skip"))
    assert [d.text for d in documents] == ["short"] and stats.skipped["long_lines"] == 1


def test_one_enormous_compressed_line(tmp_path, monkeypatch):
    zstandard = pytest.importorskip("zstandard")
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1 << 16)
    line = b'{"text": "' + b"a" * (8 << 20) + b'"}\n' + b'{"text": "after"}\n'
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(line))
    documents, stats = read(DataConfig(data_files=str(path), on_bad_input="skip"))
    assert [d.text for d in documents] == ["after"] and stats.skipped["long_lines"] == 1


def test_a_document_past_the_limit_is_cut_and_the_report_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_DOCUMENT_CHARS", 100)
    path = tmp_path / "one-line.txt"
    text = " ".join(["word"] * 200)
    path.write_text(text)
    documents, stats = read(DataConfig(data_files=str(path)))
    assert len(documents) > 1 and all(len(d.text) <= 100 for d in documents)
    assert "".join(d.text for d in documents) == text and stats.skipped["long_documents_split"] == 1


# -- a source named on the command line is the one used --------------------------------------------------


def test_data_files_on_the_command_line_replace_the_presets_corpus(tmp_path):
    mine = tmp_path / "my.txt"
    mine.write_text("my own text\n")
    experiment = load_experiment(resolve_config_path("tiny"), [f"data.data_files={mine}"])
    assert experiment.data.data_files == str(mine) and experiment.data.dataset_name is None
    assert sources.resolved_sources(experiment.data)[0].data_files == str(mine)
    config = tmp_path / "exp.yaml"
    config.write_text(f"data: {{data_files: {mine}}}\n")
    experiment = load_experiment(config, ["data.dataset_name=python-stdlib"])
    assert experiment.data.data_files is None and experiment.data.dataset_name == "python-stdlib"
    unchanged = load_experiment(resolve_config_path("tiny"), ["data.max_documents=5"])
    assert unchanged.data.dataset_name == "python-stdlib"


def test_prepare_reads_the_file_named_on_the_command_line(tmp_path, monkeypatch):
    from llm_trainer.data.prepare import prepare_data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.txt").write_text("zzz qqq zzz qqq\n" * 50)
    experiment = load_experiment(resolve_config_path("tiny"), ["data.data_files=my.txt"])
    prepared = prepare_data(experiment.data)
    assert set(prepared.tokenizer.decode(prepared.tokens("train").tolist())) <= set("zq \n")


def test_a_dcp_item_stored_through_a_transform_is_refused():
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    plain = _StorageInfo(relative_path="__0_0.distcp", offset=0, length=64)
    limits.check_dcp_items({"a": plain}, "sharded/.metadata")
    if not hasattr(plain, "transform_descriptors"):
        pytest.skip("this torch stores no transforms")
    squeezed = _StorageInfo(relative_path="__0_0.distcp", offset=0, length=64, transform_descriptors=["zstd"])
    with pytest.raises(UsageError, match="decompression limit"):
        limits.check_dcp_items({"a": plain, "b": squeezed}, "sharded/.metadata")


def test_a_resume_from_a_checkpoint_whose_rng_file_is_a_deflate_bomb_is_one_line(tmp_path, capsys):
    from conftest import write_tiny_experiment
    from llm_trainer import cli
    from llm_trainer.checkpoint import layout
    from llm_trainer.files import checksums

    config = write_tiny_experiment(tmp_path, max_steps=2, save_steps=2, eval_steps=0)
    assert cli.main(["train", "--config", str(config)]) == 0
    folder = layout.list_checkpoints(tmp_path / "run" / "checkpoints")[0]
    with zipfile.ZipFile(folder / layout.RNG, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("rng/data/0", "w") as entry:
            for _ in range(16):
                entry.write(bytes(1 << 20))
    meta = json.loads((folder / layout.META).read_text())  # resealed, as whoever crafts a folder can
    meta["files"][layout.RNG] = {
        "size": (folder / layout.RNG).stat().st_size,
        "checksum": checksums.file_checksum(folder / layout.RNG),
    }
    meta["meta_sha256"] = checksums.meta_checksum(meta)
    (folder / layout.META).write_text(json.dumps(meta))
    capsys.readouterr()
    code = cli.main(
        ["train", "--config", str(config), "training.max_steps=4", f"training.resume_from_checkpoint={folder}"]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: ") and "compression ratio limit" in lines[-1], lines


# -- a saved data position -----------------------------------------------------------------------------


def test_a_position_in_a_dataloader_that_cannot_seek_is_bounded_and_checked():
    """A user's DataLoader is skipped forward batch by batch: a crafted position would read for ever."""
    from llm_trainer.train.batches import IterableBatches

    batches = [torch.zeros(2, 5, dtype=torch.long)] * 3
    loader = IterableBatches(batches, torch.device("cpu"))
    started = time.perf_counter()
    with pytest.raises(UsageError, match="10,000,000,000 batches into an epoch .* over the limit"):
        loader.load_state_dict({"epoch": 0, "position": 10**10})
    assert time.perf_counter() - started < 0.5
    with pytest.raises(ValueError, match=r"batch 5 of epoch 0\) is past the end of this DataLoader \(3 batches\)"):
        loader.load_state_dict({"epoch": 0, "position": 5})
    for state in ({"epoch": 0, "position": "2"}, {"epoch": -1, "position": 1}, {"epoch": 0, "position": -4}):
        with pytest.raises(TypeError, match="is not a whole number"):
            loader.load_state_dict(state)
    loader.load_state_dict({"epoch": 1, "position": 2})
    assert (loader.epoch, loader.position) == (1, 2) and loader.next_batch()[0].shape == (2, 4)
