"""bench/gpu_compare.py's kernel breakdown (what a profiled step's GPU time is, read from a trace) and
the test it runs on the device."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "gpu_compare.py"


def _gpu_compare():
    spec = importlib.util.spec_from_file_location("gpu_compare", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _trace(tmp_path: Path) -> Path:
    """Two profiled steps of 100 us on the host, each launching one 40 us matmul and one 10 us triton
    kernel; the GPU runs behind, so the trace also holds a 60 us kernel launched before the first step."""
    events = [{"ph": "X", "cat": "kernel", "name": "queued_before", "ts": 5, "dur": 60, "args": {"correlation": 1}}]
    for step in range(2):
        start = 100 + step * 100
        events.append(
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{6 + step}", "ts": start, "dur": 100}
        )
        for i, (name, kind, duration) in enumerate(
            (("nvjet_gemm", "cuda_runtime", 40), ("triton_poi", "cuda_driver", 10))
        ):
            correlation = 10 + 2 * step + i
            events.append(
                {
                    "ph": "X",
                    "cat": kind,
                    "name": "launch",
                    "ts": start + 5 + i,
                    "dur": 1,
                    "args": {"correlation": correlation},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": name,
                    "ts": start + 60 + 50 * i,
                    "dur": duration,
                    "args": {"correlation": correlation},
                }
            )
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernels_count_for_the_steps_that_launched_them(tmp_path):
    breakdown = _gpu_compare().kernel_breakdown(_trace(tmp_path))
    assert breakdown["steps"] == 2
    assert breakdown["busy_ms_per_step"] == 0.05  # 40 + 10 us; the kernel queued before the steps is not theirs
    assert breakdown["wall_ms_per_step"] == 0.08  # 160..320 us from the first kernel to the last, over two steps
    assert [row["name"] for row in breakdown["top"]] == ["nvjet_gemm", "triton_poi"]
    assert breakdown["groups"] == {"matmul": 0.8, "compiled (triton)": 0.2}


def test_a_step_the_budget_does_not_reach_reads_no_other_steps_log(tmp_path):
    """A skipped step has no log of its own: its result is not the previous step's last line."""
    gpu_compare = _gpu_compare()
    earlier = tmp_path / "saved_gpt2.log"
    earlier.write_text("| gpt2-124m bf16 | 365,105 | 363,729 | 1.00 |\n")
    settings = gpu_compare.Settings.for_run(True)
    run = gpu_compare.Run(settings=settings, out=tmp_path, work=tmp_path, deadline=0.0, logs=[earlier])
    record = gpu_compare.estimate_test_step(run)
    assert record["status"] == "skipped" and record["result"] is None
    line = gpu_compare.followup_lines(
        {"steps": {"estimate_test": record}, "wall_s": 1, "date": "2026-11-28", "cpu_dry_run": True}, None
    )
    assert "365,105" not in line and "estimate_test: skipped (the call's time budget is spent)" in line


@pytest.mark.slow  # two pytest collections in child processes
@pytest.mark.parametrize("cpu", [True, False], ids=["dry-run", "gpu"])
def test_the_estimate_test_the_script_runs_exists(cpu):
    """A lease's step must not be spent on a test id that names no test (pytest then only says "no match")."""
    test = _gpu_compare().estimate_test(cpu)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", test],
        cwd=BENCH.parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert collected.returncode == 0 and test in collected.stdout, collected.stdout[-2000:]
