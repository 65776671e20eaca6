"""Model registry: named, numbered versions of trained models with what made them.

    llm-trainer registry add runs/tiny --name tiny-code          -> tiny-code:1
    llm-trainer registry list
    llm-trainer registry show tiny-code            (latest)  /  tiny-code:1  /  tiny-code:production
    llm-trainer registry promote tiny-code:1 --stage production

A version records, from the run folder: the experiment config, the final metrics (the summary
row of metrics.jsonl, with the best evaluation), the data fingerprint (prepared-data cache key,
from the checkpoint's saved config), the tokenizer fingerprint (sha256 of tokenizer.json), the git
commit of the run folder's repository (null outside git), the model folder (best_model, else the
newest checkpoint) and an exported Hugging Face folder when there is one (`--export PATH`, or a
subfolder of the run holding config.json + model.safetensors). Files are referenced, not copied.

Adding a run again when nothing about it changed (same folders, metrics, config, fingerprints,
description) returns the version that already holds it instead of a duplicate.

Stages: none (new versions), staging, production, archived. Promoting to staging/production moves
the version that held that stage to archived (unless `keep_existing`).

Backends: a local SQLite file (no server), by default `~/.llm_trainer/registry.db`, overridden by
`--db PATH` or $LLM_TRAINER_REGISTRY; or the MLflow model registry when the spec is `mlflow:URI`
(e.g. `mlflow:sqlite:///mlruns/mlflow.db`, `mlflow:http://host:5000`; `mlflow:` alone uses
$MLFLOW_TRACKING_URI or ./mlruns): versions become MLflow model versions with the same fields as
tags, and a stage is an MLflow alias of that name.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import sqlite3
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from ..checkpoint.model_folder import is_transformers_folder
from ..errors import UsageError
from ..train.rows import read_rows_of, row_kind

STAGES = ("none", "staging", "production", "archived")
DEFAULT_DB = Path("~/.llm_trainer/registry.db")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class ModelVersion:
    name: str
    version: int
    stage: str = "none"
    created_at: str = ""
    run_dir: str | None = None
    model_path: str | None = None
    export_path: str | None = None
    data_fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    git_commit: str | None = None
    model_fingerprint: str | None = None  # the model folder's weights as registered (`model_fingerprint`)
    description: str | None = None
    metrics: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    already_registered: bool = field(default=False, compare=False)  # add() found this run unchanged: not stored again

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    def to_dict(self) -> dict:
        values = asdict(self)
        del values["already_registered"]
        return values


_IDENTITY = (
    "run_dir",
    "model_path",
    "export_path",
    "data_fingerprint",
    "tokenizer_fingerprint",
    "git_commit",
    "model_fingerprint",
    "metrics",
    "config",
)


def _same_run(versions: list[ModelVersion], info: dict, description: str | None) -> ModelVersion | None:
    """The newest version that records exactly this run as it is now (and the same description), if any."""

    def key(values: dict) -> str:
        return json.dumps([values.get(k) for k in _IDENTITY], sort_keys=True, default=str)

    wanted = key(info)
    for version in reversed(versions):
        if version.description == description and key(version.to_dict()) == wanted:
            version.already_registered = True
            return version
    return None


# ----------------------------------------------------------------------------------------------
# What a run folder tells about itself


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _final_metrics(run_dir: Path) -> dict:
    """The last summary row of metrics.jsonl (else the last evaluation row), without its kind."""
    file = run_dir / "metrics.jsonl"
    if not file.is_file():
        return {}
    end, last_eval = None, None
    for row in read_rows_of(file):
        kind = row_kind(row)
        if kind == "summary":
            end = row
        elif kind == "eval":
            last_eval = row
    chosen = end or last_eval or {}
    return {k: v for k, v in chosen.items() if k not in ("kind", "event")}


def git_commit(path: Path) -> str | None:
    """HEAD of the git repository holding `path`, or None (not in a repository, or no git)."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", commit) else None


def model_fingerprint(model_path: str | Path | None) -> str | None:
    """What identifies the weights in a model folder: a hash of its meta.json's record of every file
    (sizes and checksums, computed when it was saved); None without one. A run trained again into the
    same folder (`--overwrite`) changes it, while the registered version still points there."""
    from ..checkpoint.layout import META

    if model_path is None:
        return None
    meta = _read_json(Path(model_path) / META)
    files = (meta or {}).get("files")
    if not isinstance(files, dict):
        return None
    return hashlib.sha256(json.dumps(files, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_folder_state(version: ModelVersion) -> str | None:
    """What the model folder a version points to holds now: "unchanged", "gone", "changed" (other
    weights: a run trained into it again), or None where the version recorded no weights to compare."""
    if version.model_fingerprint is None or version.model_path is None:
        return None
    now = model_fingerprint(version.model_path)
    if now == version.model_fingerprint:
        return "unchanged"
    return "gone" if now is None else "changed"


def changed_since_registered(version: ModelVersion) -> str | None:
    """One line when the model folder a version points to no longer holds the weights it recorded."""
    state = model_folder_state(version)
    if state in (None, "unchanged"):
        return None
    what = "is gone" if state == "gone" else "holds other weights (a run was trained into it again)"
    return (
        f"{version.ref}: its model folder {version.model_path} {what} since it was registered; the metrics and "
        "config shown are the registered model's, not the folder's"
    )


def check_promotable(version: ModelVersion, stage: str) -> None:
    """A version whose model folder is gone or holds other weights is not put in staging or production:
    what would be served is not what was registered (archiving it stays allowed)."""
    if stage in ("staging", "production") and (problem := changed_since_registered(version)) is not None:
        raise UsageError(
            f"{problem}; it is not promoted to {stage}: register the run again (a new version) where its model is now"
        )


def _find_export(run_dir: Path) -> Path | None:
    for sub in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        if (sub / "config.json").is_file() and any(sub.glob("*.safetensors")):
            return sub
    return None


def collect_run_info(run_dir: str | Path, export_path: str | Path | None = None) -> dict:
    """The fields of a new version, read from a run folder (see the module docstring)."""
    from ..checkpoint.layout import BEST, META, list_checkpoints
    from ..train.output_folder import recorded_checkpoint_folder

    run = Path(run_dir)
    if not run.is_dir():
        raise UsageError(f"run folder {run} not found")
    config = None
    if (run / "config.yaml").is_file():
        try:
            config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        except yaml.YAMLError:
            config = None
    config = config if isinstance(config, dict) else None  # a folder someone else made: any shape at all
    training = (config or {}).get("training")
    training = training if isinstance(training, dict) else {}
    ckpt_root = recorded_checkpoint_folder(run, training.get("checkpoint_dir"))
    best = ckpt_root / BEST
    newest = next(iter(list_checkpoints(ckpt_root)), None)
    model_path = best if (best / "model.safetensors").is_file() else newest
    meta = None
    for folder in (newest, best):  # the checkpoint's config carries data_fingerprint
        if folder is not None and (folder / META).is_file():
            meta = _read_json(folder / META)
            if meta:
                break
    saved = (meta or {}).get("config")
    saved = dict(saved) if isinstance(saved, dict) else {}
    data_fingerprint = saved.pop("data_fingerprint", None)
    config = config or {k: v for k, v in saved.items() if k in ("model", "training", "data")}
    if not config and model_path is None:
        raise UsageError(f"{run} is not a run folder: no config.yaml and no checkpoint")
    if model_path is None and export_path is None:  # a version names a model: a run that saved none has none
        raise UsageError(
            f"{run} holds no model yet (no checkpoint or best_model in {ckpt_root}); register it once the run "
            "has saved one, or pass --export with its exported model"
        )
    metrics = _final_metrics(run)
    best_meta = _read_json(best / META) if best.is_dir() else None
    if best_meta and isinstance(best_meta.get("metrics"), dict):
        metrics.setdefault("best_model", best_meta["metrics"])
    tokenizer = run / "tokenizer.json"
    if not tokenizer.is_file() and model_path is not None:
        tokenizer = Path(model_path) / "tokenizer.json"
    if export_path is not None:
        export = Path(export_path)
        if not export.exists():
            raise UsageError(f"--export {export} not found")
        if not is_transformers_folder(export):
            raise UsageError(
                f"--export {export} is not an exported model folder (it has no config.json); "
                "pass the folder `llm-trainer export` wrote for this run"
            )
    else:
        export = _find_export(run)
    return {
        "run_dir": str(run.resolve()),
        "model_path": str(Path(model_path).resolve()) if model_path is not None else None,
        "export_path": str(export.resolve()) if export is not None else None,
        "data_fingerprint": data_fingerprint,
        "tokenizer_fingerprint": hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer.is_file() else None,
        "git_commit": git_commit(run),
        "model_fingerprint": model_fingerprint(model_path),
        "metrics": metrics,
        "config": config,
    }


def parse_ref(ref: str) -> tuple[str, int | str | None]:
    """ "name" -> (name, None = latest); "name:3" -> (name, 3); "name:production" -> (name, "production")."""
    name, _, version = ref.partition(":")
    if not name:
        raise UsageError(f"model reference {ref!r} must look like NAME, NAME:VERSION or NAME:STAGE")
    if not version:
        return name, None
    if version.isdigit():
        return name, int(version)
    if version in STAGES or version == "latest":
        return name, None if version == "latest" else version
    raise UsageError(f"{ref!r}: the part after ':' must be a version number or a stage ({', '.join(STAGES)})")


def _check_name(name: str) -> None:
    if not NAME_RE.match(name or ""):
        raise UsageError(
            f"model name {name!r} must start with a letter or digit and hold only letters, digits, '.', '_', '-'"
        )


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise UsageError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")


# ----------------------------------------------------------------------------------------------
# SQLite backend

_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    stage TEXT NOT NULL DEFAULT 'none',
    created_at TEXT NOT NULL,
    run_dir TEXT,
    model_path TEXT,
    export_path TEXT,
    data_fingerprint TEXT,
    tokenizer_fingerprint TEXT,
    git_commit TEXT,
    model_fingerprint TEXT,
    description TEXT,
    metrics TEXT NOT NULL DEFAULT '{}',
    config TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS stage_history (
    name TEXT NOT NULL, version INTEGER NOT NULL, stage TEXT NOT NULL, changed_at TEXT NOT NULL
);
"""
_TABLES = {"versions", "stage_history"}
_COLUMNS = (
    "name",
    "version",
    "stage",
    "created_at",
    "run_dir",
    "model_path",
    "export_path",
    "data_fingerprint",
    "tokenizer_fingerprint",
    "git_commit",
    "model_fingerprint",
    "description",
    "metrics",
    "config",
)


class SQLiteRegistry:
    """The registry in one SQLite file; safe for several processes (writes take an immediate lock)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        # A registry never written to is empty: reading it (list, show) creates no file or folder.
        self.db = self._connect() if self.path.exists() else None

    def _connect(self) -> sqlite3.Connection:
        if self.path.is_dir():
            raise UsageError(f"registry {self.path} is a folder; --db takes the path of a file (a new one is made)")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables - _TABLES:  # another program's database (a sweep's study.db): never written into
                db.close()
                raise UsageError(
                    f"registry {self.path} is another program's database (its tables: {', '.join(sorted(tables))}); "
                    "give the registry a file of its own with --db"
                )
            db.executescript(_SCHEMA)
            known = {row[1] for row in db.execute("PRAGMA table_info(versions)")}
            if "model_fingerprint" not in known:  # a registry written before versions recorded it
                db.execute("ALTER TABLE versions ADD COLUMN model_fingerprint TEXT")
        except sqlite3.DatabaseError as exc:
            raise UsageError(f"registry {self.path} is not usable: {exc}") from None
        except OSError as exc:
            raise UsageError(f"registry {self.path} cannot be created ({exc.strerror or exc})") from None
        return db

    def close(self) -> None:
        if self.db is not None:
            self.db.close()

    def _row(self, row) -> ModelVersion:
        values = dict(zip(_COLUMNS, row))
        values["metrics"] = json.loads(values["metrics"] or "{}")
        values["config"] = json.loads(values["config"] or "{}")
        return ModelVersion(**values)

    def _select(self, where: str = "", args: tuple = ()) -> list[ModelVersion]:
        if self.db is None:
            return []
        sql = f"SELECT {', '.join(_COLUMNS)} FROM versions {where} ORDER BY name, version"
        return [self._row(r) for r in self.db.execute(sql, args)]

    def add(self, run_dir, name: str, *, export_path=None, description: str | None = None) -> ModelVersion:
        _check_name(name)
        info = collect_run_info(run_dir, export_path)
        if self.db is None:
            self.db = self._connect()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            existing = _same_run(self._select("WHERE name = ?", (name,)), info, description)
            if existing is not None:
                self.db.execute("COMMIT")
                return existing
            (latest,) = self.db.execute("SELECT MAX(version) FROM versions WHERE name = ?", (name,)).fetchone()
            version = ModelVersion(
                name=name, version=(latest or 0) + 1, created_at=_now(), description=description, **info
            )
            values = version.to_dict()
            values["metrics"] = json.dumps(values["metrics"], default=str)
            values["config"] = json.dumps(values["config"], default=str)
            self.db.execute(
                f"INSERT INTO versions ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})",
                tuple(values[c] for c in _COLUMNS),
            )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return version

    def list(self, name: str | None = None) -> list[ModelVersion]:
        return self._select("WHERE name = ?", (name,)) if name else self._select()

    def get(self, name: str, version: int | str | None = None) -> ModelVersion:
        if version is None:
            found = self._select(
                "WHERE name = ? AND version = (SELECT MAX(version) FROM versions WHERE name = ?)", (name, name)
            )
        elif isinstance(version, int):
            found = self._select("WHERE name = ? AND version = ?", (name, version))
        else:
            _check_stage(version)
            found = self._select("WHERE name = ? AND stage = ?", (name, version))[-1:]
        if not found:
            known = sorted({v.name for v in self._select()})
            what = f"{name}:{version}" if version is not None else name
            hint = f"; registered: {', '.join(known)}" if known else "; the registry is empty"
            raise UsageError(f"no model version {what} in {self.path}{hint}")
        return found[0]

    def promote(self, name: str, version: int, stage: str, *, keep_existing: bool = False) -> ModelVersion:
        _check_stage(stage)
        target = self.get(name, version)
        check_promotable(target, stage)
        self.db.execute("BEGIN IMMEDIATE")
        try:
            now = _now()
            if stage in ("staging", "production") and not keep_existing:
                for (other,) in self.db.execute(
                    "SELECT version FROM versions WHERE name = ? AND stage = ? AND version != ?", (name, stage, version)
                ).fetchall():
                    self.db.execute(
                        "UPDATE versions SET stage = 'archived' WHERE name = ? AND version = ?", (name, other)
                    )
                    self.db.execute("INSERT INTO stage_history VALUES (?, ?, 'archived', ?)", (name, other, now))
            self.db.execute("UPDATE versions SET stage = ? WHERE name = ? AND version = ?", (stage, name, version))
            self.db.execute("INSERT INTO stage_history VALUES (?, ?, ?, ?)", (name, version, stage, now))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        target.stage = stage
        return target


# ----------------------------------------------------------------------------------------------
# MLflow backend (thin)


class MLflowRegistry:
    """The MLflow model registry as the backend. Versions are numbered by MLflow; our fields are tags
    (the config split into one JSON tag per section, to stay under tag-length limits); a stage is an
    alias (`production`, `staging`) plus a `stage` tag on the version."""

    def __init__(self, tracking_uri: str | None):
        from ..train.metrics import resolve_mlflow_uri

        self._tracking_uri = tracking_uri or None
        self.path, folder = resolve_mlflow_uri(self._tracking_uri, create=False)
        # A local store never written to is empty: reading it (list, show) creates nothing.
        self._client = None if folder is not None and not (folder / "mlflow.db").is_file() else self._connect()

    def _connect(self):
        from ..train.metrics import mlflow_client

        client, _ = mlflow_client(self._tracking_uri)  # creates a local store's folder
        return client

    @property
    def client(self):
        if self._client is None:  # the first write creates the store
            self._client = self._connect()
        return self._client

    def close(self) -> None:
        pass

    def _exists(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
            return True
        except MlflowException:
            return False

    def add(self, run_dir, name: str, *, export_path=None, description: str | None = None) -> ModelVersion:
        _check_name(name)
        info = collect_run_info(run_dir, export_path)
        if not self._exists(name):
            self.client.create_registered_model(name)
        elif (existing := _same_run(self.list(name), info, description)) is not None:
            return existing
        tags = {k: ("" if v is None else str(v)) for k, v in info.items() if k not in ("metrics", "config")}
        tags["metrics"] = json.dumps(info["metrics"], default=str)[:5000]
        for section, values in (info["config"] or {}).items():
            tags[f"config.{section}"] = json.dumps(values, default=str, separators=(",", ":"))[:5000]
        tags["stage"] = "none"
        source = info["export_path"] or info["model_path"] or info["run_dir"]
        mv = self.client.create_model_version(name, source=Path(source).as_uri(), tags=tags, description=description)
        return self._version(mv)

    def _version(self, mv) -> ModelVersion:
        tags = dict(mv.tags or {})
        config = {k.split(".", 1)[1]: json.loads(v) for k, v in tags.items() if k.startswith("config.")}
        created = _dt.datetime.fromtimestamp(mv.creation_timestamp / 1000, _dt.UTC).replace(microsecond=0).isoformat()
        return ModelVersion(
            name=mv.name,
            version=int(mv.version),
            stage=tags.get("stage", "none"),
            created_at=created,
            run_dir=tags.get("run_dir") or None,
            model_path=tags.get("model_path") or None,
            export_path=tags.get("export_path") or None,
            data_fingerprint=tags.get("data_fingerprint") or None,
            tokenizer_fingerprint=tags.get("tokenizer_fingerprint") or None,
            git_commit=tags.get("git_commit") or None,
            model_fingerprint=tags.get("model_fingerprint") or None,
            description=mv.description or None,
            metrics=json.loads(tags.get("metrics") or "{}"),
            config=config,
        )

    def list(self, name: str | None = None) -> list[ModelVersion]:
        if self._client is None:
            return []
        names = [name] if name else sorted(m.name for m in self.client.search_registered_models())
        out = []
        for n in names:
            versions = self.client.search_model_versions(f"name='{n}'")
            out += sorted((self._version(v) for v in versions), key=lambda v: v.version)
        return out

    def get(self, name: str, version: int | str | None = None) -> ModelVersion:
        from mlflow.exceptions import MlflowException

        try:
            if self._client is None:  # nothing written yet
                raise MlflowException("empty registry")
            if isinstance(version, int):
                return self._version(self.client.get_model_version(name, str(version)))
            if isinstance(version, str):
                _check_stage(version)
                return self._version(self.client.get_model_version_by_alias(name, version))
            versions = self.list(name)
        except MlflowException:
            versions = []
        if not versions:
            raise UsageError(
                f"no model version {name}{'' if version is None else f':{version}'} in MLflow registry {self.path}"
            )
        return versions[-1]

    def promote(self, name: str, version: int, stage: str, *, keep_existing: bool = False) -> ModelVersion:
        _check_stage(stage)
        check_promotable(self.get(name, version), stage)
        if stage in ("staging", "production") and not keep_existing:
            for other in self.list(name):
                if other.stage == stage and other.version != version:
                    self.client.set_model_version_tag(name, str(other.version), "stage", "archived")
        from mlflow.exceptions import MlflowException

        self.client.set_model_version_tag(name, str(version), "stage", stage)
        for alias in ("staging", "production"):  # an alias points at the version holding that stage, if any
            if alias == stage:
                self.client.set_registered_model_alias(name, alias, str(version))
                continue
            try:
                holder = self.client.get_model_version_by_alias(name, alias)
            except MlflowException:
                continue
            if int(holder.version) == version:
                self.client.delete_registered_model_alias(name, alias)
        return self.get(name, version)


def default_spec() -> str:
    return os.environ.get("LLM_TRAINER_REGISTRY") or str(DEFAULT_DB)


def open_registry(spec: str | Path | None = None):
    """`SQLiteRegistry` for a path, `MLflowRegistry` for `mlflow:[URI]`; default: $LLM_TRAINER_REGISTRY or
    ~/.llm_trainer/registry.db."""
    spec = str(spec) if spec else default_spec()
    if spec.startswith("mlflow:"):
        return MLflowRegistry(spec[len("mlflow:") :])
    return SQLiteRegistry(Path(spec).expanduser())


def _model_loss(version: ModelVersion) -> float | None:
    """The validation loss of the weights the version points at: best_model's own (the evaluation that
    chose it) where it is that folder; else the run's last evaluation, whose checkpoint it is."""
    from ..checkpoint.layout import BEST

    best = version.metrics.get("best_model")
    if version.model_path and Path(version.model_path).name == BEST and isinstance(best, dict):
        loss = best.get("val_loss")
    else:
        loss = version.metrics.get("val_loss", version.metrics.get("best_val_loss"))
    return loss if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None


def format_table(versions: list[ModelVersion]) -> str:
    header = ["model", "version", "stage", "val_loss", "created", "model_path"]
    rows = []
    for v in versions:
        loss = _model_loss(v)
        rows.append(
            [
                v.name,
                str(v.version),
                v.stage,
                f"{loss:.4f}" if loss is not None else "-",
                v.created_at.replace("+00:00", "Z"),
                (v.model_path or "-")
                + {"gone": " (gone)", "changed": " (changed since registered)"}.get(model_folder_state(v) or "", ""),
            ]
        )
    if not rows:
        return "(no models registered)"
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])
