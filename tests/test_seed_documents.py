"""The five seed documents (../shared/seeds) typed as written: their code blocks, config files and
commands, scaled down to tiny sizes, with local data instead of Hub dataset names, and nothing else
changed. Every change to a block is spelled out in its `scaled(...)` call, which fails when the
document no longer holds the text it replaces.

What a document shows of its own internals (their factories, SpeedMonitor, orchestrators) is its code,
not something a user types at us; where it calls its own trainer class, ours stands in for it.
Every test here reads a document; the slow ones train through the CLI or several processes. Tests of
the behaviour the documents asked for that need no document live with their package (test_cli.py,
test_config_aliases.py, test_parallel.py, ...), so a clone without ../shared runs them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO_SRC, free_port, needs_deepspeed, src_env, tiny_loaders, tiny_model, write_corpus
from llm_trainer.cli import main
from llm_trainer.config import ExperimentConfig, ModelConfig, TrainingConfig
from llm_trainer.config_loader import load_experiment
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


def rows(run: Path, kind: str | None = None) -> list[dict]:
    found = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in found if kind is None or r["kind"] == kind]


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
    train, val = tiny_loaders()
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


def test_001_resume_from_checkpoint_pt_name_is_the_step_folder(tmp_path, monkeypatch):
    from llm_trainer.checkpoint.find import resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    train, _ = tiny_loaders()
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
    assert "project_name" in err and "is not a TrainingConfig field" in err  # said once, not refused
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
# 000 and 002: the ZeRO-3 JSON, early stopping


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
    refused = cli(tmp_path, sys.executable, "-m", "llm_trainer", "train", "--config", "exp.yaml")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: training.deepspeed_config"
    )
    assert "fp16 needs a CUDA GPU and this run is on cpu: use bf16" in refused.stderr

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
    assert (
        "effective batch 8 = 2 x 4 accumulation x 1 process(es) (deepspeed)" in result.stderr
    )  # said, in one process too
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

    train, val = tiny_loaders()
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


def test_002_export_model_as_written_writes_a_folder_transformers_loads(tmp_path):
    """The lesson's export_model block, as written, on our model and tokenizer: `model.save_pretrained`,
    `tokenizer.save_pretrained`, `model.config.hidden_size`; transformers then loads the same model."""
    transformers = pytest.importorskip("transformers")
    from llm_trainer.tokenizer import Tokenizer

    namespace: dict = {"json": json}  # imported by the lesson's earlier logging block
    exec(block(2, "python", "def export_model(model, tokenizer, export_dir):"), namespace)
    texts = ["the cat sat on the mat.", "a dog ran after the birds."] * 8
    ours = Tokenizer.train_bpe(texts, vocab_size=300, max_chars=10**6)
    model = Transformer(
        ModelConfig(
            vocab_size=ours.vocab_size,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    ).eval()
    namespace["export_model"](model, ours, str(tmp_path / "export"))
    assert json.loads((tmp_path / "export" / "model_config.json").read_text())["hidden_size"] == 16
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    ids = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))(texts[0], return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(loaded(ids["input_ids"]).logits, model(ids["input_ids"]), atol=1e-5)
