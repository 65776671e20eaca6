"""Run the two datatrove stages of `data.prepare.cluster` on `data.executor` (local, Slurm or Ray): the
driver that `prepare_data` calls, which plans the tasks, submits or runs them, waits, and reports a
failed task with its file and the command that resumes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from ...config import DataConfig
from ...errors import UsageError, first_line
from ...files.atomic import write_file
from ...files.disk import lock_exclusive
from ...logs import log
from ...tokenizer import Tokenizer
from ..format import MANIFEST, PreparedData
from ..text.sources import SourceStats, file_units, only_files
from .build import Build
from .cluster import PARTS, PLAN, STAGES, Plan, PlanFile, TaskFailed, tasks_folder


def _plan(config: DataConfig, fingerprint: str, work: Path, directory: Path, tasks_dir: Path, dtype) -> PlanFile:
    """The plan, built from the config on every run: the files are listed and assigned here. plan.json
    records the plan the completed tasks ran under and is only compared with this one, never read as the
    plan (a shared cache's task folder may be written by others): when it differs, the per-file stage
    starts over, and all that is removed are the completion markers, errors and parts in `tasks_dir`.
    The tasks read the file written here, checked against its digest (`PlanFile`)."""
    stats = SourceStats()
    units = file_units(config, stats)
    plan = Plan(
        fingerprint,
        config.executor_tasks,
        units,
        stats.to_json(),
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
            planned = recorded.get("tasks")
            log(f"data: {planned} tasks were planned, now {config.executor_tasks}: the per-file stage starts over")
        elif completed:
            log(f"data: {path} is not this config's plan: the per-file stage starts over")
        for stage in STAGES:
            shutil.rmtree(tasks_dir / stage / "completions", ignore_errors=True)
            shutil.rmtree(tasks_dir / stage / "errors", ignore_errors=True)
        shutil.rmtree(tasks_dir / PARTS, ignore_errors=True)
    tasks_dir.mkdir(parents=True, exist_ok=True)
    return plan.save(path)


def _executor(config: DataConfig, pipeline: list, tasks: int, logging_dir: Path, depends=None):
    workers = config.executor_workers
    if config.executor == "local":
        from .trove_steps import LocalTasksInProcesses

        workers = min(tasks, os.cpu_count() or 1) if workers == -1 else min(tasks, workers)
        return LocalTasksInProcesses(pipeline, tasks=tasks, workers=workers, logging_dir=str(logging_dir))
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
    from .trove_steps import SlurmThisPython

    partition = config.executor_partition or _default_partition()
    mem_per_cpu_gb = max(1, round(config.executor_mem_per_cpu_gb))
    if depends is None:  # once per command: the merge job asks for the same
        _check_slurm_request(config, partition, mem_per_cpu_gb)
    return SlurmThisPython(
        pipeline,
        tasks=tasks,
        workers=workers,
        time=config.executor_time,
        partition=partition,
        cpus_per_task=config.executor_cpus_per_task,
        mem_per_cpu_gb=mem_per_cpu_gb,
        job_name=f"prepare-{logging_dir.parent.name.strip('.').split('.')[0]}-{logging_dir.name}",
        qos="",
        env_command=config.executor_env_command or _python_path_command(),
        logging_dir=str(logging_dir),
        slurm_logs_folder=str(logging_dir.parent / "slurm_logs"),
        depends=depends,
        requeue=False,
        with_srun=False,
    )


def _check_slurm_request(config: DataConfig, partition: str, mem_per_cpu_gb: int) -> None:
    """`sbatch --test-only` with the tasks' request, before anything is submitted: a partition, time
    limit or size Slurm refuses is one line naming the settings, with sbatch's own reason."""
    command = ["sbatch", "--test-only", "--wrap=true", "--output=/dev/null", f"--partition={partition}"]
    command += [f"--time={config.executor_time}", f"--cpus-per-task={config.executor_cpus_per_task}"]
    command += [f"--mem-per-cpu={mem_per_cpu_gb}G"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_SLURM_COMMAND_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"executor slurm: sbatch could not be run ({exc}); is this a Slurm login node?") from None
    if done.returncode != 0:
        reason = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        raise UsageError(
            f"executor slurm: sbatch refuses the tasks' request ({reason}); check data.executor_partition "
            f"({partition}), executor_time ({config.executor_time}), executor_cpus_per_task and "
            "executor_mem_per_cpu_gb"
        )


_SLURM_COMMAND_SECONDS = 60  # sbatch, sinfo: a controller that does not answer in a minute is down


def _python_path_command() -> str:
    """The tasks import this llm_trainer, whatever the job's environment: its folder on PYTHONPATH."""
    import shlex

    source = str(Path(__file__).resolve().parents[2])
    return f"export PYTHONPATH={shlex.quote(source)}${{PYTHONPATH:+:$PYTHONPATH}}"


def _default_partition() -> str:
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=_SLURM_COMMAND_SECONDS
        ).stdout
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
        if isinstance(error, BrokenProcessPool):
            done = executor.world_size - len(incomplete)
            raise TaskFailed(
                f"{stage} stage: a worker process ended without a word while tasks ran (killed, as the "
                "out-of-memory killer does when memory runs short: data.executor_workers sets how many tasks "
                f"run at once; or a crash in a native library); {_logs(tasks_dir, stage)}; {done} of "
                f"{executor.world_size} tasks finished and are kept: run {_resume_command()} again to resume"
            ) from None
        if error is not None:
            raise error
        raise TaskFailed(
            f"{len(incomplete)} task(s) of the {stage} stage did not finish (first: task {incomplete[0]}); "
            f"{_logs(tasks_dir, stage)}; run {_resume_command()} again to resume"
        )
    first = failures[0]
    where = f"task {first['task']} of {first['tasks']}" + (f", input file {first['file']}" if first["file"] else "")
    if first["usage"]:
        raise UsageError(f"{first['message']} ({where})")
    done = executor.world_size - len(incomplete)
    raise TaskFailed(
        f"{stage} stage: {where} failed: {first['type']}: {first['message']}; "
        f"{_logs(tasks_dir, stage, first['task'])}; {done} of {executor.world_size} tasks "
        f"finished and are kept: run {_resume_command()} again to resume"
    )


def _logs(tasks_dir: Path, stage: str, task: int | None = None) -> str:
    """Where to look: the task's datatrove log where it exists, and Slurm's job output where there is
    some (a job that failed before its task started, e.g. in the batch script, wrote only that)."""
    shown = []
    log_file = tasks_dir / stage / "logs" / f"task_{task:05d}.log" if task is not None else None
    if log_file is not None and log_file.is_file():
        shown.append(f"log: {log_file}")
    elif (tasks_dir / stage / "logs").is_dir():
        shown.append(f"logs in {tasks_dir / stage / 'logs'}")
    if (tasks_dir / "slurm_logs").is_dir():
        shown.append(f"Slurm's job output in {tasks_dir / 'slurm_logs'}")
    return "; ".join(shown) or f"nothing was written in {tasks_dir}"


def _task_folder(config: DataConfig, fingerprint: str) -> Path:
    """The task folder, made before anything else is written, so that a path that cannot be one is a
    line naming the setting rather than a task's traceback."""
    tasks_dir = tasks_folder(config, fingerprint)
    setting = "data.executor_logs" if config.executor_logs else "data.cache_dir"
    if tasks_dir.exists() and not tasks_dir.is_dir():
        raise UsageError(f"{setting}: the task folder {tasks_dir} is a file; point {setting} at a folder")
    try:
        tasks_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"{setting}: cannot make the task folder {tasks_dir} ({exc.strerror or exc}); point {setting} at a "
            "folder you can write"
        ) from None
    if not os.access(tasks_dir, os.W_OK | os.X_OK):
        raise UsageError(
            f"{setting}: cannot write the task folder {tasks_dir}; point {setting} at a folder you can write"
        )
    return tasks_dir


def check_executor(config: DataConfig) -> None:
    """What refuses a prepare on an executor before anything is written: datatrove missing, data that is
    not files, a Ray address where no Ray cluster answers."""
    _datatrove_modules()
    only_files(config)
    _check_ray_address(config)


def prepare_with_executor(config: DataConfig, fingerprint: str, work: Path, directory: Path):
    """Build `directory` with the two stages on `config.executor` (`check_executor` passed); returns its
    PreparedData. The task folder is this prepare's alone while it runs: another prepare given the same
    `data.executor_logs` would take its plan and parts."""
    tasks_dir = _task_folder(config, fingerprint)
    with open(tasks_dir / ".lock", "a") as held:
        if not lock_exclusive(held, wait=False):
            raise UsageError(
                f"data.executor_logs {tasks_dir} is the task folder of another prepare running now (of other "
                "data: its plan and parts are there); give each prepare a data.executor_logs of its own"
            )
        return _prepare_on_executor(config, fingerprint, work, directory, tasks_dir)


def _prepare_on_executor(config: DataConfig, fingerprint: str, work: Path, directory: Path, tasks_dir: Path):
    from . import trove_steps  # datatrove's step classes: imported once datatrove is known to be there

    seconds = {}
    try:
        tokenizer = Build(config, fingerprint, work, directory).tokenizer()  # once, before any task, in `work`
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        plan_file = _plan(config, fingerprint, work, directory, tasks_dir, dtype)
        log(
            f"data: preparing {directory} on executor {config.executor} ({config.executor_tasks} tasks); "
            f"logs and completion markers in {tasks_dir}"
        )
        started = time.perf_counter()
        per_file = _executor(
            config, trove_steps.per_file_pipeline(config, plan_file), config.executor_tasks, tasks_dir / "prepare"
        )
        if config.executor == "slurm":
            merge_steps = trove_steps.merge_pipeline(config, plan_file)
            _run_slurm(
                per_file,
                _executor(config, merge_steps, 1, tasks_dir / "merge", per_file),
                tasks_dir,
                directory / MANIFEST,
            )
        else:
            with _ray(config):
                _run(per_file, "prepare", tasks_dir, config.progress_bar)
                seconds["prepare"] = time.perf_counter() - started
                merging = _executor(config, trove_steps.merge_pipeline(config, plan_file), 1, tasks_dir / "merge")
                _run(merging, "merge", tasks_dir, config.progress_bar)
    except UsageError:  # bad input: fixing it changes the fingerprint, so the work done is of no further use
        shutil.rmtree(tasks_dir / PARTS, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            (tasks_dir / ".lock").unlink()  # (still held: no other prepare can have opened it since)
            tasks_dir.rmdir()  # made by this command and still empty: the input failed before any task ran
        raise
    seconds["total"] = time.perf_counter() - started
    if "prepare" in seconds:
        seconds["merge"] = seconds["total"] - seconds["prepare"]
    write_file(tasks_dir / "seconds.json", json.dumps({k: round(v, 3) for k, v in seconds.items()}).encode())
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


def _run(executor, stage: str, tasks_dir: Path, progress: bool) -> None:
    """Run one stage on the local or Ray executor: datatrove's console log goes to the stage's folder,
    ours shows which tasks were done already, the tasks finishing and the stage's time."""
    from datatrove.executor import LocalPipelineExecutor

    error = None
    pooled = isinstance(executor, LocalPipelineExecutor) and executor.workers > 1
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if pooled:  # one task per core: each tokenizes on its own thread (no oversubscription)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    completions = tasks_dir / stage / "completions"
    done = len(list(completions.glob("*"))) if completions.is_dir() else 0
    if done:
        log(f"data: {stage} stage: {done} of {executor.world_size} tasks finished earlier, kept")
    started = time.perf_counter()
    try:
        with _datatrove_console(tasks_dir / stage), _task_progress(stage, completions, executor.world_size, progress):
            executor.run()
    except Exception as exc:  # a task's exception, re-raised by the executor: reported by _check
        error = exc
    finally:
        if pooled and saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        elif pooled:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    _check(executor, stage, tasks_dir, error)
    if stage == "prepare":
        log(f"data: {stage} stage: {executor.world_size} tasks done in {time.perf_counter() - started:.1f}s")


CONSOLE_LOG = "console.log"  # datatrove's console output of a stage, in the stage's folder


@contextlib.contextmanager
def _datatrove_console(stage_dir: Path) -> Iterator[None]:
    """datatrove's console log (each task's pipeline and stats, the executor's counts) goes to the
    stage's console.log beside its task logs. Its sinks take `sys.stderr` when they are added, at each
    task's start and end, so `sys.stderr` is that file meanwhile; our steps write to the console they
    find in `trove_steps.CONSOLE` (forked workers inherit both)."""
    from datatrove.utils.logging import setup_default_logger

    from . import trove_steps

    stage_dir.mkdir(parents=True, exist_ok=True)
    console = sys.stderr
    with open(stage_dir / CONSOLE_LOG, "a", encoding="utf-8") as sink:
        try:
            with contextlib.redirect_stderr(sink):
                setup_default_logger()  # the driver's own sink, on the file
                trove_steps.CONSOLE[:] = [console]
                yield
        finally:
            trove_steps.CONSOLE.clear()
            setup_default_logger()  # back on the console, as datatrove left it before


@contextlib.contextmanager
def _task_progress(stage: str, completions: Path, tasks: int, enabled: bool) -> Iterator[None]:
    """Tasks finished so far, from the completion markers, while a stage of several tasks runs."""
    if tasks == 1:
        yield
        return
    import threading

    from ...logs import Progress

    stop = threading.Event()
    bar = Progress(tasks, f"data: {stage} stage", "tasks", enabled=enabled)

    def watch() -> None:
        while True:
            done = len(list(completions.glob("*"))) if completions.is_dir() else 0
            if done > bar.done:
                bar.update(done - bar.done)
            if stop.wait(0.5):
                return

    watcher = threading.Thread(target=watch, name="task-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        bar.close()


RAY_CONNECT_SECONDS = 10.0  # ray.init retries an address for minutes; a head node answers at once


def _check_ray_address(config: DataConfig) -> None:
    """One bounded TCP connect to the Ray cluster named (data.executor_address, else RAY_ADDRESS) before
    ray.init, which would retry an address where nobody answers for minutes."""
    if config.executor != "ray":
        return
    setting, address = "data.executor_address", config.executor_address
    if not address:
        setting, address = "RAY_ADDRESS", os.environ.get("RAY_ADDRESS")
    if not address or address in ("auto", "local"):
        return
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not host or not port.isdigit():
        raise UsageError(f"{setting} {address!r} is not a Ray address: give host:port (or ray://host:port, auto)")
    try:
        answer = _http2_answer(host.strip("[]"), int(port))
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise UsageError(
            f"executor ray: no Ray cluster answers at {address} ({setting}: {reason}, within "
            f"{RAY_CONNECT_SECONDS:.0f}s); start one there (ray start --head) or correct {setting}"
        ) from None
    if not (len(answer) == 9 and answer[3] == HTTP2_SETTINGS):
        raise UsageError(
            f"executor ray: what answers at {address} ({setting}) is not a Ray cluster (it does not speak gRPC, as "
            f"a Ray head's GCS port does); give the head's GCS port (6379 unless `ray start --port` chose another)"
        )


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # and empty SETTINGS
HTTP2_SETTINGS = 0x04  # a frame's type, its fourth byte


def _http2_answer(host: str, port: int) -> bytes:
    """The first frame header a server sends back to an HTTP/2 client's preface (a gRPC server, as Ray's
    GCS is, answers with its SETTINGS frame), within RAY_CONNECT_SECONDS: ray.init would wait minutes
    on a port where something else listens (a dashboard, a web server)."""
    with socket.create_connection((host, port), timeout=RAY_CONNECT_SECONDS) as connection:
        connection.settimeout(RAY_CONNECT_SECONDS)
        connection.sendall(HTTP2_PREFACE)
        answer = b""
        try:
            while len(answer) < 9 and (part := connection.recv(9 - len(answer))):
                answer += part
        except TimeoutError:
            pass
        return answer


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
    try:
        ray.init(address=config.executor_address, runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:  # no cluster at `auto`, a token it refuses
        named = config.executor_address or os.environ.get("RAY_ADDRESS")
        raise UsageError(
            f"executor ray: could not join the Ray cluster{f' at {named}' if named else ''} ({first_line(exc)}); "
            "start one (ray start --head), correct data.executor_address or RAY_ADDRESS, or leave both unset "
            "for a new local Ray"
        ) from None
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
    try:
        with _datatrove_console(tasks_dir / "prepare"):  # datatrove's launch lines; sbatch's errors stay
            merging.run()  # submits the per-file array job first (its dependency), then the merge job
    except subprocess.CalledProcessError as exc:
        jobs = [str(j) for j in (per_file.job_id, merging.job_id) if j not in (None, -1)]
        write_file(submitted, json.dumps(jobs).encode())  # the next command waits for these before submitting
        raise TaskFailed(
            f"executor slurm: sbatch failed (exit status {exc.returncode}, its message above); the jobs "
            f"submitted before it: {', '.join(jobs) or 'none'}; run {_resume_command()} again once it is fixed"
        ) from None
    jobs = [str(j) for j in (per_file.job_id, merging.job_id) if j not in (None, -1)]
    write_file(submitted, json.dumps(jobs).encode())
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
