"""Loss spikes (training.on_loss_spike): a planted stretch of random tokens in a learnable sequence,
a learning rate high enough for it to throw the run off, and what each policy makes of it."""

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import kill9_when, once_per_session, tiny_loaders, tiny_model

LENGTH, BATCH, PERIOD = 16, 4, 64
ROWS_PER_STEP = BATCH
PLANTED_ROWS = (120, 132)  # rows 120..131: the batches of steps 31, 32 and 33
LR = 3e-2


def tokens(planted: bool) -> np.ndarray:
    """A sequence of period 64 (learnable by heart); `planted`: random tokens inside rows 120..131, leaving
    the token row 119 ends on and row 132 starts on (rows overlap by one token) untouched. The period
    divides the planted rows' span, so skipping those rows leaves exactly the clean sequence."""
    base = np.random.default_rng(0).integers(0, 61, size=PERIOD)
    t = np.tile(base, 100)[: LENGTH * BATCH * 70 + 1].astype(np.uint16)
    if planted:
        a, b = PLANTED_ROWS[0] * LENGTH + 1, PLANTED_ROWS[1] * LENGTH
        t[a:b] = np.random.default_rng(1).integers(0, 61, size=b - a)
    return t


def config(output_dir: Path, policy: str, **overrides):
    from llm_trainer.config import TrainingConfig

    values = dict(
        max_steps=60,
        learning_rate=LR,
        lr_scheduler="constant",
        save_steps=5,
        eval_steps=0,
        logging_steps=1,
        output_dir=str(output_dir),
        device="cpu",
        use_amp=False,
        progress_bar=False,
        report_to=["jsonl"],
        on_loss_spike=policy,
        loss_spike_warmup=10,
        max_rewinds=5,
        save_total_limit=None,
    )
    values.update(overrides)
    return TrainingConfig(**values)


def trainer(output_dir: Path, policy: str, planted: bool, callbacks=(), **overrides):
    from llm_trainer.data.batches.loader import BatchLoader, WindowRows
    from llm_trainer.train.trainer import Trainer

    loader = BatchLoader(WindowRows(tokens(planted), LENGTH), BATCH, shuffle=False)
    return Trainer(tiny_model(), config(output_dir, policy, **overrides), train_dataloader=loader, callbacks=callbacks)


def losses(output_dir: Path) -> dict[int, float]:
    """Each step's training loss; metrics.jsonl holds one row per step (a rewind drops the rows after its checkpoint)."""
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), steps
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def policy_runs(root: Path) -> dict:
    """{name: (losses by step, trainer, summary)} of the clean run and the planted data under warn, skip
    and rewind (also what bench/spike_figures.py prints)."""
    out = {}
    for name, policy, planted in (
        ("clean", "off", False),
        ("warn", "warn", True),
        ("skip", "skip", True),
        ("rewind", "rewind", True),
    ):
        t = trainer(root / name, policy, planted)
        summary = t.train()
        out[name] = (losses(root / name), t, summary)
    return out


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict:
    """`policy_runs`, trained once per session (xdist workers included): {name: (losses by step, what
    the tests read of its trainer, summary)}; of the trainer, the loader's skipped sample ranges
    (`skip`) and how many losses the spike monitor holds (`loss_history`)."""
    folder = once_per_session(tmp_path_factory, "spikes", _write_policy_runs)
    return {
        name: ({int(step): loss for step, loss in losses.items()}, seen, summary)
        for name, (losses, seen, summary) in json.loads((folder / "runs.json").read_text()).items()
    }


def _write_policy_runs(folder: Path) -> None:
    seen = {}
    for name, (losses, t, summary) in policy_runs(folder).items():
        history = t.state.spike_history  # None where no monitor ran (the clean run)
        seen[name] = (losses, {"skip": t.train_loader.skip, "loss_history": history and len(history["loss"])}, summary)
    (folder / "runs.json").write_text(json.dumps(seen))


def test_the_planted_range_makes_the_loss_spike_and_warn_only_reports_it(runs):
    clean, (warned, _, summary) = runs["clean"][0], runs["warn"]
    assert all(warned[s] == clean[s] for s in range(1, 31))  # the same run up to the planted rows
    assert warned[31] > 3 * max(clean[s] for s in range(21, 31))
    assert summary["loss_spikes"] >= 1 and summary["rewinds"] == 0
    after = np.mean([warned[s] for s in range(34, 44)])
    assert after > 1.2 * np.mean([clean[s] for s in range(34, 44)])  # thrown off by the update


def test_rewind_skips_exactly_the_planted_range_and_rejoins_the_clean_run(runs):
    clean = runs["clean"][0]
    rewound, t, summary = runs["rewind"]
    # Each spiking batch sent the run back to checkpoint 30 and was added to the skipped range.
    assert t["skip"] == [list(PLANTED_ROWS)]
    assert summary["rewinds"] == 3 and summary["loss_spikes"] == 3
    # With the planted rows skipped the data is the clean sequence: the same losses as the clean run.
    assert sorted(rewound) == sorted(clean) == list(range(1, 61))
    for s in range(1, 61):
        assert math.isclose(rewound[s], clean[s], rel_tol=1e-5), (s, rewound[s], clean[s])


def test_skip_never_applies_a_spiking_step(runs):
    skipped, t, summary = runs["skip"]
    clean = runs["clean"][0]
    assert summary["loss_spikes"] == 3 and summary["rewinds"] == 0
    assert all(skipped[s] > 3 * clean[s] for s in (31, 32, 33))  # reported, not applied
    # Three steps not applied: from then on the clean run's losses, three steps late.
    for s in range(31, 58):
        assert math.isclose(skipped[s + 3], clean[s], rel_tol=1e-5), (s, skipped[s + 3], clean[s])
    assert t["loss_history"] == 60  # every step's loss, spikes included


def test_at_most_max_rewinds_then_the_spike_is_skipped(tmp_path):
    """Checkpoints every 4 steps: the spike at step 31 rewinds to step 28 and skips rows 112..123 (all read
    since that checkpoint); the two later spiking batches find max_rewinds used up and are skipped."""
    t = trainer(tmp_path / "run", "rewind", True, max_rewinds=1, max_steps=40, save_steps=4)
    summary = t.train()
    assert summary["rewinds"] == 1 and summary["loss_spikes"] == 3
    assert t.train_loader.skip == [(112, 124)]
    assert sorted(losses(tmp_path / "run")) == list(range(1, 41))  # steps 29-30 logged once: the rows after 28 dropped


def test_rewind_needs_a_loader_that_can_skip(tmp_path):
    from llm_trainer.config import TrainingConfig
    from llm_trainer.errors import UsageError
    from llm_trainer.train.trainer import Trainer

    train, _ = tiny_loaders()
    batches = [train.next_batch()[:2] for _ in range(4)]  # a plain list of batches: no skip ranges
    config = TrainingConfig(
        max_steps=2, on_loss_spike="rewind", save_steps=1, output_dir=str(tmp_path / "run"), device="cpu"
    )
    with pytest.raises(UsageError, match="on_loss_spike=rewind needs a loader that can skip"):
        Trainer(tiny_model(), config, train_dataloader=batches).train()


@pytest.mark.parametrize("curriculum", [False, True])
def test_a_skipped_range_is_passed_over_and_survives_the_saved_position(curriculum):
    """Batches starting inside a skipped global sample range are never returned, across epochs and
    curriculum stages; a loader restored from the saved position skips the same ones."""
    from llm_trainer.config import CurriculumStage
    from llm_trainer.data.batches.curriculum import CurriculumLoader
    from llm_trainer.data.batches.loader import BatchLoader, WindowRows

    rows = WindowRows(tokens(False)[: 40 * LENGTH + 1], LENGTH)  # 40 rows: 10 batches an epoch

    def loader():
        if curriculum:
            stages = [CurriculumStage(until_step=4, max_difficulty=25.0)]
            return CurriculumLoader(rows, BATCH, difficulty=np.arange(40, dtype=np.float64), stages=stages, seed=3)
        return BatchLoader(rows, BATCH, shuffle=True, seed=3)

    plain = loader()
    every = [plain.next_batch()[0] for _ in range(24)]
    skipping = loader()
    skipping.skip = [(8, 16), (36, 48)]  # batches 2-3 and 9-11 (the last of epoch 0, the first two of epoch 1)
    kept = [i for i in range(24) if i not in (2, 3, 9, 10, 11)]
    got = [skipping.next_batch()[0] for _ in range(10)]
    assert all(torch.equal(a, every[i]) for a, i in zip(got, kept[:10]))
    restored = loader()
    restored.load_state_dict(json.loads(json.dumps(skipping.state_dict())))
    rest = [restored.next_batch()[0] for _ in range(len(kept) - 10)]
    assert all(torch.equal(a, every[i]) for a, i in zip(rest, kept[10:]))


@pytest.mark.slow
def test_sigkill_after_a_rewind_then_resume_gives_the_same_losses(tmp_path, runs):
    """The skipped range and the monitor's window are checkpointed: killed after the rewind, resumed,
    the run logs the uninterrupted rewinding run's losses."""
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from llm_trainer.train.callbacks import Callback
        from test_spikes import trainer

        class Slow(Callback):  # steps after the rewind's checkpoints take a while: the kill lands mid-run
            def on_step_end(self, trainer, row):
                if row["step"] >= 42:
                    time.sleep(0.5)

        trainer(__import__("pathlib").Path({str(out)!r}), "rewind", True, callbacks=[Slow()]).train()
        """
    )
    kill9_when(script, lambda: (out / "checkpoints" / "checkpoint-00000045").exists(), "checkpoint 45")
    resumed = trainer(out, "rewind", True, resume_from_checkpoint="latest")
    summary = resumed.train()
    assert resumed.train_loader.skip == [PLANTED_ROWS]
    assert summary["rewinds"] == 3
    expected = runs["rewind"][0]
    got = losses(out)
    assert sorted(got) == list(range(1, 61))
    for s in range(1, 61):
        assert math.isclose(got[s], expected[s], rel_tol=1e-6), (s, got[s], expected[s])


@pytest.mark.parametrize("metric", ["grad_norm", "either"])
def test_the_gradient_norm_can_be_watched_instead_or_too(tmp_path, metric):
    t = trainer(tmp_path / "run", "skip", True, max_steps=36, loss_spike_metric=metric)
    summary = t.train()
    assert summary["loss_spikes"] >= 1
    assert set(t.state.spike_history) == ({"grad_norm"} if metric == "grad_norm" else {"loss", "grad_norm"})
    assert len(t.state.spike_history["grad_norm"]) == 36
    assert summary["loss_spikes"] < 20  # a new level is learnt within half a window, not refused for ever


# The forward of step 17 returns its logits times 100 (on rank 1 only under torchrun), once: a loss spike.
SPIKE_RUNNER = r"""
import os, sys
import llm_trainer.api as pipeline
from llm_trainer import Callback
from llm_trainer.cli import main


class SpikeAtStep17(Callback):
    def on_train_begin(self, trainer):
        done = []

        def hook(module, inputs, output):
            if trainer.state.step == 16 and os.environ.get("RANK", "1") == "1" and module.training and not done:
                done.append(True)
                return output * 100.0
        trainer.model.register_forward_hook(hook)


original = pipeline.train
pipeline.train = lambda experiment, callbacks=(): original(experiment, callbacks=[*callbacks, SpikeAtStep17()])
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_rewind_under_ddp_equals_the_same_rewind_in_one_process(tmp_path):
    """2 ranks of batch 4 and one process of batch 8 spike at the same step, rewind to the same
    checkpoint, skip the same global sample range and log the same losses."""

    import yaml

    from test_distributed import EXPERIMENT, _env
    from warm_launch import python, torchrun

    lines = [f"the {w} sat on the mat number {i % 7}.\n" for i, w in enumerate(["cat", "dog", "bird", "fox"] * 120)]
    (tmp_path / "corpus.txt").write_text("".join(lines))
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    (tmp_path / "spike.py").write_text(SPIKE_RUNNER)
    args = [
        "train",
        "--config",
        "exp.yaml",
        "training.max_steps=24",
        "training.eval_steps=0",
        "training.save_steps=5",
        "training.on_loss_spike=rewind",
        "training.loss_spike_warmup=8",
    ]
    for name, batch, launch in (("ddp", 4, torchrun), ("single", 8, python)):  # started warm: warm_launch
        run = [*args, f"training.output_dir={name}", f"training.batch_size={batch}"]
        result = launch(tmp_path, run, _env(), script="spike.py")
        assert result.returncode == 0, "\n".join(result.stderr.splitlines()[-60:])
        assert "rewound to checkpoint-00000015 (step 15); the samples [120, 136)" in result.stderr
    ddp, single = losses(tmp_path / "ddp"), losses(tmp_path / "single")
    assert sorted(ddp) == sorted(single) == list(range(1, 25))
    assert [ddp[s] for s in range(1, 25)] == pytest.approx([single[s] for s in range(1, 25)], rel=1e-5)
    final = json.loads((tmp_path / "ddp" / "checkpoints" / "checkpoint-00000024" / "train_state.json").read_text())
    assert final["data"]["skip"] == [[120, 136]] and final["rewinds"] == 1
