"""Hyperparameter search with Optuna: `llm-trainer sweep --config C --search-space S.yaml --trials N`.

Each trial is an ordinary training run (`llm_trainer.api.train`) of the experiment file with
dotted overrides sampled from the search space, in its own folder `{root}/trial-0007/`. The
objective is the trial's best validation loss (so the data needs a validation split). TPE samples;
a median pruner stops trials whose intermediate validation loss (each `training.eval_steps`) is worse
than the median of earlier trials at the same step. The study lives in a SQLite file,
`{root}/study.db`, so running the same command again resumes it.

The search-space file's format is `SEARCH_SPACE_FORMAT` below (`llm-trainer sweep --help` prints it).

`--trials N` is the number of finished trials (complete, pruned, or failed on a bad config / a
diverged run) the study should hold: rerunning the same command after an interruption runs only
the missing ones, a larger N extends the sweep. Ctrl-C or SIGTERM stops the running trial's
training cleanly, marks that trial failed (not counted) and queues it to go on, with its parameters
in its folder from its last checkpoint, when the sweep is run again (`_run_again`); then the sweep
ends. A trial whose run diverged (`TrainingStopped`) gets the value +inf; one whose sampled config
is invalid fails with the reason kept as the trial's `error` attribute; both count as finished.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config_loader import load_experiment, yaml_load
from ..errors import UsageError, first_line
from ..files.buckets import join
from ..files.disk import writable_folder
from ..logs import log
from ..train.callbacks import Callback

KINDS = ("float", "int", "categorical")

SEARCH_SPACE_FORMAT = """\
search-space file (YAML), one entry per dotted config key:

  training.learning_rate: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
  training.weight_decay:  {type: float, low: 0.0, high: 0.2, step: 0.05}
  model.n_layers:         {type: int, low: 2, high: 6}        # optional: step, log
  model.activation:       {type: categorical, choices: [gelu, swiglu]}
  model.dropout:          [0.0, 0.1]                          # a list: shorthand for categorical
  training.warmup_steps:  20                                  # a plain value: fixed for every trial

type is float, int or categorical; log (true: sample on a log scale, low > 0) and step (a grid)
cannot be combined. Each trial trains in {output-dir}/trial-NNNN; its objective is the best
validation loss (the data needs a validation split).
"""


class SweepInterrupted(KeyboardInterrupt):
    """A signal stopped a trial's run; the trial is recorded as failed (not counted) and the sweep stops."""


@dataclass
class SearchParam:
    name: str  # dotted config key, e.g. training.learning_rate
    kind: str  # float | int | categorical | fixed
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: list = field(default_factory=list)
    value: Any = None  # for fixed

    def suggest(self, trial):
        if self.kind == "float":
            return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high, log=self.log, step=self.step or 1)
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, self.choices)
        return self.value

    def example(self):
        return {"float": self.low, "int": self.low, "categorical": (self.choices or [None])[0]}.get(
            self.kind, self.value
        )

    def bounds(self) -> list:
        """The values a check before the sweep tries: every choice, a range's two ends, a fixed value."""
        return {"float": [self.low, self.high], "int": [self.low, self.high], "categorical": self.choices}.get(
            self.kind, [self.value]
        )


def parse_search_space(data: Any, source: str = "search space") -> list[SearchParam]:
    """Validate the search-space mapping (see the module docstring) into `SearchParam`s."""
    if not isinstance(data, dict) or not data:
        raise UsageError(
            f"{source} must be a mapping of dotted config keys to ranges, e.g. "
            "training.learning_rate: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}"
        )
    params = []
    for name, spec in data.items():
        where = f"{source}: {name}"
        if not isinstance(name, str) or len(name.split(".")) != 2 or not all(name.split(".")):
            raise UsageError(f"{where}: keys must be section.key (e.g. training.learning_rate)")
        if name in PER_TRIAL:
            raise UsageError(f"{where}: the sweep sets it for each trial (its own folder under --output-dir)")
        if isinstance(spec, list):
            spec = {"type": "categorical", "choices": spec}
        if not isinstance(spec, dict):
            params.append(SearchParam(name, "fixed", value=spec))
            continue
        unknown = set(spec) - {"type", "low", "high", "log", "step", "choices"}
        if unknown:
            raise UsageError(
                f"{where}: unknown field(s) {', '.join(sorted(unknown))}; use type, low, high, log, step, choices"
            )
        kind = spec.get("type") or ("categorical" if "choices" in spec else None)
        if kind not in KINDS:
            raise UsageError(f"{where}: type must be float, int or categorical, got {kind!r}")
        stray = sorted(set(spec) & ({"low", "high", "log", "step"} if kind == "categorical" else {"choices"}))
        if stray:
            takes = "choices" if kind == "categorical" else "low, high, log and step"
            raise UsageError(f"{where}: {', '.join(stray)} is not a field of {kind} (it takes {takes})")
        if kind == "categorical":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                raise UsageError(f"{where}: categorical needs a non-empty list of choices")
            if not all(c is None or isinstance(c, (bool, int, float, str)) for c in choices):
                raise UsageError(f"{where}: choices must be plain values (numbers, strings, true/false, null)")
            params.append(SearchParam(name, kind, choices=list(choices)))
            continue
        if "low" not in spec or "high" not in spec:
            raise UsageError(f"{where}: {kind} needs low and high")
        cast = float if kind == "float" else int
        try:
            low, high = cast(spec["low"]), cast(spec["high"])
            step = cast(spec["step"]) if spec.get("step") is not None else None
        except (TypeError, ValueError):
            raise UsageError(
                f"{where}: low, high and step must be {'numbers' if kind == 'float' else 'integers'}"
            ) from None
        if kind == "int" and any(
            isinstance(spec.get(k), float) and not float(spec[k]).is_integer() for k in ("low", "high", "step")
        ):
            raise UsageError(f"{where}: int ranges need integer low/high/step")
        log_scale = spec.get("log", False)
        if not isinstance(log_scale, bool):
            raise UsageError(f"{where}: log must be true or false, got {log_scale!r}")
        if low > high:
            raise UsageError(f"{where}: low ({low}) is above high ({high})")
        if log_scale and low <= 0:
            raise UsageError(f"{where}: a log range needs low > 0")
        if log_scale and step is not None:
            raise UsageError(f"{where}: log and step cannot be combined")
        if step is not None:
            _check_step(where, low, high, step)
        params.append(SearchParam(name, kind, low=low, high=high, log=log_scale, step=step))
    return params


def _check_step(where: str, low: float, high: float, step: float) -> None:
    """A grid's step: positive, and dividing the range, so that its top is a value trials can take
    (Optuna would otherwise move `high` down, or with a step past the range sample `low` alone)."""
    if step <= 0:
        raise UsageError(f"{where}: step must be above 0, got {step}")
    count = (high - low) / step
    if abs(count - round(count)) > 1e-9 * max(1.0, count):
        raise UsageError(
            f"{where}: step {step} does not divide the range from {low} to {high}; choose a step that does, or "
            "leave it out for a continuous range"
        )


# Set for each trial by the sweep (its own folder), so not searched.
PER_TRIAL = ("training.output_dir", "training.checkpoint_dir", "training.resume_from_checkpoint")


def load_search_space(path: str | Path) -> list[SearchParam]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"search space {path} not found")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except Exception as exc:
        raise UsageError(f"search space {path} could not be parsed: {first_line(exc, None)}") from None
    return parse_search_space(data, str(path))


def override(name: str, value) -> str:
    """A dotted override whose value reads back as the same YAML scalar (JSON is valid YAML)."""
    return f"{name}={json.dumps(value)}"


def _optuna():
    try:
        import optuna
    except ImportError:
        raise UsageError("sweep needs optuna: pip install 'llm-trainer[hpo]'") from None
    return optuna


class OptunaPruningCallback(Callback):
    """Reports each evaluation's val_loss to the trial. When the pruner says so, the run stops as an
    early-stopped run does, at the end of that step: its checkpoint saved, its summary row saying why (so
    `llm-trainer status` of the trial's folder shows it pruned, not interrupted); the sweep then records
    the trial as pruned (`pruned` holds the reason)."""

    def __init__(self, trial):
        self.trial = trial
        self.pruned: str | None = None

    def on_evaluate(self, trainer, metrics: dict) -> None:
        step = trainer.state.step
        self.trial.report(float(metrics["val_loss"]), step)
        if self.pruned is None and self.trial.should_prune():
            self.pruned = f"pruned by the sweep at step {step} (val_loss {metrics['val_loss']:.4f})"
            trainer.stop.request(self.pruned)


HEARTBEAT_S = 60  # how often a running trial records that its process is alive (Optuna's heartbeat)
STALE_AFTER_S = 180  # a running trial silent this long was killed: the next sweep marks it failed


def _beating(optuna, url: str):
    """The study's storage with Optuna's heartbeat. A trial whose process was killed (SIGKILL, the
    out-of-memory killer, a lost node) stops beating: the next sweep on the study marks it failed and
    runs it again, where it would otherwise show as running for ever. A parallel worker's trial beats
    all along, also while it prepares its data, so it is never taken for a dead one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url=url,
            heartbeat_interval=HEARTBEAT_S,
            grace_period=STALE_AFTER_S,
            heartbeat_stale_trial_callback=_said_stale,
        )


def _said_stale(study, trial) -> None:
    log(
        f"sweep: trial {trial.number} has not run for {STALE_AFTER_S} s (its process was killed): marked failed, "
        "to be resumed from its last checkpoint"
    )
    _run_again(study, trial)


def _run_again(study, trial) -> None:
    """Queue a trial an interruption ended (a signal, a killed process) to go on: the same parameters, in
    its folder, from its last checkpoint (`objective` reads `resumes`). The trial itself stays failed and
    uncounted; the queued one counts when it finishes."""
    study.enqueue_trial(
        trial.params, user_attrs={"resumes": trial.number, "output_dir": trial.user_attrs.get("output_dir")}
    )


def _finished(trial) -> bool:
    state = trial.state.name
    return state in ("COMPLETE", "PRUNED") or (state == "FAIL" and "error" in trial.user_attrs)


@dataclass
class SweepResult:
    study: Any
    root: Path
    storage: str
    ran: int  # trials run by this call

    @property
    def best(self):
        done = [
            t
            for t in self.study.trials
            if t.state.name == "COMPLETE" and t.value is not None and math.isfinite(t.value)
        ]
        return min(done, key=lambda t: t.value) if done else None


def check_search_space(config_path: str | Path, overrides, params: list[SearchParam]) -> None:
    """Wrong keys, types and values now, not in the middle of the sweep: each choice and each end of a
    range in a config of its own (the others at their first value). A refused one is named."""
    examples = [override(p.name, p.example()) for p in params]
    load_experiment(config_path, list(overrides))  # the command line's own overrides: said as the loader says them
    try:
        load_experiment(config_path, [*overrides, *examples])
    except UsageError as error:  # a wrong key or value of the search space's: named as its, not the command line's
        raise UsageError(f"search space: {first_line(error).removeprefix('command line: ')}") from None
    for i, param in enumerate(params):
        for value in param.bounds():
            try:
                load_experiment(
                    config_path, [*overrides, *examples[:i], override(param.name, value), *examples[i + 1 :]]
                )
            except UsageError as error:
                raise UsageError(f"search space: {param.name}={value!r} is refused ({first_line(error)})") from None


def run_sweep(
    config_path: str | Path,
    search_space: str | Path | list[SearchParam],
    n_trials: int,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    output_dir: str | Path | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    pruner: Any = "median",
    seed: int | None = None,
    callbacks: list | tuple = (),
) -> SweepResult:
    """Run (or resume) the study until it holds `n_trials` finished trials; see the module docstring.

    `pruner`: "median", "none", or an `optuna.pruners.BasePruner`. `callbacks`: extra trainer
    callbacks for every trial's run (after the pruning callback).
    """
    optuna = _optuna()
    from ..api import train
    from ..errors import TrainingStopped

    if n_trials < 1:
        raise UsageError(f"--trials must be at least 1, got {n_trials}")
    params = search_space if isinstance(search_space, list) else load_search_space(search_space)
    base = load_experiment(config_path, list(overrides))
    check_search_space(config_path, overrides, params)
    root = Path(output_dir) if output_dir is not None else base.training.local_output_dir / "sweep"
    if (root / "metrics.jsonl").exists():
        raise UsageError(
            f"--output-dir {root} holds a training run (metrics.jsonl); give the sweep a folder of its own"
        )
    writable_folder(root, "--output-dir")
    if not any(p.name.startswith("data.") for p in params):
        _check_data(base)  # the data every trial trains on, prepared once, before any trial
    storage = storage or f"sqlite:///{root.resolve() / 'study.db'}"
    default_name = Path(config_path).stem
    study_name = study_name or default_name
    if pruner == "median":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    elif pruner in (None, "none"):
        pruner = optuna.pruners.NopPruner()
    elif isinstance(pruner, str):
        raise UsageError(f"pruner must be median or none, got {pruner!r}")

    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is said by our own line, not a traceback
    try:
        try:
            study = optuna.create_study(
                study_name=study_name,
                storage=_beating(optuna, storage),
                direction="minimize",
                pruner=pruner,
                load_if_exists=True,
            )
        except Exception as exc:  # SQLAlchemy's: an unknown scheme, a malformed URL, a database it cannot open
            raise UsageError(
                f"--storage {storage} cannot hold the study ({type(exc).__name__}: {first_line(exc)}); pass an SQLAlchemy "
                "URL such as sqlite:///path/to/study.db in a folder that exists"
            ) from None
        _check_same_experiment(study, study_name, storage, params, base)
        prefix = _trial_prefix(study, storage, default_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        done = sum(_finished(t) for t in study.trials)
        todo = max(0, n_trials - done)
        if todo and not any(t.state.name == "WAITING" for t in study.trials):  # the next trial is a new one
            _check_unused(root / f"{prefix}-{len(study.trials):04d}")
        # A fresh seed per invocation: a resumed study must not replay the first invocation's samples.
        sampler_seed = (base.training.seed if seed is None else seed) + len(study.trials)
        study.sampler = optuna.samplers.TPESampler(seed=sampler_seed, n_startup_trials=max(2, min(10, n_trials // 3)))
        if done:
            log(f"sweep: study {study_name!r} in {storage} has {done} finished trial(s); running {todo} more")
        else:
            log(f"sweep: study {study_name!r} in {storage}; running {todo} trial(s)")

        errors: list[str] = []

        def objective(trial):
            sampled = {p.name: p.suggest(trial) for p in params}
            resumes = trial.user_attrs.get("resumes")  # an interrupted trial's parameters, going on in its folder
            trial_dir = (
                Path(trial.user_attrs["output_dir"]) if resumes is not None else root / f"{prefix}-{trial.number:04d}"
            )
            if resumes is None:
                _check_unused(trial_dir)
            trial_overrides = [override(k, v) for k, v in sampled.items()]
            trial.set_user_attr("overrides", trial_overrides)
            trial.set_user_attr("output_dir", str(trial_dir))
            searched = {k: v for k, v in sampled.items() if any(p.name == k and p.kind != "fixed" for p in params)}
            if resumes is not None:
                log(f"sweep: trial {trial.number} resumes trial {resumes} from its last checkpoint in {trial_dir}")
            log(f"sweep: trial {trial.number} " + " ".join(override(k, v) for k, v in searched.items()))
            checkpoints = base.training.checkpoint_dir  # set in the config: each trial's in a folder of its own there
            try:
                experiment = load_experiment(
                    config_path,
                    [
                        *overrides,
                        *trial_overrides,
                        override("training.output_dir", str(trial_dir)),
                        override("training.checkpoint_dir", checkpoints and join(checkpoints, trial_dir.name)),
                        f"training.resume_from_checkpoint={'latest' if resumes is not None else 'null'}",
                    ],
                )
            except UsageError as exc:  # a sampled combination the config rejects (e.g. d_model % n_heads)
                trial.set_user_attr("error", str(exc))
                errors.append(str(exc))
                log(f"sweep: trial {trial.number} failed: {exc}")
                return float("nan")
            pruning = OptunaPruningCallback(trial)
            try:
                summary = train(experiment, callbacks=[pruning, *callbacks])
            except TrainingStopped as exc:  # diverged: the worst possible value, and the sweep goes on
                trial.set_user_attr("error", str(exc))
                log(f"sweep: trial {trial.number} diverged")
                return float("inf")
            stopped_by = summary.get("stopped_by_signal")
            if stopped_by is not None:  # SIGINT/SIGTERM: the run saved and stopped; so does the sweep
                _run_again(trial.study, trial)
                raise SweepInterrupted(
                    f"sweep interrupted during trial {trial.number} (received {stopped_by}); rerun the same "
                    "command to resume it from its last checkpoint"
                )
            if pruning.pruned is not None:
                raise optuna.TrialPruned(pruning.pruned)
            value = summary.get("best_val_loss")
            if value is None:
                value = summary.get("val_loss")
            if value is None:
                raise UsageError("sweep needs validation data: set data.validation_split (e.g. 0.1)")
            trial.set_user_attr(
                "summary",
                {k: summary.get(k) for k in ("step", "val_loss", "perplexity", "best_val_loss", "train_runtime_s")},
            )
            log(f"sweep: trial {trial.number} val_loss {value:.4f}")
            return float(value)

        def enough(study, trial) -> None:  # other workers on the study count too
            if sum(_finished(t) for t in study.trials) >= n_trials:
                study.stop()

        if todo:
            study.optimize(objective, n_trials=todo, catch=(), callbacks=[enough])
        ran = todo
        if todo and len(errors) == todo:
            raise UsageError(f"every trial failed on its config; the last: {errors[-1]}")
    finally:
        optuna.logging.set_verbosity(previous)
    return SweepResult(study=study, root=root, storage=storage, ran=ran)


EXPERIMENT_ATTR = "llm_trainer_experiment"  # the study's user attribute: what its trials search, from what
PREFIX_ATTR = "llm_trainer_trial_folders"  # ... and the names of its trials' folders


def _trial_prefix(study, storage: str, default_name: str) -> str:
    """The start of the study's trial folders' names, chosen when it starts and kept: `trial` for the
    first study in its storage, `{study name}-trial` for any other, so that two studies beside each
    other (another config's, one with --study-name) never share a folder."""
    recorded = study.user_attrs.get(PREFIX_ATTR)
    if recorded is not None:
        return recorded
    if study.trials:  # a study of an earlier version: the rule it ran with
        return "trial" if study.study_name == default_name else f"{study.study_name}-trial"
    import optuna

    others = [name for name in optuna.get_all_study_names(storage) if name != study.study_name]
    prefix = f"{study.study_name}-trial" if others else "trial"
    study.set_user_attr(PREFIX_ATTR, prefix)
    return prefix


def _check_unused(trial_dir: Path) -> None:
    """A new trial's folder must not hold a run already: one its study does not know (the study removed
    and started again, another program's) would be refused, or resumed, as the trial's own."""
    if trial_dir.is_dir() and any(trial_dir.iterdir()):
        raise UsageError(
            f"{trial_dir} holds a run this study did not start (a study whose study.db was removed, or another "
            "program's); give the sweep another --output-dir, or move that folder away"
        )


def _check_data(base) -> None:
    """Prepare the trials' data now (each trial then reuses it): a missing file or an empty corpus is
    said before the study starts, and so is data without the validation split the objective needs."""
    from ..data.prepare import prepare_data

    prepared = prepare_data(base.data)
    if not prepared.manifest["splits"].get("val", {}).get("tokens"):
        raise UsageError("sweep needs validation data: set data.validation_split (e.g. 0.1)")


def _check_same_experiment(study, name: str, storage: str, params: list[SearchParam], base) -> None:
    """A study records its search space and base config when it starts; resuming it with others would
    put trials of two experiments in one table and pick its best across them: refused in one line."""
    experiment = json.loads(
        json.dumps(
            {
                "search_space": [asdict(p) for p in params],
                "config": {**base.to_dict(), "training": {**base.to_dict()["training"], "output_dir": None}},
            },
            sort_keys=True,
            default=str,
        )
    )
    recorded = study.user_attrs.get(EXPERIMENT_ATTR)
    if recorded is None:
        if study.trials:  # a study of an earlier version, or of another program: its trials are kept as they are
            return
        study.set_user_attr(EXPERIMENT_ATTR, experiment)
        return
    changed = [what for what in ("search_space", "config") if recorded.get(what) != experiment[what]]
    if changed:
        what = " and ".join("search space" if c == "search_space" else "base config" for c in changed)
        unfinished = not any(t.state.name in ("COMPLETE", "PRUNED") for t in study.trials)
        start_over = (
            f" (none of its trials completed: `optuna delete-study --study-name {name} --storage {storage}` "
            "removes it, to start over)"
            if unfinished
            else ""
        )
        raise UsageError(
            f"the study {name!r} in {storage} was run with another {what}; resume it with the same ones, or start "
            f"a study of its own with --study-name NAME or another --output-dir{start_over}"
        )


def results_table(study, params: list[str] | None = None) -> str:
    """The study's trials as a text table, best first: each trial's objective, the best validation loss
    of its run (a pruned trial's: the best it reported before it was pruned)."""
    trials = list(study.trials)
    names = params or sorted({k for t in trials for k in t.params})
    header = ["trial", "state", "best_val_loss", "minutes"] + names
    rows = []

    def key(t):
        value = (
            t.value if t.value is not None and not (isinstance(t.value, float) and math.isnan(t.value)) else math.inf
        )
        order = {"COMPLETE": 0, "PRUNED": 1}.get(t.state.name, 2)
        return (order, value, t.number)

    for t in sorted(trials, key=key):
        duration = (
            (t.datetime_complete - t.datetime_start).total_seconds() / 60
            if t.datetime_complete and t.datetime_start
            else None
        )
        value = t.value
        if value is None and t.intermediate_values:  # pruned
            value = min(t.intermediate_values.values())
        rows.append(
            [
                str(t.number),
                t.state.name.lower(),
                "-" if value is None else f"{value:.4f}",
                "-" if duration is None else f"{duration:.2f}",
                *[_short(t.params.get(n, "-")) for n in names],
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def best_command(result: SweepResult, config: str, overrides: list[str] | tuple[str, ...] = ()) -> str | None:
    best = result.best
    if best is None:
        return None
    parts = [
        "llm-trainer",
        "train",
        "--config",
        config,
        *overrides,
        *[o for o in best.user_attrs.get("overrides", []) if not o.startswith("training.output_dir=")],
    ]
    return " ".join(_quote(p) for p in parts)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
