"""Time to quality against nanoGPT's own train.py, on this machine, in the same run.

    python bench/time_to_loss.py               # 2 rounds, alternated: nanoGPT, ours (speedrun), ours (nanoGPT's setting)
    python bench/time_to_loss.py --rounds 1 --steps 200 --quick    # smoke test

Per round:

* `nanogpt`: nanoGPT's own `train.py` from a temporary copy of ../shared/peers/nanoGPT (data prepared
  by its own prepare.py beforehand, not timed), with its CPU baby-GPT flags (PEER.md): 4 layers, 4 heads,
  128 wide, context 64, batch 12, 2000 steps, fp32, no compile. Its final validation loss `L` (its own
  estimate: 20 random batches of the validation split) and its whole-process wall time `W`.
* `ours_speedrun`: `llm-trainer train --config configs/speedrun-shakespeare.yaml` with
  `training.target_val_loss=L`: it stops at the first evaluation whose loss over the *whole*
  validation split (the same last 10% of characters as nanoGPT's split) reaches L. Whole-process
  wall time. Its final model is evaluated again afterwards, untimed, over the whole split in
  float32 (`val_loss_float32`): the run itself evaluates in its training precision (bf16 autocast).
  Our data is prepared once beforehand (`llm-trainer prepare`, untimed), as nanoGPT's is. The recipe's budget: at most nanoGPT's parameter count,
  context 64, 12 sequences per step, character level.
* `ours_nanogpt_setting`: nanoGPT's setting itself in our trainer (GPT-2 block without biases, the
  same schedule, fp32, 2000 steps, a final full-split evaluation and checkpoint): whole-process wall.

Ratios per round: `speedrun_time_to_target_over_nanogpt` = ours_speedrun wall / W (target <= 0.33),
`nanogpt_speed_over_ours_setting` = W / ours_nanogpt_setting wall (>= 1.0: ours as fast or faster).
Rounds interleave the runners (A B C A B C), so a drift of the machine shows in both.
One JSON object on stdout and in bench/out/time_to_loss.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from run_baby_gpt import _loadavg, emit_report, machine_info  # noqa: E402

SHARED = REPO_ROOT.parent / "shared"
NANOGPT = SHARED / "peers" / "nanoGPT"
DATA = SHARED / "data" / "tinyshakespeare" / "input.txt"
SPEEDRUN = REPO_ROOT / "configs" / "speedrun-shakespeare.yaml"
SETTING = REPO_ROOT / "bench" / "configs" / "nanogpt_baby.yaml"


def nanogpt_flags(steps: int) -> list[str]:
    return [
        "--device=cpu",
        "--compile=False",
        "--eval_iters=20",
        "--log_interval=1",
        "--block_size=64",
        "--batch_size=12",
        "--n_layer=4",
        "--n_head=4",
        "--n_embd=128",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--dropout=0.0",
        f"--eval_interval={steps}",
        "--always_save_checkpoint=False",
    ]


def prepare_nanogpt(work: Path) -> tuple[Path, float]:
    peer = work / "nanoGPT"
    shutil.copytree(NANOGPT, peer)
    data = peer / "data" / "shakespeare_char"
    shutil.copy(DATA, data / "input.txt")
    start = time.perf_counter()
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return peer, time.perf_counter() - start


def timed(cmd: list[str], cwd: Path, timeout: float) -> dict:
    before = _loadavg()
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    record = {
        "wall_s": round(wall, 2),
        "returncode": result.returncode,
        "loadavg_before": before,
        "loadavg_after": _loadavg(),
    }
    if result.returncode != 0:
        record["error"] = (result.stderr or result.stdout)[-2000:]
    return record | {"_stdout": result.stdout, "_stderr": result.stderr}


def run_nanogpt(peer: Path, steps: int, timeout: float) -> dict:
    record = timed(
        [sys.executable, "train.py", "config/train_shakespeare_char.py", *nanogpt_flags(steps)], peer, timeout
    )
    found = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", record.pop("_stdout"))
    record.pop("_stderr")
    if found:
        step, train_loss, val_loss = found[-1]
        record.update(step=int(step), train_loss=float(train_loss), val_loss=float(val_loss))
    return record


def prepare_ours(config: Path, cache: Path) -> float:
    """`llm-trainer prepare` once, before timing (as nanoGPT's prepare.py runs before its train.py)."""
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_trainer",
            "prepare",
            "--config",
            str(config),
            f"data.cache_dir={cache}",
            f"data.data_files={DATA}",
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def float32_loss(checkpoint: Path) -> float | None:
    """The final model's validation loss over the whole split in float32, untimed (bench/eval_ours.py)."""
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "eval_ours.py"), str(checkpoint)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    try:
        return json.loads(result.stdout.strip().splitlines()[-1]).get("val_loss")
    except (ValueError, IndexError):
        return None


def ours_train_cmd(config: Path, out: Path, cache: Path, overrides: list[str]) -> list[str]:
    """`llm-trainer train` of `config` into `out`, on the Tiny Shakespeare text prepared in `cache`."""
    return [
        sys.executable,
        "-m",
        "llm_trainer",
        "train",
        "--config",
        str(config),
        f"training.output_dir={out}",
        f"data.cache_dir={cache}",
        f"data.data_files={DATA}",
        *overrides,
    ]


def run_ours(config: Path, work: Path, name: str, overrides: list[str], timeout: float) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    record = timed(ours_train_cmd(config, out, work / "cache", overrides), REPO_ROOT, timeout)
    record.pop("_stdout")
    stderr = record.pop("_stderr")
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        summary = next((r for r in reversed(rows) if r.get("kind") == "summary"), {})
        evals = [r for r in rows if r.get("kind") == "eval"]
        record.update(
            step=summary.get("step"),
            val_loss=summary.get("val_loss"),
            stopped=summary.get("stopped_early"),
            time_to_target_s=summary.get("time_to_target_s"),
            train_runtime_s=summary.get("train_runtime_s"),
            tokens_per_s=summary.get("tokens_per_s"),
            evaluations=[(r["step"], round(r["val_loss"], 4), r.get("batches")) for r in evals],
        )
    params = re.search(r"train: ([\d,]+) parameters", stderr)
    if params:
        record["parameters"] = int(params.group(1).replace(",", ""))
    final = out / "checkpoints" / "latest"
    if final.is_file():
        record["val_loss_float32"] = float32_loss(out / "checkpoints" / final.read_text().strip())
    shutil.rmtree(out, ignore_errors=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000, help="nanoGPT's steps (and our nanoGPT-setting run's)")
    parser.add_argument("--quick", action="store_true", help="smoke test: skip the nanoGPT-setting run")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "time_to_loss.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="time_to_loss_"))
    peer, prepare_s = prepare_nanogpt(work)
    ours_prepare_s = prepare_ours(SPEEDRUN, work / "cache")  # both configs read the same prepared data
    report: dict = {
        "benchmark": "time_to_loss",
        "steps": args.steps,
        "nanogpt_prepare_s": round(prepare_s, 2),
        "ours_prepare_s": round(ours_prepare_s, 2),
        "machine": machine_info(),
        "rounds": [],
    }
    setting_args = [f"training.max_steps={args.steps}"]
    for _ in range(args.rounds):
        results: dict = {"nanogpt": run_nanogpt(peer, args.steps, args.timeout)}  # its L is the speedrun's target
        target = results["nanogpt"].get("val_loss")
        results["ours_speedrun"] = run_ours(
            SPEEDRUN,
            work,
            "ours_speedrun",
            [f"training.target_val_loss={target}"] if target is not None else [],
            args.timeout,
        )
        if not args.quick:
            results["ours_nanogpt_setting"] = run_ours(
                SETTING, work, "ours_nanogpt_setting", setting_args, args.timeout
            )
        nano = results["nanogpt"]
        ratios = {}
        speedrun = results["ours_speedrun"]
        if nano.get("wall_s") and speedrun.get("wall_s"):
            ratios["speedrun_time_to_target_over_nanogpt"] = round(speedrun["wall_s"] / nano["wall_s"], 3)
            ratios["speedrun_reached_target"] = (speedrun.get("stopped") or "").startswith("target reached")
        if "ours_nanogpt_setting" in results and results["ours_nanogpt_setting"].get("wall_s"):
            ratios["nanogpt_speed_over_ours_setting"] = round(
                nano["wall_s"] / results["ours_nanogpt_setting"]["wall_s"], 3
            )
        report["rounds"].append(
            {"order": list(results), "target_val_loss": target, "results": results, "ratios": ratios}
        )
        print(json.dumps(report["rounds"][-1]), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
