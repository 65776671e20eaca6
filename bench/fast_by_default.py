"""What a user gets by default, side by side with the peers, on nanoGPT's baby-GPT setting.

    python bench/fast_by_default.py                          # 2 rounds, 2000 steps (about 20 minutes on 2 cores)
    python bench/fast_by_default.py --rounds 1 --steps 100 --idle-steps 60     # smoke test

Three comparisons, each alternated within every round (A B A B ...), so a drift of the machine shows in
both sides; the JSON keeps every round and the worse one of each ratio:

* `vs_nanogpt`: nanoGPT's own `train.py` (a temporary copy of ../shared/peers/nanoGPT, its CPU baby-GPT
  flags, data prepared beforehand by its own prepare.py, untimed) against
  `llm-trainer train --config bench/configs/nanogpt_baby.yaml` (GPT-2 block without biases, as nanoGPT's;
  everything else our defaults: a checkpoint every 500 steps written in the background, a whole-split
  evaluation every 500 steps and at the end). Our data is prepared once beforehand (`llm-trainer
  prepare`), as nanoGPT's is. Whole-process wall time; ratio = nanoGPT's wall / ours (>= 1: ours as fast).
  Our default precision is `training.use_amp: auto` (bf16 autocast on a device that computes bf16
  natively, as this CPU does; nanoGPT and the HF Trainer run float32 on a CPU): `ours_float32` and
  `ratio_float32` are the same run with `training.use_amp=false`, precision for precision.
* `vs_hf_trainer`: `bench/hf_trainer.py` (transformers `GPT2LMHeadModel` + `Trainer`, biases, no saves and
  no evaluation inside its run, so the peer at its fastest) against
  `llm-trainer train --config bench/configs/baby_gpt_shakespeare.yaml` (the same model with biases, our
  defaults). Whole-process wall; ratio = HF's wall / ours; `ratio_float32` as above.
* `idle_writer`: ours on nanogpt_baby.yaml for `--idle-steps` steps with `training.save_steps=0` (no
  periodic saves) against `training.save_steps` beyond the run (the background writer armed, host
  buffers reserved, no save due) and the default `eval_steps` moved out of the run too, so only the
  writer differs. Training-loop tokens/s from the summary row; ratio = armed / none (target >= 0.95).

One JSON object on stdout and in bench/out/fast_by_default.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from run_baby_gpt import _last_json_line, emit_report, machine_info
from time_to_loss import nanogpt_flags, ours_train_cmd, prepare_nanogpt, prepare_ours, timed

NO_BIAS = BENCH_DIR / "configs" / "nanogpt_baby.yaml"
BIAS = BENCH_DIR / "configs" / "baby_gpt_shakespeare.yaml"


def run_nanogpt(peer: Path, steps: int, timeout: float) -> dict:
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *nanogpt_flags(steps)]
    record = timed(cmd, peer, timeout)
    stdout, _ = record.pop("_stdout"), record.pop("_stderr")
    losses = [line for line in stdout.splitlines() if "val loss" in line]
    record["last_eval"] = losses[-1] if losses else None
    return record


def run_ours(config: Path, work: Path, steps: int, overrides: list[str], timeout: float) -> dict:
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    cmd = ours_train_cmd(config, out, work / "cache", [f"training.max_steps={steps}", *overrides])
    record = timed(cmd, REPO_ROOT, timeout)
    record.pop("_stdout"), record.pop("_stderr")
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    summary = next((r for r in rows if r.get("kind") == "summary"), {})
    record.update(
        {
            key: summary.get(key)
            for key in ("step", "tokens_per_s", "train_runtime_s", "evaluation_s", "checkpoint_s", "val_loss")
        }
    )
    record["checkpoints"] = sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*"))
    shutil.rmtree(out, ignore_errors=True)
    return record


def run_hf(steps: int, timeout: float) -> dict:
    record = timed([sys.executable, str(BENCH_DIR / "hf_trainer.py"), "--steps", str(steps)], REPO_ROOT, timeout)
    stdout, _ = record.pop("_stdout"), record.pop("_stderr")
    found = _last_json_line(stdout) or {}
    record.update({key: found.get(key) for key in ("tokens_per_s", "val_loss")})
    return record


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000, help="steps of every whole-process run")
    parser.add_argument("--idle-steps", type=int, default=600, help="steps of each idle-writer run")
    parser.add_argument("--only", default="vs_nanogpt,vs_hf_trainer,idle_writer")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "fast_by_default.json"))
    args = parser.parse_args()
    chosen = set(args.only.split(","))

    work = Path(tempfile.mkdtemp(prefix="fast_by_default_"))
    peer, _ = prepare_nanogpt(work) if "vs_nanogpt" in chosen else (None, None)
    prepare_ours(NO_BIAS, work / "cache")  # untimed, as nanoGPT's prepare.py; both configs read the same data
    beyond = str(args.idle_steps * 10)  # a save_steps/eval_steps no step of the run reaches
    report: dict = {
        "benchmark": "fast_by_default",
        "steps": args.steps,
        "idle_steps": args.idle_steps,
        "machine": machine_info(),
        "rounds": [],
    }

    def against(name: str, peer_run: dict, config: Path) -> dict:
        """The peer's run beside ours on `config`, at our defaults and in float32; whole-process wall ratios."""
        ours = run_ours(config, work, args.steps, [], args.timeout)
        float32 = run_ours(config, work, args.steps, ["training.use_amp=false"], args.timeout)
        return {
            name: peer_run,
            "ours": ours,
            "ours_float32": float32,
            "ratio": ratio(peer_run["wall_s"], ours["wall_s"]),
            "ratio_float32": ratio(peer_run["wall_s"], float32["wall_s"]),
        }

    try:
        for _ in range(args.rounds):
            results: dict = {}
            if "vs_nanogpt" in chosen:
                results["vs_nanogpt"] = against("nanogpt", run_nanogpt(peer, args.steps, args.timeout), NO_BIAS)
            if "vs_hf_trainer" in chosen:
                results["vs_hf_trainer"] = against("hf_trainer", run_hf(args.steps, args.timeout), BIAS)
            if "idle_writer" in chosen:
                idle = [f"training.eval_steps={beyond}"]
                none = run_ours(NO_BIAS, work, args.idle_steps, ["training.save_steps=0", *idle], args.timeout)
                armed = run_ours(NO_BIAS, work, args.idle_steps, [f"training.save_steps={beyond}", *idle], args.timeout)
                results["idle_writer"] = {
                    "no_periodic_saves": none,
                    "armed_idle": armed,
                    "ratio": ratio(armed["tokens_per_s"], none["tokens_per_s"]),
                }
            report["rounds"].append(results)
            print(
                json.dumps(
                    {f"{n}{k[5:]}": v for n, r in results.items() for k, v in r.items() if k.startswith("ratio")}
                ),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = report["rounds"][0]
    report["worse_of_rounds"] = {
        f"{name}{key[5:]}": min((r[name][key] or 0.0) for r in report["rounds"])
        for name in first
        for key in first[name]
        if key.startswith("ratio")
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
