"""Shared fixtures: tiny configs and a tiny corpus, all in temporary folders."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_model_config(**overrides):
    from llm_trainer.config import ModelConfig

    values = dict(vocab_size=61, d_model=16, n_heads=2, n_layers=2, max_seq_len=24)
    values.update(overrides)
    return ModelConfig(**values)


def write_corpus(folder):
    """A small multi-document text folder (12 files) with enough repetition to learn from."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"the {w} sat on the mat number {i % 7}.\n" for i, w in enumerate(["cat", "dog", "bird", "fox"] * 30)]
    for d in range(12):
        (folder / f"doc{d:02d}.txt").write_text("".join(lines[d * 10 : d * 10 + 10]))
    return folder


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")
