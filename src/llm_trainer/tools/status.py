"""`llm-trainer status RUN`: a run's state on one screen, from its folder alone (a path, or a URL output_dir).

What it reads, and nothing else; it writes nothing, runs nothing, and its only side effect is an
instant's probe of the run lock (`train.run_lock`), the same probe a second `train` makes:

    metrics.jsonl                 the last training rows (step, tokens, losses, tokens/s, MFU), the last
                                  evaluation, the summary of a run that ended, and the `alert` rows
    config.yaml                   the plan: training.max_steps (when the checkpoint does not say)
    checkpoints/latest            the newest checkpoint, and its meta.json (step, when) and
    checkpoints/<name>/...        train_state.json (the run's length in steps, `schedule.total_steps`)
    .lock                         whether a live process holds the run (a local folder, or a URL run's
                                  staging folder on this machine)

Every file is parsed as data within `limits`' bounds; a malformed line of metrics.jsonl (one being
written) is skipped. A checkpoint counts as complete when its meta.json is whole and every file it lists
is there at its recorded size (checksums are hashed by a resume, not here: that would take minutes).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint.find import newest_first
from ..checkpoint.layout import CHECKPOINTS_DIR, LATEST, META, TRAIN_STATE, list_checkpoints
from ..config import TrainingConfig
from ..config_loader import yaml_load
from ..errors import UsageError
from ..files import buckets
from ..limits import parse_json
from ..train.output_folder import METRICS_FILE, recorded_checkpoint_folder
from ..train.rows import read_rows
from ..train.run_lock import lock_holder

LAST_LOSSES = 5  # training losses shown
LAST_ALERTS = 5  # alert rows shown (all are counted)


@dataclass(frozen=True)
class RunFiles:
    """Reads one run folder's files by name: a local folder, or a URL through `files.buckets`
    (`in_store`: which one, decided once by `of`)."""

    where: str
    in_store: bool

    @classmethod
    def of(cls, run: str) -> RunFiles:
        url = buckets.Location(run).url
        return cls(url.rstrip("/"), True) if url else cls(run, False)

    def text(self, *names: str) -> str | None:
        """The text of the file `names` joins to, or None when there is none (or it is unreadable)."""
        if self.in_store:
            return buckets.read_text(buckets.join(self.where, *names))
        path = Path(self.where).joinpath(*names)
        try:
            return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
        except OSError:
            return None

    def json(self, *names: str) -> dict | None:
        """A JSON object file as data, or None when missing or malformed."""
        text = self.text(*names)
        if text is None:
            return None
        try:
            value = parse_json(text, "/".join(names))
        except (ValueError, UsageError):
            return None
        return value if isinstance(value, dict) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _checkpoint_files(files: RunFiles, config: dict) -> RunFiles:
    """The run's checkpoint folder: where its config.yaml's training.checkpoint_dir says (a URL, or a
    local folder by `recorded_checkpoint_folder`'s rule), else `{run}/checkpoints`."""
    named = config.get("checkpoint_dir")
    if isinstance(named, str) and buckets.Location(named).url:
        return RunFiles.of(named)
    if files.in_store:
        return RunFiles(buckets.join(files.where, CHECKPOINTS_DIR), True)
    return RunFiles(str(recorded_checkpoint_folder(Path(files.where), named)), False)


def _complete(files: RunFiles, name: str) -> tuple[dict | None, str | None]:
    """(meta.json of the checkpoint `name` in the checkpoint folder `files`, None) when it is complete,
    else (meta or None, why not)."""
    meta = files.json(name, META)
    if meta is None or not isinstance(meta.get("files"), dict):
        return None, "no readable meta.json (a save cut short)"
    if files.in_store:
        return meta, None  # the store's `latest` is written after every file it names (checkpoint.remote)
    folder = Path(files.where) / name
    for listed, entry in meta["files"].items():
        size = entry.get("size") if isinstance(entry, dict) else None
        path = folder / str(listed)
        if (path.is_symlink() or not path.is_file()) and listed not in meta.get("in_store", ()):
            return meta, f"{listed} is missing"
        if isinstance(size, int) and path.is_file() and path.stat().st_size != size:
            return meta, f"{listed} is {path.stat().st_size:,} bytes, {size:,} expected"
    return meta, None


def _checkpoint(files: RunFiles) -> dict | None:
    """The newest complete checkpoint in the checkpoint folder `files`, the one a resume and `eval` take: in
    a local folder the newest whole one in the order they were saved (`latest` may lag a save that was
    killed before it), in a store the one `latest` names."""
    named = (files.text(LATEST) or "").strip()
    if files.in_store:
        candidates = [named] if named and "/" not in named and named not in (".", "..") else []
    else:
        candidates = [p.name for p in newest_first(Path(files.where), named or None)]
    skipped = []
    for name in dict.fromkeys(candidates):
        meta, problem = _complete(files, name)
        if problem is None and meta is not None:
            out = {"name": name, "step": _int(meta.get("step")), "created": _number(meta.get("created"))}
            state = files.json(name, TRAIN_STATE) or {}
            schedule = state.get("schedule") if isinstance(state.get("schedule"), dict) else {}
            out["total_steps"] = _int(schedule.get("total_steps"))
            if skipped:
                out["skipped"] = skipped
            return out
        skipped.append(f"{name}: {problem}")
    return {"name": None, "skipped": skipped} if skipped else None


def _lock(files: RunFiles, config: dict) -> dict:
    """Whether a live process holds the run's lock: the folder's own, or a URL run's staging folder here."""
    if files.in_store:
        staging = config.get("staging_dir") if isinstance(config.get("staging_dir"), str) else None
        training = TrainingConfig(output_dir=files.where, **({"staging_dir": staging} if staging else {}))
        folder, where = training.local_output_dir, "this machine's staging folder"
    else:
        folder, where = Path(files.where), "the run folder"
    held, pid = lock_holder(folder)
    return {"held": held, "pid": pid, "where": where}


def _training_config(files: RunFiles) -> dict:
    text = files.text("config.yaml")
    if text is None:
        return {}
    try:
        config = yaml_load(text, "config.yaml")
    except (ValueError, yaml.YAMLError):  # a malformed config.yaml: the plan is unknown, the rest is shown
        return {}
    training = config.get("training") if isinstance(config, dict) else None
    return training if isinstance(training, dict) else {}


def _state(lock: dict, summary: dict | None, ended: dict | None, checkpoint: dict | None) -> str:
    """running / finished / stopped (why) / crashed (why) / not running (interrupted; resumable when it
    has a checkpoint)."""
    if lock["held"]:
        return "running"
    if ended is not None and ended.get("event") == "crashed":
        return f"crashed: {ended.get('message', '')}".strip()
    if summary is not None:
        if summary.get("stopped_by_signal"):
            return f"stopped by {summary['stopped_by_signal']}"
        if summary.get("stopped_early"):
            return f"stopped early: {summary['stopped_early']}"
        return "finished"
    if checkpoint is None:
        return (
            "not running (interrupted before its first checkpoint: nothing to resume; train again with "
            "--overwrite to start over)"
        )
    return "not running (interrupted: no summary row; resume with training.resume_from_checkpoint=latest)"


def run_status(run: str) -> dict:
    """Everything `llm-trainer status` shows, as plain data (what `--json` prints)."""
    files = RunFiles.of(run)
    if not files.in_store and not Path(run).is_dir():
        what = "is a file, not a folder" if Path(run).exists() else "not found"
        raise UsageError(f"run folder {run} {what}; pass a run's training.output_dir (a folder or a URL)")
    text = files.text(METRICS_FILE)
    rows = read_rows(text or "")
    config = _training_config(files)
    checkpoint = _checkpoint(_checkpoint_files(files, config))
    if text is None and checkpoint is None and not config:
        if not files.in_store and ((Path(run) / LATEST).is_file() or list_checkpoints(Path(run))):
            raise UsageError(f"{run} is a run's checkpoints folder; pass the run's output_dir: {Path(run).parent}")
        raise UsageError(f"{run} holds no run (no metrics.jsonl, config.yaml or checkpoints); pass a run's output_dir")
    # a row without a whole-number step is no row of a run's (another program's file, a hand edit): skipped
    rows = [r for r in rows if _int(r.get("step")) is not None or r.get("kind") == "alert"]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval" and _number(r.get("val_loss")) is not None]
    alerts = [r for r in rows if r.get("kind") == "alert"]
    last_row = rows[-1] if rows else None
    summary = last_row if last_row is not None and last_row.get("kind") == "summary" else None
    ends = [
        i
        for i, r in enumerate(rows)
        if r.get("kind") == "alert" and r.get("event") in ("crashed", "finished", "stopped")
    ]
    ended = rows[ends[-1]] if ends else None
    if ends and any(r.get("kind") in ("train", "summary") for r in rows[ends[-1] + 1 :]):
        ended = None  # an earlier attempt's end: the run was resumed after it
    last = train[-1] if train else {}
    step = _int((summary or last).get("step"))
    tokens = _int((summary or last).get("tokens_seen"))
    if step is None:  # nothing logged yet: at its checkpoint's step, or at the start
        step = (checkpoint or {}).get("step") or 0
        tokens = 0 if step == 0 else None
    total = (checkpoint or {}).get("total_steps") or _int(config.get("max_steps"))
    lock = _lock(files, config)
    out: dict[str, Any] = {
        "run": run,
        "state": _state(lock, summary, ended, checkpoint),
        "lock": lock,
        "step": step,
        "total_steps": total,
        "tokens_seen": tokens,
        "total_tokens": round(tokens / step * total) if tokens and step and total else None,
        "last_losses": [[r.get("step"), _number(r.get("loss"))] for r in train[-LAST_LOSSES:]],
        "tokens_per_s": _number(last.get("tokens_per_s")),
        "mfu": _number(last.get("mfu")),
        "step_time_s": _number(last.get("step_time_s")),
        "eta_s": None,
        "last_eval": {"step": evals[-1].get("step"), "val_loss": _number(evals[-1].get("val_loss"))} if evals else None,
        "checkpoint": checkpoint,
        "alerts": len(alerts),
        "last_alerts": alerts[-LAST_ALERTS:],
        "updated_s_ago": _age(files),
    }
    step_time = out["step_time_s"]
    if lock["held"] and step is not None and total and step_time:
        out["eta_s"] = max(0, total - step) * step_time
    return out


def _age(files: RunFiles) -> float | None:
    """Seconds since metrics.jsonl last changed (a local folder; None for a URL)."""
    if files.in_store:
        return None
    try:
        return max(0.0, time.time() - (Path(files.where) / METRICS_FILE).stat().st_mtime)
    except OSError:
        return None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def format_status(status: dict) -> str:
    """The status as a few plain lines (no colour, no wide characters: readable over ssh)."""
    lock = status["lock"]
    holder = f"held by PID {lock['pid']}" if lock["held"] else f"free ({lock['where']})"
    step, total = status["step"], status["total_steps"]
    of_total = f" / {total:,} ({100 * step / total:.1f}%)" if step is not None and total else ""
    tokens, total_tokens = status["tokens_seen"], status["total_tokens"]
    lines = [
        f"run        {status['run']}",
        f"state      {status['state']}   lock {holder}",
        f"step       {'-' if step is None else format(step, ',')}{of_total}",
        f"tokens     {'-' if tokens is None else format(tokens, ',')}"
        + (f" / {total_tokens:,}" if total_tokens else ""),
    ]
    losses = [f"{loss:.4f}@{s}" for s, loss in status["last_losses"] if loss is not None]
    lines.append(f"loss       {'  '.join(losses) if losses else '-'}")
    if status["last_eval"]:
        lines.append(f"val_loss   {status['last_eval']['val_loss']:.4f} at step {status['last_eval']['step']}")
    speed = f"{status['tokens_per_s']:,.0f} tok/s" if status["tokens_per_s"] else "-"
    if status["mfu"] is not None:
        speed += f", MFU {100 * status['mfu']:.1f}%"
    lines.append(f"speed      {speed}   ETA {_duration(status['eta_s'])}")
    if status["updated_s_ago"] is not None:
        lines.append(f"updated    {_duration(status['updated_s_ago'])} ago (metrics.jsonl)")
    checkpoint = status["checkpoint"]
    if checkpoint and checkpoint.get("name"):
        lines.append(f"checkpoint {checkpoint['name']} (step {checkpoint['step']})")
    else:
        lines.append("checkpoint none complete yet")
    for problem in (checkpoint or {}).get("skipped", []):
        lines.append(f"           skipped {problem}")
    lines.append(f"alerts     {status['alerts']}")
    for alert in status["last_alerts"]:
        lines.append(f"  step {alert.get('step')}  {alert.get('event')}: {alert.get('message', '')}")
    return "\n".join(lines)


def print_status(run: str, as_json: bool) -> None:
    status = run_status(run)
    print(json.dumps(status, indent=1) if as_json else format_status(status))
