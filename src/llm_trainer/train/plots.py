"""PNG figures of runs from their metrics.jsonl: loss, perplexity and learning rate against optimizer
steps and against tokens seen, several runs overlaid.

Headless: figures are drawn with matplotlib's Agg canvas directly (pyplot and the global backend
are never touched), so this works on servers and inside other programs.

    plot_runs(["runs/a", "runs/b"], "plots/")   ->  {"loss_vs_steps": Path("plots/loss_vs_steps.png"), ...}

Per run, the loss figures hold a training line and (when the run evaluated) a validation line, two
when `training.eval_max_batches` made some evaluations read part of the split; the perplexity figures
exp(training loss) and the validation perplexity; the learning-rate figures one
line. Validation points are placed on the token axis through the training rows' (step, tokens_seen).
A resumed run's metrics.jsonl repeats steps; the last row logged for a step wins.

A finished run draws its own (`PlotsAtEnd`) unless LLM_TRAINER_PLOTS=0: importing matplotlib and drawing
six figures is a fixed cost at the end of every run, which many short runs (a sweep's trials, a test
suite) need not pay; `llm-trainer plot RUN_DIR` draws them later from metrics.jsonl alone.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..files.atomic import write_bytes
from ..files.disk import writable_folder
from ..logs import log, warn
from .callbacks import Callback
from .rows import read_rows_of, row_kind

FIGURES = ("loss", "perplexity", "lr")
PLOTS_AT_END = "LLM_TRAINER_PLOTS"  # "0": a finished run draws no plots
AXES = {"steps": ("step", "optimizer step"), "tokens": ("tokens_seen", "tokens seen")}


@dataclass
class RunSeries:
    label: str
    train: dict[int, dict] = field(default_factory=dict)  # step -> row
    eval: dict[int, dict] = field(default_factory=dict)

    def tokens_at(self, steps: list[int]) -> list[float]:
        """tokens_seen at each step, linearly interpolated between logged training rows (0 at step 0)."""
        known = sorted((s, r["tokens_seen"]) for s, r in self.train.items() if "tokens_seen" in r)
        known = [(0, 0)] + [k for k in known if k[0] > 0]
        out = []
        for step in steps:
            lo = max((k for k in known if k[0] <= step), default=known[0])
            hi = min((k for k in known if k[0] >= step), default=None)
            if hi is None:  # past the last training row: extrapolate at the last rate
                rate = lo[1] / lo[0] if lo[0] else 0.0
                out.append(lo[1] + rate * (step - lo[0]))
            elif hi[0] == lo[0]:
                out.append(float(lo[1]))
            else:
                out.append(lo[1] + (hi[1] - lo[1]) * (step - lo[0]) / (hi[0] - lo[0]))
        return out


def read_run(run_dir: str | Path, label: str | None = None) -> RunSeries:
    """The training and evaluation rows of a run folder (or a metrics.jsonl file)."""
    path = Path(run_dir)
    file = path if path.is_file() else path / "metrics.jsonl"
    if not path.exists():
        raise UsageError(f"{path} not found; pass a run's training.output_dir (or its metrics.jsonl)")
    if not file.is_file():
        raise UsageError(f"{path} has no metrics.jsonl: it holds no run; pass a run's training.output_dir")
    series = RunSeries(label or (path.parent.name if path.is_file() else path.resolve().name))
    for row in read_rows_of(file):
        if not isinstance(row.get("step"), int):
            continue
        kind = row_kind(row)
        if kind == "eval":
            series.eval[int(row["step"])] = row
        elif kind == "train":
            series.train[int(row["step"])] = row
    return series


def _number(value) -> float:
    try:
        return float(value)  # jsonl stores non-finite floats as "nan"/"inf" strings
    except (TypeError, ValueError):
        return math.nan


def _lines(run: RunSeries, figure: str, axis: str) -> list[tuple[str, list[float], list[float], str]]:
    """(label, xs, ys, style) for one run in one figure."""
    key = AXES[axis][0]
    train_steps = sorted(run.train)
    eval_steps = sorted(run.eval)

    def xs(steps, rows):
        if key == "step":
            return [float(s) for s in steps]
        if rows is run.train:
            return [_number(rows[s].get("tokens_seen", math.nan)) for s in steps]
        return run.tokens_at(steps)

    out = []
    if figure == "lr":
        if train_steps:
            out.append(
                (run.label, xs(train_steps, run.train), [_number(run.train[s].get("lr")) for s in train_steps], "-")
            )
        return out
    if train_steps:
        losses = [_number(run.train[s].get("loss")) for s in train_steps]
        ys = losses if figure == "loss" else [math.exp(min(v, 700.0)) if math.isfinite(v) else v for v in losses]
        out.append((f"{run.label} train", xs(train_steps, run.train), ys, "-"))
    field_name = "val_loss" if figure == "loss" else "perplexity"
    part = [s for s in eval_steps if _part_of_the_split(run.eval[s])]
    for steps, label, style in (
        ([s for s in eval_steps if s not in part], "validation" if not part else "validation, whole split", "o--"),
        (part, "validation, first batches (training.eval_max_batches)", "x:"),
    ):
        if steps:
            ys = [_number(run.eval[s].get(field_name)) for s in steps]
            out.append((f"{run.label} {label}", xs(steps, run.eval), ys, style))
    return out


def _part_of_the_split(row: dict) -> bool:
    """An evaluation over the first `training.eval_max_batches` batches only: a loss of other rows than the
    whole split's, drawn apart from those so that no line joins the two."""
    read, held = row.get("batches"), row.get("batches_total")
    return isinstance(read, int) and isinstance(held, int) and read < held


def make_figures(runs: list[RunSeries]) -> dict:
    """{"loss_vs_steps": Figure, ...}: matplotlib Figures (Agg canvas), one per quantity and x axis."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("plots need matplotlib: pip install 'llm-trainer[tracking]'") from None
    titles = {"loss": "loss (nats/token)", "perplexity": "perplexity", "lr": "learning rate"}
    figures = {}
    for figure in FIGURES:
        for axis, (_, xlabel) in AXES.items():
            fig = Figure(figsize=(8, 5), dpi=100)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
            for i, run in enumerate(runs):
                color = f"C{i % 10}"
                for label, xs, ys, style in _lines(run, figure, axis):
                    ax.plot(xs, ys, style, label=label, color=color, markersize=3)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(titles[figure])
            ax.set_title(f"{titles[figure]} vs {xlabel}")
            if figure == "perplexity":
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=8)
            fig.subplots_adjust(
                left=0.11, right=0.97, top=0.92, bottom=0.11
            )  # fixed margins: tight_layout costs 80 ms a figure
            figures[f"{figure}_vs_{axis}"] = fig
    return figures


def _matplotlib_installed() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_runs(
    run_dirs, output_dir, *, labels: list[str] | None = None, strict: bool = False, replace: bool = True
) -> dict[str, Path]:
    """Write loss/perplexity/lr vs steps/tokens PNGs of the runs into `output_dir`; returns name -> path.

    With `strict=False` (the default, what the trainer uses at the end of a run) nothing is raised:
    a problem (no matplotlib, no metrics) is logged as a warning and {} returned. `strict=True`
    raises `UsageError` instead (the `plot` command). `replace=False`: files of the same names in
    `output_dir` (a folder of the user's) are refused before anything is written.
    """
    try:
        run_dirs = [Path(d) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
        if not run_dirs:
            raise UsageError("no run folders to plot")
        if labels is not None and len(labels) != len(run_dirs):
            raise UsageError(f"{len(labels)} labels for {len(run_dirs)} runs")
        if not strict and not _matplotlib_installed():  # an optional extra: said, not warned
            log(
                "plots: none drawn, matplotlib is not installed (pip install 'llm-trainer[tracking]', then `llm-trainer plot RUN_DIR`)"
            )
            return {}
        runs = [read_run(d, labels[i] if labels else None) for i, d in enumerate(run_dirs)]
        empty = [str(d) for d, run in zip(run_dirs, runs) if not run.train and not run.eval]
        if empty:  # no figure to draw but blank axes
            raise UsageError(
                f"{', '.join(empty)}: metrics.jsonl holds no training or evaluation rows yet; nothing to plot"
            )
        _disambiguate(runs, run_dirs)
        figures = make_figures(runs)  # before the folder: a run that cannot be plotted leaves no empty plots/
        out = writable_folder(Path(output_dir), "the plot folder (--output)")
        there = [f"{name}.png" for name in figures if (out / f"{name}.png").exists()]
        if there and not replace:
            raise UsageError(
                f"--output {out} holds {', '.join(there)} already; choose another folder or pass --overwrite to "
                "replace them"
            )
        written = {}
        for name, fig in figures.items():
            path = out / f"{name}.png"
            _save_png(fig, path)
            written[name] = path
        return written
    except Exception as exc:
        if strict:
            raise
        warn(f"plots not written: {exc}")
        return {}


class PlotsAtEnd(Callback):
    """PNG plots of the run's metrics.jsonl into `{output_dir}/plots` when training ends (rank 0); a
    plot never fails a finished run (`plot_runs` warns instead of raising)."""

    def __init__(self, output: Path):
        self.output = output

    def on_train_end(self, trainer, metrics: dict) -> None:
        if trainer.dist.is_main and os.environ.get(PLOTS_AT_END, "1") != "0":
            plot_runs([self.output], self.output / "plots")


def plot_lr_finder(lrs, losses, smoothed, suggested: float | None, path) -> Path:
    """Loss (raw and smoothed) against the learning rate on a log axis, the suggestion marked."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("the lr-find plot needs matplotlib: pip install 'llm-trainer[tracking]'") from None
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(lrs, losses, color="C0", alpha=0.35, label="loss")
    ax.plot(lrs, smoothed, color="C0", label="smoothed loss")
    if suggested is not None:
        ax.axvline(suggested, color="C3", linestyle="--", label=f"suggested {suggested:.2e}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title("learning-rate range test")
    finite = [v for v in smoothed if math.isfinite(v)]
    raw = [v for v in losses if math.isfinite(v)]
    if finite:  # keep the divergence spike from flattening the interesting part
        low = min(finite + raw)
        high = max(v for v in finite[: max(1, len(finite) // 10)] + [min(finite)])  # where the curve started
        high = max(high, min(max(finite), 2 * min(finite) if min(finite) > 0 else max(finite)))
        pad = 0.05 * max(high - low, 1e-6)
        ax.set_ylim(low - pad, high + 4 * pad)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = check_png_path(path, "the lr-find plot")
    _save_png(fig, path)
    return path


def check_png_path(path, what: str) -> Path:
    """`path` for a PNG file: not a folder, in a folder that exists (created) and can be written; a
    one-line error naming `what` otherwise."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path} is a folder; name the PNG file to write")
    writable_folder(path.absolute().parent, f"the folder of {what}")
    return path


def _save_png(fig, path: Path) -> None:
    """The figure as a PNG file, replaced atomically (a symlink planted at `path` is replaced, not followed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes(path, buffer.getvalue())


def _disambiguate(runs: list[RunSeries], dirs: list[Path]) -> None:
    """Runs whose folders share a name get their parent folder's name too."""
    names = [r.label for r in runs]
    for run, d in zip(runs, dirs):
        if names.count(run.label) > 1:
            run.label = f"{d.resolve().parent.name}/{run.label}"
