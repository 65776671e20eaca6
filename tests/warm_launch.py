"""`torchrun -m llm_trainer ARGS` and `python -m llm_trainer ARGS` for tests whose subject is what the
processes do, at a fraction of their cost.

A torchrun job started as a command pays for three new interpreters (its agent and two ranks), each
importing torch, torch._dynamo (which torch's optimizers import) and llm_trainer: seconds of CPU each,
before a tiny run that then trains for a fraction of a second. Here torchrun's own elastic agent,
configured from the same options by torchrun's own `config_from_args`, runs in the test's process and
starts the ranks by multiprocessing's forkserver, which imported those modules once per pytest worker,
so each rank starts warm. A rank gets what torchrun gives its ranks (the agent's variables: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*, OMP_NUM_THREADS) on top of the environment the
test passes, the test's working directory, and the `sys.argv` of `python -m llm_trainer ARGS` (or of
`python SCRIPT ARGS`). It builds its process groups, rendezvouses and fails as under torchrun, and a
failed rank fails the job with exit status 1 and torchrun's summary of the failure on stderr. `python`
is one such process without an agent: no launcher's variables, as a process started on its own.

What this does not show, and the tests that show it start the commands themselves: the command line's
own parsing and the interpreter's start, the launcher's own messages, signals and kills aimed at a rank
(a rank here is a child of the forkserver, not of the agent), several agents (nodes) of one job, and
anything measured of a whole process (its memory).
"""

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What torchrun's agent sets in a rank's environment besides conftest's LAUNCHER_VARIABLES and its own
# environment (which passes on its OMP_NUM_THREADS), with TORCHELASTIC_*.
_MORE_AGENT_VARIABLES = (
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
# What torchrun's agent handles to end the job (torch's LaunchConfig.signals_to_handle).
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Imported once, in the forkserver, before it forks a process.
_PRELOAD = ["warm_preload", __name__]


def torchrun(cwd, args, env: dict, nproc: int = 2, script=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """What `torchrun --nproc_per_node=NPROC --master-port=FREE -m llm_trainer ARGS` (or, with `script`,
    `... SCRIPT ARGS`), run in `cwd` with environment `env`, returns: its exit status, and the ranks'
    stdout and stderr, each one stream as the ranks wrote to it. A job still running after `timeout`
    seconds has its processes killed and fails the test."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from conftest import LAUNCHER_VARIABLES, free_port

    options = [f"--nproc_per_node={nproc}", f"--master-port={free_port()}"]
    args = [str(arg) for arg in args]
    entry = [str(script)] if script else ["-m", "llm_trainer"]
    command = ["torchrun", *options, *entry, *args]

    def launch(cwd, args, script, files) -> int:
        # The agent is this process: it reads its settings (OMP_NUM_THREADS, which it passes on to the
        # ranks) from this process's environment, as torchrun does from its own, and it sets its own
        # handlers of the signals that end a job; both are this process's own again afterwards.
        handlers = {number: signal.getsignal(number) for number in _AGENT_SIGNALS}
        keep = (*LAUNCHER_VARIABLES, *_MORE_AGENT_VARIABLES)
        try:
            with _environment(env):
                config, _, _ = config_from_args(parse_args([*options, "--start-method=forkserver", *entry]))
                # A rank started by the command inherits the agent's whole environment, this setting included.
                environment_of_ranks = {**os.environ, "TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle}
                try:
                    elastic_launch(config, _process)(cwd, environment_of_ranks, args, script, files, keep)
                except ChildFailedError as failure:  # torchrun prints this summary and exits 1
                    with open(files[2], "a") as stream:
                        stream.write(failure.format_msg())
                    return 1
                return 0
        finally:
            for number, handler in handlers.items():
                if handler is not None:  # None: a handler not set from Python, which cannot be set back
                    signal.signal(number, handler)

    return _launched(command, cwd, args, script, timeout, launch)


def python(cwd, args, env: dict, script=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """What `python -m llm_trainer ARGS` (or `python SCRIPT ARGS`), run in `cwd` with environment `env`,
    returns: exit status, stdout and stderr. Killed and failing the test after `timeout` seconds."""
    args = [str(arg) for arg in args]
    command = ["python", *([str(script)] if script else ["-m", "llm_trainer"]), *args]

    def launch(cwd, args, script, files) -> int:
        process = multiprocessing.get_context("forkserver").Process(
            target=_process, args=(cwd, env, args, script, files, ())
        )
        process.start()
        process.join()
        return process.exitcode  # as subprocess gives it: -N for a process ended by signal N

    return _launched(command, cwd, args, script, timeout, launch)


def _launched(command, cwd, args, script, timeout, launch) -> subprocess.CompletedProcess:
    """`command` as `launch(cwd, args, script, files)` starts it, its processes writing their ids, stdout
    and stderr into `files`; returned as a child's run would be."""
    _start_forkserver()
    timed_out = threading.Event()
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        pids, out, err = Path(scratch, "pids"), Path(scratch, "stdout"), Path(scratch, "stderr")
        pids.mkdir()
        out.touch()
        err.touch()
        watchdog = threading.Timer(timeout, _kill, args=(pids, timed_out))
        watchdog.start()
        try:
            code = launch(str(cwd), args, script and str(script), (str(pids), str(out), str(err)))
        finally:
            watchdog.cancel()
        result = subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())
    if timed_out.is_set():
        raise AssertionError(f"{' '.join(command)} ran past {timeout} s and was killed\n{result.stderr[-3000:]}")
    return result


def _process(cwd: str, env: dict, args: list, script, files: tuple, keep) -> None:
    """One process forked from the forkserver (whose environment, working directory and standard streams
    are its own), made into what `python -m llm_trainer ARGS` (or `python SCRIPT ARGS`) started in `cwd`
    with `env` would be, keeping the variables named in `keep` and TORCHELASTIC_* that its launcher set
    (none without `keep`); then run. It writes its id into the folder `files[0]` and appends its stdout
    and stderr to the files `files[1]` and `files[2]`, as the ranks of a torchrun command to its pipes."""
    pids, out, err = files
    launcher = {n: v for n, v in os.environ.items() if n in keep or n.startswith("TORCHELASTIC_")} if keep else {}
    os.environ.clear()
    os.environ.update({**env, **launcher})
    os.chdir(cwd)
    Path(pids, str(os.getpid())).touch()
    for path, stream in ((out, 1), (err, 2)):
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(descriptor, stream)
        os.close(descriptor)
    import torch

    import llm_trainer
    from llm_trainer import cli

    # OpenMP read OMP_NUM_THREADS when the forkserver loaded torch; the process's own value applies now.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", len(os.sched_getaffinity(0)))))
    try:
        if script:
            sys.argv = [script, *args]
            sys.path.insert(0, str(Path(script).resolve().parent))
            runpy.run_path(script, run_name="__main__")
            code = 0
        else:
            sys.argv = [str(Path(llm_trainer.__file__).with_name("__main__.py")), *args]
            code = cli.main(args)
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        sys.exit(code)


def _start_forkserver() -> None:
    """The forkserver, unless it runs already: started with OMP_NUM_THREADS=1 (the modules it imports start
    no thread pool that a fork would copy without its threads) and unbuffered output (what it prints while
    importing is not left in a buffer that every process it forks would inherit and write out)."""
    from conftest import src_env

    multiprocessing.set_forkserver_preload(_PRELOAD)
    # Without a launcher's variables, so that those a rank has are its agent's, and with this folder on
    # its path (it applies this process's sys.path only after preloading).
    environment = src_env()
    environment["PYTHONPATH"] = str(Path(__file__).parent) + os.pathsep + environment["PYTHONPATH"]
    with _environment({**environment, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}):
        multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _environment(env: dict):
    """This process's environment is `env` inside the block, and what it was again after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _kill(pids: Path, timed_out: threading.Event) -> None:
    timed_out.set()
    for pid in os.listdir(pids):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
