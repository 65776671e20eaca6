"""Ours beside nanoGPT's own train.py on one GPU, in one device call of under 9 minutes.

    python bench/gpu_compare.py --stage [--peer DIR]   # here, before the call: copy nanoGPT into bench/.peers
    python bench/gpu_compare.py [OUT_DIR]              # on the GPU machine (bench/gpu_compare.sh runs this)
    python bench/gpu_compare.py --cpu-dry-run [OUT_DIR] # every step with tiny shapes on the CPU (~2 min)

Steps, in order, each a subprocess with its own time limit (and all of them inside `--budget` seconds,
so one that hangs or fails leaves the later ones what is left):

  env          the GPU, torch and the packages found
  prepare      our data (the built-in python-stdlib corpus, char tokenizer, model.vocab_size 50257: the
               token values do not change a step's cost; no validation split, so no run ends evaluating)
               and nanoGPT's `data/synth/{train,val}.bin`
               (random uint16 ids, its own format) in a scratch copy of the staged nanoGPT
  plan         `llm-trainer estimate`: our best GPT-2 batch (the largest power of two whose estimated
               peak leaves a quarter of the GPU free, at most 64 rows of 1024) and whether the 1.0B LLaMA
               fits without activation checkpointing (estimated peak under 85% of the GPU)
  gpt2_nanogpt_shape   ours, GPT-2 124M at nanoGPT's shape (12 x 1024, no biases, bf16, compile), with
               the profiler on three early steps (training.profile_steps): the per-kernel breakdown
  nanogpt_nanogpt_shape  nanoGPT's train.py at the same batch
  llama1b      our 1.0B LLaMA at its best settings (the plan's choice)
  gpt2_best    ours at the best batch;   nanogpt_best: nanoGPT at that batch
  gpt2_in_place  ours at nanoGPT's shape again with `training.read_ahead=false` (batches read and
               copied in the step, not ahead on a worker thread and side stream): the default's
               gain, in what the budget leaves

Both trainers run one micro-batch per step (gradient accumulation 1). tokens/s: ours, the median of
the speed monitor's windows over the second half of the logged steps; nanoGPT, rows x context over the
median of its printed iteration times over the second half (it synchronises every iteration at its
default log_interval=1). MFU is ours by our count (6N + 12·L·d·T) against the device's dense peak.

Writes into OUT_DIR (default $OUT, else bench/out/gpu_compare): `gpu_compare.json` (everything),
`readme_lines.md` (the lines for bench/README "On an H100") and `logs.txt` (the end of each step's log).
nanoGPT's code is never committed: `--stage` copies it into bench/.peers/ (git-ignored), which the
device call carries, with torchao's wheel for the follow-up.

    python bench/gpu_compare.py --followup [--best-batch N] [--baseline FILE] [OUT_DIR]

is the second, shorter call, on the same warm machine (a GPU lease has room for about one more): what
the first call leaves out, most telling first, inside `--budget` (default 250 s):

  torchao      torchao's wheel from bench/.peers/wheels, into a scratch folder (the device has no network)
  llama1b_float8   the 1.0B with `training.float8: true` at the first call's settings (one GPU, no
               sharding, no checkpointing); with `--baseline` (the first call's gpu_compare.json) set
               against its bf16 run
  estimate_test  tests/test_estimate_measured.py's CUDA case: the estimate within 10% of the peak
  gpt2_best_float8   GPT-2 at the best batch in float8, profiled like the first GPT-2 run, set against
               our bf16 run and nanoGPT's at that batch
  saved_llama1b, saved_gpt2   bench/saved_activations.py on the GPU: what the compiled 1.0B (8 x 2048)
               and GPT-2 124M (12 x 1024) keep for the backward, against eager

and writes `followup.json`, `followup_lines.md` and `logs.txt`. With `--cpu-dry-run` the float8 runs,
which need a GPU, run in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
STAGED_PEER = BENCH_DIR / ".peers" / "nanoGPT"  # git-ignored; the device call carries bench/.peers
DEFAULT_PEER = REPO_ROOT.parent / "shared" / "peers" / "nanoGPT"
sys.path.insert(0, str(REPO_ROOT / "src"))  # this checkout's llm_trainer (the FLOP count, the peak), as the steps run
PEER_FILES = ("train.py", "model.py", "configurator.py", "LICENSE")  # what its train.py needs (and its licence)
WHEELS = BENCH_DIR / ".peers" / "wheels"  # torchao's wheel, for the follow-up's float8 run
TORCHAO = "torchao==0.17.0"  # the release float8 training ran with under the device's PyTorch 2.11
NANOGPT_VOCAB = 50304  # nanoGPT's default: GPT-2's 50,257 padded to a multiple of 64
VOCAB = 50257
SYNTH_TOKENS = 4_000_000  # random ids in nanoGPT's train.bin: far more than any run here reads
RESERVE_S = 15  # kept back from the budget for writing the report

# GPT-2 124M at nanoGPT's defaults: 12 layers, 12 heads, 768 wide, context 1024, no biases, no dropout.
GPT2 = ["model.bias=false", "model.dropout=0.0"]
LLAMA_1B = [  # 1,017,526,272 parameters with the 50,257 vocabulary (bench/gpu.sh's 1.0B)
    "model.architecture=llama",
    "model.d_model=2048",
    "model.n_layers=18",
    "model.n_heads=16",
    "model.n_kv_heads=4",
    "model.d_ff=5632",
    "model.max_seq_len=2048",
]
TINY_GPT2 = ["model.d_model=64", "model.n_heads=2", "model.n_layers=2", "model.d_ff=256", "model.max_seq_len=64"]
TINY_LLAMA = [
    "model.architecture=llama",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=176",
    "model.max_seq_len=128",
]

# (group, substrings of a lower-cased kernel or op name), first match wins
KERNEL_GROUPS = [
    ("attention", ("flash", "fmha", "cudnn", "scaled_dot_product", "attention", "sdpa")),
    ("loss (softmax, cross-entropy)", ("cross_entropy", "softmax", "nll_loss")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lerp", "addcdiv")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
    ("compiled (triton)", ("triton",)),
    ("norm", ("layer_norm", "rms_norm", "layernorm")),
    ("copies and fills", ("memcpy", "memset", "copy_", "aten::to", "fill")),
    ("other elementwise and reductions", ("elementwise", "vectorized", "reduce", "gelu", "silu", "aten::")),
]


@dataclass
class Settings:
    """What differs between the GPU run and the CPU dry-run; the steps are the same."""

    cpu: bool
    gpt2: list[str]
    llama: list[str]
    context: int
    llama_context: int
    nanogpt_shape_batch: int  # nanoGPT's own micro-batch at its shape
    max_best_batch: int  # the plan's best GPT-2 batch is at most this
    device_memory_gib: float | None  # None: the GPU's, from the env step
    gpt2_steps: int
    llama_steps: int
    profile_steps: tuple[int, int]
    max_documents: int
    limits: dict[str, int]  # seconds per step

    @staticmethod
    def for_run(cpu: bool) -> Settings:
        if cpu:
            return Settings(
                cpu=True,
                gpt2=[*GPT2, *TINY_GPT2, "training.device=cpu", "training.compile=false", "training.use_amp=false"],
                llama=[*TINY_LLAMA, "training.device=cpu", "training.compile=false", "training.use_amp=false"],
                context=64,
                llama_context=128,
                nanogpt_shape_batch=12,
                max_best_batch=8,
                device_memory_gib=4.0,
                gpt2_steps=8,
                llama_steps=4,
                profile_steps=(3, 4),
                max_documents=40,
                limits=dict(
                    env=30, prepare=60, plan=60, gpt2=60, nanogpt=60, llama1b=60, float8=60, saved=120, test=90
                ),
            )
        return Settings(
            cpu=False,
            gpt2=[*GPT2, "training.device=cuda"],
            llama=[*LLAMA_1B, "training.device=cuda"],
            context=1024,
            llama_context=2048,
            nanogpt_shape_batch=12,
            max_best_batch=64,
            device_memory_gib=None,
            gpt2_steps=60,
            llama_steps=30,
            profile_steps=(6, 8),
            max_documents=300,
            # sized from the steps' wall times on a GPU (bench/README): compilation is most of each run
            limits=dict(env=20, prepare=60, plan=40, gpt2=170, nanogpt=80, llama1b=150, float8=180, saved=70, test=90),
        )


@dataclass
class Run:
    """One call: where things go, the clock, and the report being built."""

    settings: Settings
    out: Path
    work: Path
    deadline: float
    report: dict = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)
    site: Path | None = None  # packages installed for this call (torchao), after our src on the path

    def step(self, name: str, cmd: list[str], cwd: Path, limit: int) -> dict:
        """Run `cmd` as a process group of its own, killed (with its children: compile workers,
        torchrun's ranks) at `limit` seconds or at the call's budget, whichever comes first."""
        left = self.deadline - time.monotonic() - RESERVE_S
        limit = int(min(limit, left))
        if limit < 10:
            return {"status": "skipped", "why": "the call's time budget is spent"}
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(log)
        path = _pythonpath() + (os.pathsep + str(self.site) if self.site else "")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        if self.settings.cpu:
            env.setdefault("OMP_NUM_THREADS", "1")
        start = time.monotonic()
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                cmd, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, status = None, "timeout"
        record = {"status": status, "returncode": rc, "wall_s": round(time.monotonic() - start, 1), "limit_s": limit}
        record["log"] = str(log)
        print(f"[{name}] {status} in {record['wall_s']} s (limit {limit} s)", flush=True)
        return record


def _pythonpath() -> str:
    """Our tree's src first: the steps run this checkout, not an installed copy."""
    current = os.environ.get("PYTHONPATH")
    return str(REPO_ROOT / "src") + (os.pathsep + current if current else "")


def stage(peer: Path) -> int:
    """Copy nanoGPT's train.py, model.py and configurator.py (with its licence) into bench/.peers/nanoGPT."""
    missing = [name for name in PEER_FILES if not (peer / name).is_file()]
    if missing:
        print(f"error: {peer} has no {', '.join(missing)}: pass --peer with nanoGPT's folder", file=sys.stderr)
        return 2
    shutil.rmtree(STAGED_PEER, ignore_errors=True)
    STAGED_PEER.mkdir(parents=True)
    for name in PEER_FILES:
        shutil.copy2(peer / name, STAGED_PEER / name)
    print(f"nanoGPT staged in {STAGED_PEER.relative_to(REPO_ROOT)} (git-ignored): carry bench/.peers")
    if sorted(WHEELS.glob("torchao-*.whl")):
        return 0
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(WHEELS)]
    if subprocess.run([*download, TORCHAO]).returncode == 0:
        print(f"{TORCHAO} staged in {WHEELS.relative_to(REPO_ROOT)}, for the follow-up's float8 run")
    else:
        print(f"note: {TORCHAO} could not be downloaded: the follow-up's float8 run will be skipped", file=sys.stderr)
    return 0


# -- steps ------------------------------------------------------------------------------------------


def env_step(run: Run) -> dict:
    code = (
        "import importlib.util, json, platform, torch\n"
        "mods = ['torchao', 'triton', 'transformers', 'numpy']\n"
        "cuda = torch.cuda.is_available()\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "  'gpu': torch.cuda.get_device_name(0) if cuda else None,\n"
        "  'gpu_memory_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,\n"
        "  'cudnn': torch.backends.cudnn.version() if cuda else None, 'python': platform.python_version(),\n"
        "  'cpus': __import__('os').cpu_count(),\n"
        "  'packages': {m: importlib.util.find_spec(m) is not None for m in mods}}))\n"
    )
    record = run.step("env", [sys.executable, "-c", code], REPO_ROOT, run.settings.limits["env"])
    if record["status"] == "ok":
        record.update(_last_json(log_of(record)) or {})
    return record


def data_overrides(run: Run) -> list[str]:
    """No validation split: the runs measure training, and an end-of-run evaluation would spend the
    call's budget compiling the no-gradient graph (bench/README has its cost)."""
    return [
        "data.dataset_name=python-stdlib",
        "data.tokenizer=char",
        f"model.vocab_size={VOCAB}",
        f"data.max_documents={run.settings.max_documents}",
        "data.validation_split=0.0",
        f"data.cache_dir={run.work / 'cache'}",
    ]


def prepare_step(run: Run, nanogpt: bool = True) -> dict:
    """Our prepared data (once, shared by every run of ours) and a scratch copy of nanoGPT with random
    tokens in its .bin format; nanoGPT writes next to itself, so it never runs from bench/.peers."""
    cmd = [sys.executable, "-m", "llm_trainer", "prepare", "--config", "configs/gpt2-small.yaml", *data_overrides(run)]
    record = run.step("prepare", cmd, REPO_ROOT, run.settings.limits["prepare"])
    if not nanogpt:
        return record
    if not all((STAGED_PEER / name).is_file() for name in PEER_FILES):
        record["nanogpt"] = "not staged: run `bash bench/gpu_compare.sh --stage` here and carry bench/.peers"
        record["nanogpt_copy"] = None
        return record
    import numpy as np

    peer = run.work / "nanoGPT"
    shutil.copytree(STAGED_PEER, peer)
    synth = peer / "data" / "synth"
    synth.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", SYNTH_TOKENS), ("val", SYNTH_TOKENS // 10)):
        rng.integers(0, VOCAB, count, dtype=np.uint16).tofile(synth / f"{split}.bin")
    record["nanogpt"] = "copied, with random tokens in data/synth"
    record["nanogpt_copy"] = str(peer)
    return record


def estimate(run: Run, name: str, overrides: list[str], memory_gib: float) -> dict | None:
    cmd = [sys.executable, "-m", "llm_trainer", "estimate", "--config", "configs/gpt2-small.yaml"]
    cmd += [*overrides, f"model.vocab_size={VOCAB}", "--device-memory", str(memory_gib), "--json"]
    record = run.step(name, cmd, REPO_ROOT, run.settings.limits["plan"] // 2)
    return _last_json(log_of(record), whole=True) if record["status"] == "ok" else None


def plan_step(run: Run, memory_gib: float | None) -> dict:
    """The estimator chooses the best GPT-2 batch and the 1.0B's checkpointing before anything runs."""
    s = run.settings
    memory_gib = s.device_memory_gib or memory_gib
    plan: dict = {"device_memory_gib": memory_gib, "gpt2_best_batch": 16, "llama_checkpointing": True}
    if memory_gib is None:
        plan["why"] = "no GPU memory known (the env step failed): batch 16 and checkpointing"
        return plan
    gpt2 = estimate(run, "plan_gpt2", [*s.gpt2, "training.batch_size=1"], memory_gib * 0.75)
    if gpt2 and gpt2.get("max_micro_batch_size"):
        most = min(int(gpt2["max_micro_batch_size"]), s.max_best_batch)
        plan["gpt2_best_batch"] = 1 << (most.bit_length() - 1)  # the largest power of two that fits
        plan["gpt2_max_micro_batch_at_75_percent"] = gpt2["max_micro_batch_size"]
    llama = estimate(run, "plan_llama1b", [*s.llama, "training.batch_size=8"], memory_gib * 0.85)
    if llama:
        plan["llama_checkpointing"] = not llama.get("fits", False)
        plan["llama_estimated_peak_gib"] = round(llama["memory"]["peak_gb"], 2)
    return plan


def ours_gpt2(run: Run, name: str, batch: int, profile: bool, extra: tuple[str, ...] = (), limit: str = "gpt2") -> dict:
    s = run.settings
    out = run.work / name
    cmd = [sys.executable, "-m", "llm_trainer", "train", "--config", "configs/gpt2-small.yaml", *s.gpt2, *extra]
    cmd += _loop_overrides(out, batch, s.gpt2_steps) + data_overrides(run)
    if profile:
        cmd.append(f"training.profile_steps=[{s.profile_steps[0]},{s.profile_steps[1]}]")
    record = run.step(name, cmd, REPO_ROOT, s.limits[limit])
    record.update(batch=batch, context=s.context, header=header(log_of(record)), **summarise(out))
    if profile:
        traces = sorted((out / "profile").glob("*.pt.trace.json")) if (out / "profile").is_dir() else []
        record["kernels"] = kernel_breakdown(traces[0]) if traces else None
    return record


def _loop_overrides(out: Path, batch: int, steps: int) -> list[str]:
    return [
        f"training.batch_size={batch}",
        "training.gradient_accumulation_steps=1",
        f"training.max_steps={steps}",
        "training.warmup_steps=5",
        "training.logging_steps=5" if steps >= 20 else "training.logging_steps=2",
        "training.eval_steps=0",
        "training.save_steps=0",
        f"training.output_dir={out}",
    ]


def llama_step(run: Run, plan: dict) -> dict:
    """The 1.0B at the plan's settings; when the run without checkpointing runs out of memory (the
    estimate is within about 10%), once more with FSDP2 and checkpointing, in what the budget leaves."""
    record = _llama(run, "llama1b", plan["llama_checkpointing"])
    if record["status"] == "failed" and not plan["llama_checkpointing"]:
        if "out of device memory" in _text(log_of(record)):
            retry = _llama(run, "llama1b_checkpointing", True)
            retry["first_try"] = {key: record.get(key) for key in ("status", "wall_s", "settings")}
            return retry
    return record


def _llama(run: Run, name: str, checkpointing: bool, extra: tuple[str, ...] = (), limit: str = "llama1b") -> dict:
    s = run.settings
    out = run.work / name
    batch = 2 if s.cpu else 8
    overrides = [*s.llama, *extra, *_loop_overrides(out, batch, s.llama_steps), *data_overrides(run)]
    if checkpointing:  # the settings measured before: FSDP2 on a world of 1 with activation checkpointing
        overrides += ["training.gradient_checkpointing=true", "training.distributed_strategy=fsdp"]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "llm_trainer"]
    else:  # it fits: no sharding and no recomputation
        launcher = [sys.executable, "-m", "llm_trainer"]
    if s.cpu and checkpointing:
        overrides.append("training.distributed_backend=gloo")
    cmd = [*launcher, "train", "--config", "configs/gpt2-small.yaml", *overrides]
    record = run.step(name, cmd, REPO_ROOT, s.limits[limit])
    settings = "FSDP2 world 1, activation checkpointing" if checkpointing else "one GPU, no sharding, no checkpointing"
    record.update(batch=batch, context=s.llama_context, settings=settings, header=header(log_of(record)))
    record.update(summarise(out))
    return record


def nanogpt_step(run: Run, name: str, peer: Path | None, batch: int) -> dict:
    if peer is None:
        return {"status": "skipped", "why": "nanoGPT is not staged: `bash bench/gpu_compare.sh --stage` here first"}
    s = run.settings
    steps = s.gpt2_steps
    flags = [
        "--dataset=synth",
        f"--batch_size={batch}",
        f"--block_size={s.context}",
        "--gradient_accumulation_steps=1",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--warmup_iters=5",
        "--eval_interval=100000",  # it still evaluates once, at iteration 0
        "--eval_iters=1",
        "--always_save_checkpoint=False",
        f"--out_dir={run.work / (name + '_out')}",
    ]
    if s.cpu:
        flags += ["--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=2", "--n_head=2", "--n_embd=64"]
    else:
        flags += ["--compile=True"]  # its defaults: cuda, bfloat16, GPT-2 124M shape
    record = run.step(name, [sys.executable, "train.py", *flags], peer, s.limits["nanogpt"])
    iters = [
        (int(i), float(ms), float(mfu))
        for i, ms, mfu in re.findall(
            r"iter (\d+): loss [\d.na]+, time ([\d.]+)ms, mfu (-?[\d.]+)%", _text(log_of(record))
        )
    ]
    steady = [row for row in iters if row[0] >= steps // 2 and row[0] > 0]
    record.update(batch=batch, context=s.context, iterations=len(iters))
    if steady:
        step_s = statistics.median(ms for _, ms, _ in steady) / 1000
        record.update(step_time_s=round(step_s, 5), tokens_per_s=round(batch * s.context / step_s, 1))
        record["its_printed_mfu_a100"] = steady[-1][2] / 100  # against an A100's 312 TFLOP/s, smoothed
    return record


def torchao_step(run: Run, torchao_found: bool) -> dict:
    """torchao for the float8 run: the device's own, else the staged wheel installed into a scratch folder
    (which the dry-run always walks)."""
    if torchao_found and not run.settings.cpu:
        return {"status": "ok", "torchao": "the device's own"}
    wheels = sorted(WHEELS.glob("torchao-*.whl"))
    if not wheels:
        return {
            "status": "skipped",
            "why": "no torchao wheel: `bash bench/gpu_compare.sh --stage` here, carry bench/.peers",
        }
    site = run.work / "site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--target",
        str(site),
        str(wheels[-1]),
    ]
    record = run.step("torchao", cmd, REPO_ROOT, run.settings.limits["env"])
    if record["status"] == "ok":
        run.site = site
        record["torchao"] = wheels[-1].name
    return record


def float8_step(run: Run, name: str, torchao: dict, batch: int | None = None) -> dict:
    """Ours in float8 (torchao's layers): GPT-2 at `batch`, profiled, or (no batch) the 1.0B at the
    settings it ran with in bf16 (one GPU, no sharding, no checkpointing). A CPU cannot train in
    float8, so the dry-run walks it in bf16."""
    if torchao.get("status") != "ok" and not run.settings.cpu:
        return {"status": "skipped", "why": f"torchao missing ({torchao.get('why') or torchao.get('status')})"}
    extra = () if run.settings.cpu else ("training.float8=true",)
    if batch is None:
        return _llama(run, name, checkpointing=False, extra=extra, limit="float8")
    return ours_gpt2(run, name, batch, profile=True, extra=extra, limit="float8")


def saved_step(run: Run, name: str, shape: str, batch: int, seq: int) -> dict:
    """bench/saved_activations.py for one shape on this device: bytes per token kept for the backward."""
    result = run.work / f"{name}.json"
    device, shape = ("cpu", shape.split("-")[0]) if run.settings.cpu else ("cuda", shape)  # CPU: the small shapes
    if run.settings.cpu:
        batch, seq = 2, 64
    cmd = [sys.executable, str(BENCH_DIR / "saved_activations.py"), "--device", device, "--shapes", shape]
    cmd += ["--batch", str(batch), "--seq", str(seq), "--out", str(result)]
    record = run.step(name, cmd, REPO_ROOT, run.settings.limits["saved"])
    record.update(shape=shape, batch=batch, seq=seq)
    if result.is_file():
        record["rows"] = json.loads(result.read_text())["rows"]
    return record


def estimate_test(cpu: bool) -> str:
    """The case of tests/test_estimate_measured.py this device runs: on the GPU bf16, what runs there;
    on the CPU of the dry-run float32, the case every CPU measures."""
    case = "cpu-fp32" if cpu else "cuda-bf16"
    return f"tests/test_estimate_measured.py::test_the_estimated_peak_is_within_10_percent_of_the_measured_one[{case}]"


def estimate_test_step(run: Run) -> dict:
    """The memory estimate within 10% of the measured peak, as tests/test_estimate_measured.py checks it."""
    test = estimate_test(run.settings.cpu)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--no-header", test]
    record = run.step("estimate_test", cmd, REPO_ROOT, run.settings.limits["test"])
    lines = [line for line in _text(log_of(record)).splitlines() if line.strip()]
    record["result"] = lines[-1][:300] if lines else None
    return record


# -- reading results --------------------------------------------------------------------------------


def summarise(out: Path) -> dict:
    """Our run's steady state: the medians over the second half of the logged train rows."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    train = train[len(train) // 2 :]
    result = {}
    for key in ("tokens_per_s", "mfu", "peak_memory_mb", "data_wait_fraction", "step_time_s"):
        values = [r[key] for r in train if r.get(key) is not None]
        result[key] = statistics.median(values) if values else None
    summary = next((r for r in reversed(rows) if r.get("kind") == "summary"), None)
    if summary:
        result["checkpoint_s"] = summary.get("checkpoint_s")
    return result


def header(log: Path | None) -> list[str]:
    """Our run's header lines (the model and loop it ran, the attention kernel where it says one, the
    layers float8 converted)."""
    keep = re.compile(r"^train:|^float8:|float8_layers|attention|sdpa|flash|cudnn", re.IGNORECASE)
    return [line for line in _text(log).splitlines() if keep.search(line)][:4]


def kernel_breakdown(trace: Path, top: int = 20) -> dict:
    """Where the profiled steps' time went, from the Chrome trace our profiler writes: GPU kernels (and
    copies) by total time, grouped by kind, against the time from the steps' first kernel to their last.
    Without a GPU the trace has only CPU ops; each op's own time (less the ops it calls) is counted, so
    the shares add up to one, against the steps' wall time.

    A kernel counts when the host launched it inside a profiled step (its correlation id names the
    launch): the host runs ahead of the GPU, so the trace also holds kernels queued before the first
    profiled step, which would otherwise be counted as the profiled steps' work."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    steps = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name")).startswith("ProfilerStep#")
    ]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    n = max(len(steps), 1)
    if spans:
        source = "CUDA kernels"
        launched = launched_in(events, steps)
        if launched:  # a trace without the launches keeps every kernel
            spans = [e for e in spans if (e.get("args") or {}).get("correlation") in launched]
        times = [(str(e.get("name")), float(e.get("dur", 0))) for e in spans]
        first = min((float(e.get("ts", 0)) for e in spans), default=0.0)
        wall = max((float(e.get("ts", 0)) + float(e.get("dur", 0)) for e in spans), default=0.0) - first
    else:
        source = "CPU ops, self time"
        times = self_times([e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"])
        wall = sum(float(e.get("dur", 0)) for e in steps)
    by_name: dict[str, list[float]] = {}
    for name, duration in times:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
    busy = sum(total for total, _ in by_name.values())
    groups: dict[str, float] = {}
    for name, (total, _) in by_name.items():
        lower = name.lower()
        group = next((g for g, keys in KERNEL_GROUPS if any(k in lower for k in keys)), "other")
        groups[group] = groups.get(group, 0.0) + total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "source": source,
        "steps": len(steps),
        "wall_ms_per_step": round(wall / n / 1000, 3),
        "busy_ms_per_step": round(busy / n / 1000, 3),
        "groups": {g: round(t / busy, 4) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])} if busy else {},
        "top": [
            {
                "name": name[:160],
                "ms_per_step": round(t / n / 1000, 3),
                "calls_per_step": c / n,
                "share": round(t / busy, 4),
            }
            for name, (t, c) in ranked
        ],
    }


def launched_in(events: list[dict], steps: list[dict]) -> set:
    """The correlation ids of the GPU work the host launched (CUDA runtime or driver calls) inside one
    of `steps`' spans."""
    windows = [(float(s.get("ts", 0)), float(s.get("ts", 0)) + float(s.get("dur", 0))) for s in steps]
    return {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and any(start <= float(e.get("ts", 0)) < end for start, end in windows)
    }


def self_times(ops: list[dict]) -> list[tuple[str, float]]:
    """Each op's duration less that of the ops nested in it on the same thread (a trace gives only
    inclusive durations: `aten::linear` would otherwise count its `aten::mm` again)."""
    result = []
    threads: dict[tuple, list[dict]] = {}
    for op in ops:
        threads.setdefault((op.get("pid"), op.get("tid")), []).append(op)
    for thread in threads.values():
        thread.sort(key=lambda e: (float(e.get("ts", 0)), -float(e.get("dur", 0))))
        stack: list[list] = []  # [name, end, self time]
        for op in thread:
            start, duration = float(op.get("ts", 0)), float(op.get("dur", 0))
            while stack and stack[-1][1] <= start:
                name, _, own = stack.pop()
                result.append((name, own))
            if stack:
                stack[-1][2] -= duration  # the caller's own time excludes this op
            stack.append([str(op.get("name")), start + duration, duration])
        result.extend((name, own) for name, _, own in stack)
    return result


def log_of(record: dict) -> Path | None:
    """A step's log; None for a step that did not run (skipped: the budget was spent)."""
    return Path(record["log"]) if "log" in record else None


def _text(path: Path | None) -> str:
    return path.read_text(errors="replace") if path is not None and path.is_file() else ""


def _last_json(path: Path | None, whole: bool = False) -> dict | None:
    """The last JSON object a step printed (`whole`: the output is one indented object)."""
    text = _text(path)
    if whole:  # from the line that opens it (warnings may come first)
        lines = text.splitlines()
        start = next((i for i, line in enumerate(lines) if line.rstrip() == "{"), None)
        try:
            return json.loads("\n".join(lines[start:])) if start is not None else None
        except json.JSONDecodeError:
            return None
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


# -- the report -------------------------------------------------------------------------------------


def ratios(report: dict) -> list[dict]:
    """ours / nanoGPT tokens/s for each batch both ran."""
    steps = report["steps"]
    pairs = [("gpt2_nanogpt_shape", "nanogpt_nanogpt_shape"), ("gpt2_best", "nanogpt_best")]
    found = []
    for ours, theirs in pairs:
        a, b = steps.get(ours, {}), steps.get(theirs, {})
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            found.append(
                {
                    "batch": a["batch"],
                    "context": a["context"],
                    "ours_tokens_per_s": a["tokens_per_s"],
                    "nanogpt_tokens_per_s": b["tokens_per_s"],
                    "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
                }
            )
    return found


def readme_lines(report: dict) -> str:
    env = report["steps"].get("env", {})
    device = env.get("gpu") or "CPU (dry-run: tiny shapes, not GPU figures)"
    day = report["date"][:10]
    lines = [
        f'One device call, `bash bench/gpu_compare.sh "$OUT"` ({report["wall_s"] / 60:.1f} min wall), on {device}, '
        f"PyTorch {env.get('torch')}, {day}. tokens/s: the second half of each run's steps; MFU by our count "
        "against the dense bf16 peak.",
        "",
        "| run | batch | tokens/s | step | MFU (ours) | peak memory | data wait |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {
        "gpt2_nanogpt_shape": "ours, GPT-2 124M at nanoGPT's shape",
        "nanogpt_nanogpt_shape": "nanoGPT train.py, same shape",
        "gpt2_best": "ours, GPT-2 124M at our best batch",
        "nanogpt_best": "nanoGPT train.py, same batch",
        "llama1b": "ours, LLaMA-style 1.0B",
        "gpt2_in_place": "ours, GPT-2 124M at nanoGPT's shape, batches read in place (`training.read_ahead=false`)",
    }
    for key, label in names.items():
        r = report["steps"].get(key, {})
        if "batch" not in r:
            continue
        if not r.get("tokens_per_s"):
            lines.append(f"| {label} | {r['batch']} x {r['context']} | {r['status']} | | | | |")
            continue
        extra = f" ({r['settings']})" if r.get("settings") else ""
        if report["cpu_dry_run"]:
            extra += " [tiny stand-in]"
        mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else ""
        if r.get("its_printed_mfu") is not None:
            mfu += f" (it prints {r['its_printed_mfu'] * 100:.1f}%)"
        memory = f"{r['peak_memory_mb'] / 1024:.2f} GiB" if r.get("peak_memory_mb") else ""
        wait = f"{r['data_wait_fraction'] * 100:.2f}%" if r.get("data_wait_fraction") is not None else ""
        step = f"{r['step_time_s']:.3f} s" if r.get("step_time_s") else ""
        tokens = f"{r['tokens_per_s'] / 1000:.1f}k"
        lines.append(
            f"| {label}{extra} | {r['batch']} x {r['context']} | {tokens} | {step} | {mfu} | {memory} | {wait} |"
        )
    lines.append("")
    lines += not_run_lines(report["steps"])
    for pair in report["ratios"]:
        model = "tiny stand-in" if report["cpu_dry_run"] else "GPT-2 124M"
        lines.append(
            f"- ours / nanoGPT tokens/s, same GPU, same batch: {pair['ratio']:.2f}× "
            f"({model}, {pair['batch']} x {pair['context']})"
        )
    ahead, in_place = (report["steps"].get(key, {}) for key in ("gpt2_nanogpt_shape", "gpt2_in_place"))
    if ahead.get("tokens_per_s") and in_place.get("tokens_per_s"):
        lines.append(
            f"- ours, by default (batches read ahead on a GPU) / batches read in place, tokens/s: "
            f"{ahead['tokens_per_s'] / in_place['tokens_per_s']:.2f}× ({ahead['batch']} x {ahead['context']})"
        )
    kernels = report["steps"].get("gpt2_nanogpt_shape", {}).get("kernels")
    if kernels and kernels.get("groups"):
        lines.append(kernel_line("Where GPT-2's step goes at nanoGPT's shape", kernels))
    return "\n".join(lines) + "\n"


def not_run_lines(steps: dict) -> list[str]:
    """A README line for each step that failed, timed out or was skipped, with why."""
    lines = []
    for key, r in steps.items():
        if r.get("status") in ("failed", "timeout", "skipped"):
            why = r.get("why") or f"after {r.get('wall_s')} s of its {r.get('limit_s')} s; logs.txt has its log"
            lines.append(f"- {key}: {r['status']} ({why})")
    return lines


def kernel_line(what: str, kernels: dict) -> str:
    """One README line from `kernel_breakdown`: the time per step and the six largest groups' shares."""
    shares = ", ".join(f"{g} {v * 100:.0f}%" for g, v in list(kernels["groups"].items())[:6])
    span = "from its first kernel to its last" if kernels["source"] == "CUDA kernels" else "of wall time"
    return (
        f"- {what} ({kernels['source']}, {kernels['steps']} profiled steps: {kernels['busy_ms_per_step']:.1f} ms "
        f"busy per step of {kernels['wall_ms_per_step']:.1f} ms {span}): {shares}"
    )


def followup_lines(report: dict, baseline: dict | None) -> str:
    """The follow-up's lines for bench/README "On an H100": the float8 run (beside the first call's bf16
    run and nanoGPT's at the same batch, when `baseline` is that call's report), what compile keeps for
    the backward, and the estimate's test."""
    steps, env = report["steps"], report["steps"].get("env", {})
    device = env.get("gpu") or "CPU (dry-run: tiny shapes, not GPU figures)"
    lines = [
        f'The follow-up call, `bash bench/gpu_compare.sh --followup "$OUT"` ({report["wall_s"] / 60:.1f} min wall), '
        f"on {device}, PyTorch {env.get('torch')}, torchao {steps.get('torchao', {}).get('torchao')}, "
        f"{report['date'][:10]}.",
        "",
    ]
    runs = (  # the float8 runs, each beside the first call's runs at its batch
        ("llama1b_float8", "LLaMA-style 1.0B", (("llama1b", "ours float8 / ours bf16"),)),
        (
            "gpt2_best_float8",
            "GPT-2 124M",
            (("gpt2_best", "ours float8 / ours bf16"), ("nanogpt_best", "ours float8 / nanoGPT")),
        ),
    )
    base = (baseline or {}).get("steps", {})
    for key, model, pairs in runs:
        f8 = steps.get(key, {})
        if not f8.get("tokens_per_s"):
            continue
        label = f"ours, {model}, float8" + (" [dry-run: bf16, tiny stand-in]" if report["cpu_dry_run"] else "")
        mfu = f", {f8['mfu'] * 100:.1f}% MFU (bf16 count)" if f8.get("mfu") is not None else ""
        memory = f", peak {f8['peak_memory_mb'] / 1024:.2f} GiB" if f8.get("peak_memory_mb") else ""
        lines.append(
            f"- {label}, {f8['batch']} x {f8['context']}: {f8['tokens_per_s'] / 1000:.1f}k tokens/s, "
            f"{f8['step_time_s']:.3f} s a step{mfu}{memory}"
        )
        converted = [line for line in f8.get("header") or [] if "float8" in line and not line.startswith("train:")]
        if converted:
            lines.append(f"- its start line: `{converted[0].strip()}`")
        for other_key, what in pairs:
            other = base.get(other_key, {})
            if other.get("tokens_per_s") and other.get("batch") == f8["batch"]:
                lines.append(
                    f"- {what} tokens/s, same GPU, same batch: {f8['tokens_per_s'] / other['tokens_per_s']:.2f}× "
                    f"({model}, {f8['batch']} x {f8['context']}; the bf16 figure from the first call)"
                )
        if (f8.get("kernels") or {}).get("groups"):
            lines.append(kernel_line("Where its step goes", f8["kernels"]))
    for key in ("saved_gpt2", "saved_llama1b"):
        for row in steps.get(key, {}).get("rows") or []:
            r = steps[key]
            lines.append(
                f"- saved for the backward, {row['config']} ({r['batch']} x {r['seq']}): eager "
                f"{row['eager_per_token']:,.0f} B/token, compiled {row['compiled_per_token']:,.0f} B/token, "
                f"compiled / eager {row['compiled_over_eager']:.2f}"
            )
    test = steps.get("estimate_test", {})
    if test.get("result"):
        lines.append(f"- tests/test_estimate_measured.py, this device's case: {test['result']}")
    lines += not_run_lines(steps)
    return "\n".join(lines) + "\n"


def peak_bf16(gpu: str | None) -> float | None:
    if not gpu:
        return None
    import torch

    from llm_trainer.train.flops import peak_flops

    return peak_flops(gpu, torch.bfloat16)


def nanogpt_mfu(record: dict, settings: Settings, peak: float | None) -> None:
    """nanoGPT's MFU by our count (its model: no biases, vocabulary 50,304), and its own printed figure
    moved from an A100's 312 TFLOP/s to this GPU's peak."""
    if not (peak and record.get("tokens_per_s")):
        return
    from llm_trainer.config import ModelConfig
    from llm_trainer.train.flops import flops_per_token

    width, layers, heads = (64, 2, 2) if settings.cpu else (768, 12, 12)
    shape = ModelConfig(
        architecture="gpt2",
        d_model=width,
        n_layers=layers,
        n_heads=heads,
        d_ff=4 * width,
        bias=False,
        max_seq_len=settings.context,
        vocab_size=NANOGPT_VOCAB,
    )
    record["mfu"] = round(flops_per_token(shape, settings.context) * record["tokens_per_s"] / peak, 4)
    if record.get("its_printed_mfu_a100") is not None:
        record["its_printed_mfu"] = round(record["its_printed_mfu_a100"] * 312e12 / peak, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT") or str(BENCH_DIR / "out" / "gpu_compare"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="every step with tiny shapes on the CPU")
    parser.add_argument("--stage", action="store_true", help="copy nanoGPT into bench/.peers/nanoGPT and stop")
    parser.add_argument("--peer", type=Path, default=DEFAULT_PEER, help="nanoGPT's folder, for --stage")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds for every step together (510; --followup: 250, dry-run 400)"
    )
    parser.add_argument("--best-batch", type=int, default=None, help="our best GPT-2 batch, instead of the plan's")
    parser.add_argument("--followup", action="store_true", help="the second call: float8, saved tensors, the estimate")
    parser.add_argument("--baseline", type=Path, default=None, help="the first call's gpu_compare.json (--followup)")
    parser.add_argument(
        "--llama",
        choices=["auto", "plain", "fsdp-checkpointing"],
        default="auto",
        help="the 1.0B's settings: auto (the estimate decides), or one of the two",
    )
    args = parser.parse_args()
    if args.stage:
        return stage(args.peer)

    baseline = None
    if args.baseline is not None:
        try:
            baseline = json.loads(args.baseline.read_text())
        except (OSError, ValueError) as error:
            print(
                f"error: --baseline {args.baseline}: {error}; pass the first call's gpu_compare.json", file=sys.stderr
            )
            return 2
    settings = Settings.for_run(args.cpu_dry_run)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu_compare_"))
    budget = args.budget or (510 if not args.followup else 400 if settings.cpu else 250)
    run = Run(settings=settings, out=out, work=work, deadline=started + budget)
    if args.followup:
        return followup(run, args.best_batch or settings.max_best_batch, baseline, started)
    steps: dict[str, dict] = {}
    usage_error = None
    run.report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu_dry_run": settings.cpu, "steps": steps}
    try:
        steps["env"] = env_step(run)
        if not settings.cpu and not steps["env"].get("gpu"):
            usage_error = "error: no CUDA device found; for a CPU walk-through pass --cpu-dry-run"
            return 2
        steps["prepare"] = prepare_step(run)
        peer = Path(steps["prepare"]["nanogpt_copy"]) if steps["prepare"]["nanogpt_copy"] else None
        plan = steps["plan"] = plan_step(run, steps["env"].get("gpu_memory_gib"))
        best = args.best_batch or plan["gpt2_best_batch"]
        if args.llama != "auto":
            plan["llama_checkpointing"] = args.llama == "fsdp-checkpointing"
        steps["gpt2_nanogpt_shape"] = ours_gpt2(run, "gpt2_nanogpt_shape", settings.nanogpt_shape_batch, profile=True)
        steps["nanogpt_nanogpt_shape"] = nanogpt_step(run, "nanogpt_nanogpt_shape", peer, settings.nanogpt_shape_batch)
        steps["llama1b"] = llama_step(run, plan)
        steps["gpt2_best"] = ours_gpt2(run, "gpt2_best", best, profile=False)
        steps["nanogpt_best"] = nanogpt_step(run, "nanogpt_best", peer, best)
        steps["gpt2_in_place"] = ours_gpt2(
            run, "gpt2_in_place", settings.nanogpt_shape_batch, profile=False, extra=("training.read_ahead=false",)
        )
    finally:
        report = run.report
        report["wall_s"] = round(time.monotonic() - started, 1)
        report["peak_bf16_flops"] = peak_bf16(steps.get("env", {}).get("gpu"))
        for key in ("nanogpt_nanogpt_shape", "nanogpt_best"):
            nanogpt_mfu(steps.get(key, {}), settings, report["peak_bf16_flops"])
        report["ratios"] = ratios(report)
        write(run, "gpu_compare.json", "readme_lines.md", readme_lines(report))
        if usage_error:
            print(usage_error, file=sys.stderr)
    print(json.dumps({"wall_s": report["wall_s"], "ratios": report["ratios"]}))
    print(readme_lines(report))
    return 0


def followup(run: Run, best: int, baseline: dict | None, started: float) -> int:
    """The second call's steps, most telling first (the module's docstring lists them)."""
    settings, steps = run.settings, {}
    run.report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu_dry_run": settings.cpu, "steps": steps}
    try:
        steps["env"] = env_step(run)
        if not settings.cpu and not steps["env"].get("gpu"):
            print("error: no CUDA device found; for a CPU walk-through pass --cpu-dry-run", file=sys.stderr)
            return 2
        steps["torchao"] = torchao_step(run, steps["env"].get("packages", {}).get("torchao", False))
        steps["prepare"] = prepare_step(run, nanogpt=False)
        steps["llama1b_float8"] = float8_step(run, "llama1b_float8", steps["torchao"])
        steps["estimate_test"] = estimate_test_step(run)
        steps["gpt2_best_float8"] = float8_step(run, "gpt2_best_float8", steps["torchao"], best)
        steps["saved_llama1b"] = saved_step(run, "saved_llama1b", "llama-1b", 8, 2048)
        steps["saved_gpt2"] = saved_step(run, "saved_gpt2", "gpt2-124m", settings.nanogpt_shape_batch, 1024)
    finally:
        run.report["wall_s"] = round(time.monotonic() - started, 1)
        write(run, "followup.json", "followup_lines.md", followup_lines(run.report, baseline))
    print(followup_lines(run.report, baseline))
    return 0


def write(run: Run, report_name: str, lines_name: str, lines: str) -> None:
    """The call's report, its README lines and the end of every step's log into the output folder; the
    scratch folder removed."""
    (run.out / report_name).write_text(json.dumps(run.report, indent=2))
    (run.out / lines_name).write_text(lines)
    with open(run.out / "logs.txt", "w") as sink:
        for log in run.logs:
            tail = _text(log).splitlines()[-40:]
            sink.write(f"==> {log.name} <==\n" + "\n".join(tail) + "\n\n")
    shutil.rmtree(run.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
