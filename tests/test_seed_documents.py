"""The five seed documents (../shared/seeds) typed as written: their code blocks, config files and
commands, scaled down to tiny sizes, with local data instead of Hub dataset names, and nothing else
changed. Every change to a block is spelled out in its `scaled(...)` call, which fails when the
document no longer holds the text it replaces.

What a document shows of its own internals (their factories, SpeedMonitor, orchestrators) is its code,
not something a user types at us; where it calls its own trainer class, ours stands in for it.
One test or more per bullet of issue #14; the slow ones train through the CLI or several processes.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO_SRC, src_env, write_corpus
from llm_trainer.cli import main
from llm_trainer.config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig, load_experiment
from llm_trainer.data.loader import IGNORE_INDEX, BatchLoader, WindowRows
from llm_trainer.errors import UsageError
from llm_trainer.model import Transformer
from llm_trainer.train.trainer import Trainer

REPO = REPO_SRC.parent
SEEDS = REPO.parent / "shared" / "seeds"
TRAIN_SCRIPT = REPO / "scripts" / "train.py"

pytestmark = pytest.mark.skipif(not SEEDS.is_dir(), reason=f"the seed documents are not at {SEEDS}")


# -- reading the documents -------------------------------------------------------------------------


def document(number: int) -> str:
    (path,) = SEEDS.glob(f"{number:03d}_*.txt")
    return path.read_text(encoding="utf-8")


def blocks(number: int, lang: str) -> list[str]:
    """A document's code blocks in `lang`: Markdown fences, or reStructuredText `.. code-block::`."""
    text = document(number)
    found = [m.group(1) for m in re.finditer(rf"```{lang}\n(.*?)```", text, re.S)]
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == f".. code-block:: {lang}":
            body, indent = [], None
            for item in lines[i + 1 :]:
                if indent is None and (not item.strip() or item.strip().startswith(":")):
                    continue
                width = len(item) - len(item.lstrip())
                indent = width if indent is None else indent
                if item.strip() and width < indent:
                    break
                body.append(item[indent:])
            found.append("\n".join(body).strip() + "\n")
    return found


def block(number: int, lang: str, containing: str) -> str:
    (found,) = [b for b in blocks(number, lang) if containing in b]
    return found


def scaled(text: str, changes: dict[str, str]) -> str:
    """`text` with each change made; each must apply (a document that changed fails loudly)."""
    for old, new in changes.items():
        assert old in text, f"the seed block no longer holds {old!r}"
        text = text.replace(old, new)
    return text


def hf_local_dataset(folder: Path, n_train: int = 120, n_val: int = 20) -> Path:
    """A local stand-in for a Hub dataset with `train` and `validation` splits: one text file each,
    one document per line (what `datasets` makes of a folder of .txt files)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"the cat number {i} sat on the mat near the dog {i % 7}." for i in range(n_train + n_val)]
    (folder / "train.txt").write_text("\n".join(lines[:n_train]) + "\n")
    (folder / "validation.txt").write_text("\n".join(lines[n_train:]) + "\n")
    return folder


def cli(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**src_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(run: Path, kind: str | None = None) -> list[dict]:
    found = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in found if kind is None or r["kind"] == kind]


def tiny_trainer_data(n_tokens: int = 3000, length: int = 16):
    t = (np.cumsum(np.random.default_rng(0).integers(1, 3, size=n_tokens)) % 61).astype(np.uint16)
    train = BatchLoader(WindowRows(t, length), 4, shuffle=True, seed=0)
    val = BatchLoader(WindowRows(t[:600], length, keep_partial=True), 4, shuffle=False, drop_last=False)
    return train, val


def tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        ModelConfig(**{**dict(vocab_size=61, d_model=16, n_heads=2, n_layers=1, max_seq_len=24), **overrides})
    )


# ==================================================================================================
# 001: the training guide


GUIDE_MODEL = {
    "vocab_size=50000": "vocab_size=1024",
    "d_model=768": "d_model=16",
    "n_heads=12": "n_heads=2",
    "n_layers=12": "n_layers=1",
    "d_ff=3072": "d_ff=32",
    "max_seq_len=1024": "max_seq_len=32",
}
GUIDE_TRAINING = {
    "batch_size=8": "batch_size=4",
    "warmup_steps=2000": "warmup_steps=2",
    "gradient_accumulation_steps=8": "gradient_accumulation_steps=2",
    "save_steps=2000": "save_steps=4",
    "eval_steps=1000": "eval_steps=2",
    "logging_steps=100": "logging_steps=1",
}


def guide_configs(tmp_path: Path) -> dict:
    """The guide's ModelConfig / TrainingConfig / DataConfig blocks, executed as written (scaled)."""
    local = hf_local_dataset(tmp_path / "wikitext-local")
    namespace: dict = {}
    exec(scaled(block(1, "python", "vocab_size=50000"), GUIDE_MODEL), namespace)
    exec(scaled(block(1, "python", 'report_to=["tensorboard"]        # Monitoring tools'), GUIDE_TRAINING), namespace)
    exec(
        scaled(
            block(1, "python", 'dataset_config="wikitext-103-raw-v1"'),
            {
                'dataset_name="wikitext"': f'dataset_name="{local}"',
                'dataset_config="wikitext-103-raw-v1"': "dataset_config=None",
                "max_length=1024": "max_length=32",
                "preprocessing_num_workers=8": "preprocessing_num_workers=2",
            },
        ),
        namespace,
    )
    return namespace


def custom_trainer_class(namespace: dict) -> type:
    """The guide's CustomTrainer, as written, with the two metric functions it leaves to the reader."""
    namespace.update(Trainer=Trainer, compute_custom_metric=lambda: 0.25, compute_another_metric=lambda: 0.5)
    exec(block(1, "python", "class CustomTrainer(Trainer):"), namespace)
    return namespace["CustomTrainer"]


def test_001_custom_trainer_logs_through_metrics_tracker_at_current_step(tmp_path):
    """The CustomTrainer block: `_log_metrics(self, loss)` gets each row, `super()._log_metrics(loss)`
    logs it, and `self.metrics_tracker.update(custom_metrics, self.current_step)` adds a custom row."""
    CustomTrainer = custom_trainer_class({})
    train, val = tiny_trainer_data()
    config = TrainingConfig(
        max_steps=4,
        logging_steps=2,
        eval_steps=2,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
    )
    trainer = CustomTrainer(tiny_model(), config, train_dataloader=train, val_dataloader=val)
    assert trainer.current_step == 0
    trainer.train()
    assert trainer.current_step == 4
    logged = rows(tmp_path / "run")
    custom = [r for r in logged if r["kind"] == "custom"]
    # one custom row after each row the loop logged (train and eval at steps 2 and 4, the summary at 4)
    assert [r["step"] for r in custom] == [r["step"] for r in logged if r["kind"] != "custom"] == [2, 2, 4, 4, 4]
    assert all(r["custom/metric1"] == 0.25 and r["custom/metric2"] == 0.5 for r in custom)
    assert [r["kind"] for r in logged if r["kind"] != "custom"] == ["train", "eval", "train", "eval", "summary"]
    from llm_trainer.train.metrics import scalar_items

    assert scalar_items(custom[0]) == [
        ("custom/metric1", 0.25),
        ("custom/metric2", 0.5),
    ]  # TensorBoard/W&B/MLflow names
    assert scalar_items({"kind": "custom", "step": 1, "accuracy": 0.5}) == [("accuracy", 0.5)]


@pytest.mark.slow
def test_001_the_guide_trains_logs_resumes_and_exports(tmp_path, monkeypatch):
    """The guide's three configs -> CustomTrainer.from_config -> train; TensorBoard at ./checkpoints/logs
    beside metrics.jsonl and console lines; `plot`; `scripts/train.py --resume_from_checkpoint
    ./checkpoints/checkpoint-N.pt` resumes exactly; best_model exports."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace = guide_configs(tmp_path)
    trainer = custom_trainer_class(namespace).from_config(
        namespace["model_config"], namespace["training_config"], namespace["data_config"]
    )
    summary = trainer.train()
    steps = summary["step"]
    assert steps > 4 and (tmp_path / "checkpoints" / "best_model" / "model.safetensors").is_file()

    # report_to=["tensorboard"]: TensorBoard where the guide looks, and metrics.jsonl all the same
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "checkpoints" / "logs"))
    events.Reload()
    assert {"train/loss", "eval/loss", "custom/metric1"} <= set(events.Tags()["scalars"])
    output = Path(namespace["training_config"].output_dir)
    first = rows(output, "train")
    assert [r["step"] for r in first] == list(range(1, steps + 1))
    assert main(["plot", str(output)]) == 0 and (output / "plots" / "loss_vs_steps.png").is_file()

    # the command line: the same experiment as config.json, resumed from the guide's checkpoint-N.pt name
    experiment = ExperimentConfig(
        model=namespace["model_config"], training=namespace["training_config"], data=namespace["data_config"]
    )
    (tmp_path / "config.json").write_text(json.dumps(experiment.to_dict()))
    kept = min(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").glob("checkpoint-*"))  # save_total_limit
    command = scaled(
        block(1, "bash", "--resume_from_checkpoint"), {"checkpoint-10000.pt": f"checkpoint-{kept}.pt"}
    ).split()
    assert command[:2] == ["python", "scripts/train.py"]
    result = cli(tmp_path, sys.executable, str(TRAIN_SCRIPT), *command[2:])
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        f"checkpoints/checkpoint-{kept}.pt is the checkpoint folder checkpoints/checkpoint-{kept:08d}" in result.stderr
    )
    # the replayed steps' rows replace the first run's, so metrics.jsonl reads as one run with the same losses
    after = rows(output, "train")
    assert [r["step"] for r in after] == list(range(1, steps + 1))
    assert [r["loss"] for r in after] == [r["loss"] for r in first]  # exact resume
    ran_again = [int(line.split()[2]) for line in result.stderr.splitlines() if line.startswith("train step")]
    assert ran_again == list(range(kept + 1, steps + 1))

    assert main(["export", "--checkpoint", "checkpoints/best_model", "--output", "hf"]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "python -m torch.distributed.launch"])
def test_001_multi_gpu_commands_as_written(tmp_path, launcher):
    """Both launch commands of the guide, with 2 processes (CPU, gloo) instead of 4 GPUs."""
    write_corpus(tmp_path / "corpus")
    experiment = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 32},
        "training": {"batch_size": 4, "max_steps": 3, "device": "cpu", "progress_bar": False},
        "data": {"data_files": ["corpus"], "tokenizer": "char"},
    }
    (tmp_path / "config.json").write_text(json.dumps(experiment))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text(TRAIN_SCRIPT.read_text())
    (line,) = [x for x in block(1, "bash", "torchrun").splitlines() if x.startswith(launcher)]
    command = scaled(line, {"--nproc_per_node=4": f"--nproc_per_node=2 --master_port={free_port()}"}).split()
    command[0:1] = [sys.executable, "-m", "torch.distributed.run"] if command[0] == "torchrun" else [sys.executable]
    result = cli(tmp_path, *command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "effective batch 8 = 4 x 1 accumulation x 2 process(es) (ddp)" in result.stderr
    assert [r["step"] for r in rows(tmp_path / "output", "train")] == [3]


def guide_deepspeed_json() -> dict:
    return json.loads(
        scaled(
            block(1, "json", '"train_batch_size": 64'),
            {
                '"train_batch_size": 64': '"train_batch_size": 8',
                '"train_micro_batch_size_per_gpu": 4': '"train_micro_batch_size_per_gpu": 2',
            },
        )
    )


def test_001_deepspeed_json_is_honoured_and_fp16_on_cpu_names_bf16(tmp_path, monkeypatch):
    """Its optimizer section becomes ours (lr 1e-4, weight decay 0.01), its batch sizes set ours; fp16 on
    a CPU is one line that says to use bf16."""
    from llm_trainer.parallel.deepspeed_engine import build_config, merge_into_training

    monkeypatch.chdir(tmp_path)
    (tmp_path / "deepspeed_config.json").write_text(json.dumps(guide_deepspeed_json()))
    namespace = {"TrainingConfig": TrainingConfig}
    exec(block(1, "python", 'deepspeed_config="deepspeed_config.json"'), namespace)
    training = namespace["training_config"]
    with pytest.raises(UsageError, match=r"fp16 needs a CUDA GPU and this run is on cpu: use bf16 instead") as error:
        merge_into_training(training, world_size=1, device=torch.device("cpu"))
    assert "\n" not in str(error.value)

    merged = merge_into_training(training, world_size=1, device=torch.device("cuda"))  # fp16 where it runs
    assert (merged.learning_rate, merged.weight_decay, merged.optimizer) == (1e-4, 0.01, "adamw")
    assert (merged.batch_size, merged.gradient_accumulation_steps) == (2, 4)
    assert (merged.use_amp, merged.amp_dtype) == (True, "float16")
    ds = build_config(merged, world_size=1, d_model=16)
    assert "optimizer" not in ds and ds["train_batch_size"] == 8 and ds["fp16"]["enabled"] is True


def test_deepspeed_conflicts_are_listed_in_one_message(tmp_path):
    """Every disagreement between the file and the training config at once, with both values."""
    from llm_trainer.parallel.deepspeed_engine import merge_into_training

    config = guide_deepspeed_json()
    config["fp16"]["enabled"] = False
    config["scheduler"] = {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}
    training = TrainingConfig(
        use_deepspeed=True, deepspeed_config=config, learning_rate=1e-3, batch_size=4, weight_decay=0.01
    )
    with pytest.raises(UsageError) as error:
        merge_into_training(training, world_size=1, device=torch.device("cpu"))
    message = str(error.value)
    assert "\n" not in message and message.count("(") >= 3
    for part in (
        "train_micro_batch_size_per_gpu=2 but training.batch_size=4",
        "optimizer.params.lr=0.0001 but training.learning_rate=0.001",
        "scheduler.type 'OneCycle' is not supported",
        "train_batch_size=8 but batch_size x gradient_accumulation_steps x world size = 4 x 4 x 1 = 16",
    ):
        assert part in message, message
    assert "weight_decay" not in message  # it agrees


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
            {"lr_scheduler": "constant_with_warmup", "warmup_steps": 10, "learning_rate": 1e-4},
        ),
        (
            {
                "type": "WarmupDecayLR",
                "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 1e-4, "warmup_num_steps": 5, "total_num_steps": 50},
            },
            {"lr_scheduler": "linear", "warmup_steps": 5, "max_steps": 50, "min_lr": 1e-6},
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 40, "warmup_num_steps": 4, "cos_min_ratio": 0.1}},
            {"lr_scheduler": "cosine", "warmup_steps": 4, "max_steps": 40, "min_lr": pytest.approx(1e-5)},
        ),
    ],
)
def test_deepspeed_schedulers_map_onto_ours_and_a_missing_accumulation_is_derived(scheduler, expected):
    from llm_trainer.parallel.deepspeed_engine import merge_into_training

    config = {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 2,
        "scheduler": scheduler,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    merged = merge_into_training(
        TrainingConfig(use_deepspeed=True, deepspeed_config=config), world_size=3, device=torch.device("cpu")
    )
    assert merged.gradient_accumulation_steps == 2  # 12 = 2 x 2 x 3
    assert {key: getattr(merged, key) for key in expected} == expected


def test_001_resume_from_checkpoint_pt_name_is_the_step_folder(tmp_path, monkeypatch):
    from llm_trainer.checkpoint.find import resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    train, _ = tiny_trainer_data()
    config = TrainingConfig(
        max_steps=4, save_steps=2, checkpoint_dir="./checkpoints", output_dir="out", device="cpu", progress_bar=False
    )
    Trainer(tiny_model(), config, train_dataloader=train).train()
    namespace = {"TrainingConfig": TrainingConfig}
    exec(scaled(block(1, "python", "resume_from_checkpoint="), {"checkpoint-10000.pt": "checkpoint-2.pt"}), namespace)
    spec = namespace["training_config"].resume_from_checkpoint
    assert resolve_checkpoint(spec, Path("checkpoints")) == Path("checkpoints/checkpoint-00000002")
    with pytest.raises(UsageError, match="checkpoints holds checkpoint-00000004, checkpoint-00000002"):
        resolve_checkpoint("./checkpoints/checkpoint-3.pt", Path("checkpoints"))


def test_001_tensorboard_goes_to_checkpoint_dir_logs_and_jsonl_stays(tmp_path):
    """report_to=["tensorboard"] alone: console lines and metrics.jsonl are still written (plot and the
    registry read it); TensorBoard writes where `tensorboard --logdir ./checkpoints/logs` looks."""
    pytest.importorskip("tensorboard")
    from llm_trainer.train.metrics import (
        ConsoleLogger,
        JsonlLogger,
        TensorBoardLogger,
        build_loggers,
        close_loggers,
        tensorboard_dir,
    )

    namespace = {"TrainingConfig": TrainingConfig}
    exec(block(1, "python", 'checkpoint_dir="./checkpoints",  # Checkpoint directory'), namespace)
    training = namespace["training_config"]
    assert "tensorboard --logdir ./checkpoints/logs" in document(1)
    assert tensorboard_dir(training) == Path("./checkpoints/logs")
    assert tensorboard_dir(TrainingConfig(output_dir="runs/a")) == Path("runs/a/tensorboard")
    loggers = build_loggers(training.report_to, tmp_path, {}, progress_bar=False, tensorboard_dir=tmp_path / "tb")
    try:
        assert [type(x) for x in loggers] == [ConsoleLogger, JsonlLogger, TensorBoardLogger]
    finally:
        close_loggers(loggers)


# ==================================================================================================
# 004: the Hindi trainer (Hugging Face style: Trainer(model=, tokenizer=, config=) then .train(...))


class PaddedLines(torch.utils.data.Dataset):
    """What the guide's `corpus_builder.create_dataloader` yields: {'input_ids', 'attention_mask'},
    each line right-padded to max_length."""

    def __init__(self, lines, tokenizer, max_length):
        self.items = []
        for line in lines:
            ids = tokenizer.encode(line)[:max_length]
            pad = max_length - len(ids)
            self.items.append(
                {
                    "input_ids": torch.tensor(ids + [tokenizer.eot_id] * pad),
                    "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                }
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def hindi_pipeline(tmp_path: Path, model_factory=None, batch_size: int = 4):
    """The guide's 'Complete Training Example' with our pieces in place of its factories; steps 6 and 7
    (the trainer and its .train call) run as written, with our Trainer for its class."""
    from llm_trainer import build_model
    from llm_trainer.tokenizer import Tokenizer

    text = (REPO / "tests" / "data" / "multilingual" / "hindi.txt").read_text(encoding="utf-8")
    sentences = [s.strip() for s in re.split(r"[।\n]", text) if len(s.strip()) > 5]
    lines = [f"{s} {i}" for i in range(6) for s in sentences]
    tokenizer = Tokenizer.train_bpe(lines, vocab_size=400, max_chars=10**6)
    train_loader = torch.utils.data.DataLoader(
        PaddedLines(lines[6:], tokenizer, 24), batch_size=batch_size, shuffle=True
    )
    val_loader = torch.utils.data.DataLoader(PaddedLines(lines[:6], tokenizer, 24), batch_size=batch_size)
    torch.manual_seed(0)
    model = (
        model_factory
        or (lambda vocab: build_model(ModelConfig(vocab_size=vocab, d_model=32, n_heads=2, n_layers=1, max_seq_len=24)))
    )(tokenizer.vocab_size)
    config = types.SimpleNamespace(
        learning_rate=3e-3,
        weight_decay=0.01,
        project_name="hindi-babylm",
        num_epochs=2,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
    )
    example = block(4, "python", "# 6. Create trainer")
    steps = example[example.index("# 6. Create trainer") : example.index("# 8.")]
    namespace = dict(
        HindiLanguageModelTrainer=Trainer,
        model=model,
        tokenizer=tokenizer,
        config=config,
        train_loader=train_loader,
        val_loader=val_loader,
    )
    exec(steps, namespace)
    return namespace["trainer"], tokenizer


@pytest.mark.slow
def test_004_hindi_trainer_shape_trains_with_a_dict_config_and_the_model_generates_and_exports(tmp_path, capfd):
    trainer, tokenizer = hindi_pipeline(tmp_path)
    err = capfd.readouterr().err
    assert "project_name" in err and "not TrainingConfig fields" in err  # said once, not refused
    assert trainer.config.learning_rate == 3e-3 and trainer.config.weight_decay == 0.01
    run = tmp_path / "run"
    train_rows, evals = rows(run, "train"), rows(run, "eval")
    assert train_rows[-1]["epoch"] == 1 and evals[-1]["val_loss"] < np.log(tokenizer.vocab_size) - 0.5  # it learned
    best = tmp_path / "checkpoints" / "best_model"
    assert (
        main(["generate", "--checkpoint", str(best), "--prompt", "समरसेट", "--max_new_tokens", "5", "--seed", "0"]) == 0
    )
    assert capfd.readouterr().out.startswith("समरसेट")
    assert main(["export", "--checkpoint", str(best), "--output", str(tmp_path / "hf")]) == 0


def test_004_start_line_prints_the_dataloaders_effective_batch(tmp_path, capfd):
    tokens = torch.from_numpy((np.arange(30 * 17) % 61).astype(np.int64)).reshape(30, 17)
    loader = torch.utils.data.DataLoader(tokens, batch_size=3)  # the guide's config has no batch size: the loader's
    config = TrainingConfig(
        gradient_accumulation_steps=2, output_dir=str(tmp_path / "run"), device="cpu", progress_bar=False
    )  # our TrainingConfig in the HF-style call (a dict: the Hindi test)
    summary = Trainer(model=tiny_model(), config=config).train(train_dataloader=loader, num_epochs=2)
    assert "effective batch 6 = 3 x 2 accumulation x 1 process(es)" in capfd.readouterr().err
    assert summary["step"] == 2 * 5  # 10 batches a epoch, 2 per step, 2 epochs


def test_004_padding_is_never_a_target():
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


class Bigram(torch.nn.Module):
    """A user's own model: any module returning logits trains."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(61, 61)

    def forward(self, x):
        return self.table(x)


def test_004_a_model_that_generate_cannot_take_gets_one_line_why(tmp_path, capsys):
    """The HF-style path takes any module; a checkpoint of one that is not our Transformer, or without a
    tokenizer it could save, gets a one-line reason from generate/export (exit 2)."""

    train, _ = tiny_trainer_data()
    for name, model, tokenizer, reason in [
        ("own", Bigram(), None, "holds a test_seed_documents.Bigram model, not llm-trainer's Transformer"),
        ("notok", tiny_model(), object(), "has no tokenizer.json: the Trainer that saved it was given no tokenizer"),
    ]:
        config = {"max_steps": 1, "output_dir": str(tmp_path / name), "device": "cpu", "progress_bar": False}
        Trainer(model=model, tokenizer=tokenizer, config=config).train(train_dataloader=train)
        capsys.readouterr()
        checkpoint = str(tmp_path / name / "checkpoints" / "checkpoint-00000001")
        for command in (
            ["generate", "--checkpoint", checkpoint],
            ["export", "--checkpoint", checkpoint, "--output", "x"],
        ):
            if command[0] == "export":
                pytest.importorskip("transformers")
            assert main(command) == 2
            err = capsys.readouterr().err
            assert reason in err and err.count("\n") == 1, err


# ==================================================================================================
# 003: the pretraining guide's YAML (HF names, model.size, clip_grad_norm, a distributed: section)


def pretraining_yaml(**changes) -> str:
    return scaled(block(3, "yaml", "type: llama"), changes)


def test_003_yaml_as_written_loads_with_every_alias_and_the_distributed_section(tmp_path):
    (tmp_path / "pretrain.yaml").write_text(pretraining_yaml() + "data:\n  data_files: [corpus]\n")
    exp = load_experiment(tmp_path / "pretrain.yaml")
    m, t = exp.model, exp.training
    assert (m.architecture, m.vocab_size, m.d_model, m.d_ff, m.n_layers, m.n_heads, m.max_seq_len, m.rms_norm_eps) == (
        "llama",
        32000,
        4096,
        11008,
        32,
        32,
        4096,
        1e-6,
    )
    assert (t.batch_size, t.gradient_accumulation_steps, t.max_steps, t.warmup_steps, t.max_grad_norm) == (
        32,
        8,
        100000,
        2000,
        1.0,
    )
    assert (t.distributed_strategy, t.fsdp_sharding, t.use_amp, t.gradient_checkpointing) == (
        "fsdp",
        "full_shard",
        True,
        True,
    )
    with torch.device("meta"):
        assert 6.5e9 < Transformer(m).num_parameters() < 6.9e9  # size: 7B and the explicit shape agree: LLaMA-7B

    # size: 7B alone fills the shape; explicit keys win over it
    (tmp_path / "sized.yaml").write_text(
        "model: {type: llama, size: 7B, num_hidden_layers: 2}\ndata: {data_files: [x]}\n"
    )
    sized = load_experiment(tmp_path / "sized.yaml").model
    assert (sized.d_model, sized.n_heads, sized.d_ff, sized.n_layers) == (4096, 32, 11008, 2)


def test_nanogpt_and_hf_names_are_aliases_and_conflicts_are_reported(tmp_path):
    path = tmp_path / "nano.yaml"
    path.write_text(
        "model: {n_embd: 64, n_head: 4, n_layer: 3, block_size: 128, bias: false, dropout: 0.1}\n"
        "training: {max_iters: 50, grad_clip: 0.5, lr: 1.0e-3, warmup_iters: 5, eval_interval: 10, eval_iters: 2, out_dir: o}\n"
        "data: {data_files: [x]}\n"
    )
    exp = load_experiment(path)
    assert (
        exp.model.d_model,
        exp.model.n_heads,
        exp.model.n_layers,
        exp.model.max_seq_len,
        exp.model.bias,
        exp.model.dropout,
    ) == (64, 4, 3, 128, False, 0.1)
    t = exp.training
    assert (
        t.max_steps,
        t.max_grad_norm,
        t.learning_rate,
        t.warmup_steps,
        t.eval_steps,
        t.eval_max_batches,
        t.output_dir,
    ) == (50, 0.5, 1e-3, 5, 10, 2, "o")
    # an override replaces the field however the file spelled it
    assert load_experiment(path, ["model.d_model=32", "training.max_grad_norm=1.0"]).model.d_model == 32

    path.write_text("model: {hidden_size: 64, d_model: 32, n_embd: 64}\ndata: {data_files: [x]}\n")
    with pytest.raises(
        UsageError, match=r"model.hidden_size \(64\) and model.d_model \(32\) both set model.d_model; keep one"
    ):
        load_experiment(path)


def test_003_every_unknown_key_in_one_error_with_hints_that_know_the_aliases(tmp_path):
    path = tmp_path / "typos.yaml"
    path.write_text(
        pretraining_yaml(
            **{
                "num_attention_heads": "num_attention_head",
                "clip_grad_norm": "clip_grad_nrm",
                "sharding_strategy": "sharding_strat",
            }
        )
        + "data:\n  data_files: [x]\n"
    )
    with pytest.raises(UsageError) as error:
        load_experiment(path)
    message = str(error.value)
    assert "\n" not in message and message.count("unknown key") == 3
    assert "unknown key model.num_attention_head; did you mean model.num_attention_heads (= model.n_heads)?" in message
    assert (
        "unknown key training.clip_grad_nrm; did you mean training.clip_grad_norm (= training.max_grad_norm)?"
        in message
    )
    assert "distributed.fsdp_config.sharding_strat; did you mean distributed.fsdp_config.sharding_strategy?" in message
    assert "attention_dropout" not in message


def test_003_fsdp_in_one_process_says_it_shards_nothing(capsys):
    from llm_trainer.parallel.distributed import setup

    dist, _ = setup(TrainingConfig(distributed_strategy="fsdp"), torch.device("cpu"))
    assert dist.world_size == 1
    assert (
        "distributed_strategy=fsdp in one process: nothing is sharded; launch with torchrun" in capsys.readouterr().err
    )


PRETRAIN_SCALED = {
    "hidden_size: 4096": "hidden_size: 32",
    "intermediate_size: 11008": "intermediate_size: 64",
    "num_hidden_layers: 32": "num_hidden_layers: 2",
    "num_attention_heads: 32": "num_attention_heads: 2",
    "max_position_embeddings: 4096": "max_position_embeddings: 32",
    "vocab_size: 32000": "vocab_size: 128",
    "batch_size: 32": "batch_size: 4",
    "gradient_accumulation_steps: 8": "gradient_accumulation_steps: 2",
    "warmup_steps: 2000": "warmup_steps: 1",
    "max_steps: 100000": "max_steps: 4",
}


@pytest.mark.slow
def test_003_yaml_trains_under_fsdp_and_its_sharded_checkpoint_exports(tmp_path):
    write_corpus(tmp_path / "corpus")
    (tmp_path / "pretrain.yaml").write_text(
        pretraining_yaml(**PRETRAIN_SCALED) + "data:\n  data_files: [corpus]\n  tokenizer: char\n"
    )
    alone = cli(
        tmp_path, sys.executable, "-m", "llm_trainer", "train", "--config", "pretrain.yaml", "training.output_dir=alone"
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "nothing is sharded" in alone.stderr

    sharded = cli(
        tmp_path,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master-port={free_port()}",
        "-m",
        "llm_trainer",
        "train",
        "--config",
        "pretrain.yaml",
        "training.output_dir=fsdp",
        "training.batch_size=2",
    )
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "(fsdp)" in sharded.stderr and "amp bfloat16" in sharded.stderr
    final = tmp_path / "fsdp" / "checkpoints" / "checkpoint-00000004"
    assert not (final / "model.safetensors").exists()  # only shards
    result = cli(tmp_path, sys.executable, "-m", "llm_trainer", "export", "--checkpoint", str(final), "--output", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 2


# ==================================================================================================
# 000 and 002: the ZeRO-3 JSON, warnings, early stopping


needs_deepspeed = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode != 0,
    reason="DeepSpeed is not installed (pip install '.[deepspeed]')",
)


def zero3_json(**changes: str) -> dict:
    return json.loads(
        scaled(
            block(0, "json", '"stage": 3'),
            {
                '"train_batch_size": 128': '"train_batch_size": 8',
                '"train_micro_batch_size_per_gpu": 4': '"train_micro_batch_size_per_gpu": 2',
                '"gradient_accumulation_steps": 32': '"gradient_accumulation_steps": 4',
                '"warmup_num_steps": 2000': '"warmup_num_steps": 2',
                '"total_num_steps": 100000': '"total_num_steps": 6',
                **changes,
            },
        )
    )


@pytest.mark.slow
@needs_deepspeed
def test_000_zero3_json_as_written_trains_with_its_own_optimizer_and_schedule_and_warns_once(tmp_path):
    write_corpus(tmp_path / "corpus")
    experiment = {
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 32},
        "training": {
            "use_deepspeed": True,
            "deepspeed_config": "ds_config.json",
            "device": "cpu",
            "progress_bar": False,
            "logging_steps": 1,
            "eval_steps": 3,
        },
        "data": {"data_files": ["corpus"], "tokenizer": "char"},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(experiment))
    (tmp_path / "ds_config.json").write_text(json.dumps(zero3_json()))
    started = time.monotonic()
    refused = cli(tmp_path, sys.executable, "-m", "llm_trainer", "train", "--config", "exp.yaml")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: training.deepspeed_config"
    )
    assert (
        "fp16 needs a CUDA GPU and this run is on cpu: use bf16" in refused.stderr and time.monotonic() - started < 60
    )

    # what the error says to do: bf16 instead of fp16; nothing else
    (tmp_path / "ds_config.json").write_text(
        json.dumps(
            zero3_json(
                **{
                    '"fp16": {\n        "enabled": true': '"fp16": {\n        "enabled": false',
                    '"bf16": {\n        "enabled": false': '"bf16": {\n        "enabled": true',
                }
            )
        )
    )
    result = cli(tmp_path, sys.executable, "-m", "llm_trainer", "train", "--config", "exp.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "effective batch 8 = 2 x 4 accumulation x 1 process(es)" in result.stderr
    saved = yaml.safe_load((tmp_path / "output" / "config.yaml").read_text())["training"]
    assert (
        saved["learning_rate"],
        saved["weight_decay"],
        saved["adam_beta2"],
        saved["lr_scheduler"],
        saved["max_steps"],
        saved["warmup_steps"],
        saved["amp_dtype"],
    ) == (1e-4, 0.1, 0.95, "linear", 6, 2, "bfloat16")
    lrs = [r["lr"] for r in rows(tmp_path / "output", "train")]
    assert len(lrs) == 6 and lrs[0] == pytest.approx(0.5e-4) and lrs[1] == pytest.approx(1e-4) and lrs[-1] < lrs[1] / 2
    warnings_ = [line for line in result.stderr.splitlines() if "Warning:" in line]
    assert len(warnings_) == len(set(warnings_)), warnings_  # each distinct warning once, not every step


def test_002_best_model_follows_the_lowest_loss_and_min_delta_only_drives_patience(tmp_path):
    """The lesson's EarlyStopping(patience=3, min_delta=0.001) as our two fields: an evaluation lower by
    less than min_delta is still the best model, and does not reset the patience."""
    namespace: dict = {}
    exec(block(2, "python", "class EarlyStopping:"), namespace)
    lesson = namespace["EarlyStopping"](patience=3, min_delta=0.001)
    scripted = iter([3.0, 2.9995, 3.1, 3.2, 3.3])

    class Scripted(Trainer):
        def evaluate(self):
            return {"val_loss": next(scripted), "perplexity": 1.0, "tokens": 1}

    train, val = tiny_trainer_data()
    config = TrainingConfig(
        max_steps=10,
        eval_steps=1,
        save_steps=0,
        early_stopping_patience=lesson.patience,
        early_stopping_min_delta=lesson.min_delta,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
    )
    summary = Scripted(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    stopped = [lesson(loss) for loss in (3.0, 2.9995, 3.1, 3.2)]
    assert stopped == [False, False, False, True] and summary["step"] == 4  # stops where the lesson's class does
    best = json.loads((tmp_path / "run" / "checkpoints" / "best_model" / "meta.json").read_text())
    assert best["metrics"]["step"] == 2 and summary["best_val_loss"] == 2.9995


# ==================================================================================================
# Everywhere


def test_a_fraction_split_over_few_files_splits_by_tokens_and_says_so(tmp_path, capfd):
    """Three files at validation_split 0.1: no document would validate; the last 10% of each one's tokens
    do instead. Enough documents: split by documents, as before. Either way the log says which."""
    from llm_trainer.data.prepare import prepare_data

    folder = tmp_path / "few"
    folder.mkdir()
    texts = ["".join(chr(ord("a") + (i + k) % 26) for i in range(100)) for k in range(3)]
    for k, text in enumerate(texts):
        (folder / f"{k}.txt").write_text(text)
    prepared = prepare_data(
        DataConfig(data_files=str(folder), tokenizer="char", validation_split=0.1, cache_dir=str(tmp_path / "cache"))
    )
    assert (
        "3 document(s) are too few for a 0.1 split by documents; validation is the last 10% of each"
        in capfd.readouterr().err
    )
    assert prepared.manifest["splits"]["val"] == {"documents": 3, "tokens": 3 * 11}
    assert prepared.manifest["validation_split_by"] == "tokens"
    val = prepared.tokenizer.decode(np.asarray(prepared.tokens("val")).tolist())
    assert val == "".join(text[90:] for text in texts)

    many = prepare_data(
        DataConfig(
            data_files=str(write_corpus(tmp_path / "many")),
            tokenizer="char",
            validation_split=0.25,
            cache_dir=str(tmp_path / "cache"),
        )
    )
    assert "validation: 3 of 12 documents (validation_split 0.25)" in capfd.readouterr().err
    assert many.manifest["validation_split_by"] == "documents" and many.manifest["splits"]["val"]["documents"] == 3


def test_quality_filters_off_unquoted_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  data_files: [x]\n  quality_filters: off\n  deduplication: no\n")
    data = load_experiment(path).data
    assert (data.quality_filters, data.deduplication) == ("off", "none")


def test_overrides_after_an_option_and_the_double_dash_dotted_form(tmp_path, capsys):
    """`--json training.batch_size=2` and litgpt/torchtitan's `--model.n_layers 3` are overrides too."""
    path = tmp_path / "c.yaml"
    path.write_text("model: {d_model: 32, n_heads: 2, n_layers: 1, vocab_size: 100}\ndata: {data_files: [x]}\n")
    assert main(["estimate", "--config", str(path), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "estimate",
                "--config",
                str(path),
                "--json",
                "training.batch_size=2",
                "--model.n_layers",
                "3",
                "--model.d_ff=64",
            ]
        )
        == 0
    )
    three = json.loads(capsys.readouterr().out)
    assert three["parameters"] > one["parameters"] and three != one
    assert load_experiment(path, ["model.n_layers=3", "model.d_ff=64"]).model.n_layers == 3
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--config", str(path), "--json", "--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_training_evaluation_and_eval_command_say_what_they_covered(tmp_path, capfd, monkeypatch):
    from conftest import write_tiny_experiment

    monkeypatch.chdir(tmp_path)
    config = write_tiny_experiment(tmp_path, eval_max_batches=1, max_steps=4, eval_steps=2)
    assert main(["train", "--config", str(config)]) == 0
    err = capfd.readouterr().err
    periodic, last = [x for x in err.splitlines() if x.startswith("eval  step")]
    assert re.search(r"\(first 1 of (\d+) batches, [\d,]+ tokens: training.eval_max_batches\)", periodic), periodic
    total = int(re.search(r"first 1 of (\d+)", periodic).group(1))
    assert f"(all {total} batches, " in last  # the run's last evaluation covers the whole split
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 0
    out = capfd.readouterr().out
    assert f"(all {total} batches, " in out and "of the run's validation split)" in out
    assert re.search(r"val_loss (\d+\.\d+)", last).group(1) == re.search(r"loss (\d+\.\d+)", out).group(1)  # one number


def test_lr_find_writes_its_plot_into_the_run_folder(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from conftest import write_tiny_experiment

    monkeypatch.chdir(tmp_path)
    config = write_tiny_experiment(tmp_path)
    assert main(["lr-find", "--config", str(config), "--num-steps", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(tmp_path / "run" / "lr_find.png")
    assert (tmp_path / "run" / "lr_find.png").is_file() and not (tmp_path / "lr_find.png").exists()


def test_registry_add_of_the_same_run_twice_is_one_version(tmp_path, capsys):
    run = tmp_path / "run"
    train, val = tiny_trainer_data()
    config = TrainingConfig(max_steps=2, eval_steps=2, output_dir=str(run), device="cpu", progress_bar=False)
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    db = str(tmp_path / "reg.db")
    assert main(["registry", "add", str(run), "--name", "tiny", "--db", db]) == 0
    assert "registered tiny:1" in capsys.readouterr().out
    assert main(["registry", "add", str(run), "--name", "tiny", "--db", db]) == 0
    assert "already registered as tiny:1" in capsys.readouterr().out
    assert main(["registry", "list", "--db", db, "--json"]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)] == [1]


@pytest.mark.slow  # a child process
def test_eval_lines_are_never_glued_to_a_progress_bar_in_a_file(tmp_path):
    """stderr to a file (not a terminal): no bar redraws, every line whole."""
    script = (
        "import numpy as np\n"
        "from llm_trainer import ModelConfig, Trainer, TrainingConfig, Transformer\n"
        "from llm_trainer.data.loader import BatchLoader, WindowRows\n"
        "t = (np.arange(3000) % 61).astype(np.uint16)\n"
        "train, val = BatchLoader(WindowRows(t, 16), 4, shuffle=True), BatchLoader(WindowRows(t[:300], 16), 4, shuffle=False)\n"
        "model = Transformer(ModelConfig(vocab_size=61, d_model=16, n_heads=2, n_layers=1, max_seq_len=16))\n"
        f"config = TrainingConfig(max_steps=4, eval_steps=2, logging_steps=2, save_steps=0, output_dir={str(tmp_path / 'run')!r}, "
        "device='cpu')\n"
        "Trainer(model, config, train_dataloader=train, val_dataloader=val).train()\n"
    )
    log = tmp_path / "train.log"
    with open(log, "w") as handle:
        subprocess.run(
            [sys.executable, "-c", script],
            stderr=handle,
            stdout=subprocess.DEVNULL,
            check=True,
            env=src_env(),
            timeout=120,
        )
    text = log.read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert sum(line.startswith("eval  step") for line in lines) == 2
    assert sum(line.startswith("train step") for line in lines) == 2  # the bar's place: plain lines


def test_a_hub_dataset_offline_fails_fast_and_names_data_files(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    from llm_trainer.data.prepare import prepare_data

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens: the Hub is unreachable
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    with pytest.raises(UsageError) as error:
        prepare_data(DataConfig(dataset_name="wikitext", dataset_config="wikitext-2-raw-v1", cache_dir=str(tmp_path)))
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "cannot be reached" in message and "data.data_files" in message and "\n" not in message


def test_warnings_repeated_every_step_are_shown_once(recwarn):
    import warnings

    from llm_trainer.logs import warnings_once

    shown = []
    original = warnings.showwarning
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
    try:
        with warnings_once():
            for _ in range(5):
                with warnings.catch_warnings():  # what resets Python's own once-per-location memory
                    warnings.simplefilter("ignore", BytesWarning)
                warnings.warn("x is deprecated", FutureWarning, stacklevel=1)
                warnings.warn("y is deprecated", FutureWarning, stacklevel=1)
    finally:
        warnings.showwarning = original
    assert shown == ["x is deprecated", "y is deprecated"]
