"""Run the baby-GPT Tiny Shakespeare benchmark: every runner as its own subprocess, one at a time.

    python bench/run_baby_gpt.py                      # bare loop, HF Trainer, ours; 2000 steps each
    python bench/run_baby_gpt.py --steps 30           # smoke test
    python bench/run_baby_gpt.py --only ours,hf_trainer
    python bench/run_baby_gpt.py --compile            # also bare loop and ours with torch.compile

Runners (names for --only): bare_loop, hf_trainer, ours. With --compile, bare_loop_compile and
ours_compile run too (after their eager version, when that one is selected; --only also accepts the
_compile names directly). Each subprocess's whole wall time (interpreter start to exit) is measured
here; the runners' own figures (tokens/s over the training loop, val loss with the shared
definition) come from their JSON line or, for ours, from <output_dir>/metrics.jsonl.

Prints one JSON object and also writes it to --out (default bench/out/baby_gpt_shakespeare_steps<N>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CONFIG = "bench/configs/baby_gpt_shakespeare.yaml"
DATA_ENV_VAR = "BABY_GPT_DATA"  # same override as bench/shakespeare.py
TOKENS_PER_STEP = 12 * 64  # batch 12 x 64 predicted tokens
BASE_RUNNERS = ("bare_loop", "hf_trainer", "ours", "ours_llama")
# ours_llama: the same setting (width, depth, heads, context, batch, steps, schedule) with the LLaMA block
# (RMSNorm, SwiGLU of the same parameter count, RoPE, no biases): our recommended architecture.
VARIANTS = {
    "ours_llama": ["model.architecture=llama"],
    "ours_read_ahead": ["training.read_ahead=true"],  # bench/read_ahead.py's two sides (auto: off on a CPU)
    "ours_read_in_place": ["training.read_ahead=false"],
}
ALIASES = {"bare": "bare_loop", "hf": "hf_trainer", "llm_trainer": "ours"}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def emit_report(report: dict, out) -> int:
    """A benchmark's result: one JSON object on stdout, and the same, indented, in `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
    }
    try:
        info["sched_affinity_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _last_json_line(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict) and "name" in value:
                return value
    return None


def _run(cmd: list[str], timeout: float | None) -> dict:
    """Run one subprocess from the repo root; return its whole wall time, rc and output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    load_before = _loadavg()
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = (
            exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ) + f"\n[timed out after {timeout}s]"
    wall = time.perf_counter() - start
    return {
        "cmd": " ".join(cmd),
        "returncode": rc,
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "stdout": stdout,
        "stderr": stderr,
    }


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:]


def run_script(name: str, script: str, steps: int, compile_: bool, timeout: float | None) -> dict:
    cmd = [sys.executable, f"bench/{script}", "--steps", str(steps)] + (["--compile"] if compile_ else [])
    raw = _run(cmd, timeout)
    parsed = _last_json_line(raw["stdout"])
    result = {**(parsed or {}), "name": name}
    result.update({k: raw[k] for k in ("cmd", "returncode", "wall_s", "loadavg_before", "loadavg_after")})
    if raw["returncode"] != 0 or parsed is None:
        result["error"] = _tail(raw["stderr"] or raw["stdout"])
    return result


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _loop_throughput(trains: list[dict]) -> tuple[float, float] | None:
    """(tokens/s, seconds) of ours' training loop from its train rows: each row's tokens_per_s covers
    the tokens since the previous row, so the loop time is the sum of window_tokens / tokens_per_s."""
    seconds, previous = 0.0, 0
    for row in trains:
        seen, rate = row.get("tokens_seen"), row.get("tokens_per_s")
        if seen is None or not rate:
            return None
        seconds += (seen - previous) / rate
        previous = seen
    return (previous / seconds, seconds) if seconds > 0 else None


def _shared_eval(end: dict, out_dir: Path, timeout: float | None) -> dict:
    """Re-evaluate ours' final model with bench/shakespeare.py's definition (untimed, own subprocess)."""
    candidates = [end.get("checkpoint"), out_dir / "checkpoints" / "best_model"]
    model_dir = next((Path(c) for c in candidates if c and (Path(c) / "model.safetensors").is_file()), None)
    if model_dir is None:
        return {"val_loss_shared_error": "no model folder with model.safetensors found"}
    raw = _run([sys.executable, "bench/eval_ours.py", str(model_dir)], timeout)
    parsed = _last_json_line(raw["stdout"])
    if raw["returncode"] != 0 or parsed is None:
        return {"val_loss_shared_error": _tail(raw["stderr"] or raw["stdout"])}
    return {
        "val_loss_shared": parsed["val_loss"],
        "val_tokens_shared": parsed["val_tokens"],
        "vocab_size": parsed.get("vocab_size"),
    }


def run_ours(
    name: str, steps: int, compile_: bool, timeout: float | None, keep: bool, shared_eval: bool = True
) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="bench_ours_"))
    cmd = [
        sys.executable,
        "-m",
        "llm_trainer",
        "train",
        "--config",
        CONFIG,
        f"training.output_dir={out_dir}",
        f"training.max_steps={steps}",
        f"data.cache_dir={out_dir / 'data_cache'}",  # cold cache, like the other runners; repo stays clean
        *VARIANTS.get(name.removesuffix("_compile"), []),
    ]
    if compile_:
        cmd.append("training.compile=true")
    if os.environ.get(DATA_ENV_VAR):
        cmd.append(f"data.data_files={os.environ[DATA_ENV_VAR]}")
    raw = _run(cmd, timeout)
    result: dict = {"name": name, "steps": steps, "compile": compile_}
    result.update({k: raw[k] for k in ("cmd", "returncode", "wall_s", "loadavg_before", "loadavg_after")})
    metrics_path = out_dir / "metrics.jsonl"
    rows = _read_jsonl(metrics_path) if metrics_path.is_file() else []
    end = next((r for r in reversed(rows) if r.get("kind") == "summary"), None)
    evals = [r for r in rows if r.get("kind") == "eval"]
    trains = [r for r in rows if r.get("kind") == "train"]
    if end is not None:
        result["train_runtime_s"] = end.get("train_runtime_s")  # ours' train(): loop + final eval + checkpoint
        result["tokens_per_s_train_end"] = end.get("tokens_per_s")
        result["val_loss"] = end.get("val_loss")
        result["train_end"] = end
    loop = _loop_throughput(trains)
    if loop is not None:
        # The training loop alone, as the bare-loop and HF figures time it: ours' train rows each cover
        # the steps since the previous row and end before the final eval and checkpoint.
        result["tokens_per_s"], result["train_wall_s"] = loop
    elif end is not None:
        result["tokens_per_s"], result["train_wall_s"] = end.get("tokens_per_s"), end.get("train_runtime_s")
        result["tokens_per_s_note"] = "no usable train rows; figure includes ours' final eval and checkpoint"
    if trains and all(isinstance(r.get("data_wait_fraction"), float) for r in trains):
        result["data_wait_fraction"] = statistics.median(r["data_wait_fraction"] for r in trains)
    if result.get("val_loss") is None and evals:
        result["val_loss"] = evals[-1]["val_loss"]
    result["process_wall_s"] = raw["wall_s"]
    result["metrics_rows"] = len(rows)
    if raw["returncode"] != 0 or end is None:
        why = "no summary row in metrics.jsonl" if raw["returncode"] == 0 else ""
        result["error"] = (why + "\n" + _tail(raw["stderr"] or raw["stdout"])).strip()
    if shared_eval and end is not None:
        result.update(_shared_eval(end, out_dir, timeout))
    if keep:
        result["output_dir"] = str(out_dir)
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _ratio(a, b):
    try:
        return a / b if a is not None and b else None
    except TypeError:
        return None


def ratios(runs: dict[str, dict]) -> dict:
    out = {}
    for suffix in ("", "_compile"):
        ours, hf, bare = runs.get("ours" + suffix), runs.get("hf_trainer"), runs.get("bare_loop" + suffix)
        if ours and hf and not suffix:
            out["ours_vs_hf_throughput"] = _ratio(ours.get("tokens_per_s"), hf.get("tokens_per_s"))
            out["ours_vs_hf_throughput_train_end"] = _ratio(ours.get("tokens_per_s_train_end"), hf.get("tokens_per_s"))
            out["ours_vs_hf_process_wall"] = _ratio(ours.get("wall_s"), hf.get("wall_s"))
            ours_val = ours.get("val_loss_shared", ours.get("val_loss"))
            out["ours_minus_hf_val_loss"] = (
                ours_val - hf["val_loss"] if ours_val is not None and hf.get("val_loss") is not None else None
            )
        if ours and bare:
            out[f"ours_vs_bare_wall{suffix}"] = _ratio(ours.get("wall_s"), bare.get("wall_s"))
            out[f"ours_vs_bare_throughput{suffix}"] = _ratio(ours.get("tokens_per_s"), bare.get("tokens_per_s"))
        if hf and bare and not suffix:
            out["hf_vs_bare_wall"] = _ratio(hf.get("wall_s"), bare.get("wall_s"))
            out["hf_vs_bare_throughput"] = _ratio(hf.get("tokens_per_s"), bare.get("tokens_per_s"))
    if runs.get("ours_llama") and runs.get("hf_trainer"):
        out["ours_llama_vs_hf_throughput"] = _ratio(
            runs["ours_llama"].get("tokens_per_s"), runs["hf_trainer"].get("tokens_per_s")
        )
    if runs.get("ours_compile") and runs.get("hf_trainer"):
        out["ours_compile_vs_hf_throughput"] = _ratio(
            runs["ours_compile"].get("tokens_per_s"), runs["hf_trainer"].get("tokens_per_s")
        )
    return out


def _selected(only: str | None, compile_: bool) -> list[str]:
    order = ["bare_loop", "bare_loop_compile", "hf_trainer", "ours", "ours_compile", "ours_llama"]
    if only is None:
        chosen = set(BASE_RUNNERS)
    else:
        chosen = set()
        for name in (n.strip() for n in only.split(",") if n.strip()):
            name = ALIASES.get(name, name)
            if name not in order:
                raise SystemExit(f"unknown runner {name!r}; choose from {', '.join(order)}")
            chosen.add(name)
    if compile_:
        chosen |= {f"{n}_compile" for n in ("bare_loop", "ours") if n in chosen}
    return [n for n in order if n in chosen]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="baby-GPT Tiny Shakespeare benchmark (runners run one after another)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps for every runner (default 2000)")
    parser.add_argument("--only", help="comma-separated runners: bare_loop, hf_trainer, ours (and *_compile)")
    parser.add_argument("--compile", action="store_true", help="also run bare loop and ours with torch.compile")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per runner (default: none)")
    parser.add_argument("--out", help="where to write the JSON (default bench/out/baby_gpt_shakespeare_steps<N>.json)")
    parser.add_argument("--keep-outputs", action="store_true", help="keep ours' output directory")
    parser.add_argument(
        "--no-shared-eval",
        action="store_true",
        help="skip re-evaluating ours' final model with the shared val definition (bench/eval_ours.py)",
    )
    args = parser.parse_args(argv)

    names = _selected(args.only, args.compile)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    runs: dict[str, dict] = {}
    for name in names:
        print(f"[bench] running {name} ({args.steps} steps) ...", file=sys.stderr, flush=True)
        compile_ = name.endswith("_compile")
        base = name.removesuffix("_compile")
        if base == "bare_loop":
            runs[name] = run_script(name, "bare_loop.py", args.steps, compile_, args.timeout)
        elif base == "hf_trainer":
            runs[name] = run_script(name, "hf_trainer.py", args.steps, False, args.timeout)
        else:
            runs[name] = run_ours(name, args.steps, compile_, args.timeout, args.keep_outputs, not args.no_shared_eval)
        r = runs[name]
        status = "FAILED" if "error" in r else "ok"
        print(
            f"[bench] {name}: {status}, wall {r['wall_s']:.1f}s, tokens/s {r.get('tokens_per_s')}, val_loss {r.get('val_loss')}",
            file=sys.stderr,
            flush=True,
        )

    report = {
        "benchmark": "baby_gpt_shakespeare_char",
        "started_utc": started,
        "steps": args.steps,
        "tokens_per_step": TOKENS_PER_STEP,
        "machine": machine_info(),
        "runners": runs,
        "ratios": ratios(runs),
    }
    text = json.dumps(report, indent=2)
    out = Path(args.out) if args.out else BENCH_DIR / "out" / f"baby_gpt_shakespeare_steps{args.steps}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text, flush=True)
    return 1 if any("error" in r for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
