"""Run the two datatrove stages of `data.cluster` on `data.executor` (local, Slurm or Ray): the
driver that `prepare_data` calls, which plans the tasks, submits or runs them, waits, and reports a
failed task with its file and the command that resumes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..config import DataConfig
from ..errors import UsageError
from ..logs import log
from ..tokenizer import Tokenizer
from .build import MANIFEST, PreparedData, _Build
from .cluster import PARTS, PLAN, STAGES, Plan, TaskFailed, tasks_folder
from .sources import SourceStats, file_units, only_files


def _plan(config: DataConfig, fingerprint: str, work: Path, directory: Path, tasks_dir: Path, dtype) -> Plan:
    """The plan, built from the config on every run: the files are listed and assigned here. plan.json
    records the plan the completed tasks ran under and is only compared with this one, never read as the
    plan (a shared cache's task folder may be written by others): when it differs, the per-file stage
    starts over, and all that is removed are the completion markers, errors and parts in `tasks_dir`."""
    stats = SourceStats()
    units = file_units(config, stats)
    plan = Plan(
        fingerprint,
        config.executor_tasks,
        units,
        dict(stats.skipped),
        np.dtype(dtype).name,
        str(work),
        str(directory),
        time.time(),
        os.getcwd(),
    )
    path = tasks_dir / PLAN
    completed = any((tasks_dir / "prepare" / "completions").glob("*"))
    recorded = None
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads(path.read_text(encoding="utf-8"))
    if plan.matches(recorded):
        started = recorded.get("started")
        if completed and isinstance(started, (int, float)):  # the stage's time counts from its first run
            plan.started = float(started)
    else:
        if completed and isinstance(recorded, dict) and recorded.get("tasks") != config.executor_tasks:
            log(
                f"data: {recorded.get('tasks')} tasks were planned, now {config.executor_tasks}: the per-file stage starts over"
            )
        elif completed:
            log(f"data: {path} is not this config's plan: the per-file stage starts over")
        for stage in STAGES:
            shutil.rmtree(tasks_dir / stage / "completions", ignore_errors=True)
            shutil.rmtree(tasks_dir / stage / "errors", ignore_errors=True)
        shutil.rmtree(tasks_dir / PARTS, ignore_errors=True)
    tasks_dir.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return plan


def _executor(config: DataConfig, pipeline: list, tasks: int, logging_dir: Path, depends=None):
    workers = config.executor_workers
    if config.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        workers = min(tasks, os.cpu_count() or 1) if workers == -1 else min(tasks, workers)
        # fork: the workers start with this process's modules imported (a fresh interpreter per worker
        # would import llm_trainer and torch again, seconds on a small machine)
        return LocalPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir), start_method="fork"
        )
    if config.executor == "ray":
        from datatrove.executor import RayPipelineExecutor

        return RayPipelineExecutor(
            pipeline,
            tasks=tasks,
            workers=workers,
            logging_dir=str(logging_dir),
            cpus_per_task=config.executor_cpus_per_task,
            mem_per_cpu_gb=config.executor_mem_per_cpu_gb,
        )
    from datatrove.executor import SlurmPipelineExecutor

    executor = SlurmPipelineExecutor(
        pipeline,
        tasks=tasks,
        workers=workers,
        time=config.executor_time,
        partition=config.executor_partition or _default_partition(),
        cpus_per_task=config.executor_cpus_per_task,
        mem_per_cpu_gb=max(1, round(config.executor_mem_per_cpu_gb)),
        job_name=f"prepare-{logging_dir.parent.name.strip('.').split('.')[0]}-{logging_dir.name}",
        qos="",
        env_command=config.executor_env_command or _python_path_command(),
        logging_dir=str(logging_dir),
        slurm_logs_folder=str(logging_dir.parent / "slurm_logs"),
        depends=depends,
        requeue=False,
        with_srun=False,
    )
    # no stats-merging job: it would wait for ever behind a failed task (the stats stay per task in stats/)
    executor.launch_merge_stats = _no_stats_job
    return executor


def _no_stats_job() -> None:
    return None


def _python_path_command() -> str:
    """The tasks import this llm_trainer, whatever the job's environment: its folder on PYTHONPATH."""
    import shlex

    source = str(Path(__file__).resolve().parents[2])
    return f"export PYTHONPATH={shlex.quote(source)}${{PYTHONPATH:+:$PYTHONPATH}}"


def _default_partition() -> str:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"executor slurm: sinfo could not be run ({exc}); is this a Slurm login node?") from None
    names = out.split()
    default = [n.rstrip("*") for n in names if n.endswith("*")] or [n for n in names]
    if not default:
        raise UsageError("executor slurm: sinfo lists no partition; set data.executor_partition")
    return default[0]


def _resume_command() -> str:
    import shlex

    if Path(sys.argv[0]).name in ("llm-trainer", "__main__.py", "cli.py"):
        return shlex.join(["llm-trainer", *sys.argv[1:]])
    return "the same prepare (same config and sources)"


def _check(executor, stage: str, tasks_dir: Path, error: BaseException | None) -> None:
    """Raise, naming the task, its file and how to resume, when a task of the stage did not finish."""
    incomplete = executor.get_incomplete_ranks(skip_completed=True)
    if not incomplete:
        return
    failures = []
    for rank in incomplete:
        path = tasks_dir / stage / "errors" / f"{rank:05d}.json"
        with contextlib.suppress(OSError, ValueError):
            failures.append(json.loads(path.read_text()))
    if not failures:
        if error is not None:
            raise error
        raise TaskFailed(
            f"{len(incomplete)} task(s) of the {stage} stage did not finish (first: task {incomplete[0]}); "
            f"logs in {tasks_dir / stage / 'logs'}; run {_resume_command()} again to resume"
        )
    first = failures[0]
    where = f"task {first['task']} of {first['tasks']}" + (f", input file {first['file']}" if first["file"] else "")
    if first["usage"]:
        raise UsageError(f"{first['message']} ({where})")
    done = executor.world_size - len(incomplete)
    log_file = tasks_dir / stage / "logs" / f"task_{first['task']:05d}.log"
    raise TaskFailed(
        f"{stage} stage: {where} failed: {first['type']}: {first['message']}; log: "
        f"{log_file}; {done} of {executor.world_size} tasks "
        f"finished and are kept: run {_resume_command()} again to resume"
    )


def prepare_with_executor(config: DataConfig, fingerprint: str, work: Path, directory: Path):
    """Build `directory` with the two stages on `config.executor`; returns its PreparedData."""
    _, _ = _datatrove_modules()
    from . import trove_steps  # datatrove's step classes: imported once datatrove is known to be there

    only_files(config)
    tokenizer = _Build(config, fingerprint, work, directory)._tokenizer()  # once, before any task, in `work`
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tasks_dir = tasks_folder(config, fingerprint)
    plan = _plan(config, fingerprint, work, directory, tasks_dir, dtype)
    log(
        f"data: preparing {directory} on executor {config.executor} ({config.executor_tasks} tasks); "
        f"logs and completion markers in {tasks_dir}"
    )
    started = time.perf_counter()
    per_file = _executor(
        config, trove_steps.per_file_pipeline(config, plan, tasks_dir), config.executor_tasks, tasks_dir / "prepare"
    )
    seconds = {}
    try:
        if config.executor == "slurm":
            merge_steps = trove_steps.merge_pipeline(config, plan, tasks_dir)
            _run_slurm(
                per_file,
                _executor(config, merge_steps, 1, tasks_dir / "merge", per_file),
                tasks_dir,
                directory / MANIFEST,
            )
        else:
            with _ray(config):
                _run(per_file, "prepare", tasks_dir)
                seconds["prepare"] = time.perf_counter() - started
                merging = _executor(config, trove_steps.merge_pipeline(config, plan, tasks_dir), 1, tasks_dir / "merge")
                _run(merging, "merge", tasks_dir)
    except UsageError:  # bad input: fixing it changes the fingerprint, so the work done is of no further use
        shutil.rmtree(tasks_dir / PARTS, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        raise
    seconds["total"] = time.perf_counter() - started
    if "prepare" in seconds:
        seconds["merge"] = seconds["total"] - seconds["prepare"]
    (tasks_dir / "seconds.json").write_text(json.dumps({k: round(v, 3) for k, v in seconds.items()}))
    for stage in STAGES:
        shutil.rmtree(tasks_dir / stage / "completions", ignore_errors=True)
    shutil.rmtree(tasks_dir / PARTS, ignore_errors=True)
    manifest = json.loads((directory / MANIFEST).read_text())
    if config.executor != "local":
        from .report import REPORT, print_summary

        print_summary(json.loads((directory / REPORT).read_text()))
    return PreparedData(directory, Tokenizer.load(directory), manifest)


def _datatrove_modules():
    try:
        import datatrove.executor  # noqa: F401
        import datatrove.pipeline.base  # noqa: F401
    except ImportError:
        raise UsageError("data.executor needs datatrove: pip install -e '.[cluster]'") from None
    return datatrove.executor, datatrove.pipeline.base


def _run(executor, stage: str, tasks_dir: Path) -> None:
    error = None
    from datatrove.executor import LocalPipelineExecutor

    pooled = isinstance(executor, LocalPipelineExecutor) and executor.workers > 1
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if pooled:  # one task per core: each tokenizes on its own thread (no oversubscription)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        executor.run()
    except Exception as exc:  # a task's exception, re-raised by the executor: reported by _check
        error = exc
    finally:
        if pooled and saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        elif pooled:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    _check(executor, stage, tasks_dir, error)


@contextlib.contextmanager
def _ray(config: DataConfig):
    """Ray joined (data.executor_address, else RAY_ADDRESS, else a new local cluster) for the executor's run."""
    if config.executor != "ray":
        yield
        return
    try:
        import ray
    except ImportError:
        raise UsageError("executor ray needs ray: pip install -e '.[cluster]'") from None
    if ray.is_initialized():
        yield
        return
    source = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=config.executor_address, runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _run_slurm(per_file, merging, tasks_dir: Path, manifest: Path, poll: float = 1.0) -> None:
    """Submit both stages (the merge after the per-file jobs), then wait for the manifest or a failure."""
    submitted = tasks_dir / "slurm_jobs.json"
    with contextlib.suppress(OSError, ValueError):
        earlier = json.loads(submitted.read_text())
        while earlier and _queued(earlier):  # an earlier command's jobs still run: never two tasks on one part
            log(f"data: waiting for the Slurm job(s) {', '.join(earlier)} an earlier prepare submitted")
            time.sleep(10 * poll)
    merging.run()  # submits the per-file array job first (its dependency), then the merge job
    jobs = [str(j) for j in (per_file.job_id, merging.job_id) if j not in (None, -1)]
    submitted.write_text(json.dumps(jobs))
    log(f"data: submitted Slurm job(s) {', '.join(jobs) or '(none: all tasks were complete)'}")
    while not manifest.is_file():
        queued = _queued(jobs)
        if str(per_file.job_id) not in queued and per_file.get_incomplete_ranks(skip_completed=True):
            subprocess.run(["scancel", *jobs], capture_output=True)  # the merge would wait for ever
            _check(per_file, "prepare", tasks_dir, None)
        if not queued & set(jobs):
            if manifest.is_file():
                break
            _check(merging, "merge", tasks_dir, None)
            raise TaskFailed(
                f"the Slurm jobs {', '.join(jobs)} ended without a result; see {tasks_dir / 'slurm_logs'}; "
                f"run {_resume_command()} again to resume"
            )
        time.sleep(poll)


def _queued(jobs: list[str]) -> set[str]:
    """The jobs of `jobs` Slurm still lists (pending or running)."""
    if not jobs:
        return set()
    listed = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)], capture_output=True, text=True)
    return {line.split("_")[0] for line in listed.stdout.split()} & set(jobs)
