"""Do finished 2-rank CPU runs exit 0? A stress of the exit race `parallel.distributed.finish` closes.

gloo frees finished collective work on its own worker threads. If one of them frees work holding
tensors with Python objects after the interpreter began to exit, the process aborts ("terminate called
without an active exception") and torchrun reports the finished run as failed. Only a worker that runs
late loses that race, so this script makes them late: each run is pinned to CPU 0 beside two busy
loops, and from the first checkpoint on, its gloo worker threads run at nice 19. Every run trains the
6-step experiment of tests/test_distributed.py under torchrun, as the tests run it (plots off), and
counts as failed if it exits non-zero.

    python bench/exit_race.py                      # DeepSpeed ZeRO-3 (the shipped file), 12 runs
    python bench/exit_race.py --strategy fsdp --runs 8

Prints one JSON object. Linux only (CPU affinity, per-thread nice). Compare code versions by running
each with its own source on PYTHONPATH, one after the other on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "deepspeed-zero3": [
        "training.distributed_strategy=deepspeed",
        f"training.deepspeed_config={ROOT}/src/llm_trainer/configs/deepspeed/zero3.json",
    ],
    "fsdp": ["training.distributed_strategy=fsdp"],
    "ddp": ["training.distributed_strategy=ddp"],
}
BUSY_LOOP = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


def worker(argv: list[str]) -> int:
    """One rank: the CLI, with its gloo worker threads made late from the first checkpoint on."""
    from llm_trainer import cli
    from llm_trainer.checkpoint.checkpointer import Checkpointer

    save = Checkpointer.save

    def save_with_late_gloo_threads(self, *args, **kwargs):
        for thread in os.listdir("/proc/self/task"):
            try:
                if Path(f"/proc/self/task/{thread}/comm").read_text().strip() == "pt_gloo_runloop":
                    os.setpriority(os.PRIO_PROCESS, int(thread), 19)
            except OSError:
                pass  # the thread ended
        return save(self, *args, **kwargs)

    Checkpointer.save = save_with_late_gloo_threads
    return cli.main(argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="deepspeed-zero3")
    parser.add_argument("--runs", type=int, default=12)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_distributed import CORPUS, EXPERIMENT, _free_port  # the runs whose exits lost the race in CI

    folder = Path(tempfile.mkdtemp(prefix="exit_race_"))
    (folder / "corpus.txt").write_text(CORPUS)
    (folder / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLM_TRAINER_PLOTS": "0"}
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(2)]
    failed, aborted, seconds = 0, 0, []
    try:
        for run in range(args.runs):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                f"--master-port={_free_port()}",
                __file__,
                "--worker",
                "train",
                "--config",
                "exp.yaml",
                f"training.output_dir=run{run}",
                "training.batch_size=4",  # per rank: test_distributed's global batch of 8
                *STRATEGIES[args.strategy],
            ]
            start = time.perf_counter()
            result = subprocess.run(
                command,
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                preexec_fn=lambda: os.sched_setaffinity(0, {0}),
            )
            seconds.append(round(time.perf_counter() - start, 1))
            failed += result.returncode != 0
            aborted += result.stderr.count("terminate called")
    finally:
        for process in busy:
            process.kill()
        shutil.rmtree(folder)
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "strategy": args.strategy,
                "runs": args.runs,
                "failed": failed,
                "ranks_aborted": aborted,
                "seconds_per_run": seconds,
                "llm_trainer": str(Path(importlib.util.find_spec("llm_trainer").origin).parent),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2:]))
    main()
