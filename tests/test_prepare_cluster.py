"""`prepare` as a datatrove pipeline (`data.executor`): the prepared folder equals the in-process prepare's
for 1, 2 and 8 tasks and for the local, Ray and Slurm executors (real engines, started here); a killed
prepare resumes with only its unfinished tasks; bad input and failed tasks are reported in one line."""

from __future__ import annotations

import contextlib
import gzip
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import free_port, src_env
from llm_trainer.config import DataConfig
from llm_trainer.data.prepare import prepare_data
from llm_trainer.data.prepare.cluster import task_ranges, tasks_folder
from llm_trainer.errors import UsageError

pytest.importorskip("datatrove")

TIMING = ("seconds", "bytes_per_second", "resumed_from_shard")  # the only report fields that may differ
WORDS = "river stone light garden window paper music forest letter winter harbor silver market candle".split()


# What cleaning changes (CRLF, trailing spaces, blank-line runs, control characters, text that NFC
# normalises, other scripts): a stage that tokenized the raw text instead of the cleaned one differs.
NOISE = ("\r\n", "  \n", "\n\n\n\n", "\x07", "\x0c", "e\u0301", "\u212b", "мир ", "水 ", "\t\n")


def _text(rng, n: int) -> str:
    words = rng.choice(WORDS + [f"w{i}" for i in range(300)], n).tolist()
    for _ in range(int(rng.integers(0, 4))):
        words[int(rng.integers(n))] += NOISE[int(rng.integers(len(NOISE)))]
    return " ".join(words) + ".  "


def write_mixed_corpus(root: Path, documents: int = 40, files: int = 4) -> list[dict]:
    """Two sources: `web` (JSONL files, the last xz-compressed, with exact copies, planted near-duplicates
    one word apart, short documents the filters remove, a binary file the folder walk skips) and `books`
    (text files, the last gzip-compressed)."""
    rng = np.random.default_rng(0)
    web, books = root / "web", root / "books"
    web.mkdir(parents=True)
    books.mkdir()
    originals = []
    for f in range(files):
        with open(web / f"part-{f}.jsonl", "w") as out:
            for d in range(documents):
                text = _text(rng, 80)
                if d % 6 == 1 and originals:  # a near-duplicate of an earlier document, in any file
                    words = originals[int(rng.integers(len(originals)))].split()
                    words[int(rng.integers(len(words)))] = "changed"
                    text = " ".join(words)
                elif d % 6 == 2 and originals:  # an exact copy up to case and spacing
                    text = originals[int(rng.integers(len(originals)))].upper().replace(" ", "  ")
                elif d % 6 == 3:
                    text = "too short"
                else:
                    originals.append(text)
                out.write(json.dumps({"text": text}) + "\n")
    last = web / f"part-{files - 1}.jsonl"  # compressed files are read on every path
    last.with_name(last.name + ".xz").write_bytes(lzma.compress(last.read_bytes()))
    last.unlink()
    (web / "blob").write_bytes(b"\x00\x01binary" * 50)
    (web / "README.Debian").write_text("a file the folder walk does not read\n")
    for f in range(3):
        (books / f"book{f}.txt").write_bytes("\r\n\r\n".join(_text(rng, 60) for _ in range(3)).encode())
    (books / "book2.txt.gz").write_bytes(gzip.compress((books / "book2.txt").read_bytes()))
    (books / "book2.txt").unlink()
    return [
        {"name": "web", "data_files": [str(web)], "weight": 3.0},
        {"name": "books", "data_files": [str(books)], "weight": 1.0},
    ]


def settings(sources: list[dict], cache: Path, **overrides) -> dict:
    return {
        "sources": sources,
        "deduplication": "near",
        "min_words": 5,
        "tokenizer_vocab_size": 300,
        "validation_split": 0.1,
        "cache_dir": str(cache),
        "progress_bar": False,
        "shard_tokens": 2000,  # several shards
        **overrides,
    }


def prepared_files(directory: Path) -> dict:
    """Everything the trainer reads from a prepared folder; timings and where-it-ran settings left out."""
    out = {}
    for path in sorted(directory.iterdir()):
        if path.name == "manifest.json":
            manifest = json.loads(path.read_text())
            manifest.pop("seconds")
            manifest["config"] = {
                k: v for k, v in manifest["config"].items() if not k.startswith("executor") and k != "cache_dir"
            }
            out[path.name] = manifest
        elif path.name == "data_report.json":
            out[path.name] = {k: v for k, v in json.loads(path.read_text()).items() if k not in TIMING}
        elif not path.name.startswith("."):
            out[path.name] = path.read_bytes()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    sources = write_mixed_corpus(root / "corpus")
    reference = prepare_data(DataConfig(**settings(sources, root / "in-process")))
    return root, sources, prepared_files(reference.directory)


def test_tasks_take_contiguous_file_ranges_balanced_by_bytes():
    assert task_ranges([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert task_ranges([30, 10, 10, 10], 2) == [(0, 1), (1, 4)]
    ranges = task_ranges([5, 7, 1], 8)  # more tasks than files: some tasks have none
    assert ranges[0][0] == 0 and ranges[-1][1] == 3 and sum(b > a for a, b in ranges) == 3
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, every file once
    assert task_ranges([0, 0], 3) == [(0, 2), (2, 2), (2, 2)]


@pytest.mark.slow
def test_the_local_executor_writes_the_in_process_folder_for_1_2_and_8_tasks(corpus):
    root, sources, reference = corpus
    report = reference["data_report.json"]
    assert report["removed"]["near_duplicates"] > 0 and report["removed"]["exact_duplicates"] > 0
    assert report["removed"]["min_words"] > 0
    assert report["skipped_inputs"] == {"binary_files": 1, "unsupported_files": 1}
    assert [len(names) for names in report["skipped_inputs_named"].values()] == [1, 1]  # named on every path
    assert report["splits"]["val"]["documents"] > 0 and report["shards"] > 1
    for tasks in (1, 2, 8):
        config = DataConfig(**settings(sources, root / f"local-{tasks}", executor="local", executor_tasks=tasks))
        prepared = prepare_data(config)
        assert prepared_files(prepared.directory) == reference, f"{tasks} tasks"
        logs = tasks_folder(config, prepared.manifest["fingerprint"])
        assert len(list((logs / "prepare" / "logs").glob("task_*.log"))) == tasks
        assert not (logs / "parts").exists() and not (logs / "prepare" / "completions").exists()


def _cli(*args: str, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llm_trainer", *args], cwd=cwd, env=src_env(), capture_output=True, text=True, **kwargs
    )


def _experiment(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump({"data": data}))
    return path


@pytest.mark.slow
def test_a_killed_prepare_runs_only_its_unfinished_tasks_again(tmp_path):
    """SIGKILL the whole prepare (driver and tasks) once a task has finished; the same command again
    skips the finished tasks (their parts untouched) and writes the folder an uninterrupted prepare writes."""
    sources = write_mixed_corpus(tmp_path / "corpus", documents=400, files=6)
    reference = prepared_files(prepare_data(DataConfig(**settings(sources, tmp_path / "in-process"))).directory)
    data = settings(sources, tmp_path / "cache")
    config = _experiment(tmp_path / "exp.yaml", data)
    command = [sys.executable, "-m", "llm_trainer", "prepare", "--config", str(config), "--executor", "local"]
    command += ["--tasks", "6", "--workers", "1"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=src_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    logs = next_tasks_folder = None
    deadline = time.monotonic() + 120
    try:
        while True:
            found = list((tmp_path / "cache").glob(".*.tasks"))
            if found and any((found[0] / "prepare" / "completions").glob("*")):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no task finished"
            time.sleep(0.002)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    logs = found[0]
    finished = sorted(int(p.name) for p in (logs / "prepare" / "completions").iterdir())
    assert 0 < len(finished) < 6, f"the kill came too late to leave unfinished tasks: {finished}"
    parts = {r: (logs / "parts" / f"{r:05d}" / "done.json").stat().st_mtime_ns for r in finished}
    next_tasks_folder = logs

    done = subprocess.run(command, cwd=tmp_path, env=src_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"data: prepare stage: {len(finished)} of 6 tasks finished earlier, kept" in done.stderr
    console_log = (next_tasks_folder / "prepare" / "console.log").read_text()
    assert f"Skipping {len(finished)} already completed tasks" in console_log  # datatrove's own count
    started = {int(p.stem.split("_")[1]) for p in (next_tasks_folder / "prepare" / "logs").glob("task_*.log")}
    assert started == set(range(6))
    for rank in finished:  # not run again: its log still holds only the first run
        log_text = (next_tasks_folder / "prepare" / "logs" / f"task_{rank:05d}.log").read_text()
        assert log_text.count("Launching pipeline") == 1
    directory = Path(json.loads(done.stdout)["directory"])
    assert prepared_files(directory) == reference
    assert parts  # the finished tasks' parts were kept until the merge used them


def _forked_workers(pid: int) -> list[int]:
    """The processes `pid` forked (a forked worker keeps its parent's command line)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        return [int(c) for c in children if Path(f"/proc/{c}/cmdline").read_bytes() == command]
    except OSError:  # a process that has just ended
        return []


@pytest.mark.slow
@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(), reason="needs Linux's /proc")
def test_a_task_s_worker_killed_ends_the_prepare_in_one_line_and_the_same_command_resumes(tmp_path):
    """SIGKILL one of the local executor's worker processes while the tasks run, as the out-of-memory
    killer does: the prepare ends at once with one line saying so and how to resume (datatrove's own
    pool waits for the dead worker's result for ever), and the same command then finishes the folder."""
    sources = write_mixed_corpus(tmp_path / "corpus", documents=300, files=8)
    reference = prepared_files(prepare_data(DataConfig(**settings(sources, tmp_path / "in-process"))).directory)
    config = _experiment(tmp_path / "exp.yaml", settings(sources, tmp_path / "cache"))
    command = [sys.executable, "-m", "llm_trainer", "prepare", "--config", str(config), "--executor", "local"]
    command += ["--tasks", "8", "--workers", "2"]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=src_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while len(workers := _forked_workers(proc.pid)) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the two worker processes did not start"
            time.sleep(0.002)
        os.kill(workers[-1], signal.SIGKILL)  # the last forked: a worker (datatrove forks a manager first)
        _, err = proc.communicate(timeout=60)  # datatrove's pool never returned here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == 1, err.decode()[-3000:]
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("error: prepare stage: a worker process ended without a word while tasks ran"), last
    assert "data.executor_workers" in last and "tasks finished and are kept" in last
    assert f"run llm-trainer prepare --config {config} --executor local --tasks 8 --workers 2 again" in last
    assert not list((tmp_path / "cache").rglob("manifest.json"))  # no folder looks prepared

    done = subprocess.run(command, cwd=tmp_path, env=src_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert prepared_files(Path(json.loads(done.stdout)["directory"])) == reference


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(), reason="needs Linux's /proc")
def test_the_local_executor_s_workers_end_with_a_command_killed_alone(tmp_path):
    """SIGKILL the command alone, not its process group: its worker processes end with it rather than go
    on taking tasks and writing parts that the same command, run again, writes too."""
    sources = write_mixed_corpus(tmp_path / "corpus", documents=300, files=8)
    config = _experiment(tmp_path / "exp.yaml", settings(sources, tmp_path / "cache"))
    command = [sys.executable, "-m", "llm_trainer", "prepare", "--config", str(config), "--executor", "local"]
    command += ["--tasks", "8", "--workers", "2"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=src_env(), stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(workers := _forked_workers(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the two worker processes did not start"
            time.sleep(0.002)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived the command by 30 s"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever of its group is left
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_datatrove_s_console_log_goes_to_the_task_folder_and_ours_stays(tmp_path):
    """A prepare on the local executor, 3 tasks 2 at a time: the console shows our lines only (the plan,
    the stage's time, the merge's summary); datatrove's log (pipelines, stats, emoji) is in console.log."""
    data = {"data_files": _small_corpus(tmp_path / "corpus"), "cache_dir": str(tmp_path / "cache")}
    data.update(tokenizer_vocab_size=300, executor="local", executor_tasks=3, executor_workers=2)
    done = _cli("prepare", "--config", str(_experiment(tmp_path / "exp.yaml", data)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert all(line.startswith("data: ") for line in lines), done.stderr
    assert "data: prepare stage: 3 tasks done in " in done.stderr and "documents in -> " in done.stderr
    (tasks_dir,) = (tmp_path / "cache").glob(".*.tasks")
    for stage in ("prepare", "merge"):
        console_log = (tasks_dir / stage / "console.log").read_text()
        assert "Stats" in console_log and "Launching pipeline" in console_log
    assert len(list((tasks_dir / "prepare" / "logs").glob("task_*.log"))) == 3


@pytest.mark.slow
def test_bad_input_in_a_task_is_one_line_and_exit_2(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"some words that are fine {i}"}) + "\n" for i in range(300))
    )
    (corpus / "named.bin").write_bytes(b"\x00\x01\x02" * 100)
    data = {"data_files": [str(corpus / "a.jsonl"), str(corpus / "named.bin")], "cache_dir": str(tmp_path / "cache")}
    # the tokenizer's sample is read before the tasks, from the first batch of documents (a.jsonl's)
    data.update(tokenizer_vocab_size=300, tokenizer_train_max_chars=100, executor="local", executor_tasks=2)
    done = _cli("prepare", "--config", str(_experiment(tmp_path / "exp.yaml", data)), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "named.bin looks like a binary file" in last and "task 1 of 2" in last
    # as without an executor, bad input leaves no work behind (fixing it changes the fingerprint); logs stay
    assert not list((tmp_path / "cache").glob(".*.partial")) and not list((tmp_path / "cache").glob(".*.tasks/parts"))
    assert list((tmp_path / "cache").glob(".*.tasks/prepare/logs/task_00001.log"))

    # bad input met before any task (the tokenizer's sample reads the binary file first): nothing is left at all
    data.update(data_files=[str(corpus / "named.bin"), str(corpus / "a.jsonl")], cache_dir=str(tmp_path / "cache2"))
    done = _cli("prepare", "--config", str(_experiment(tmp_path / "exp2.yaml", data)), cwd=tmp_path)
    assert done.returncode == 2 and "named.bin looks like a binary file" in done.stderr.strip().splitlines()[-1]
    assert not [p.name for p in (tmp_path / "cache2").iterdir()]


@pytest.mark.slow
def test_a_failed_task_names_the_task_the_file_and_the_command_to_resume(tmp_path):
    """A Parquet file whose data is damaged after its header: the reader's error is not bad input the
    readers know, so the task fails; the message names it, its file, its log and the command to resume."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some words that are fine " * 10)
    table = pa.table({"text": [f"document number {i} " * 20 for i in range(4000)]})
    pq.write_table(table, corpus / "b.parquet", row_group_size=500, compression="NONE")
    raw = bytearray((corpus / "b.parquet").read_bytes())
    damaged = len(raw) * 3 // 4  # past the rows the tokenizer's sample reads before the tasks
    raw[damaged : damaged + 4000] = b"\xff" * 4000
    (corpus / "b.parquet").write_bytes(bytes(raw))
    data = {"data_files": [str(corpus)], "cache_dir": str(tmp_path / "cache"), "tokenizer_vocab_size": 300}
    data.update(executor="local", executor_tasks=2, tokenizer_train_max_chars=100)
    config = _experiment(tmp_path / "exp.yaml", data)
    done = _cli("prepare", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: prepare stage: task 1 of 2, input file ") and "b.parquet failed" in last
    assert "task_00001.log" in last and "1 of 2 tasks finished and are kept" in last
    assert f"run llm-trainer prepare --config {config} again to resume" in last


# -- Ray: a local cluster on 127.0.0.1 ------------------------------------------------------------------


@pytest.fixture
def ray_cluster():
    ray = pytest.importorskip("ray")
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"PYTHONPATH": src_env()["PYTHONPATH"]}},
            log_to_driver=False,
        )
    except Exception as exc:  # noqa: BLE001 - any failure to start is a reason to skip, said in the report
        pytest.skip(f"a local Ray cluster could not start here: {str(exc).splitlines()[0]}")
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_the_ray_executor_writes_the_in_process_folder(corpus, ray_cluster, monkeypatch):
    """With paths relative to the command's folder, which Ray's workers need not start in."""
    root, sources, _ = corpus
    monkeypatch.chdir(root)
    relative = [{**source, "data_files": [str(Path(source["data_files"][0]).relative_to(root))]} for source in sources]
    reference = prepared_files(prepare_data(DataConfig(**settings(relative, Path("relative")))).directory)
    config = DataConfig(
        **settings(relative, Path("ray"), executor="ray", executor_tasks=3, executor_workers=2),
        executor_mem_per_cpu_gb=0.25,
    )
    prepared = prepare_data(config)
    assert prepared_files(prepared.directory) == reference


# -- Slurm: slurmctld + slurmd (Debian's slurm-wlm) as one node on localhost ------------------------------

SLURM_CONF = """\
ClusterName=llmtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm_cluster(tmp_path_factory, monkeypatch):
    """munged, slurmctld and slurmd on this machine with a temporary configuration; skipped, saying why,
    where they cannot run (not root, not installed)."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing)}; .ci/run installs slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("a single-node Slurm runs as root (SlurmUser=root); this test runs as another user")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket = root / "munge" / "munge.socket"
    started = []

    def start(command: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        started.append(proc)
        return proc

    try:
        munged = [
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={socket}",
            f"--pid-file={root / 'munge' / 'munged.pid'}",
            f"--log-file={root / 'munge' / 'munged.log'}",
            f"--seed-file={root / 'munge' / 'munged.seed'}",
        ]
        start(munged)
        conf = root / "slurm.conf"
        conf.write_text(
            SLURM_CONF.format(root=root, ctld_port=free_port(), slurmd_port=free_port(), munge_socket=socket)
        )
        monkeypatch.setenv("SLURM_CONF", str(conf))
        deadline = time.monotonic() + 10
        while not socket.exists():
            if time.monotonic() > deadline or started[0].poll() is not None:
                pytest.skip(
                    f"munged did not start: {started[0].stderr.read().decode()[-500:] if started[0].poll() is not None else 'no socket'}"
                )
            time.sleep(0.1)
        start(["slurmctld", "-D", "-f", str(conf)])
        start(["slurmd", "-D", "-f", str(conf), "-N", "localhost"])
        deadline = time.monotonic() + 30
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                logs = "; ".join(
                    f"{name}: {(root / name).read_text()[-300:]}"
                    for name in ("slurmctld.log", "slurmd.log")
                    if (root / name).is_file()
                )
                pytest.skip(f"a single-node Slurm did not come up here (node state {state!r}); {logs}")
            time.sleep(0.3)
        yield conf
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            proc.stderr.close()


@pytest.mark.slow
def test_the_slurm_executor_submits_jobs_and_writes_the_in_process_folder(corpus, slurm_cluster, tmp_path):
    """The command is run by its interpreter's full path with only the system's folders on PATH (no
    activated environment: cron, a job script): the jobs run that interpreter, not a script on PATH."""
    root, sources, reference = corpus
    data = settings(sources, root / "slurm", executor_mem_per_cpu_gb=1)
    config = _experiment(tmp_path / "exp.yaml", data)
    command = [sys.executable, "-m", "llm_trainer", "prepare", "--config", str(config), "--executor", "slurm"]
    env = {**src_env(), "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    assert shutil.which("launch_pickled_pipeline", path=env["PATH"]) is None
    done = subprocess.run(
        [*command, "--tasks", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "submitted Slurm job(s)" in done.stderr
    prepared = Path(json.loads(done.stdout)["directory"])
    assert prepared_files(prepared) == reference
    slurm_logs = list((root / "slurm").glob(".*.tasks/slurm_logs/*.out"))
    assert slurm_logs, "no Slurm job wrote its output"


@pytest.mark.slow
def test_a_cancelled_slurm_task_is_reported_and_only_it_runs_again(corpus, slurm_cluster, tmp_path):
    """One task of the array job is cancelled (Slurm kills it, or it never starts): the command says which
    task did not finish and how to resume; the same command submits that task alone, then the merge."""
    root, sources, reference = corpus
    data = settings(sources, root / "slurm-cancel", executor_mem_per_cpu_gb=1)
    config = _experiment(tmp_path / "exp.yaml", data)
    command = [sys.executable, "-m", "llm_trainer", "prepare", "--config", str(config), "--executor", "slurm"]
    command += ["--tasks", "3", "--workers", "1"]  # one array task at a time: the last one starts last
    proc = subprocess.Popen(command, cwd=tmp_path, env=src_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (jobs := list((root / "slurm-cancel").glob(".*.tasks/slurm_jobs.json"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        tasks_dir = jobs[0].parent
        per_file_job = json.loads(jobs[0].read_text())[0]
        subprocess.run(["scancel", f"{per_file_job}_2"], check=True)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err.decode()[-3000:]
    last = err.decode().strip().splitlines()[-1]
    assert "task(s) of the prepare stage did not finish (first: task 2)" in last and "again to resume" in last
    assert f"Slurm's job output in {tasks_dir / 'slurm_logs'}" in last
    finished = sorted(p.name for p in (tasks_dir / "prepare" / "completions").iterdir())
    assert finished == ["00000", "00001"]
    assert json.loads((tasks_dir / "prepare" / "ranks_to_run.json").read_text()) == [0, 1, 2]

    done = subprocess.run(command, cwd=tmp_path, env=src_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tasks_dir / "prepare" / "ranks_to_run.json").read_text()) == [2]  # only the cancelled task
    assert prepared_files(Path(json.loads(done.stdout)["directory"])) == reference


def test_a_hugging_face_dataset_is_refused_in_one_line_before_anything_is_read(tmp_path):
    config = DataConfig(dataset_name="wikitext", executor="local", cache_dir=str(tmp_path))
    with pytest.raises(UsageError) as error:
        prepare_data(config)
    message = str(error.value)
    assert "reads files" in message and "save it as JSONL or Parquet" in message and "\n" not in message


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _kill_ray_task_workers() -> int:
    """SIGKILL the processes of this test's Ray cluster (descendants of this process) that run a datatrove
    task: the actor and the rank it forked. How many."""
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        pid = ancestor = int(proc.name)
        while ancestor > 1 and ancestor != os.getpid():
            ancestor = _parent(ancestor)
        try:
            if ancestor == os.getpid() and (proc / "cmdline").read_bytes().startswith(b"ray::RankWorker"):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


@pytest.mark.slow
def test_a_ray_task_whose_worker_is_killed_runs_again_and_the_result_is_the_same(tmp_path, ray_cluster):
    """SIGKILL the worker process of a task while it writes its part: datatrove's Ray executor submits the
    task again, which starts its part over; the folder is the in-process prepare's."""
    import threading

    sources = write_mixed_corpus(tmp_path / "corpus", documents=800, files=2)
    reference = prepared_files(prepare_data(DataConfig(**settings(sources, tmp_path / "in-process"))).directory)
    config = DataConfig(
        **settings(sources, tmp_path / "ray", executor="ray", executor_tasks=2, executor_workers=1),
        executor_mem_per_cpu_gb=0.25,
    )
    killed = []

    def kill_first_task():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            if list((tmp_path / "ray").glob(".*.tasks/parts/00000")):  # the task is writing its part
                killed.append(_kill_ray_task_workers())
                killed.append(datetime.now())
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_first_task, daemon=True)
    watcher.start()
    prepared = prepare_data(config)
    watcher.join(timeout=5)
    assert killed and killed[0] > 0, "no Ray task worker was killed"
    log = tasks_folder(config, prepared.manifest["fingerprint"]) / "prepare" / "logs" / "task_00000.log"
    started = datetime.strptime(log.read_text()[:23], "%Y-%m-%d %H:%M:%S.%f")  # its log's first line
    assert started > killed[1]  # the task ran again after the kill (its log is rewritten by each run)
    assert prepared_files(prepared.directory) == reference


def test_a_folder_an_executor_wrote_from_raw_text_is_not_reused(tmp_path, monkeypatch):
    """Executors of data format 5 tokenized the raw text; their folders carry format 5's fingerprint, which
    this version never looks up, so a prepare writes a new folder beside the old one (left as it was)."""
    from llm_trainer.data.prepare import build

    sources = write_mixed_corpus(tmp_path / "corpus", documents=12, files=1)
    config = DataConfig(**settings(sources, tmp_path / "cache", deduplication="exact"))
    monkeypatch.setattr(build, "FORMAT_VERSION", 5)
    old = prepare_data(config).directory
    monkeypatch.undo()
    assert build.FORMAT_VERSION > 5
    new = prepare_data(config).directory
    assert new != old and (old / "manifest.json").is_file()
    assert json.loads((new / "manifest.json").read_text())["format_version"] == build.FORMAT_VERSION


def test_a_planted_plan_neither_removes_a_folder_nor_adds_an_input(tmp_path):
    """A plan.json written into the shared cache's task folder by someone else, with this config's
    fingerprint, task count and work folder, naming a user's folder as the result and a file outside
    data_files as input: the command builds its plan from the config, so the folder is untouched and
    the prepared tokens are the in-process prepare's."""
    from llm_trainer.data.prepare.build import data_fingerprint
    from llm_trainer.data.text.sources import FileUnit

    sources = write_mixed_corpus(tmp_path / "corpus", documents=12, files=2)
    reference = prepared_files(prepare_data(DataConfig(**settings(sources, tmp_path / "in-process"))).directory)
    own = tmp_path / "users-own-folder"
    own.mkdir()
    (own / "thesis.txt").write_text("years of work")
    outside = tmp_path / "outside.txt"
    outside.write_text("planted words that were never in data_files " * 20)
    config = DataConfig(**settings(sources, tmp_path / "cache", executor="local", executor_tasks=1))
    fingerprint = data_fingerprint(config)
    tasks_dir = tasks_folder(config, fingerprint)
    tasks_dir.mkdir(parents=True)
    planted = {
        "fingerprint": fingerprint,
        "tasks": 1,
        "units": [
            list(FileUnit(source, str(path), True, False, path.stat().st_size))
            for source, path in ((0, tmp_path / "corpus" / "web" / "part-0.jsonl"), (1, outside))
        ],
        "skipped": {},
        "dtype": "uint16",
        "work": str(tmp_path / "cache" / f".{fingerprint}.partial"),
        "directory": str(own),
        "started": 0.0,
        "cwd": str(tmp_path),
    }
    (tasks_dir / "plan.json").write_text(json.dumps(planted))

    prepared = prepare_data(config)
    assert (own / "thesis.txt").read_text() == "years of work"
    assert prepared.directory == tmp_path / "cache" / fingerprint
    assert prepared_files(prepared.directory) == reference
    assert json.loads((tasks_dir / "plan.json").read_text())["directory"] == str(prepared.directory)


# -- bad input around the executors: one line, before anything is written ----------------------------------


def _small_corpus(root: Path) -> list[str]:
    root.mkdir(parents=True)
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"some words that are fine {i}"}) + "\n" for i in range(50))
    )
    return [str(root / "a.jsonl")]


def _local_executor_config(tmp_path: Path, logs: Path) -> DataConfig:
    """The small corpus prepared on the local executor, its task folder at `logs` (data.executor_logs)."""
    return DataConfig(
        data_files=_small_corpus(tmp_path / "corpus"),
        cache_dir=str(tmp_path / "cache"),
        executor="local",
        executor_logs=str(logs),
        tokenizer_vocab_size=300,
    )


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_executor_logs_that_cannot_be_a_folder_is_one_line_and_nothing_is_written(tmp_path, kind):
    blocker = tmp_path / "logs"
    blocker.write_text("not a folder")
    logs = blocker if kind == "a file" else blocker / "tasks"
    config = _local_executor_config(tmp_path, logs)
    with pytest.raises(UsageError) as error:
        prepare_data(config)
    message = str(error.value)
    assert "data.executor_logs" in message and str(logs) in message and "\n" not in message
    assert blocker.read_text() == "not a folder"
    assert not list((tmp_path / "cache").glob("*/tokenizer.json")) and not list((tmp_path / "cache").glob("*/*.bin"))


def test_executor_logs_as_a_url_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"executor_logs must be a local folder .* got s3://b/logs$"):
        DataConfig(executor="local", executor_logs="s3://b/logs")


def test_absurd_task_counts_and_memory_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"executor_tasks \(100,000,000\) is over the limit of 100,000 \(each task"):
        DataConfig(executor="local", executor_tasks=100_000_000)
    for value in (-1.0, 0.0):
        with pytest.raises(ValueError, match="executor_mem_per_cpu_gb must be above 0"):
            DataConfig(executor="ray", executor_mem_per_cpu_gb=value)


@pytest.mark.slow
def test_tasks_100000000_on_the_command_line_is_exit_2_at_once(tmp_path):
    data = {"data_files": _small_corpus(tmp_path / "corpus"), "cache_dir": str(tmp_path / "cache")}
    started = time.monotonic()
    done = _cli("prepare", "--config", str(_experiment(tmp_path / "exp.yaml", data)), "--executor", "local",
                "--tasks", "100000000", cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 2 and time.monotonic() - started < 60, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "executor_tasks (100,000,000) is over the limit" in lines[0]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("where", ["executor_address", "RAY_ADDRESS"])
def test_a_ray_address_where_nobody_answers_is_one_line_in_seconds(tmp_path, monkeypatch, where):
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    settings_ = {"executor_address": address} if where == "executor_address" else {}
    if where == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    config = DataConfig(
        data_files=_small_corpus(tmp_path / "corpus"),
        cache_dir=str(tmp_path / "cache"),
        executor="ray",
        tokenizer_vocab_size=300,
        **settings_,
    )
    started = time.monotonic()
    with pytest.raises(UsageError) as error:
        prepare_data(config)
    assert time.monotonic() - started < 30
    message = str(error.value)
    assert f"no Ray cluster answers at {address}" in message and where in message and "\n" not in message
    assert not list((tmp_path / "cache").glob("*/tokenizer.json"))


def test_a_ray_address_where_something_else_answers_is_one_line_and_nothing_is_written(tmp_path):
    """A web server at the address (a dashboard's port, a typo), where ray.init would retry for minutes:
    one line, in seconds, before the cache is touched."""
    pytest.importorskip("ray")
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    corpus = _small_corpus(tmp_path / "corpus")
    try:
        config = DataConfig(
            data_files=corpus, cache_dir=str(tmp_path / "cache"), executor="ray", executor_address=address
        )
        started = time.monotonic()
        with pytest.raises(UsageError, match=rf"what answers at {address} \(data.executor_address\) is not a Ray"):
            prepare_data(config)
        assert time.monotonic() - started < 30 and not (tmp_path / "cache").exists()
    finally:
        server.shutdown()
        server.server_close()


def test_ray_address_auto_with_no_cluster_running_is_one_line(tmp_path, monkeypatch):
    """The README's `RAY_ADDRESS=auto` where no cluster runs: Ray's ConnectionError, said in one line."""
    pytest.importorskip("ray")
    from ray._private.services import find_gcs_addresses

    if find_gcs_addresses():
        pytest.skip("a Ray cluster runs on this machine (another test's): `auto` would join it")
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))  # no last cluster's address file either
    config = DataConfig(
        data_files=_small_corpus(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), executor="ray"
    )
    with pytest.raises(UsageError, match=r"^executor ray: could not join the Ray cluster at auto \("):
        prepare_data(config)


def test_two_prepares_never_share_a_task_folder(tmp_path):
    """data.executor_logs named by two prepares of other data at once: the second is refused in one line
    while the first holds it (each would take the other's plan and parts)."""
    from llm_trainer.files.disk import lock_exclusive

    logs = tmp_path / "logs"
    logs.mkdir()
    config = _local_executor_config(tmp_path, logs)
    holder = subprocess.Popen(  # another prepare's hold on the folder: a process that locks it and waits
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)",
            str(logs / ".lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=r"is the task folder of another prepare running now"):
            prepare_data(config)
    finally:
        holder.kill()
        holder.wait()
    with open(logs / ".lock", "a") as free:
        assert lock_exclusive(free, wait=False)  # the refused prepare held nothing
    prepared = prepare_data(config)  # and once it is free, the prepare runs there
    assert prepared.manifest["splits"]["train"]["tokens"] > 0


@pytest.mark.slow
def test_a_slurm_request_sbatch_refuses_is_one_line_and_exit_2(corpus, slurm_cluster, tmp_path):
    root, sources, _ = corpus
    data = settings(sources, root / "slurm-refused", executor_partition="no-such-partition")
    config = _experiment(tmp_path / "exp.yaml", data)
    done = _cli("prepare", "--config", str(config), "--executor", "slurm", "--tasks", "2", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: executor slurm: sbatch refuses the tasks' request (") and "Traceback" not in done.stderr
    )
    assert "data.executor_partition (no-such-partition)" in last
    assert not list((root / "slurm-refused").glob(".*.tasks/slurm_jobs.json"))  # nothing was submitted


@pytest.mark.slow
def test_a_url_cache_dir_keeps_the_task_folder_in_its_local_copy(tmp_path, monkeypatch):
    """`--executor local` with `data.cache_dir: s3://...`: the folder is prepared in the local copy under
    stream_cache_dir and uploaded; nothing named after the URL appears in the command's folder."""
    import s3fs

    from test_object_storage import FAKE_CREDENTIALS, _start_server, _stop

    proc, endpoint = _start_server()
    try:
        for key, value in {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("executor-cache")
        s3fs.S3FileSystem.clear_instance_cache()
        monkeypatch.chdir(tmp_path)
        config = DataConfig(
            data_files=_small_corpus(tmp_path / "corpus"),
            cache_dir="s3://executor-cache/prepared",
            stream_cache_dir=str(tmp_path / "stream"),
            executor="local",
            tokenizer_vocab_size=300,
        )
        prepared = prepare_data(config)
        fingerprint = prepared.manifest["fingerprint"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "stream"]
        assert tasks_folder(config, fingerprint).is_relative_to(tmp_path / "stream")
        assert (tasks_folder(config, fingerprint) / "plan.json").is_file()
        remote = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        assert remote.exists(f"executor-cache/prepared/{fingerprint}/manifest.json")
    finally:
        _stop(proc)


def test_a_task_refuses_a_plan_changed_after_the_command_wrote_it(tmp_path):
    from llm_trainer.data.prepare.cluster import Plan
    from llm_trainer.data.text.sources import FileUnit

    unit = FileUnit(0, str(tmp_path / "a.txt"), True, False, 10)
    plan = Plan("0" * 16, 1, [unit], {}, "uint16", str(tmp_path / "w"), str(tmp_path / "d"), 0.0, str(tmp_path))
    plan_file = plan.save(tmp_path / "plan.json")
    assert plan_file.load() == plan
    changed = json.loads((tmp_path / "plan.json").read_text())
    changed["directory"] = str(tmp_path / "users-own-folder")
    (tmp_path / "plan.json").write_text(json.dumps(changed))
    with pytest.raises(UsageError, match=r"plan.json changed after the command wrote it"):
        plan_file.load()
