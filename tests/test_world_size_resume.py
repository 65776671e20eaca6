"""The training loader's order is a function of the seed and the global sample index: the same global
batch split into any number of processes and micro-batches takes the same samples per step, and a
position saved under one split resumes under another, in O(1). (The training runs that resume at
another world size, with their losses, are in test_distributed.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from llm_trainer.config import CurriculumStage
from llm_trainer.data.batches.curriculum import CurriculumLoader
from llm_trainer.data.batches.loader import BatchLoader, WindowRows

LENGTH = 4
N_ROWS = 53  # not a multiple of any global batch below: epochs end on a partial step
# (batch_size, accumulation, world_size): 8 samples per optimizer step in each
LAYOUTS = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4), (1, 2, 4)]


def _rows() -> WindowRows:
    tokens = np.arange(N_ROWS * LENGTH + 1, dtype=np.int64)  # row i starts with token i * LENGTH: its id
    return WindowRows(tokens, LENGTH)


def _loaders(batch_size, accumulation, world_size, cls=BatchLoader, **kwargs):
    return [
        cls(
            _rows(),
            batch_size,
            seed=3,
            rank=rank,
            world_size=world_size,
            accumulation=accumulation,
            **({"shuffle": True} if cls is BatchLoader else {}),
            **kwargs,
        )
        for rank in range(world_size)
    ]


def _steps(loaders, accumulation, n_steps) -> list[list[int]]:
    """The row ids each optimizer step reads, in the order of the global batch (micro-batch, then rank)."""
    steps = []
    for _ in range(n_steps):
        ids = []
        for _ in range(accumulation):
            for loader in loaders:
                inputs = loader.next_batch()[0]
                ids += (inputs[:, 0] // LENGTH).tolist()
        steps.append(ids)
    return steps


def _step_sets(steps):
    return [sorted(s) for s in steps]


def test_every_split_of_the_global_batch_reads_the_same_samples_per_step_and_each_once_an_epoch():
    per_epoch = N_ROWS // 8
    reference = _steps(_loaders(8, 1, 1), 1, 3 * per_epoch)
    for epoch in range(3):
        seen = [i for step in reference[epoch * per_epoch : (epoch + 1) * per_epoch] for i in step]
        assert len(seen) == len(set(seen)) == per_epoch * 8  # every sample of the epoch at most once
    for batch_size, accumulation, world_size in LAYOUTS[1:]:
        loaders = _loaders(batch_size, accumulation, world_size)
        assert _steps(loaders, accumulation, 3 * per_epoch) == reference  # the same global order, epochs included
        assert loaders[0].epoch == 2


@pytest.mark.parametrize("saved", LAYOUTS)
def test_a_position_saved_under_one_split_resumes_under_any_other(saved):
    per_epoch, at = N_ROWS // 8, N_ROWS // 8 + 2  # saved in the second epoch
    reference = _steps(_loaders(8, 1, 1), 1, at + per_epoch)
    batch_size, accumulation, world_size = saved
    writers = _loaders(batch_size, accumulation, world_size)
    _steps(writers, accumulation, at)
    state = writers[0].state_dict()
    run_samples = (N_ROWS // 8 + 2) * 8  # since the run began
    assert state == {
        "epoch": 1,
        "epoch_samples": 2 * 8,
        "seed": 3,
        "global_batch": 8,
        "row_length": LENGTH,
        "samples": run_samples,
        "skip": [],
    }
    for batch_size, accumulation, world_size in LAYOUTS:
        readers = _loaders(batch_size, accumulation, world_size)
        for reader in readers:
            reader.load_state_dict(state)
        assert _steps(readers, accumulation, per_epoch) == reference[at:]


@pytest.mark.parametrize("ahead", [False, True], ids=["read-in-place", "read-ahead"])
def test_a_resume_seeks_without_reading_the_batches_before_it(ahead):
    state = {"epoch": 5, "epoch_samples": 6 * 8, "seed": 3, "global_batch": 8}
    loader = _loaders(2, 2, 2, ahead=ahead)[1]
    read = []
    batch = loader.rows.batch
    loader.rows.batch = lambda indices: read.append(indices.tolist()) or batch(indices)
    loader.load_state_dict(state)
    taken = (loader.next_batch()[0][:, 0] // LENGTH).tolist()
    twin = _loaders(2, 2, 2, ahead=False)[1]  # what this rank takes from the saved position on
    twin.load_state_dict(state)
    coming = [(twin.next_batch()[0][:, 0] // LENGTH).tolist() for _ in range(twin.batches_per_epoch() - 6)]
    assert taken == coming[0]
    if loader._ahead is not None:
        loader._ahead.drop()  # the worker's reads have ended
    assert read[0] == coming[0]  # the batch asked for, read first, nothing before it replayed
    assert all(indices in coming[1:4] for indices in read[1:])  # then at most the next step's and one more
    assert len({tuple(indices) for indices in read}) == len(read)  # none twice
    assert ahead or len(read) == 1


def test_another_global_batch_is_refused_naming_both_and_the_fix():
    state = _loaders(4, 1, 2)[0].state_dict()  # 8 per step
    with pytest.raises(ValueError) as error:
        _loaders(4, 1, 1)[0].load_state_dict(state)
    assert str(error.value) == (
        "the checkpoint was trained with a global batch of 8 samples per step, this run has 4 = 4 batch_size x "
        "1 accumulation x 1 process(es); set training.gradient_accumulation_steps=2 to resume it"
    )
    with pytest.raises(ValueError, match=r"set training.batch_size=2 to resume"):
        _loaders(3, 2, 2)[0].load_state_dict(state)


def test_another_row_length_is_refused_naming_both():
    """A position counts rows of the saved length: under another model.max_seq_len it would name other
    rows (a RoPE model takes the new length without a shape error), so the resume is refused."""
    state = _loaders(4, 1, 1)[0].state_dict()
    assert state["row_length"] == LENGTH
    other = BatchLoader(WindowRows(np.arange(N_ROWS * LENGTH + 1, dtype=np.int64), LENGTH * 2), 4, seed=3, shuffle=True)
    with pytest.raises(ValueError, match=r"rows were 4 tokens long, this run's are 8 \(model.max_seq_len"):
        other.load_state_dict(state)
    del state["row_length"]  # a checkpoint from before rows recorded it: taken as it is
    other.load_state_dict(state)


def test_a_position_saved_in_rank_batches_loads_at_its_own_world_size_only():
    """Checkpoints written before positions were global samples hold {position, world_size}."""
    old = {"epoch": 1, "position": 3, "seed": 3, "world_size": 2}
    same = _loaders(4, 1, 2)
    for loader in same:
        loader.load_state_dict(old)
    assert same[0].state_dict()["epoch_samples"] == 3 * 4 * 2
    with pytest.raises(ValueError, match="for world size 2, this run has 1; resume with the same number"):
        _loaders(8, 1, 1)[0].load_state_dict(old)


def test_a_curriculum_position_resumes_under_another_split():
    stages = [CurriculumStage(until_step=3, max_difficulty=20.0)]
    difficulty = np.arange(N_ROWS, dtype=np.float64)  # stage 1: the 21 easiest rows
    make = lambda *layout: _loaders(*layout, cls=CurriculumLoader, difficulty=difficulty, stages=stages)  # noqa: E731
    reference = _steps(make(8, 1, 1), 1, 6)
    writers = make(4, 1, 2)
    _steps(writers, 1, 2)
    readers = make(2, 2, 2)
    for reader in readers:
        reader.load_state_dict(writers[0].state_dict())
    assert _steps(readers, 2, 4) == reference[2:]


def test_a_users_dataloader_resumes_at_its_own_world_size_only():
    """A DataLoader of the user's own splits its data its own way: its position (batches of this rank)
    is refused at another world size, in one line naming both and the way out."""
    import torch

    from llm_trainer.train.batches import IterableBatches

    data = [torch.arange(9).reshape(1, 9) + i for i in range(6)]
    two = IterableBatches(data, torch.device("cpu"), processes=2)
    two.next_batch()
    one = IterableBatches(data, torch.device("cpu"), processes=1)
    with pytest.raises(ValueError, match=r"split among 2 process\(es\), this run has 1; resume with 2"):
        one.load_state_dict(two.state_dict())
    again = IterableBatches(data, torch.device("cpu"), processes=2)
    again.load_state_dict(two.state_dict())
    assert torch.equal(again.next_batch()[0], data[1][:, :-1])
    one.load_state_dict({"epoch": 0, "position": 1})  # saved before the world size was recorded
