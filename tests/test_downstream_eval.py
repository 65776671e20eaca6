"""Downstream evaluation through lm-evaluation-harness: our adapter against lm-eval's own `hf` backend on
the exported model (the reference), the shipped offline tasks, and the CLI's one-line errors.

Never reaches the network: the Hub and `datasets` are offline for this whole file."""

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import torch

from llm_trainer.downstream.tasks import BUILTIN, load_tasks

TEXTS = [
    json.loads(line)["text"]
    for line in (Path(__file__).parents[1] / "src/llm_trainer/downstream/tasks/text.jsonl").read_text().splitlines()
]


def approx_numbers(row: dict, rel: float) -> dict:
    """`row` with each number compared within `rel` and every other value exactly (`pytest.approx` of a dict
    refuses non-numeric values)."""
    return {
        key: pytest.approx(value, rel=rel) if isinstance(value, float | int) and not isinstance(value, bool) else value
        for key, value in row.items()
    }


def _tokenizer():
    from llm_trainer.tokenizer import Tokenizer

    return Tokenizer.train_bpe(TEXTS * 4, 300, 10**6)


def _model(tokenizer, architecture: str, max_seq_len: int = 40):
    from llm_trainer.config import ModelConfig
    from llm_trainer.model import Transformer

    torch.manual_seed(0)
    config = ModelConfig(
        architecture=architecture,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=max_seq_len,
        vocab_size=tokenizer.vocab_size,
    )
    return Transformer(config).eval()


def _export(model, tokenizer, folder: Path) -> Path:
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.hf.interop import export_to_hf

    save_model_folder(model, folder / "ours")
    tokenizer.save(folder / "ours")
    return export_to_hf(folder / "ours", folder / "hf")


def _reference(model, tokenizer, folder: Path):
    """lm-eval's `hf` backend on our exported model, each request computed on its own: its logits cache
    (one-token continuations share the logits of requests with the same tokens before them) gives a
    request ending "(self" + "):" the logits of another whose tokens split otherwise ("(" + "self):"),
    0.05 nats off what the request's own forward gives."""
    from lm_eval.models.huggingface import HFLM

    path = str(_export(model, tokenizer, folder))
    return HFLM(pretrained=path, device="cpu", batch_size=8, dtype="float32", logits_cache=False)


def _requests(names, num_fewshot: int = 0):
    """Every request of the tasks, as lm-eval's evaluator builds them, grouped by request type."""
    grouped = {}
    for task in load_tasks(list(names)):
        task.set_config(key="num_fewshot", value=num_fewshot)
        task.build_all_requests(limit=None, rank=0, world_size=1)
        for instance in task.instances:
            grouped.setdefault(instance.request_type, []).append(instance)
    return grouped


def _max_new_tokens_task(folder: Path) -> str:
    """llmt_exact as a task YAML that caps generation with `max_new_tokens` (one of lm-eval's aliases of
    `max_gen_toks`: the hf backend leaves max_length - 8 tokens of context for it)."""
    import yaml

    from llm_trainer.downstream.tasks import builtin_config

    config = builtin_config("llmt_exact")
    config["task"] = "llmt_exact_new_tokens"
    del config["generation_kwargs"]["max_gen_toks"]
    config["generation_kwargs"]["max_new_tokens"] = 8
    path = folder / "llmt_exact_new_tokens.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    "architecture, max_seq_len, shots", [("llama", 40, 2), ("gpt2", 40, 2), ("llama", 28, 5), ("gpt2", 28, 5)]
)
def test_same_loglikelihoods_and_generations_as_lm_eval_hf_backend(tmp_path, architecture, max_seq_len, shots):
    """Per request: log-likelihoods within 1e-4 of lm-eval's `hf` backend on the exported model, the same
    is-greedy flags and the same greedy generations, with prompts longer than the model's context: with 2
    shots many do not fit in 40 tokens, with 5 shots none fits in 28 (every one cut from the left, as the
    hf backend cuts it), and a task that caps generation with `max_new_tokens` instead of `max_gen_toks`
    leaves room for 8 new tokens, not the default 256."""
    from llm_trainer.downstream.adapter import LLMTrainerLM

    tokenizer = _tokenizer()
    model = _model(tokenizer, architecture, max_seq_len)
    reference = _reference(model, tokenizer, tmp_path)
    ours = LLMTrainerLM(model, tokenizer, batch_size=5)
    grouped = _requests([*BUILTIN, _max_new_tokens_task(tmp_path)], num_fewshot=shots)
    assert set(grouped) == {"loglikelihood", "loglikelihood_rolling", "generate_until"}

    theirs_ll, ours_ll = reference.loglikelihood(grouped["loglikelihood"]), ours.loglikelihood(grouped["loglikelihood"])
    assert len(ours_ll) == len(theirs_ll) == 24 * 4 + 24
    assert max(abs(a[0] - b[0]) for a, b in zip(ours_ll, theirs_ll)) < 1e-4
    assert [a[1] for a in ours_ll] == [b[1] for b in theirs_ll]
    assert 0 < ours.truncated["loglikelihood"] <= len(ours_ll)
    if shots == 5:
        assert ours.truncated["loglikelihood"] == len(ours_ll)

    rolling = grouped["loglikelihood_rolling"]
    theirs_roll, ours_roll = reference.loglikelihood_rolling(rolling), ours.loglikelihood_rolling(rolling)
    assert ours_roll == pytest.approx(theirs_roll, rel=1e-6, abs=1e-4)

    generations = grouped["generate_until"]
    assert len(generations) == 16 * 2
    assert ours.generate_until(generations) == reference.generate_until(generations)
    assert ours.truncated["generate_until"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("max_seq_len, shots", [(128, None), (32, 5)])
def test_same_scores_as_lm_eval_hf_backend(tmp_path, max_seq_len, shots):
    """The whole evaluation (lm-eval's evaluator, few-shot examples, metrics and aggregation) gives the
    same accuracy, perplexities and exact match with our adapter as with lm-eval's `hf` backend: with
    prompts that fit, and with 5-shot prompts longer than a 32-token context (each cut from the left)."""
    from lm_eval.evaluator import simple_evaluate

    from llm_trainer.downstream import evaluate_tasks, scores

    tokenizer = _tokenizer()
    model = _model(tokenizer, "llama", max_seq_len=max_seq_len)
    reference = _reference(model, tokenizer, tmp_path)
    tasks = [*BUILTIN, _max_new_tokens_task(tmp_path)]
    theirs = scores(
        simple_evaluate(
            model=reference, tasks=load_tasks(tasks), num_fewshot=shots, bootstrap_iters=0, log_samples=False
        )
    )
    results = evaluate_tasks(model, tokenizer, tasks, num_fewshot=shots, batch_size=4)
    ours = scores(results)
    assert set(ours) == {*BUILTIN, "llmt_exact_new_tokens"} and set(ours["llmt_choice"]) == {"acc", "acc_norm"}
    if shots:
        assert results["config"]["truncated_requests"]["loglikelihood"] == 24 * 4 + 24
    for task, metrics in theirs.items():
        for metric, value in metrics.items():
            assert math.isclose(ours[task][metric], value, rel_tol=1e-4), (task, metric, ours[task][metric], value)


def test_an_evaluation_leaves_the_random_generators_where_they_were():
    """lm-eval seeds every generator; training after an in-loop evaluation must draw what it would have."""
    import random

    import numpy as np

    from llm_trainer.downstream import evaluate_tasks

    tokenizer = _tokenizer()
    model = _model(tokenizer, "gpt2", max_seq_len=128)

    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    for generator in (torch.manual_seed, random.seed, np.random.seed):
        generator(7)
    expected = draws()
    for generator in (torch.manual_seed, random.seed, np.random.seed):
        generator(7)
    evaluate_tasks(model, tokenizer, "llmt_choice", limit=2, batch_size=2)
    assert draws() == expected


def test_the_environment_report_is_asked_for_once_per_process(monkeypatch):
    """lm-eval records torch's report of the environment (`pip list`, `lscpu`: a second or two) in every
    result: the evaluations of a run ask for it once, and each result still holds it; afterwards torch's
    function is torch's again."""
    import torch.utils.collect_env as collect_env

    from llm_trainer.downstream import evaluate_tasks, tasks

    asked = []

    def report():
        asked.append(1)
        return f"report {len(asked)}"

    monkeypatch.setattr(tasks, "_ENVIRONMENT", {})
    monkeypatch.setattr(collect_env, "get_pretty_env_info", report)
    tokenizer = _tokenizer()
    model = _model(tokenizer, "gpt2", max_seq_len=128)
    results = [evaluate_tasks(model, tokenizer, "llmt_choice", limit=2, batch_size=2) for _ in range(2)]
    assert [r["pretty_env_info"] for r in results] == ["report 1", "report 1"] and len(asked) == 1
    assert collect_env.get_pretty_env_info is report


def test_shared_context_batches_match_one_request_at_a_time():
    """Batching by length and reusing a context's KV cache for each continuation give the numbers of
    one request at a time, each computed from scratch by the plain forward."""
    from llm_trainer.downstream.adapter import LLMTrainerLM

    tokenizer = _tokenizer()
    model = _model(tokenizer, "llama", max_seq_len=128)
    requests = _requests(["llmt_choice", "llmt_cloze"])["loglikelihood"]
    lm = LLMTrainerLM(model, tokenizer, batch_size=16)
    batched = lm.loglikelihood(requests)
    for request, (logprob, greedy) in zip(requests, batched):
        context, continuation = lm._encode_pair(*request.args)  # lm-eval's own split of the tokens
        ids, n = context + continuation, len(continuation)
        assert len(ids) <= model.config.max_seq_len + 1
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]])).log_softmax(-1)[0, -n:]  # (n, V)
        target = torch.tensor(ids[-n:])
        assert abs(float(logits.gather(1, target[:, None]).sum()) - logprob) < 1e-4
        assert bool((logits.argmax(-1) == target).all()) == greedy


def _cli(*args, cwd):
    import subprocess
    import sys

    from conftest import src_env

    env = {**src_env(), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "llm_trainer", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_training_logs_downstream_rows_and_best_model_follows_a_task_metric(tmp_path):
    """training.eval_tasks: `downstream` rows in metrics.jsonl at each evaluation; best_model/ follows
    metric_for_best_model; `eval --tasks` on the checkpoint writes lm-eval's results JSON and prints its
    table, with the truncation of prompts longer than the 24-token context said in one line."""
    from conftest import cli_in_process, write_tiny_experiment

    config = write_tiny_experiment(
        tmp_path,
        eval_tasks="llmt_choice,llmt_cloze",
        eval_tasks_limit=6,
        metric_for_best_model="downstream/llmt_choice/acc",
    )
    done = cli_in_process(["train", "--config", config], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    downstream = [row for row in rows if row["kind"] == "downstream"]
    assert [row["step"] for row in downstream] == [3, 6]
    for row in downstream:
        assert 0 <= row["downstream/llmt_choice/acc"] <= 1 and row["downstream/llmt_cloze/perplexity"] > 1
    meta = json.loads((tmp_path / "run/checkpoints/best_model/meta.json").read_text())
    assert "downstream/llmt_choice/acc" in json.dumps(meta)

    out = tmp_path / "results.json"
    evaluate = ["eval", "--checkpoint", tmp_path / "run", "--tasks", "llmt_choice,llmt_exact", "--limit", "5"]
    done = cli_in_process([*evaluate, "--output", out], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"llmt_choice", "llmt_exact"} and "acc,none" in results["results"]["llmt_choice"]
    assert "|llmt_choice" in done.stdout and "exact_match" in done.stdout
    assert "cut from the left" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "hellaswg"], "closest: hellaswag"),
        (["--tasks", "arc_easy"], "dataset_path: json"),
        (["--tasks", "llmt_choice", "--limit", "0"], "--limit must be"),
        (["--tasks", "missing/task.yaml"], "not found"),
    ],
)
def test_eval_tasks_bad_input_is_one_line(tmp_path, args, message):
    """An unknown task (with the closest names), a Hub task offline (how to point it at local files),
    --limit 0, a missing task file: one line, exit status 2, no traceback, before any model loads. (The CLI
    in this process: lm-eval's index of its own tasks, built at the first of these, serves the rest.)"""
    from conftest import cli_in_process

    done = cli_in_process(["eval", "--checkpoint", tmp_path, *args], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("error:")]) == 1, done.stderr


@pytest.mark.slow  # a subprocess CLI
def test_eval_tasks_console_has_no_progress_bars_or_git_noise(tmp_path):
    """`eval --tasks` outside a git repository: no "fatal: not a git repository" (lm-eval records the
    working directory's commit) and no progress bars of lm-eval's loops on stderr; our own warnings
    (2-shot prompts longer than the 40-token context: one line with the counts, which the results JSON
    holds too) still show, and the table is on stdout."""
    from llm_trainer.checkpoint.model_folder import save_model_folder

    tokenizer = _tokenizer()
    save_model_folder(_model(tokenizer, "llama"), tmp_path / "m")
    tokenizer.save(tmp_path / "m")
    done = _cli(
        "eval",
        "--checkpoint",
        str(tmp_path / "m"),
        "--tasks",
        "llmt_choice,llmt_exact",
        "--limit",
        "3",
        "--num_fewshot",
        "2",
        "--output",
        "results.json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|llmt_choice" in done.stdout
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    cut = config["truncated_requests"]
    assert config["max_length"] == 40 and set(cut) == {"loglikelihood", "generate_until"}
    assert 0 < cut["loglikelihood"] <= 3 * 4 and 0 < cut["generate_until"] <= 3
    [line] = [line for line in done.stderr.splitlines() if "cut from the left" in line]
    assert f"{cut['generate_until']} of 3 generate_until, {cut['loglikelihood']} of 12 loglikelihood" in line
    assert "fatal:" not in done.stderr
    assert not [line for line in done.stderr.splitlines() if "it/s" in line or "%|" in line], done.stderr


def test_checkpoint_without_tokenizer_is_one_line(tmp_path):
    """A model folder without tokenizer.json: the project's loader says so in one line."""
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.cli import main

    tokenizer = _tokenizer()
    save_model_folder(_model(tokenizer, "llama"), tmp_path / "m")
    assert main(["eval", "--checkpoint", str(tmp_path / "m"), "--tasks", "llmt_choice"]) == 2


DISTRIBUTED_SCRIPT = """
import json, os, sys
os.environ["HF_DATASETS_OFFLINE"] = "1"; os.environ["HF_HUB_OFFLINE"] = "1"
import torch
torch.distributed.init_process_group("gloo")
sys.path.insert(0, sys.argv[2])
from test_downstream_eval import _model, _tokenizer
from llm_trainer.config import TrainingConfig
from llm_trainer.downstream import evaluate_tasks, scores
from llm_trainer.parallel.parallelize import apply_fsdp, device_mesh
tokenizer = _tokenizer()
together = {}
for sharding, shots in json.loads(sys.argv[4]):
    model = _model(tokenizer, "llama")
    if sharding == "fsdp":  # each rank holds its shards of every weight, as FSDP training leaves them
        config, cpu = TrainingConfig(distributed_strategy="fsdp"), torch.device("cpu")
        apply_fsdp(model, config, cpu, None, device_mesh(config, cpu))
    results = evaluate_tasks(model, tokenizer, sys.argv[3], num_fewshot=shots, limit=7, batch_size=3)
    if torch.distributed.get_rank() == 0:
        together[f"{sharding}-{shots}"] = scores(results)
    else:
        assert results is None
if torch.distributed.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(together))
torch.distributed.barrier()  # both ranks done with the group before either tears it down
torch.distributed.destroy_process_group()
"""

# (how each rank holds the weights, few-shot examples): one launch of two ranks evaluates them in turn
SHARES = [("whole", 0), ("whole", 2), ("fsdp", 2)]


@pytest.mark.slow
def test_two_processes_score_their_shares_and_equal_one_process(tmp_path):
    """Under torchrun (2 CPU processes, gloo) each rank scores its share of the batches (7 items per task,
    batches of 3: one rank has more to do) and rank 0's scores equal one process's: with few-shot
    examples too (every rank builds the requests one process builds, the examples drawn alike), and with
    each rank holding only its FSDP2 shards of the weights (every forward a collective: the rank with less
    to do joins the other's forwards, generation's decoding steps included)."""

    from conftest import src_env
    from llm_trainer.downstream import evaluate_tasks, scores
    from warm_launch import torchrun

    tasks = ",".join(BUILTIN)
    script, out = tmp_path / "evaluate.py", tmp_path / "scores.json"
    script.write_text(DISTRIBUTED_SCRIPT)
    env = {**src_env(), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    arguments = [out, Path(__file__).parent, tasks, json.dumps(SHARES)]
    done = torchrun(tmp_path, arguments, env, script=script, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    together = json.loads(out.read_text())
    assert set(together) == {f"{sharding}-{shots}" for sharding, shots in SHARES}
    tokenizer = _tokenizer()
    for shots in sorted({shots for _, shots in SHARES}):
        alone = scores(
            evaluate_tasks(_model(tokenizer, "llama"), tokenizer, tasks, num_fewshot=shots, limit=7, batch_size=3)
        )
        for case in [f"{sharding}-{n}" for sharding, n in SHARES if n == shots]:
            assert set(together[case]) == set(BUILTIN), case
            for task, metrics in alone.items():
                assert together[case][task] == pytest.approx(metrics, rel=1e-5), (case, task)


TRAINING_OPTIONS = dict(
    eval_tasks=["llmt_choice", "llmt_rolling"],
    eval_tasks_limit=5,
    use_amp=False,
    metric_for_best_model="downstream/llmt_rolling/bits_per_byte",
)
# two layers, untied: two pipeline stages, each with its own end of the model
MODEL = {"n_layers": 2, "tie_embeddings": False}
STRATEGIES = {  # each rank reads half of one process's batch of 4, or (TP, PP) all of it
    "ddp": dict(distributed_strategy="ddp", batch_size=2),
    "fsdp": dict(distributed_strategy="fsdp", batch_size=2),
    "deepspeed": dict(
        distributed_strategy="deepspeed", deepspeed_config={"zero_optimization": {"stage": 3}}, batch_size=2
    ),
    "tp": dict(distributed_strategy="fsdp", tensor_parallel_degree=2, batch_size=4),
    "pp": dict(distributed_strategy="fsdp", pipeline_parallel_degree=2, batch_size=4),
}


def _train_with_tasks(root: Path, nproc: int, **training):
    """(the `downstream` rows of metrics.jsonl, the run's stderr) of the tiny experiment (with `MODEL`)
    trained in `root` by `nproc` CPU processes (gloo)."""

    import yaml

    from conftest import src_env, write_tiny_experiment
    from warm_launch import python, torchrun

    root.mkdir()
    config = write_tiny_experiment(root, **TRAINING_OPTIONS, **training)
    experiment = yaml.safe_load(config.read_text())
    experiment["model"].update(MODEL)
    config.write_text(yaml.safe_dump(experiment))
    env = {**src_env(), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    train = ["train", "--config", config]
    done = torchrun(root, train, env, nproc=nproc, timeout=600) if nproc > 1 else python(root, train, env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "run/checkpoints/best_model").is_dir()
    rows = [json.loads(line) for line in (root / "run/metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == "downstream"], done.stderr


@pytest.fixture(scope="session")
def one_process_rows(tmp_path_factory):
    """The downstream rows of one process training the tiny experiment with batch 4, trained once per
    session (xdist workers included)."""
    from conftest import once_per_session

    def build(folder: Path) -> None:
        (folder / "rows.json").write_text(json.dumps(_train_with_tasks(folder / "one", 1, batch_size=4)[0]))

    return json.loads((once_per_session(tmp_path_factory, "downstream-one-process", build) / "rows.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_distributed_training_logs_the_scores_of_one_process(tmp_path, one_process_rows, strategy):
    """training.eval_tasks under DDP, FSDP2 (each rank holds shards of the weights), DeepSpeed ZeRO-3 (the
    same), tensor parallelism (sequence parallelism, which a request of any length cannot go through) or
    pipeline parallelism (each rank holds one layer), 2 CPU processes, logs the downstream rows of one
    process training with the same global batch (the same weights; under TP and PP each evaluation scores a
    whole copy gathered from the split weights), best_model/ follows the task metric, and lm-eval's
    progress bars and git call stay off the console."""
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install '.[deepspeed]')")
    rows, stderr = _train_with_tasks(tmp_path / strategy, 2, **STRATEGIES[strategy])
    assert [row["step"] for row in rows] == [row["step"] for row in one_process_rows] == [3, 6]
    for together, alone in zip(rows, one_process_rows):
        assert together == approx_numbers(alone, rel=1e-4)
    assert "step 6 downstream: llmt_choice/acc" in stderr
    assert "fatal:" not in stderr and "it/s]" not in stderr


def test_a_continuation_merged_into_the_context_scores_zero_and_is_counted():
    """lm-eval splits the tokens of context + continuation after the context's own tokens; where the
    tokenizer merges the continuation into the context's last token nothing is left to score: log-
    likelihood 0 (its probability given the context is 1), counted for the warning, no crash."""
    from llm_trainer.downstream.adapter import LLMTrainerLM

    tokenizer = _tokenizer()
    lm = LLMTrainerLM(_model(tokenizer, "llama"), tokenizer)
    requests = [(("x", ""), [5, 6], []), (("x", "y"), [5, 6], [7])]
    empty, scored = lm._loglikelihood_tokens(requests)
    assert empty == (0.0, True) and scored[0] < 0
    assert lm.empty["loglikelihood"] == 1


def test_downstream_rows_reach_the_backends_as_task_and_metric():
    """A downstream row's values go to TensorBoard, W&B and MLflow as downstream/<task>/<metric>."""
    from llm_trainer.train.metrics import scalar_items
    from llm_trainer.train.rows import downstream_row

    row = downstream_row(6, {"llmt_choice": {"acc": 0.5, "acc_norm": 0.75}, "llmt_cloze": {"perplexity": 9.0}})
    assert row["kind"] == "downstream" and row["step"] == 6
    assert dict(scalar_items(row)) == {
        "downstream/llmt_choice/acc": 0.5,
        "downstream/llmt_choice/acc_norm": 0.75,
        "downstream/llmt_cloze/perplexity": 9.0,
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_eval_tasks_reads_sharded_checkpoints(tmp_path, strategy):
    """A checkpoint of FSDP (its shards gathered) or DeepSpeed (2 CPU processes) gives the scores of its
    best_model/ (whole weights, same step)."""

    from conftest import cli_in_process, src_env, write_tiny_experiment
    from warm_launch import torchrun

    if strategy == "deepspeed":
        pytest.importorskip("deepspeed")
    config = write_tiny_experiment(tmp_path, distributed_strategy=strategy, use_amp=False, eval_steps=6, max_steps=6)
    env = {**src_env(), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = torchrun(tmp_path, ["train", "--config", config], env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {}
    for name, folder in (("checkpoint", tmp_path / "run"), ("best", tmp_path / "run/checkpoints/best_model")):
        evaluate = ["eval", "--checkpoint", folder, "--tasks", "llmt_choice", "--limit", "6", "--json"]
        done = cli_in_process(evaluate, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["checkpoint"]["llmt_choice"] == pytest.approx(results["best"]["llmt_choice"], rel=1e-5)


def test_trainer_refuses_eval_tasks_it_cannot_run_before_training(tmp_path):
    """No tokenizer to encode the prompts, or a task file that is not there: one UsageError at
    construction, not at the first evaluation."""
    from conftest import tiny_loaders, tiny_model
    from llm_trainer.errors import UsageError
    from llm_trainer.train.trainer import Trainer

    train, val = tiny_loaders()
    config = dict(max_steps=2, output_dir=str(tmp_path), device="cpu", report_to=["jsonl"], eval_tasks="llmt_choice")
    with pytest.raises(UsageError, match="needs the run's tokenizer"):
        Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val)
    with pytest.raises(UsageError, match="not found"):
        Trainer(
            tiny_model(), {**config, "eval_tasks": "tasks/mine.yaml"}, train_dataloader=train, tokenizer=_tokenizer()
        )


HUB_TASK_SCRIPT = """
import sys, time
from llm_trainer.downstream.tasks import _manager, load_tasks
from llm_trainer.errors import UsageError
_manager(True)  # lm-eval's index of its own tasks (seconds, no network): not what is timed
start = time.monotonic()
try:
    load_tasks(["hellaswag"])
except UsageError as error:
    print(f"{time.monotonic() - start:.1f}", error)
"""


@pytest.mark.slow
def test_hub_task_offline_without_offline_mode_fails_at_once(tmp_path):
    """HF_HUB_OFFLINE not set and the Hub unreachable (nothing listens at HF_ENDPOINT), a dataset not in
    the (empty) cache: one line saying it cannot be reached, in well under the 23 s that `datasets`
    spends retrying (1 + 2 + 4 + 8 + 8 s)."""
    import subprocess
    import sys

    from conftest import free_port, src_env

    env = {k: v for k, v in src_env().items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", HUB_TASK_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, message = done.stdout.strip().split(" ", 1)
    assert "task hellaswag" in message and "cannot be reached" in message and "dataset_path: json" in message
    assert float(seconds) < 10, done.stdout


def test_the_hub_probe_dials_the_proxy_when_one_is_set(monkeypatch):
    """Behind HTTPS_PROXY the Hub's own address may not be reachable from here: the probe dials the proxy
    (a real listener on 127.0.0.1), and names it when it does not answer."""
    import socket

    from llm_trainer.hf.hub import hub_unreachable

    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # never resolves: only the proxy can answer
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        port = proxy.getsockname()[1]
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
        assert hub_unreachable() is None
    why = hub_unreachable()  # the proxy has stopped listening
    assert why is not None and f"hub.invalid:443 through the proxy 127.0.0.1:{port}" in why


def test_max_gen_toks_as_long_as_the_context_keeps_one_prompt_token_and_says_so(tmp_path, capsys):
    """lm-eval's hf backend refuses a generation whose max_gen_toks leaves no room for the prompt; ours
    keeps the prompt's last token, generates up to the context's end and says so in one line, with the
    other counts: every one of the 2 prompts cut, in `config.truncated_requests`."""
    import yaml

    from llm_trainer.downstream import evaluate_tasks
    from llm_trainer.downstream.tasks import builtin_config

    config = builtin_config("llmt_exact")
    config["task"] = "llmt_exact_long"
    config["generation_kwargs"]["max_gen_toks"] = 40
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config))
    tokenizer = _tokenizer()
    results = evaluate_tasks(_model(tokenizer, "llama", max_seq_len=40), tokenizer, [str(path)], limit=2)
    assert results["config"]["truncated_requests"] == {"generate_until": 2}
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: downstream")]
    assert len(lines) == 2, lines
    assert "2 of 2 generate_until requests do not fit in the model's context (40 tokens" in lines[0]
    assert "2 generate_until request(s) allow as many new tokens as the model's context (40)" in lines[1]


# -- task files someone else made: their code runs only when trusted; bad ones are one line ---------


CHOICE_DATA = Path(__file__).parents[1] / "src/llm_trainer/downstream/tasks/choice.jsonl"
MARKER_CODE = (
    "from pathlib import Path\nPath({marker!r}).write_text('ran')\n\n\ndef process(doc):\n    return doc['context']\n"
)


def _task_yaml(**fields) -> str:
    """A multiple-choice task YAML on the shipped items (24 documents), with `fields` changed (None: left out)."""
    import yaml

    config = {
        "task": "mine",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(CHOICE_DATA)}},
        "test_split": "test",
        "fewshot_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    config.update(fields)
    return yaml.safe_dump({key: value for key, value in config.items() if value is not None})


def _shared_task_folder(root: Path, marker: Path) -> Path:
    """A task folder as someone might share it: task.yaml includes sub/base.yaml, whose `!function`
    names sub/utils.py; importing utils.py creates `marker`."""
    folder = root / "shared"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub/utils.py").write_text(MARKER_CODE.format(marker=str(marker)))
    (folder / "sub/base.yaml").write_text(_task_yaml(task=None) + "doc_to_text: !function utils.process\n")
    (folder / "task.yaml").write_text("include: sub/base.yaml\ntask: shared_task\n")
    return folder


def _refused(capsys, *argv) -> str:
    """The one `error:` line of `llm-trainer eval ARGV` (exit status 2, no traceback)."""
    import logging
    import sys

    from llm_trainer.cli import main

    for handler in logging.getLogger("datasets").handlers:  # made with the stderr of an earlier test's capsys
        handler.stream = sys.stderr
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_task_code_runs_only_when_trusted(tmp_path, capsys):
    """A task folder or file whose YAML (through an include) names Python with `!function`: refused in one
    line naming the Python file and the flag, from `eval --tasks` and from `training.eval_tasks`, and
    nothing of it runs; with --trust_task_code / training.trust_task_code it loads (the payload is live)."""
    from conftest import tiny_loaders, tiny_model
    from llm_trainer.errors import UsageError
    from llm_trainer.train.trainer import Trainer

    marker = tmp_path / "ran"
    folder = _shared_task_folder(tmp_path, marker)
    for spec in (str(folder), str(folder / "task.yaml")):
        line = _refused(capsys, "--checkpoint", str(tmp_path), "--tasks", spec)
        assert str(folder / "sub/utils.py") in line and "--trust_task_code" in line, line
    train, val = tiny_loaders()
    config = dict(max_steps=2, output_dir=str(tmp_path / "run"), device="cpu", report_to=["jsonl"])
    with pytest.raises(UsageError, match="training.trust_task_code: true"):
        Trainer(tiny_model(), {**config, "eval_tasks": str(folder)}, train_dataloader=train, tokenizer=_tokenizer())
    assert not marker.exists()

    Trainer(
        tiny_model(),
        {**config, "eval_tasks": str(folder), "trust_task_code": True},
        train_dataloader=train,
        val_dataloader=val,
        tokenizer=_tokenizer(),
    )
    assert marker.exists()


def test_a_prompt_template_cannot_reach_python(tmp_path, capsys):
    """lm-eval renders `doc_to_*` templates with Jinja: one that climbs to Python's `os` is a template
    error in the sandbox, trusted or not, and runs nothing."""
    marker = tmp_path / "ran"
    template = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}{{ context }}"
    (tmp_path / "t.yaml").write_text(_task_yaml(doc_to_text=template))
    for trust in ([], ["--trust_task_code"]):
        line = _refused(capsys, "--checkpoint", str(tmp_path), "--tasks", str(tmp_path / "t.yaml"), *trust)
        assert "unsafe" in line, line
    assert not marker.exists()


@pytest.mark.slow
def test_a_bare_task_name_is_never_a_folder(tmp_path, monkeypatch):
    """`arc_easy` is lm-eval's task even with a folder of that name in the working directory (here offline:
    the one line about its Hub dataset), and `./arc_easy` is that folder, whose code is refused."""
    from llm_trainer.errors import UsageError

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy/utils.py").write_text(MARKER_CODE.format(marker=str(marker)))
    (tmp_path / "arc_easy/arc.yaml").write_text(_task_yaml(task="arc_easy") + "doc_to_text: !function utils.process\n")
    with pytest.raises(UsageError, match="dataset_path: json"):
        load_tasks(["arc_easy"])
    with pytest.raises(UsageError, match="--trust_task_code"):
        load_tasks(["./arc_easy"])
    assert not marker.exists()


def _write(root: Path, name: str, text: str) -> str:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("function-module-missing", "Cannot import module 'nothere'"),
        ("function-attribute-missing", "has no function 'absent'"),
        ("max-gen-toks-word", "generation_kwargs.max_gen_toks must be a whole number, got 'lots'"),
        ("until-number", "generation_kwargs.until must be a string or a list of strings, got 5"),
        ("fewshot-above-data", "50 few-shot examples asked for, but its few-shot split holds 24 documents"),
        ("fewshot-flag-huge", "--num_fewshot must be from 0 to 10,000, got 100,000"),
        ("jinja-undefined", "'nope' is undefined"),
        ("choice-without-doc-to-choice", "multiple_choice needs doc_to_choice"),
        ("repeats-word", "repeats must be a whole number, got 'many'"),
        ("repeats-huge", "repeats must be from 1 to 10,000, got 3,000,000,000"),
        ("folder-with-broken-yaml", "broken.yaml is not valid YAML (line 3"),
        ("include-missing", "includes"),
        ("data-empty", "its data cannot be read (no records)"),
        ("data-not-json", "its data cannot be read ("),
        ("choices-not-a-list", "SyntaxError"),
        ("yaml-alias-bomb", "expands to more than 1,000,000 values"),
        ("yaml-python-tag", "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply"),
        ("yaml-nested-deep", "nested more than 64 levels deep"),
        ("metric-through-evaluate", "metric './mymetric'"),
        ("output-under-a-file", "file is a file, not a folder"),
        ("output-a-folder", "is a folder"),
        ("output-exists", "exists; choose another file or pass --overwrite to replace it"),
        ("tasks-too-many", "--tasks names 100,000 tasks, over the limit of 1,000"),
        ("tasks-twice", "--tasks names llmt_choice more than once"),
        ("output-read-only-folder", "cannot write into the folder of --output /sys/kernel"),
    ],
)
def test_task_file_bad_input_is_one_line(tmp_path, capsys, case, message):
    """Each mistake in a task YAML (or the flags next to it) is one line naming it, before any model
    loads (the checkpoint here is an empty folder): where lm-eval would fail mid-evaluation with a
    traceback, build a list of billions of requests, or skip a folder's broken file without a word."""
    args = ["--checkpoint", str(tmp_path)]
    utils = "def process(doc):\n    return doc['context']\n"
    if case == "function-module-missing":
        args += [
            "--trust_task_code",
            "--tasks",
            _write(tmp_path, "t.yaml", _task_yaml() + "process_docs: !function nothere.f\n"),
        ]
    elif case == "function-attribute-missing":
        _write(tmp_path, "utils.py", utils)
        args += [
            "--trust_task_code",
            "--tasks",
            _write(tmp_path, "t.yaml", _task_yaml() + "process_docs: !function utils.absent\n"),
        ]
    elif case in ("max-gen-toks-word", "until-number"):
        generation = {"max_gen_toks": "lots"} if case == "max-gen-toks-word" else {"until": 5}
        text = _task_yaml(
            output_type="generate_until",
            doc_to_choice=None,
            doc_to_target="{{ choices[answer] }}",
            generation_kwargs=generation,
            metric_list=[{"metric": "exact_match"}],
        )
        args += ["--tasks", _write(tmp_path, "t.yaml", text)]
    elif case == "fewshot-above-data":
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(num_fewshot=50))]
    elif case == "fewshot-flag-huge":
        args += ["--tasks", "llmt_choice", "--num_fewshot", "100000"]
    elif case == "jinja-undefined":
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(doc_to_text="{{ nope }}"))]
    elif case == "choice-without-doc-to-choice":
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(doc_to_choice=None))]
    elif case == "repeats-word":
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(repeats="many"))]
    elif case == "repeats-huge":  # lm-eval would build a list of 3e9 requests per document (24 GB)
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(repeats=3_000_000_000))]
    elif case == "folder-with-broken-yaml":
        _write(tmp_path, "tasks/good.yaml", _task_yaml())
        _write(tmp_path, "tasks/broken.yaml", "task: other\ndoc_to_text: [unclosed\n")
        args += ["--tasks", str(tmp_path / "tasks")]
    elif case == "include-missing":
        args += ["--tasks", _write(tmp_path, "t.yaml", "include: gone.yaml\ntask: mine\n")]
    elif case in ("data-empty", "data-not-json"):
        data = _write(tmp_path, "d.jsonl", "" if case == "data-empty" else '{"context": "a"}\n{not json\n')
        config = _task_yaml(dataset_kwargs={"data_files": {"test": data}})
        args += ["--tasks", _write(tmp_path, "t.yaml", config)]
    elif case == "choices-not-a-list":  # lm-eval reads rendered choices with ast.literal_eval
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(doc_to_choice="{{ choices }}x"))]
    elif case == "yaml-alias-bomb":  # 10^9 values from a few hundred bytes
        levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml() + "\n".join(levels) + "\n")]
    elif case == "yaml-python-tag":
        text = _task_yaml() + f"x: !!python/object/apply:os.system ['touch {tmp_path / 'ran'}']\n"
        args += ["--tasks", _write(tmp_path, "t.yaml", text)]
    elif case == "yaml-nested-deep":
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml() + "deep: " + "[" * 5000 + "]" * 5000 + "\n")]
    elif case == "metric-through-evaluate":
        args += ["--tasks", _write(tmp_path, "t.yaml", _task_yaml(metric_list=[{"metric": "./mymetric"}]))]
    elif case == "output-under-a-file":
        _write(tmp_path, "file", "")
        args += ["--tasks", "llmt_choice", "--output", str(tmp_path / "file/results.json")]
    elif case == "output-a-folder":
        args += ["--tasks", "llmt_choice", "--output", str(tmp_path)]
    elif case == "output-exists":  # a file of the user's is never replaced unasked
        args += ["--tasks", "llmt_choice", "--output", _write(tmp_path, "notes.json", "my notes")]
    elif case == "tasks-too-many":
        args += ["--tasks", ",".join(f"t{i}" for i in range(100_000))]
    elif case == "tasks-twice":
        args += ["--tasks", "llmt_choice,llmt_cloze,llmt_choice"]
    elif case == "output-read-only-folder":  # even root cannot create files there
        if not Path("/sys/kernel").is_dir():
            pytest.skip("needs /sys/kernel")
        args += ["--tasks", "llmt_choice", "--output", "/sys/kernel/results.json"]
    line = _refused(capsys, *args)
    assert message in line, line
    assert not (tmp_path / "ran").exists()
    if case == "output-exists":
        assert (tmp_path / "notes.json").read_text() == "my notes"


def test_eval_scores_in_the_runs_precision_says_so_and_takes_float32(tmp_path, capsys):
    """A run that trained in bf16 autocast is scored in it by default, and the console says so;
    `--dtype float32` scores the weights in float32, as lm-eval's `hf` backend on the export does: the
    same figures as the adapter with no autocast at all."""
    from conftest import write_tiny_experiment
    from llm_trainer import cli
    from llm_trainer.api import load_for_inference
    from llm_trainer.downstream import evaluate_tasks, scores

    config = write_tiny_experiment(tmp_path, use_amp=True, amp_dtype="bfloat16", max_steps=2, eval_steps=0)
    assert cli.main(["train", "--config", str(config)]) == 0
    run = str(tmp_path / "run")
    capsys.readouterr()

    def scored(*dtype):
        assert cli.main(["eval", "--checkpoint", run, "--tasks", "llmt_rolling", "--json", *dtype]) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["llmt_rolling"], out.err

    as_run, said = scored()
    assert "eval: scoring in bfloat16 autocast, as the run trained on this device (--dtype float32" in said
    # the char tokenizer learnt the test corpus's characters only: the tasks' others are named, once
    unseen = [line for line in said.splitlines() if "downstream evaluation: the tasks' text:" in line]
    assert len(unseen) == 1 and "which the model never saw in training" in unseen[0], said
    in_float32, said = scored("--dtype", "float32")
    assert "autocast" not in said
    model, tokenizer, _ = load_for_inference(run)
    assert in_float32 == scores(evaluate_tasks(model, tokenizer, ["llmt_rolling"], batch_size=16))["llmt_rolling"]
    assert in_float32 != as_run  # bf16's rounding moves the perplexities
    assert cli.main(["eval", "--checkpoint", run, "--json", "--dtype", "float32"]) == 0
    assert "autocast" not in capsys.readouterr().err
