"""Each time-to-quality technique of configs/speedrun-shakespeare.yaml measured alone and together.

    python bench/speedrun_ablation.py                 # ~8 minutes on 2 cores
    python bench/speedrun_ablation.py --target 1.8802 --only all,baseline

Every run is `llm-trainer train --config configs/speedrun-shakespeare.yaml` with
`training.target_val_loss=<target>` (default 1.8802: nanoGPT's baby-GPT loss on this machine, see
bench/time_to_loss.py) and overrides:

* `all`: the recipe as shipped.
* `baseline`: nanoGPT's block (GPT-2: learned positions, GELU) with AdamW, float32, no block options,
  the recipe's schedule at AdamW's usual rate for this model (1e-3).
* `baseline+X`: the baseline with one technique X added (measured alone).
* `all-X`: the recipe without technique X (its share together with the others); `all+X` for a
  technique the recipe leaves out (ReLU² and zero-initialised projections: measured behind without).

Per run: whole-process wall time, whether and at which step the target was reached, the last
validation loss and the loop's tokens/s. One JSON object on stdout and in bench/out/speedrun_ablation.json.
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
from run_baby_gpt import emit_report, machine_info  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "speedrun-shakespeare.yaml"
DATA = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"

# technique -> (overrides that take it out of the recipe, or that put it in when the recipe has it not;
#               overrides that add it to the baseline)
TECHNIQUES = {
    "muon": (
        ["training.optimizer=adamw", "training.learning_rate=1e-3", "training.min_lr=1e-4"],
        ["training.optimizer=muon", "training.learning_rate=0.06", "training.min_lr=0.006"],  # the recipe's
    ),
    "relu2": (["model.activation=relu2"], ["model.activation=relu2"]),  # not in the recipe: measured behind gelu
    "qk_norm": (["model.qk_norm=false"], ["model.qk_norm=true"]),
    "zero_init": (["model.zero_init_projections=true"], ["model.zero_init_projections=true"]),  # not in the recipe
    "softcap": (["model.logit_softcap=null"], ["model.logit_softcap=15"]),
    "rope": (["model.position_embedding=learned"], ["model.position_embedding=rope"]),
    "bf16": (["training.use_amp=false"], ["training.use_amp=auto"]),
}
IN_RECIPE = {"muon", "qk_norm", "softcap", "rope", "bf16"}
BASELINE = [
    "model.position_embedding=learned",
    "model.activation=gelu",
    "model.qk_norm=false",
    "model.zero_init_projections=false",
    "model.logit_softcap=null",
    "training.use_amp=false",
    "training.optimizer=adamw",
    "training.learning_rate=1e-3",
    "training.min_lr=1e-4",
]


def variants() -> dict[str, list[str]]:
    out = {"all": [], "baseline": BASELINE}
    for name, (change, add) in TECHNIQUES.items():
        out[f"baseline+{name}"] = [*BASELINE, *add]
        out[f"all-{name}" if name in IN_RECIPE else f"all+{name}"] = change
    return out


def run(name: str, overrides: list[str], target: float, work: Path) -> dict:
    out = work / name
    cmd = [
        sys.executable,
        "-m",
        "llm_trainer",
        "train",
        "--config",
        str(CONFIG),
        f"training.output_dir={out}",
        f"data.cache_dir={work / 'cache'}",
        f"data.data_files={DATA}",
        f"training.target_val_loss={target}",
        "training.progress_bar=false",
        *overrides,
    ]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    record: dict = {"overrides": overrides, "wall_s": round(time.perf_counter() - start, 2)}
    if result.returncode != 0:
        record["error"] = result.stderr[-1500:]
        return record
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]
    loop = [r["tokens_per_s"] for r in rows if r["kind"] == "train" and "tokens_per_s" in r]
    record.update(
        reached=(summary.get("stopped_early") or "").startswith("target reached"),
        step=summary["step"],
        val_loss=summary.get("val_loss"),
        loop_tokens_per_s=round(sum(loop) / len(loop)) if loop else None,
        evaluation_s=round(summary["evaluation_s"], 2),
    )
    shutil.rmtree(out, ignore_errors=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=1.8802)
    parser.add_argument("--only", help="comma-separated variant names")
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "speedrun_ablation.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ablation_"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "llm_trainer",
            "prepare",
            "--config",
            str(CONFIG),
            f"data.cache_dir={work / 'cache'}",
            f"data.data_files={DATA}",
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    chosen = variants()
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    results = {}
    for name, overrides in chosen.items():
        results[name] = run(name, overrides, args.target, work)
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "speedrun_ablation",
        "target_val_loss": args.target,
        "machine": machine_info(),
        "runs": results,
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
