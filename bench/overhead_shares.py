"""Where our whole-process time goes against nanoGPT's own train.py, on nanoGPT's baby-GPT setting.

    python bench/overhead_shares.py              # 2 rounds, ~6 minutes on 2 cores
    python bench/overhead_shares.py --steps 300  # quicker

Differences of whole 2000-step runs are too noisy on this machine to split a few seconds into causes
(two identical runs differ by up to 5 s), so each cause is measured where it can be measured precisely:

* **Per step** (`step_ms`): the two processes' own per-step clocks over the same run: nanoGPT's printed
  `time ...ms` of every iteration (its whole loop body: batch sampling, forward, backward, clip, AdamW,
  the loss read back) and our speed monitor's `step_time_s` (the same span, averaged over each logging window of 10
  steps); medians. Whole runs of `--steps` steps, alternated, `--rounds` rounds.
* **Fixed** (`fixed_s`): a whole run's wall time minus steps x its median step: start-up, evaluation,
  checkpoints, plots and exit, and any per-step work outside the timed span (ours: the metric rows and
  the progress bar; nanoGPT's clock spans its whole loop body).
* **Our fixed costs by part**: the package import (`import_s`, a separate process), evaluation and
  checkpoint stalls (`evaluation_s`, `checkpoint_s` from our run's own summary), the end-of-run plots
  (`plots_s`: rendered again from the run's metrics, as at the end of a run, matplotlib's import included).
* **Per-step causes, in one process, alternated** (`in_process_ms`): nanoGPT's model and optimizer
  against ours on one fixed batch, ours with the GPT-2 preset's biases, and the progress bar's per-step
  update (tqdm, as the loop calls it).

Shares (`shares_s`) are seconds of a `--steps`-step run. One JSON object on stdout and in
bench/out/overhead_shares.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
import time_to_loss  # noqa: E402
from run_baby_gpt import emit_report, machine_info  # noqa: E402

CONFIG = BENCH_DIR / "configs" / "nanogpt_baby.yaml"


def nanogpt_run(peer: Path, steps: int) -> dict:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "train.py", "config/train_shakespeare_char.py", *time_to_loss.nanogpt_flags(steps)],
        cwd=peer,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    step_ms = statistics.median(
        float(ms) for ms in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", result.stdout)[1:]
    )
    return {"wall_s": round(wall, 2), "step_ms": round(step_ms, 2), "fixed_s": round(wall - steps * step_ms / 1000, 2)}


def ours_run(work: Path, steps: int, round_: int) -> dict:
    out = work / f"ours-{round_}"  # a run folder per round: training refuses to write into a finished run
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_trainer",
            "train",
            "--config",
            str(CONFIG),
            f"training.output_dir={out}",
            f"data.cache_dir={work / 'cache'}",
            f"data.data_files={time_to_loss.DATA}",
            f"training.max_steps={steps}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    )
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_ms = 1000 * statistics.median(r["step_time_s"] for r in rows if r["kind"] == "train" and "step_time_s" in r)
    summary = rows[-1]
    plots = float(
        subprocess.run(
            [sys.executable, "-c", PLOTS, str(out), str(work / "plots")],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
    )
    return {
        "wall_s": round(wall, 2),
        "step_ms": round(step_ms, 2),
        "fixed_s": round(wall - steps * step_ms / 1000, 2),
        "evaluation_s": round(summary["evaluation_s"], 2),
        "checkpoint_s": round(summary["checkpoint_s"], 2),
        "plots_s": round(plots, 2),
    }


PLOTS = r"""
import sys, time
from llm_trainer.train.plots import plot_runs
start = time.perf_counter()
plot_runs(sys.argv[1], sys.argv[2], strict=True)  # as at the end of a run: matplotlib's import included
print(time.perf_counter() - start)
"""

IN_PROCESS = r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig
from tqdm.auto import tqdm
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.model import Transformer
from llm_trainer.parallel.distributed import DistInfo
from llm_trainer.parallel.strategies import Parallelism
from llm_trainer.train.optim import build_optimizer
from llm_trainer.train.step import autocast, train_step

torch.manual_seed(1337)
x, y = torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))
nano = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False))
nano_opt = nano.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")

def nanogpt():
    _, loss = nano(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(nano.parameters(), 1.0)
    nano_opt.step()
    nano_opt.zero_grad(set_to_none=True)
    loss.item()

def ours(bias):
    model = Transformer(ModelConfig(architecture="gpt2", bias=bias, vocab_size=65, d_model=128, n_heads=4, n_layers=4, max_seq_len=64))
    training = TrainingConfig(weight_decay=0.1, adam_beta2=0.99, learning_rate=1e-3)
    parallel = Parallelism(model, model, build_optimizer(model, training, torch.device("cpu")), dist=DistInfo(),
                           device=torch.device("cpu"), amp_dtype=None)
    context = autocast(torch.device("cpu"), None)
    return lambda: float(train_step(parallel, [(x, y)], autocast=context, max_grad_norm=1.0).loss)

bar = tqdm(total=10**9, desc="train", unit="step", mininterval=0.5, file=open("/dev/null", "w"))
def progress_bar():
    bar.update(1)

runners = {"nanogpt": nanogpt, "ours": ours(False), "ours_biases": ours(True), "progress_bar": progress_bar}
for fn in runners.values():
    for _ in range(10):
        fn()
times = {name: [] for name in runners}
for _ in range(int(sys.argv[2])):
    for name, fn in runners.items():
        start = time.perf_counter()
        for _ in range(20):
            fn()
        times[name].append((time.perf_counter() - start) / 20 * 1000)
print(json.dumps({name: round(sorted(v)[len(v) // 2], 4) for name, v in times.items()}))
"""


def in_process(peer: Path, rounds: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, str(peer), str(rounds)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def import_time() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import llm_trainer.cli, llm_trainer.api"], check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "overhead_shares.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overhead_"))
    peer, _ = time_to_loss.prepare_nanogpt(work)
    time_to_loss.prepare_ours(CONFIG, work / "cache")
    rounds = []
    for r in range(args.rounds):
        order = ["nanogpt", "ours"] if r % 2 == 0 else ["ours", "nanogpt"]
        results = {
            name: nanogpt_run(peer, args.steps) if name == "nanogpt" else ours_run(work, args.steps, r)
            for name in order
        }
        results["import_s"] = round(import_time(), 2)
        results["in_process_ms"] = in_process(peer, 8)
        rounds.append(results)
        print(json.dumps(results), file=sys.stderr, flush=True)

    def mean(get) -> float:
        return round(statistics.fmean(get(r) for r in rounds), 2)

    steps = args.steps
    ip = {key: mean(lambda r, k=key: r["in_process_ms"][k]) for key in rounds[0]["in_process_ms"]}
    shares = {
        "whole_process_s": {
            "nanogpt": mean(lambda r: r["nanogpt"]["wall_s"]),
            "ours": mean(lambda r: r["ours"]["wall_s"]),
        },
        "loop_s": {
            "nanogpt": round(steps * mean(lambda r: r["nanogpt"]["step_ms"]) / 1000, 2),
            "ours": round(steps * mean(lambda r: r["ours"]["step_ms"]) / 1000, 2),
        },
        "fixed_s": {"nanogpt": mean(lambda r: r["nanogpt"]["fixed_s"]), "ours": mean(lambda r: r["ours"]["fixed_s"])},
        "ours_fixed_parts_s": {
            "import": mean(lambda r: r["import_s"]),
            "evaluation": mean(lambda r: r["ours"]["evaluation_s"]),
            "checkpoint_stall": mean(lambda r: r["ours"]["checkpoint_s"]),
            "plots": mean(lambda r: r["ours"]["plots_s"]),
        },
        "model_and_optimizer_step_s": round(steps * (ip["ours"] - ip["nanogpt"]) / 1000, 2),  # < 0: ours is faster
        "biases_s": round(steps * (ip["ours_biases"] - ip["ours"]) / 1000, 2),  # what nanoGPT's bias=False saves us
        "progress_bar_s": round(steps * ip["progress_bar"] / 1000, 3),
    }
    report = {
        "benchmark": "overhead_shares",
        "steps": steps,
        "machine": machine_info(),
        "in_process_ms_per_step": ip,
        "shares_s": shares,
        "rounds": rounds,
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
