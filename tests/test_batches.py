"""Batches from a user's own DataLoader (the Hugging Face style `Trainer(model=, config=).train(train_dataloader=)`):
its batch size is the run's, and dict batches' attention_mask keeps padding out of the loss."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import tiny_model
from llm_trainer.config import TrainingConfig
from llm_trainer.data.batches.loader import IGNORE_INDEX
from llm_trainer.train.trainer import Trainer


def test_a_user_dataloaders_batch_size_is_the_runs_and_the_start_line_says_so(tmp_path, capfd):
    tokens = torch.from_numpy((np.arange(30 * 17) % 61).astype(np.int64)).reshape(30, 17)
    loader = torch.utils.data.DataLoader(tokens, batch_size=3)  # the guide's config has no batch size: the loader's
    config = TrainingConfig(
        gradient_accumulation_steps=2, output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False
    )  # our TrainingConfig in the HF-style call (a dict: the Hindi test)
    summary = Trainer(model=tiny_model(), config=config).train(train_dataloader=loader, num_epochs=2)
    assert "effective batch 6 = 3 x 2 accumulation x 1 process(es)" in capfd.readouterr().err
    assert summary["step"] == 2 * 5  # 10 batches a epoch, 2 per step, 2 epochs


def test_a_plain_list_of_batches_and_a_model_of_the_user_s_get_a_true_start_line(tmp_path, capfd):
    """A list of (4, 17) token tensors: the effective batch is 4, not the config's default 8; a model of
    the user's is not said to write attention out (only llm-trainer's models do that)."""

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(61, 61)

        def forward(self, x, targets=None):
            logits = self.table(x)
            if targets is None:
                return logits
            return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    batches = [torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    config = {"max_steps": 3, "output_dir": str(tmp_path / "run"), "device": "cpu", "progress_bar": False}
    Trainer(model=Bigram(), config=config).train(train_dataloader=batches)
    start = next(line for line in capfd.readouterr().err.splitlines() if line.startswith("train: "))
    assert "effective batch 4 = 4 x 1 accumulation x 1 process(es)" in start, start
    assert start.endswith("the model's SDPA calls, if any: flash (auto)") and "written out" not in start, start


def test_padding_is_never_a_target():
    """Dict batches with attention_mask: padded positions are masked from the labels, so what the pad
    holds cannot change the loss (nor, hence, the gradient)."""
    from llm_trainer.parallel.distributed import DistInfo
    from llm_trainer.parallel.strategies import Parallelism
    from llm_trainer.train.batches import IterableBatches
    from llm_trainer.train.step import autocast, train_step

    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    inputs, targets = IterableBatches([{"input_ids": ids, "attention_mask": mask}], torch.device("cpu")).next_batch()
    assert targets.tolist() == [[6, 7, 8, IGNORE_INDEX, IGNORE_INDEX], [10, 11, 12, 13, 14]]

    losses, grads = [], []
    for pad in (0, 33):
        model = tiny_model(max_seq_len=8)
        padded = ids.masked_fill(mask == 0, pad)
        batch = IterableBatches([{"input_ids": padded, "attention_mask": mask}], torch.device("cpu")).next_batch()
        parallel = Parallelism(
            model,
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            dist=DistInfo(),
            device=torch.device("cpu"),
            amp_dtype=None,
        )
        parallel.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients to compare
        losses.append(
            float(train_step(parallel, [batch], autocast=autocast(torch.device("cpu"), None), max_grad_norm=None).loss)
        )
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[0] == losses[1]
    torch.testing.assert_close(grads[0], grads[1])


def _rows(run, kind: str) -> list[dict]:
    import json

    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_later_train_calls_train_on_in_stages_over_their_own_data(tmp_path):
    """The curriculum of the Hindi trainer's document, `train_on(easy, epochs=1)` then `train_on(hard,
    epochs=2)`: each call trains its epochs of its own data after the steps already taken, in one run;
    a call with nothing more to train says so instead of training no step."""
    import pytest

    from llm_trainer.errors import UsageError

    easy = torch.arange(20 * 9).reshape(20, 9) % 7  # ids 0-6
    hard = 30 + torch.arange(40 * 9).reshape(40, 9) % 30  # ids 30-59, never in the easy stage
    run = tmp_path / "run"
    config = TrainingConfig(output_dir=str(run), device="cpu", progress_bar=False, logging_steps=1, save_steps=0)
    trainer = Trainer(model=tiny_model(), config=config)
    first = trainer.train(train_dataloader=torch.utils.data.DataLoader(easy, batch_size=4), num_epochs=1)
    assert first["step"] == 5
    embedding = trainer.model.tok_emb.weight.detach().clone()
    second = trainer.train(train_dataloader=torch.utils.data.DataLoader(hard, batch_size=4), num_epochs=2)
    assert second["step"] == 5 + 2 * 10
    assert second["tokens_seen"] == first["tokens_seen"] + 2 * 40 * 8
    changed = (trainer.model.tok_emb.weight.detach() != embedding).any(dim=1)
    assert changed[30:60].all()  # the second stage read its own data, whose ids the first never saw
    assert [r["step"] for r in _rows(run, "train")] == list(range(1, 26))
    assert [r["step"] for r in _rows(run, "summary")] == [5, 25]
    assert trainer.train()["step"] == 45  # again: as many epochs more, of the data it was last given

    bounded = Trainer(
        model=tiny_model(), config=dataclasses.replace(config, output_dir=str(tmp_path / "b"), max_steps=2)
    )
    assert bounded.train(train_dataloader=torch.utils.data.DataLoader(easy, batch_size=4))["step"] == 2
    with pytest.raises(UsageError, match=r"has trained to its last step \(2\); to train on, pass the data"):
        bounded.train()
    bounded.config.max_steps = 3  # raised in between: on to it
    assert bounded.train()["step"] == 3


def test_a_trainer_of_ones_own_refuses_a_folder_that_holds_a_run(tmp_path):
    """The Python API keeps what `llm-trainer train` keeps: a second Trainer into a finished run's folder
    is refused in one line, the run's files untouched; --overwrite's setting starts over."""
    import pytest

    from llm_trainer.errors import UsageError

    data = torch.arange(16 * 9).reshape(16, 9) % 7
    run = tmp_path / "run"

    def trainer(**overrides) -> Trainer:
        config = TrainingConfig(output_dir=str(run), device="cpu", progress_bar=False, save_steps=2, **overrides)
        return Trainer(model=tiny_model(), config=config)

    trainer(max_steps=4).train(train_dataloader=torch.utils.data.DataLoader(data, batch_size=4))
    before = (run / "metrics.jsonl").read_bytes(), sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(UsageError, match=r"holds a finished run \(it ended at step 4\)"):
        trainer(max_steps=2).train(train_dataloader=torch.utils.data.DataLoader(data, batch_size=4))
    assert ((run / "metrics.jsonl").read_bytes(), sorted(p.name for p in (run / "checkpoints").iterdir())) == before
    trainer(max_steps=2, overwrite_output_dir=True).train(
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=4)
    )
    assert [r["step"] for r in _rows(run, "summary")] == [2]


def test_evaluate_takes_a_loader_of_ones_own_as_the_hf_style_does():
    """`trainer.evaluate(test_loader)`: the loss over all of that loader, equal to the loss computed
    directly with the model; `evaluate()` alone still reads the validation loader."""
    import math

    import torch.nn.functional as F

    test = torch.arange(12 * 9).reshape(12, 9) % 7
    config = TrainingConfig(device="cpu", progress_bar=False, max_steps=1, save_steps=0)
    trainer = Trainer(model=tiny_model(), config=config)
    out = trainer.evaluate(torch.utils.data.DataLoader(test, batch_size=5))
    with torch.no_grad():
        logits = trainer.model(test[:, :-1])
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), test[:, 1:].reshape(-1)).item()
    assert math.isclose(out["val_loss"], expected, rel_tol=1e-4)  # (the run evaluates in its autocast)
    assert math.isclose(out["perplexity"], math.exp(out["val_loss"]), rel_tol=1e-9)


def test_the_best_model_is_chosen_over_the_batches_every_evaluation_covers(tmp_path):
    """Evaluations capped at eval_max_batches, then the run's last one over the whole split: the best
    model and early stopping compare the last one's first batches with the others, never a whole split's
    loss (here far higher: its later batches are noise) with a part's."""
    import json

    from llm_trainer.data.batches.loader import BatchLoader, WindowRows

    pattern = (np.cumsum(np.random.default_rng(0).integers(1, 3, size=3000)) % 61).astype(np.int64)
    noise = np.random.default_rng(1).integers(0, 61, size=3 * 4 * 16 + 1)
    train = BatchLoader(WindowRows(pattern, 16), 4, shuffle=True, seed=0)
    val = BatchLoader(WindowRows(np.concatenate([pattern[: 4 * 16], noise]), 16), 4, shuffle=False)
    config = TrainingConfig(
        max_steps=15,
        eval_steps=5,
        eval_max_batches=1,
        learning_rate=1e-2,
        save_steps=0,
        output_dir=str(tmp_path / "r"),
        device="cpu",
        progress_bar=False,
        use_amp=False,
    )
    trainer = Trainer(model=tiny_model(max_seq_len=16), config=config, train_dataloader=train, val_dataloader=val)
    summary = trainer.train()
    evals = [
        r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"
    ]
    assert [(r["step"], r["batches"]) for r in evals] == [(5, 1), (10, 1), (15, 4)]
    assert evals[-1]["val_loss"] > evals[0]["val_loss"]  # the whole split's loss: not comparable with the others
    first_batch = trainer.evaluate()["val_loss"]  # the final model over the batch the others covered
    assert first_batch < evals[1]["val_loss"] and trainer.state.best_step == 15
    assert summary["best_val_loss"] == pytest.approx(first_batch)
    meta = json.loads((tmp_path / "r" / "checkpoints" / "best_model" / "meta.json").read_text())
    assert meta["metrics"]["step"] == 15


def test_a_saved_pass_start_that_cannot_be_replayed_is_refused_and_leaves_torchs_random_state():
    """A position whose `epoch_start` holds torch's state but a generator state the DataLoader's generator
    refuses: a TypeError, and torch's random stream goes on where it was (nothing half-restored)."""
    import base64

    from llm_trainer.train.batches import IterableBatches, _encoded

    rows = torch.arange(8 * 5).reshape(8, 5)
    data = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    loader = IterableBatches(data, torch.device("cpu"))
    torch.manual_seed(3)
    elsewhere = _encoded(torch.get_rng_state())
    torch.manual_seed(4)
    before = torch.get_rng_state()
    broken = {"torch": elsewhere, "generator": base64.b64encode(b"not a state").decode("ascii")}
    with pytest.raises(TypeError, match="does not hold torch's random states"):
        loader.load_state_dict({"epoch": 1, "position": 1, "processes": 1, "epoch_start": broken})
    assert torch.equal(torch.get_rng_state(), before)
