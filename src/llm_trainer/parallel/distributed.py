"""Process-group setup for runs under `torchrun`, and the few collectives the loop needs.

We use PyTorch's own engines (DDP, FSDP2) and DeepSpeed's; this module only reads the launcher's
environment (RANK, WORLD_SIZE, LOCAL_RANK), checks it against the config, picks the backend and the
device, and opens the process group with a timeout so a dead rank fails the job instead of hanging.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import launcher
from ..config import TrainingConfig
from ..errors import TrainingStopped, UsageError, first_line
from ..logs import log, warn
from .mesh import resolve_layout, strategy_of


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    strategy: str = "single"  # single, ddp, fsdp, deepspeed
    # the data-parallel coordinate and degree: which batch this rank reads, of how many (tensor-parallel
    # ranks of one replica read the same one)
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(config: TrainingConfig, device: torch.device) -> tuple[DistInfo, torch.device]:
    """Open the process group when launched with several processes; idempotent.

    Returns the rank information and the device this process should use (cuda:LOCAL_RANK on GPUs).
    """
    world = launcher.world_size()
    if config.world_size is not None and config.world_size != world:
        raise UsageError(
            f"training.world_size={config.world_size} but the launcher started {world} process(es); "
            f"use torchrun --nproc_per_node={config.world_size} (times nodes) or remove training.world_size"
        )
    strategy = config.distributed_strategy
    if world == 1 and strategy != "deepspeed":
        if strategy in ("ddp", "fsdp"):
            warn(
                f"training.distributed_strategy={strategy} in one process: nothing is "
                f"{'sharded' if strategy == 'fsdp' else 'replicated'}; launch with torchrun --nproc_per_node=N "
                "(N > 1) to use it"
            )
        return DistInfo(), device
    if strategy == "auto":
        strategy = strategy_of(config)
    rank, local_rank = launcher.rank(), launcher.local_rank()
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = config.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise UsageError("training.distributed_backend=nccl needs CUDA; use gloo on CPU")
        if "MASTER_ADDR" not in os.environ and world > 1:  # every launcher sets it: WORLD_SIZE is left over
            raise UsageError(
                f"WORLD_SIZE={world} is set but MASTER_ADDR is not, so no launcher started this process; unset "
                "WORLD_SIZE and RANK to train in one process, or start the processes with torchrun"
            )
        if "MASTER_ADDR" not in os.environ:  # DeepSpeed in one process, started without torchrun
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
            )
        elif world > 1:  # said before the wait: a process group whose other ranks never come waits for the timeout
            log(
                f"distributed: joining {world} processes at {os.environ['MASTER_ADDR']}:"
                f"{os.environ.get('MASTER_PORT', '?')} (waits up to training.distributed_timeout_s="
                f"{config.distributed_timeout_s}s for all of them)"
            )
        timeout = timedelta(seconds=config.distributed_timeout_s)
        dist.init_process_group(
            backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **_restart_safe_store(rank, world, timeout),
        )
    layout = resolve_layout(config, world)
    per_replica = world // layout.dp  # mesh order (dp_replicate, dp_shard, pp, cp, tp): a replica's ranks adjacent
    return (
        DistInfo(
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            strategy=strategy,
            dp_rank=rank // per_replica,
            dp_size=layout.dp,
        ),
        device,
    )


def _restart_safe_store(rank: int, world: int, timeout: timedelta) -> dict:
    """Under torchrun, the rendezvous store of this attempt, under a prefix of its own.

    torchrun's agent keeps one store across elastic restarts (`--max-restarts`), and the addresses the
    workers of a failed attempt published there stay: a restarted worker may read one and fail with
    "Connection refused" (pytorch/pytorch#167288). A per-attempt prefix hides them."""
    store = attempt_store(timeout)
    if store is None:
        return {}  # not torchrun's agent store: the env:// rendezvous as usual
    return {"store": store, "rank": rank, "world_size": world}


# This attempt's store in torchrun's agent, which outlives every worker of it (empty without torchrun).
_ATTEMPT_STORE: list[dist.Store] = []
_RANK_0_ERROR = "error-of-rank-0"


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """This attempt's store in torchrun's agent (connected once), or None without torchrun's agent store.
    It needs no process group, so the ranks can use it before theirs exists (`said_by_rank_0`)."""
    if not _ATTEMPT_STORE and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            launcher.world_size(),
            is_master=False,
            timeout=timeout,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _ATTEMPT_STORE[:] = [dist.PrefixStore(f"llm_trainer/attempt-{attempt}", store)]
    return _ATTEMPT_STORE[0] if _ATTEMPT_STORE else None


def said_by_rank_0(message: str, *, follows_rank_0: bool = False, wait_s: float = 5.0) -> bool:
    """Whether rank 0 stops with this same one-line error, so that this rank need not print it again.

    A usage error (a refused resume, a bad option, a config key misspelt) usually stops every rank alike:
    without this, the console would show it once per process. Rank 0 leaves its message in torchrun's
    store and prints it; another rank waits up to `wait_s` for it and prints its own only when it differs
    or never came (an error of this rank alone). `follows_rank_0`: this rank's error is that rank 0
    stopped (`wait_for_main`), so whatever rank 0 said stands for it. This works before the process
    group exists (a config refused while it is read); without torchrun's store every rank prints its own."""
    try:
        if launcher.world_size() < 2:
            return False
        store = attempt_store(timedelta(seconds=wait_s))
        if store is None:
            return False
        store.set_timeout(timedelta(seconds=wait_s))  # the process is ending: no wait for an agent that is gone
        if launcher.rank() == 0:
            store.set(_RANK_0_ERROR, message)
            return False
        store.wait([_RANK_0_ERROR])
        return follows_rank_0 or store.get(_RANK_0_ERROR).decode() == message
    except (RuntimeError, ValueError):  # rank 0 never said one (the store's timeout), or the agent is gone;
        return False  # or the launcher's variables are what is wrong (UsageError): this rank says so itself


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def all_reduce_(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce when a process group is open; a no-op in a single process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def wait_for_main(task: str) -> None:
    """The other ranks wait here while rank 0 does `task` alone. Should rank 0 stop with an error, the
    wait fails on a closed connection: rank 0's own message says why, so this rank's says only that it
    stops with it (one line, not a traceback about a socket)."""
    try:
        barrier()
    except RuntimeError as exc:  # gloo's and NCCL's DistBackendError, DistNetworkError
        stopped = TrainingStopped(
            f"rank {dist.get_rank()} stops: its wait for rank 0, {task}, failed ({_reason(exc)}); rank 0's error "
            "says why"
        )
        stopped.follows_rank_0 = True  # not printed where rank 0's error was (`said_by_rank_0`)
        raise stopped from None


# What gloo, NCCL and the store say when the process at the other end ended or stopped answering; and
# the names that mark an error as theirs (gloo's errors are plain RuntimeErrors naming its source file).
_PEER_GONE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|timed out|timeout|communicator was aborted|remote process", re.I
)
_BACKEND = re.compile(r"gloo|nccl|processgroup|c10d|tcpstore", re.I)


def peer_lost(exc: BaseException) -> str | None:
    """The reason (the library's first sentence), when `exc` is a collective of a process group of several
    that failed because another process ended or stopped answering; None for anything else, which keeps
    its traceback (a bug in a collective is not a lost peer, nor a timeout of something else)."""
    if not (isinstance(exc, RuntimeError) and dist.is_available() and dist.is_initialized()):
        return None
    text = str(exc)
    from_backend = isinstance(exc, dist.DistError) or _BACKEND.search(text)
    if dist.get_world_size() < 2 or not (from_backend and _PEER_GONE.search(text)):
        return None
    return _reason(exc)


def _reason(exc: BaseException) -> str:
    """The first sentence of a collective's error, without gloo's `[file:line]` prefix."""
    return re.sub(r"^\[[^\]]*\]\s*", "", first_line(exc)).split(". ")[0]


# The last barrier of each gloo process group, kept until the process ends (`finish`).
_LAST_BARRIERS: list[dist.Work] = []


def finish() -> None:
    """Every rank meets here after a successful run, before any tears the process groups down.

    gloo frees the work it has finished on its own worker threads, and work still in flight when a
    barrier was issued is not freed before that barrier is. A worker that frees the last of such work
    after the interpreter began to exit must take the GIL to release tensors with Python objects, and
    the process aborts ("terminate called without an active exception",
    pytorch/pytorch#190489): torchrun then reports a finished run as failed. So the last barrier of
    each gloo group is issued here and its handle kept until the process ends (or its next run
    finishes): what it holds is then freed on this thread, never on a worker."""
    if not (dist.is_available() and dist.is_initialized()):  # DeepSpeed opens a group in one process too
        return
    if dist.get_backend() != dist.Backend.GLOO:
        dist.barrier()
    groups = dist.distributed_c10d._world.pg_map  # every group this rank is in; waited for only once all are issued
    works = [
        dist.barrier(group=group, async_op=True) for group in groups if dist.get_backend(group) == dist.Backend.GLOO
    ]
    for work in works:
        work.wait()
    _LAST_BARRIERS[:] = works  # an earlier run's (one process, several runs) are freed here, on this thread


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
