"""Batches read ahead on a worker thread are the batches read in place: the same tensors in the same
order, the same saved positions, across epochs, skipped ranges, resumes and errors. (The CUDA side
stream's copy is in test_gpu.py.)"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from conftest import write_tiny_experiment
from llm_trainer import cli
from llm_trainer.config import CurriculumStage
from llm_trainer.data.batches.curriculum import CurriculumLoader
from llm_trainer.data.batches.loader import BatchLoader, DocumentRows, WindowRows
from llm_trainer.errors import UsageError

LENGTH, EOT = 8, 0


def _tokens() -> np.ndarray:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, size=900).astype(np.uint16)
    tokens[rng.choice(900, size=60, replace=False)] = EOT  # documents of uneven lengths
    tokens[-1] = EOT
    return tokens


def _offsets(tokens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.flatnonzero(tokens == EOT) + 1])


ROWS = {
    "windows": lambda t: WindowRows(t, LENGTH, seed=5),  # the grid moves each epoch
    "windows-document-ids": lambda t: WindowRows(t, LENGTH, seed=5, eot_id=EOT),
    "first-fit": lambda t: DocumentRows(t, _offsets(t), LENGTH, pack=True, pad_id=EOT, document_ids=True),
    "unpacked": lambda t: DocumentRows(t, _offsets(t), LENGTH, pack=False, pad_id=EOT),
}


def _loader(rows: str, ahead: bool, accumulation: int = 2, **kwargs) -> BatchLoader:
    return BatchLoader(ROWS[rows](_tokens()), 4, shuffle=True, seed=7, accumulation=accumulation, ahead=ahead, **kwargs)


def _read(loader, n: int) -> list[tuple[list, dict]]:
    """n batches, each with the position saved after it."""
    return [([t.tolist() for t in loader.next_batch()], loader.state_dict()) for _ in range(n)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_batches_read_ahead_are_the_batches_read_in_place(rows, accumulation):
    """Three epochs and more, through skipped ranges (one across an epoch's end), a resume from an
    earlier position, a range skipped while its batches were queued, and a rewind."""
    loaders = [_loader(rows, ahead, accumulation, world_size=2, rank=1) for ahead in (False, True)]
    per_epoch = loaders[0].batches_per_epoch()
    end_of_epoch = per_epoch * 8  # global samples of an epoch (batch 4 x 2 processes)
    reads = []
    for loader in loaders:
        loader.skip = [(16, 40), (end_of_epoch - 8, end_of_epoch + 16)]
        first = _read(loader, per_epoch + 3)
        saved = first[4][1]
        loader.load_state_dict(saved)  # a resume, with the next batches queued
        again = _read(loader, 5)
        loader.skip = [*loader.skip, (loader.samples, loader.samples + 24)]  # the next 3 batches, while queued
        then = _read(loader, 4)
        loader.load_state_dict(saved)  # a rewind: back, then a range skipped
        loader.skip = [*loader.skip, (loader.samples + 8, loader.samples + 16)]
        reads.append((first, again, then, _read(loader, 2 * per_epoch + 5)))
    assert reads[0] == reads[1]
    assert reads[0][1][0] == reads[0][0][5]  # the resume went back (the comparison is not of two no-ops)


def test_a_curriculum_read_ahead_is_the_curriculum_read_in_place():
    tokens = _tokens()
    reads = []
    for ahead in (False, True):
        rows = WindowRows(tokens, LENGTH, seed=5)
        difficulty = np.arange(len(rows), dtype=float) % 10
        stages = [CurriculumStage(until_step=3, max_difficulty=4), CurriculumStage(until_step=6, max_difficulty=8)]
        loader = CurriculumLoader(rows, 4, difficulty=difficulty, stages=stages, accumulation=2, seed=7, ahead=ahead)
        reads.append(_read(loader, 12 + 2 * loader.batches_per_epoch()))
    assert reads[0] == reads[1]


def test_the_coming_batches_are_read_on_the_worker_thread():
    """The loop's own thread reads only an epoch's first batch: the rest were ready when it asked."""
    loader = _loader("windows", ahead=True)
    threads = []
    batch = loader.rows.batch
    loader.rows.batch = lambda indices: threads.append(threading.current_thread().name) or batch(indices)
    _read(loader, 3 * loader.batches_per_epoch())
    assert loader.epoch >= 2
    main = threading.current_thread().name
    assert threads.count(main) == loader.epoch + 1  # the first batch of each epoch begun
    assert all(name == main or name.startswith("batches-ahead") for name in threads)


@pytest.mark.parametrize("ahead", [False, True], ids=["read-in-place", "read-ahead"])
def test_a_batch_that_cannot_be_read_fails_at_its_own_turn(ahead):
    """An error of a read ahead (a chunk a bucket does not send) is raised when the loop takes that batch,
    as reading in place raises it, after the batches before it were trained on."""
    loader = _loader("windows", ahead=ahead, accumulation=1)
    order = loader._epoch_order()
    bad = set(order[8:12].tolist())  # the third batch's rows
    batch = loader.rows.batch

    def read(indices):
        if bad & set(indices.tolist()):
            raise UsageError("chunk 3 of gs://bucket/data could not be read: 503; try again")
        return batch(indices)

    loader.rows.batch = read
    _read(loader, 2)
    with pytest.raises(UsageError, match="chunk 3 of gs://bucket/data could not be read"):
        loader.next_batch()


def test_batches_read_ahead_are_tensors_of_their_own():
    """A batch the loop changes in place (a user's callback masking targets) leaves the queued ones alone."""
    loader = _loader("windows", ahead=True, accumulation=1)
    twin = _loader("windows", ahead=False, accumulation=1)
    for _ in range(6):
        x, y = loader.next_batch()
        assert torch.equal(x, twin.next_batch()[0])
        y.fill_(-100)
        x.zero_()


@pytest.mark.parametrize("rows", ["windows-document-ids", "first-fit"])
def test_an_evaluation_pass_read_ahead_is_the_pass_read_in_place(rows):
    """Every rank's batches in order, its padding batch's targets ignored, and the training position
    untouched; a pass stopped early (a screened evaluation) ends its reads."""
    passes = []
    for ahead in (False, True):
        loader = BatchLoader(
            ROWS[rows](_tokens()), 5, shuffle=False, drop_last=False, rank=2, world_size=3, ahead=ahead
        )
        loader.next_batch()
        before = loader.state_dict()
        batches = [[t.tolist() for t in batch] for batch in loader]
        assert loader.state_dict() == before
        screened = [batch for _, batch in zip(range(2), loader)]
        assert [[t.tolist() for t in b] for b in screened] == batches[:2]
        passes.append(batches)
    assert passes[0] == passes[1]
    assert set(passes[0][-1][1][0]) == {-100}  # this rank's last batch pads the world's count


def test_a_run_reading_ahead_trains_as_one_reading_in_place(tmp_path, capfd):
    """The whole run: losses, evaluations and the final weights' loss equal to the last digit, with
    gradient accumulation over the epochs of a small corpus (each epoch's first batch read in place)."""
    rows = {}
    for ahead in (True, False):
        config = write_tiny_experiment(
            tmp_path,
            f"{ahead}.yaml",
            max_steps=60,
            gradient_accumulation_steps=2,
            output_dir=str(tmp_path / f"run-{ahead}"),
        )
        assert cli.main(["train", "--config", str(config), f"training.read_ahead={str(ahead).lower()}"]) == 0
        start = next(line for line in capfd.readouterr().err.splitlines() if line.startswith("train: "))
        assert ("batches read ahead" in start) is ahead, start  # the run header says so
        lines = (tmp_path / f"run-{ahead}" / "metrics.jsonl").read_text().splitlines()
        rows[ahead] = [
            (row.get("step"), row.get("epoch"), row.get("loss"), row.get("val_loss"))
            for row in map(json.loads, lines)
            if row.get("kind") in ("train", "eval")
        ]
    assert rows[True] == rows[False]
    assert max(row[1] or 0 for row in rows[True]) >= 2  # a few epochs


def test_by_default_a_loader_reads_ahead_on_a_gpu_only():
    """`training.read_ahead: auto`: on a CPU a batch's gather is cheaper than a handoff from a thread."""
    rows = ROWS["windows"](_tokens())
    assert BatchLoader(rows, 4, shuffle=True)._ahead is None
    assert BatchLoader(rows, 4, shuffle=True, device="cuda")._ahead is not None  # (no GPU needed to build it)
    assert BatchLoader(rows, 4, shuffle=True, ahead=True)._ahead is not None
