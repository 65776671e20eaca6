"""Packing with document boundaries: document ids from the rows, the block-diagonal mask in the model,
padding fractions per strategy, and the curriculum loader."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from llm_trainer.api import build_loaders
from llm_trainer.config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
from llm_trainer.data.batches.curriculum import CurriculumLoader, document_difficulty, row_difficulty
from llm_trainer.data.batches.loader import IGNORE_INDEX, DocumentRows, WindowRows, document_ids
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.prepare.report import REPORT, padding_fractions
from llm_trainer.errors import UsageError
from llm_trainer.model import Transformer, document_attention

EOT = 0


def corpus(seed: int = 0, n: int = 40, low: int = 2, high: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Documents of random tokens in [1, 50), each ending in EOT; (tokens, offsets)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 50, size=int(rng.integers(low, high))), EOT) for _ in range(n)]
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return np.concatenate(docs).astype(np.uint16), offsets


def model(architecture: str) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        architecture=architecture, vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=48
    )
    return Transformer(config).eval()


def test_document_ids_and_positions():
    x = np.array([[5, 6, EOT, 7, 8, 9, EOT, EOT, EOT]])
    ids = document_ids(x, EOT)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3]]  # end-of-text stays with its document; pads alone
    mask, positions = document_attention(torch.from_numpy(ids))
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    assert mask.shape == (1, 1, 9, 9)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False, False]


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])  # learned positions and RoPE
def test_packed_document_gives_the_same_logits_as_alone(architecture):
    tokens, offsets = corpus()
    L = 47
    rows = DocumentRows(tokens, offsets, L, pack=True, pad_id=EOT, document_ids=True)
    net = model(architecture)
    checked = 0
    with torch.no_grad():
        for r in range(len(rows)):
            x, _, ids = (torch.from_numpy(a) for a in rows.batch(np.array([r])))
            packed = net(x, doc_ids=ids)
            start = 0
            for s, e in rows.rows[r]:
                n = min(e - s, L - start)  # the row's last token is only a target
                alone = net(torch.from_numpy(tokens[s : s + n].astype(np.int64))[None])
                torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
                start += e - s
                checked += 1
            unmasked = net(x)
            if len(rows.rows[r]) > 1:  # without the mask, the second document sees the first
                second = rows.rows[r][0][1] - rows.rows[r][0][0]
                assert not torch.allclose(unmasked[:, second], packed[:, second], atol=1e-4)
    assert checked == len(offsets) - 1


def test_default_forward_is_unchanged_by_the_new_argument():
    net = model("llama")
    x = torch.randint(1, 50, (2, 40))
    torch.testing.assert_close(net(x), net(x, doc_ids=torch.zeros_like(x)), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="KV cache"):
        from llm_trainer.model import KVCache

        net(x, cache=KVCache.empty(net.config, 2, 48, "cpu", torch.float32), doc_ids=torch.zeros_like(x))


def test_first_fit_never_splits_a_document_and_masks_padding():
    tokens, offsets = corpus(1, n=120, low=1, high=60)
    L = 31
    rows = DocumentRows(tokens, offsets, L, pack=True, pad_id=EOT, document_ids=True)
    whole = {(int(s), int(e)) for s, e in zip(offsets[:-1], offsets[1:]) if e - s <= L + 1}
    segments = {seg for row in rows.rows for seg in row}
    assert whole <= segments  # every document that fits a row is in one row, in one piece
    x, y, ids = rows.batch(np.arange(len(rows)))
    for r, row in enumerate(rows.rows):
        used = sum(e - s for s, e in row)
        assert (y[r, used - 1 :] == IGNORE_INDEX).all()  # padding leaves the loss
        assert (y[r, : used - 1] != IGNORE_INDEX).all()
        real = set(ids[r, : used - 1].tolist())
        assert not real & set(ids[r, used:].tolist())  # padding is never in a real document
    window = WindowRows(tokens, L, eot_id=EOT)
    x, y, ids = window.batch(np.arange(len(window)))
    assert (np.diff(ids, axis=1) >= 0).all() and (ids == document_ids(x, EOT)).all()


def test_padding_fraction_per_strategy(tmp_path):
    tokens, offsets = corpus(2, n=200, low=1, high=40)
    fractions = padding_fractions(offsets, 31)
    assert fractions["greedy"] == 0.0
    assert 0.0 <= fractions["first_fit"] < fractions["unpacked"] < 1.0
    packed = DocumentRows(tokens, offsets, 31, pack=True, pad_id=EOT)
    assert abs(packed.padding_fraction() - fractions["first_fit"]) < 1e-6
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps({"text": "x" * (i % 37 + 1) + str(i)}) + "\n" for i in range(300)))
    prepared = prepare_data(
        DataConfig(
            data_files=str(source), tokenizer="char", cache_dir=str(tmp_path / "c"), max_length=32, progress_bar=False
        )
    )
    reported = json.loads((prepared.directory / REPORT).read_text())["padding_fraction"]
    assert reported["first_fit"] < reported["unpacked"]


def _experiment(tmp_path, **data) -> tuple[ExperimentConfig, object]:
    source = tmp_path / "d.jsonl"
    rng = np.random.default_rng(0)
    texts = [
        "".join(rng.choice(list("abcdefgh "), size=int(n))) + f" {i}" for i, n in enumerate(rng.integers(3, 60, 400))
    ]
    source.write_text("".join(json.dumps({"text": t, "difficulty": i % 10}) + "\n" for i, t in enumerate(texts)))
    experiment = ExperimentConfig(
        model=ModelConfig(architecture="llama", vocab_size=None, d_model=32, n_heads=2, n_layers=1, max_seq_len=32),
        training=TrainingConfig(batch_size=4, seed=3, device="cpu"),
        data=DataConfig(
            data_files=str(source),
            tokenizer="char",
            cache_dir=str(tmp_path / "c"),
            max_length=32,
            progress_bar=False,
            **data,
        ),
    )
    return experiment, prepare_data(experiment.data)


@pytest.mark.parametrize("strategy", ["greedy", "first_fit"])
def test_loaders_yield_document_ids_the_model_uses(tmp_path, strategy):
    experiment, prepared = _experiment(tmp_path, document_mask=True, packing_strategy=strategy)
    train, val = build_loaders(experiment, prepared, torch.device("cpu"))
    x, y, ids = train.next_batch()
    assert x.shape == y.shape == ids.shape == (4, 32)
    assert torch.equal(ids, torch.from_numpy(document_ids(x.numpy(), prepared.tokenizer.eot_id)))
    assert all(len(batch) == 3 for batch in val)
    net = Transformer(
        ModelConfig(
            architecture="llama",
            vocab_size=prepared.tokenizer.vocab_size,
            d_model=32,
            n_heads=2,
            n_layers=1,
            max_seq_len=32,
        )
    )
    assert net(x, doc_ids=ids).shape == (4, 32, prepared.tokenizer.vocab_size)
    plain = dataclasses.replace(experiment, data=dataclasses.replace(experiment.data, document_mask=False))
    assert prepare_data(plain.data).directory == prepared.directory  # a loader setting: same prepared data
    train, _ = build_loaders(plain, prepared, torch.device("cpu"))
    assert len(train.next_batch()) == 2  # without document_mask, batches stay (inputs, targets)


# ----------------------------------------------------------------------------------------------
# curriculum


def test_curriculum_stages_by_length_are_seeded_and_seekable(tmp_path):
    stages = [{"until_step": 5, "max_difficulty": 20}, {"until_step": 10, "max_difficulty": 40}]
    experiment, prepared = _experiment(tmp_path, curriculum=stages, packing_strategy="first_fit", pack_sequences=False)
    train, _ = build_loaders(experiment, prepared, torch.device("cpu"))
    assert isinstance(train, CurriculumLoader)
    offsets = prepared.offsets("train")
    lengths = np.diff(offsets)
    per_row = row_difficulty(train.rows, offsets, document_difficulty(offsets, None, "length"))
    seen = []
    for step in range(14):
        x, y = train.next_batch()
        n = (y != IGNORE_INDEX).sum(dim=1) + 1  # unpacked rows: one document each, its length
        seen.append(x.clone())
        if step < 5:
            assert (n <= 20).all(), n
        elif step < 10:
            assert (n <= 40).all() and n.max() > 20
    assert per_row.max() == lengths.max()
    # the same seed gives the same batches; a saved position resumes exactly
    again, _ = build_loaders(experiment, prepared, torch.device("cpu"))
    for _ in range(7):
        again.next_batch()
    state = json.loads(json.dumps(again.state_dict()))
    resumed, _ = build_loaders(experiment, prepared, torch.device("cpu"))
    resumed.load_state_dict(state)
    for step in range(7, 14):
        assert torch.equal(resumed.next_batch()[0], seen[step])


def test_curriculum_by_score_column(tmp_path):
    stages = [{"until_step": 6, "max_difficulty": 2}]
    experiment, prepared = _experiment(
        tmp_path, curriculum=stages, curriculum_key="difficulty", pack_sequences=False, validation_split=0.0
    )
    scores = prepared.scores("train")
    assert scores is not None and len(scores) == prepared.manifest["splits"]["train"]["documents"]
    train, _ = build_loaders(experiment, prepared, torch.device("cpu"))
    eligible = set(np.flatnonzero(row_difficulty(train.rows, prepared.offsets("train"), scores) <= 2).tolist())
    for _ in range(6):
        train._epoch_order()
        indices = train._stage_batch()
        assert set(indices.tolist()) <= eligible
        train.next_batch()
    too_hard = ExperimentConfig(
        model=experiment.model,
        training=experiment.training,
        data=DataConfig(**{**experiment.data.to_dict(), "curriculum": [{"until_step": 2, "max_difficulty": -1}]}),
    )
    with pytest.raises(UsageError, match="curriculum stage 0"):
        build_loaders(too_hard, prepared, torch.device("cpu"))


@pytest.mark.parametrize(
    "key, value", [("curriculum_samples", -8), ("curriculum_samples", "8"), ("curriculum_taken", 1.5)]
)
def test_a_curriculum_position_of_the_wrong_type_is_refused(tmp_path, key, value):
    """A saved position may come from a folder we did not write: the checkpoint calls this a malformed
    data position (one line) instead of seeking to a negative batch."""
    stages = [{"until_step": 5, "max_difficulty": 20}, {"until_step": 10, "max_difficulty": 40}]
    experiment, prepared = _experiment(tmp_path, curriculum=stages, packing_strategy="first_fit", pack_sequences=False)
    train, _ = build_loaders(experiment, prepared, torch.device("cpu"))
    state = {**train.state_dict(), key: value}
    with pytest.raises(TypeError, match=f"{key} {value!r} is not a whole number"):
        train.load_state_dict(state)
