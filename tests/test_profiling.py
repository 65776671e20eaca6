"""training.profile_steps: a torch.profiler trace of chosen steps, with the loop's phases named."""

import json
from collections import defaultdict

import pytest

from conftest import tiny_loaders, tiny_model


def test_profile_steps_write_a_trace_of_those_steps_with_the_loop_phases_named(tmp_path):
    from llm_trainer.config import TrainingConfig
    from llm_trainer.train.trainer import Trainer

    train, val = tiny_loaders()
    config = TrainingConfig(
        max_steps=6,
        profile_steps=[3, 4],
        save_steps=2,
        eval_steps=2,
        eval_max_batches=2,
        logging_steps=1,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        report_to=["jsonl"],
    )
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()

    (trace,) = (tmp_path / "run" / "profile").glob("*.pt.trace.json")
    assert trace.name == "rank0.steps-3-4.pt.trace.json"
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = defaultdict(list)
    for e in events:
        spans[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= set(spans) and "ProfilerStep#5" not in spans
    for phase in ("data", "forward_backward", "optimizer", "logging", "evaluation", "checkpoint"):
        assert phase in spans, phase
    assert len(spans["forward_backward"]) == 2 and len(spans["optimizer"]) == 2  # one each per profiled step
    # Each phase lies inside a profiled step; the model's own operators are traced too.
    steps = spans["ProfilerStep#3"] + spans["ProfilerStep#4"]
    for phase in ("data", "forward_backward", "optimizer", "checkpoint"):
        assert all(any(a <= s and e <= b for a, b in steps) for s, e in spans[phase]), phase
    assert any(name.startswith("aten::") for name in spans)


def test_profile_steps_beyond_a_run_sized_in_epochs_are_refused_before_training(tmp_path):
    from llm_trainer.config import TrainingConfig
    from llm_trainer.errors import UsageError
    from llm_trainer.train.trainer import Trainer

    train, _ = tiny_loaders()
    config = TrainingConfig(
        num_epochs=1, profile_steps=[5, 5000], output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False
    )
    with pytest.raises(UsageError, match=r"profile_steps \[5, 5000\] ends after the run's last step \(\d+\)"):
        Trainer(tiny_model(), config, train_dataloader=train).train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_out_of_device_memory_is_one_line_naming_the_knobs(tmp_path):
    """A model whose forward runs out of device memory (raised here by a user's own module, as the
    allocator raises it): the run ends with a UsageError (one line, exit 2) saying what to lower."""
    import torch

    from llm_trainer.config import TrainingConfig
    from llm_trainer.errors import UsageError
    from llm_trainer.train.trainer import Trainer

    class Hungry(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_model()

        def forward(self, x, **kwargs):
            if self.training:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return self.inner(x, **kwargs)

    train, _ = tiny_loaders()
    config = TrainingConfig(max_steps=2, output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False)
    with pytest.raises(UsageError) as error:
        Trainer(Hungry(), config, train_dataloader=train).train()
    message = str(error.value)
    assert "\n" not in message and message.startswith("out of device memory (CUDA out of memory.")
    assert "training.batch_size (now 8)" in message and "training.gradient_checkpointing=true" in message
    assert "training.memory_snapshot=true" in message


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_memory_snapshot_on_cuda_is_written_after_the_profiled_steps(tmp_path):
    import pickle

    import torch

    from llm_trainer.config import TrainingConfig
    from llm_trainer.train.trainer import Trainer

    train, _ = tiny_loaders()
    train.device = torch.device("cuda")
    config = TrainingConfig(
        max_steps=4,
        profile_steps=[2, 3],
        memory_snapshot=True,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
        device="cuda",
        progress_bar=False,
        report_to=["jsonl"],
    )
    Trainer(tiny_model(), config, train_dataloader=train).train()
    profile = tmp_path / "run" / "profile"
    assert (profile / "rank0.steps-2-3.pt.trace.json").is_file()
    snapshot = pickle.loads((profile / "memory_snapshot.rank0.pickle").read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])
