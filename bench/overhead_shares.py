"""Where our whole-process time goes beyond nanoGPT's, on nanoGPT's own setting.

    python bench/overhead_shares.py              # 2 rounds of every variant, ~2 min each
    python bench/overhead_shares.py --steps 300  # quicker, coarser

Runs `llm-trainer train --config bench/configs/nanogpt_baby.yaml` (nanoGPT's baby GPT in our trainer,
our defaults otherwise) and, alternated with it, the same run with one cause switched off at a time:

    biases           model.bias=true (our GPT-2 preset) instead of nanoGPT's bias-free block
    no_progress_bar  training.progress_bar=false
    sync_checkpoint  training.async_checkpoint=false
    eval_20_batches  training.eval_max_batches=20 (nanoGPT's 20 random batches; ours: the first 20)

plus, from each run's own summary, the seconds spent evaluating and saving (`evaluation_s`,
`checkpoint_s`), and the import of the package alone (`import_s`). Each figure is a whole-process
wall time; the shares are differences against the default run of the same round. One JSON object on stdout and in
bench/out/overhead_shares.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from run_baby_gpt import machine_info  # noqa: E402

CONFIG = BENCH_DIR / "configs" / "nanogpt_baby.yaml"
DATA = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
VARIANTS = {
    "default": [],
    "biases": ["model.bias=true"],
    "no_progress_bar": ["training.progress_bar=false"],
    "sync_checkpoint": ["training.async_checkpoint=false"],
    "eval_20_batches": ["training.eval_max_batches=20"],
}


def run(name: str, overrides: list[str], steps: int, work: Path) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "llm_trainer", "train", "--config", str(CONFIG), f"training.output_dir={out}",
           f"data.cache_dir={work / 'cache'}", f"data.data_files={DATA}", f"training.max_steps={steps}", *overrides]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    record = {"wall_s": round(wall, 2)}
    if result.returncode != 0:
        record["error"] = result.stderr[-1500:]
        return record
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]
    record.update(train_runtime_s=round(summary["train_runtime_s"], 2), val_loss=summary.get("val_loss"),
                  tokens_per_s=round(summary["tokens_per_s"]), evaluation_s=round(summary["evaluation_s"], 2),
                  checkpoint_s=round(summary["checkpoint_s"], 2))
    shutil.rmtree(out, ignore_errors=True)
    return record


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
    run("warm", [], 10, work)  # the data cache and the page cache, once
    rounds = []
    for r in range(args.rounds):
        names = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        results = {name: run(name, VARIANTS[name], args.steps, work) for name in names}
        results["import_s"] = round(import_time(), 2)
        base = results["default"]["wall_s"]
        results["shares_s"] = {name: round(base - results[name]["wall_s"], 2) for name in VARIANTS if name != "default"}
        rounds.append(results)
        print(json.dumps(results), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    report = {"benchmark": "overhead_shares", "steps": args.steps, "machine": machine_info(), "rounds": rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
