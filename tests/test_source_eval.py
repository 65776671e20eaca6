"""Per-source validation loss: with several data sources, every evaluation also reports each source's
loss (`eval/<source>/loss`), from the same forward passes as the mixed val_loss."""

import json

import numpy as np
import pytest
import yaml

from conftest import tiny_model


def two_sources(root):
    """Prose (learnable, repetitive) and noise-like digits: two sources the model finds unequally hard."""
    prose, digits = root / "prose", root / "digits"
    prose.mkdir(parents=True)
    digits.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for d in range(12):
        animals = ["cat", "dog", "bird", "fox", "owl", "hen", "cow", "pig", "eel", "ant", "bee", "elk"]
        (prose / f"p{d:02d}.txt").write_text(
            "".join(f"the {animals[(d + i) % 12]} sat on the mat {(d * i) % 7}.\n" for i in range(12))
        )
        (digits / f"d{d:02d}.txt").write_text(" ".join(str(x) for x in rng.integers(0, 10**6, size=40)) + "\n")
    return [{"name": "prose", "data_files": str(prose)}, {"name": "digits", "data_files": str(digits)}]


def mixed_experiment(root, **training) -> str:
    """An experiment file: a one-layer char model on `two_sources`; `training` overrides its fields."""
    values = {
        "batch_size": 4,
        "save_steps": 0,
        "output_dir": str(root / "run"),
        "device": "cpu",
        "progress_bar": False,
        "report_to": ["jsonl"],
        **training,
    }
    config = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 32},
        "training": values,
        "data": {
            "sources": two_sources(root),
            "tokenizer": "char",
            "validation_split": 0.25,
            "cache_dir": str(root / "cache"),
        },
    }
    path = root / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_mixed_run_reports_each_sources_validation_loss(tmp_path):
    from llm_trainer.api import train
    from llm_trainer.config_loader import load_experiment

    path = mixed_experiment(tmp_path, max_steps=60, learning_rate=1e-2, eval_steps=30, logging_steps=30)
    summary = train(load_experiment(path))

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [30, 60]
    for row in evals:
        prose, digits = row["eval/prose/loss"], row["eval/digits/loss"]
        assert prose < digits  # the repetitive prose is the easier source
        assert min(prose, digits) < row["val_loss"] < max(prose, digits)  # the mixed loss is their weighted mean
    # every backend gets them under these names (TensorBoard, W&B and MLflow alike)
    from llm_trainer.train.metrics import scalar_items

    names = dict(scalar_items(evals[-1]))
    assert names["eval/prose/loss"] == evals[-1]["eval/prose/loss"] and names["eval/loss"] == evals[-1]["val_loss"]
    # best_model follows the mixed loss
    assert summary["best_val_loss"] == min(r["val_loss"] for r in evals)


@pytest.mark.parametrize("packed", [False, True])
def test_each_sources_loss_is_the_loss_over_its_own_documents(packed):
    """Unpacked rows (one document each): a source's loss equals evaluating that source's documents
    alone. Packed (first-fit) rows mix sources in a row: the per-source losses still make up the mixed one."""
    from llm_trainer.data.batches.loader import BatchLoader, DocumentRows
    from llm_trainer.data.batches.source_labels import SourceLabels
    from llm_trainer.train.evaluate import evaluate

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 20, size=30)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 61, size=offsets[-1]).astype(np.uint16)
    doc_sources = rng.integers(0, 3, size=30)
    names = ["a", "b", "c"]
    model = tiny_model()

    rows = DocumentRows(tokens, offsets, 16, pack=packed, pad_id=0)
    loader = BatchLoader(rows, 4, shuffle=False, drop_last=False)
    loader.source_labels = SourceLabels(rows, offsets, doc_sources, names)
    result = evaluate(model, loader, sources=loader.source_labels)
    assert set(result["source_losses"]) == set(names)

    counts = {}
    for k, name in enumerate(names):
        docs = np.flatnonzero(doc_sources == k)
        parts = [tokens[offsets[d] : offsets[d + 1]] for d in docs]
        own_offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
        own = BatchLoader(
            DocumentRows(np.concatenate(parts), own_offsets, 16, pack=False, pad_id=0),
            4,
            shuffle=False,
            drop_last=False,
        )
        alone = evaluate(model, own)
        counts[name] = alone["tokens"]
        if not packed:
            assert result["source_losses"][name] == pytest.approx(alone["val_loss"], rel=1e-5)
    if not packed:  # every target token counted once, under its document's source
        assert sum(counts.values()) == result["tokens"]
        mixed = sum(result["source_losses"][n] * counts[n] for n in names) / result["tokens"]
        assert mixed == pytest.approx(result["val_loss"], rel=1e-5)
    assert min(result["source_losses"].values()) <= result["val_loss"] <= max(result["source_losses"].values())


def test_every_source_holds_out_its_own_fraction_of_documents(tmp_path):
    """A fraction split counts each source's documents apart: 12 and 30 kept documents at 0.25 give
    3 and 7 validation documents, however the mixture interleaves them."""
    from collections import Counter

    from llm_trainer.config import DataConfig
    from llm_trainer.data.prepare import prepare_data

    sources = two_sources(tmp_path)
    more = tmp_path / "more"
    more.mkdir()
    for d in range(30):
        (more / f"m{d:02d}.txt").write_text(f"document {d} of the third source: " + "xyz " * (d + 5) + "\n")
    sources.append({"name": "more", "data_files": str(more), "weight": 3})
    prepared = prepare_data(
        DataConfig(sources=sources, tokenizer="char", validation_split=0.25, cache_dir=str(tmp_path / "cache"))
    )
    assert Counter(prepared.sources("val")) == {"prose": 3, "digits": 3, "more": 7}
    assert Counter(prepared.sources("train")) == {"prose": 9, "digits": 9, "more": 23}


def test_llm_trainer_eval_reports_each_source_too(tmp_path, capsys):
    """`llm-trainer eval` of a mixed run's checkpoint: the mixed loss and each source's, as training's
    last (whole-split) evaluation gave them."""
    from llm_trainer.cli import main

    path = mixed_experiment(tmp_path, max_steps=4, eval_steps=0, use_amp=False)
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run" / "checkpoints" / "latest"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in rows if r["kind"] == "eval"]
    assert result["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    assert result["sources"] == pytest.approx(
        {"prose": last["eval/prose/loss"], "digits": last["eval/digits/loss"]}, rel=1e-5
    )


def test_best_model_can_follow_one_sources_loss(tmp_path):
    from llm_trainer.api import train
    from llm_trainer.config_loader import load_experiment
    from llm_trainer.errors import UsageError

    path = mixed_experiment(
        tmp_path,
        max_steps=40,
        learning_rate=3e-2,
        eval_steps=10,
        logging_steps=10,
        metric_for_best_model="eval/digits/loss",
    )
    train(load_experiment(path))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    best = min(evals, key=lambda r: r["eval/digits/loss"])
    meta = json.loads((tmp_path / "run" / "checkpoints" / "best_model" / "meta.json").read_text())
    assert meta["metrics"]["step"] == best["step"]
    assert meta["metrics"]["eval/digits/loss"] == pytest.approx(best["eval/digits/loss"])

    other = tmp_path / "other"
    other.mkdir()
    path = mixed_experiment(other, max_steps=10, eval_steps=10, metric_for_best_model="eval/code/loss")
    with pytest.raises(
        UsageError, match="names no source of the validation data.*known: eval/prose/loss, eval/digits/loss"
    ):
        train(load_experiment(path))
