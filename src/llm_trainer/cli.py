"""`llm-trainer prepare | train | eval | generate | export | consolidate | plot | status | lr-find | sweep |
registry | estimate | quickstart`: a thin layer over the Python API.

A user error prints one line, `error: ...`, and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from .errors import UsageError, first_line
from .launcher import launched

PRESETS = Path(__file__).parent / "configs"
CHECKPOINT = (
    "a checkpoint, best_model or run folder (a run's newest checkpoint), or checkpoints/latest; "
    "or the URL of one (s3://..., downloaded first)"
)
START_OVER = (
    "start over in a training.output_dir that holds a run: remove what a run writes there first "
    "(metrics.jsonl, checkpoints/, config.yaml, tokenizer.json, plots/, profile/, tensorboard/; other files are kept)"
)


def resolve_config_path(name: str) -> Path:
    """A path, or the name of a shipped preset (`tiny`, `small`, `gpt2-small`, ...). Never a URL: a run's
    config.yaml in a store is copied by the user, then read as a local file."""
    from .files.buckets import Location

    Location(name).refuse_url(f"config {name} is a URL; --config takes a local file: copy it here first")
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (PRESETS / name, PRESETS / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "not found"
    raise UsageError(f"config {name} {what}; pass a YAML/JSON file or a preset ({presets})")


def _experiment(args):
    from .config_loader import load_experiment

    return load_experiment(resolve_config_path(args.config), args.overrides)


def cmd_prepare(args) -> int:
    from .data.prepare import prepare_data

    flags = {"executor": args.executor, "executor_tasks": args.tasks, "executor_workers": args.workers}
    args.overrides = [*args.overrides, *(f"data.{k}={v}" for k, v in flags.items() if v is not None)]
    data = _experiment(args).data
    if data.executor is None and (args.tasks is not None or args.workers is not None):
        raise UsageError("--tasks and --workers need an executor: add --executor local (or slurm, ray)")
    try:
        prepared = prepare_data(data)
    except RuntimeError as exc:
        from .data.prepare.cluster import TaskFailed

        if not isinstance(exc, TaskFailed):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "directory": str(prepared.directory),
                **{k: prepared.manifest[k] for k in ("splits", "documents_out", "removed", "vocab_size")},
                "skipped_inputs": prepared.manifest.get("skipped_inputs", {}),
            }
        )
    )
    return 0


def _run_options(experiment, args):
    """The experiment with the training options given as flags (--resume_from_checkpoint, --overwrite)."""
    from dataclasses import replace

    changes = {}
    if getattr(args, "resume_from_checkpoint", None):
        changes["resume_from_checkpoint"] = args.resume_from_checkpoint
    if getattr(args, "overwrite", False):
        changes["overwrite_output_dir"] = True
    return replace(experiment, training=replace(experiment.training, **changes)) if changes else experiment


def cmd_train(args) -> int:
    from .api import train

    return _exit_status(train(_run_options(_experiment(args), args)))


def _exit_status(summary: dict) -> int:
    """0 for a run that finished; the shell's 128 + the signal's number for one a signal stopped (its
    checkpoint saved), 1 when that was a signal another rank received."""
    stopped_by = summary.get("stopped_by_signal")
    if stopped_by is None:
        return 0
    known = signal.Signals.__members__.get(stopped_by)
    return 128 + known.value if known is not None else 1


def _check_eval_options(args) -> None:
    """`eval` is one of two things: the loss on the run's validation split or on --data, or benchmark
    scores (--tasks); an option of the other one is refused rather than ignored."""
    if args.tasks is not None:
        given = [name for name, value in (("--data", args.data), ("--text-column", args.text_column)) if value]
        if given:
            raise UsageError(
                f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with the loss on a file, and --tasks "
                "runs benchmarks; pass one of them (two commands for both)"
            )
        return
    given = [
        name
        for name, value in (
            ("--num_fewshot", args.num_fewshot),
            ("--limit", args.limit),
            ("--output", args.output),
            ("--trust_task_code", args.trust_task_code or None),
        )
        if value is not None
    ]
    if given:
        raise UsageError(f"{', '.join(given)} set how benchmarks run (--tasks), and no --tasks was given")
    if args.text_column and not args.data:
        raise UsageError("--text-column names the field of --data's records, and no --data was given")


def cmd_eval(args) -> int:
    from .api import eval_loader, load_for_inference
    from .config_loader import saved_batch_size
    from .train.evaluate import evaluate
    from .train.metrics import coverage
    from .train.step import autocast

    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    _check_eval_options(args)
    if args.tasks is not None:
        return _eval_tasks(args)
    model, tokenizer, experiment = load_for_inference(args.checkpoint)
    batch_size = args.batch_size or saved_batch_size(experiment) or 8  # as in training
    precision = _eval_precision(args.dtype, experiment, next(model.parameters()).device)
    loader = eval_loader(
        model,
        tokenizer,
        experiment,
        batch_size=batch_size,
        data=args.data,
        text_column=args.text_column,
        checkpoint=args.checkpoint,
    )
    metrics = evaluate(
        model,
        loader,
        autocast=autocast(next(model.parameters()).device, precision),
        progress=True,
        sources=loader.source_labels,
    )
    by_source = metrics.get("source_losses", {})
    if args.json:
        print(
            json.dumps(
                {
                    "loss": metrics["val_loss"],
                    "perplexity": metrics["perplexity"],
                    "tokens": metrics["tokens"],
                    "batches": metrics["batches"],
                    **({"sources": by_source} if by_source else {}),
                }
            )
        )
    else:  # everything, where training's evaluations may cover only the first training.eval_max_batches
        data = args.data or "the run's validation split"
        print(
            f"loss {metrics['val_loss']:.4f}  perplexity {metrics['perplexity']:.3f}  tokens {metrics['tokens']:,}  "
            f"({coverage(metrics)} of {data})"
        )
        for name, loss in by_source.items():
            print(f"  {name}: loss {loss:.4f}")
    return 0


def _eval_precision(asked: str, experiment: dict, device):
    """The autocast dtype `eval --dtype` scores in (None: float32): `run`, the one the checkpoint's run
    trained and evaluated with on this device, said on the console when it is not float32."""
    import torch

    from .logs import log
    from .resolve import recorded_amp_dtype

    if asked != "run":
        return None if asked == "float32" else getattr(torch, asked)
    precision = recorded_amp_dtype(experiment.get("training"), device)
    if precision is not None:
        name = str(precision).removeprefix("torch.")
        log(f"eval: scoring in {name} autocast, as the run trained on this device (--dtype float32 for float32)")
    return precision


def _eval_tasks(args) -> int:
    """`eval --tasks`: lm-eval's results for the checkpoint (JSON to --output), its table on the console."""
    from .api import load_for_inference
    from .downstream.run import check_limit, check_output, evaluate_tasks, scores, table, write_results
    from .downstream.tasks import load_tasks, split_tasks
    from .train.step import autocast

    check_limit(args.limit)
    if args.output:
        check_output(args.output, args.overwrite)
    trust = args.trust_task_code
    # a wrong task name, a task file's code not trusted, a task that cannot run: said before the model loads
    load_tasks(split_tasks(args.tasks), trust_code=trust, num_fewshot=args.num_fewshot)
    model, tokenizer, experiment = load_for_inference(args.checkpoint)
    device = next(model.parameters()).device
    precision = _eval_precision(args.dtype, experiment, device)
    results = evaluate_tasks(
        model,
        tokenizer,
        args.tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size or 16,
        autocast=lambda: autocast(device, precision),
        trust_task_code=trust,
    )
    print(json.dumps(scores(results)) if args.json else table(results))  # shown even if --output fails
    if args.output:
        print(f"results in {write_results(results, args.output, args.overwrite)}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from .api import load_for_inference
    from .generate import check_sampling, generate, without_cut_character
    from .tokenizer import warn_unseen

    check_sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    from .data.text.clean import cleaner_of_run

    given = args.prompt or ""
    args.prompt = given.encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # argv's bytes, as UTF-8
    if args.prompt != given:
        from .logs import warn

        warn("--prompt holds bytes that are not UTF-8 text; they read as the replacement character \ufffd")
    model, tokenizer, experiment = load_for_inference(args.checkpoint)
    # the prompt's characters as the training text's were (Unicode form, newlines, control characters)
    text = cleaner_of_run(experiment).characters(args.prompt) if args.prompt else ""
    warn_unseen(tokenizer, text, "--prompt")
    prompt = tokenizer.encode(text) if text else []
    new = generate(
        model,
        prompt or [tokenizer.eot_id],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=tokenizer.eot_id,
        vocab_size=tokenizer.vocab_size,
    )
    text = without_cut_character(tokenizer, new) if len(new) == args.max_new_tokens else tokenizer.decode(new)
    print(args.prompt + text)
    return 0


def _quiet_transformers() -> None:
    """transformers, imported for a one-shot command, without what only clutters its output: the
    accelerator guess of DeepSpeed (which transformers imports when it is installed) on a machine
    without CUDA, the progress bar of writing one small weight file, and torchao's import (transformers'
    quantizers import it when it is installed), which warns of each kernel library this machine cannot
    load and of its deprecated pytree registrations; none of them is used by these commands."""
    import logging
    import os

    import torch

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # said, not guessed: DeepSpeed then warns of nothing
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def cmd_export(args) -> int:
    if args.format == "gguf":
        return _export_gguf(args)
    if args.dtype is not None:
        raise UsageError("--dtype sets a GGUF file's weights; a transformers export keeps float32 (use --format gguf)")
    if str(args.output).lower().endswith(".gguf"):
        raise UsageError(
            f"--output {args.output} is named as a GGUF file: pass --format gguf for one (a transformers export, "
            "the default, is a folder)"
        )
    try:
        _quiet_transformers()
        from .hf.interop import export_to_hf
    except ImportError:
        raise UsageError("export needs transformers: pip install 'llm-trainer[hf]'") from None
    from .api import local_checkpoint
    from .checkpoint.reading import held_checkpoint

    with held_checkpoint(local_checkpoint(args.checkpoint)) as path:  # a URL: its local copy
        if path is None:
            raise UsageError(f"{args.checkpoint} holds no checkpoint to export")
        return _export_hf(path, args, export_to_hf)


def _export_hf(path: Path, args, export_to_hf) -> int:
    """`export` of the checkpoint folder `path`, held while it is read."""
    from .api import load_for_inference

    # The model as load_for_inference gives it (checksums verified, an FSDP checkpoint's shards gathered),
    # written as a model folder for export_to_hf; the tokenizer file is the checkpoint's own, checked there.
    model, _, experiment = load_for_inference(path)
    import tempfile

    from .checkpoint.model_folder import save_model_folder
    from .checkpoint.publish import check_remote_target, check_target, publish_remote
    from .data.text.clean import cleaner_of_run
    from .files import buckets

    target = buckets.Location(args.output)
    if target.url:  # written locally, then uploaded, config.json last
        check_remote_target(target.url, args.overwrite)
    else:
        check_target(Path(args.output), path, args.overwrite)  # against the checkpoint, not the temporary folder
    staged_name = str(args.output).rstrip("/").rsplit("/", 1)[-1] or "export"  # the model card's name: the target's
    with tempfile.TemporaryDirectory(prefix="export-") as folder, target.staged(staged_name) as written:
        save_model_folder(model, folder)
        out = export_to_hf(
            Path(folder),
            written,
            tokenizer_file=path / "tokenizer.json",
            overwrite=args.overwrite,
            text_cleaning=cleaner_of_run(experiment).described(),
        )
        if target.url:
            publish_remote(Path(out), target.url, marker="config.json")
            out = target.url
    print(f"exported to {out}")
    return 0


def _export_gguf(args) -> int:
    """`export --format gguf`: the checkpoint's model and tokenizer as one GGUF file (hf/gguf.py)."""
    from .api import local_checkpoint
    from .checkpoint.reading import held_checkpoint
    from .hf.gguf import check_output, require_gguf

    require_gguf()
    check_output(args.output, args.overwrite)  # before the checkpoint is read
    with held_checkpoint(local_checkpoint(args.checkpoint)) as path:
        if path is None:
            raise UsageError(f"{args.checkpoint} holds no checkpoint to export")
        return _export_gguf_of(path, args)


def _export_gguf_of(path: Path, args) -> int:
    """`export --format gguf` of the checkpoint folder `path`, held while it is read."""
    from .api import load_for_inference
    from .hf.gguf import export_to_gguf, llama_cpp_pre, read_tokenizer_json

    llama_cpp_pre(read_tokenizer_json(path / "tokenizer.json")[1])  # one llama.cpp cannot read: before the weights
    model, _, _ = load_for_inference(path)
    import tempfile

    from .checkpoint.model_folder import save_model_folder

    with tempfile.TemporaryDirectory(prefix="export-") as folder:
        save_model_folder(model, folder)
        out = export_to_gguf(
            Path(folder),
            args.output,
            tokenizer_file=path / "tokenizer.json",
            dtype=args.dtype or "f32",
            overwrite=args.overwrite,
        )
    print(f"exported to {out}")
    return 0


def cmd_consolidate(args) -> int:
    """A sharded (FSDP) checkpoint -> one standalone model folder (safetensors, config, tokenizer)."""
    from .api import load_for_inference
    from .checkpoint.durable import record_files
    from .checkpoint.layout import CONSOLIDATED_KIND
    from .checkpoint.model_folder import save_model_folder
    from .checkpoint.publish import check_target, publish

    check_target(Path(args.output), Path(args.checkpoint), args.overwrite)
    model, tokenizer, experiment = load_for_inference(args.checkpoint)

    def build(folder: Path) -> None:  # best_model's files: the run's config (its cleaning) and checksums with them
        save_model_folder(model, folder)
        tokenizer.save(folder)
        record_files(folder, {"kind": CONSOLIDATED_KIND, "config": experiment, "metrics": {}})

    publish(Path(args.output), build, source=Path(args.checkpoint), overwrite=args.overwrite)
    print(f"consolidated {args.checkpoint} into {args.output}")
    return 0


def cmd_quickstart(args) -> int:
    """Prepare the built-in corpus, train the quickstart preset on CPU, evaluate, print a sample."""
    from .api import train
    from .config_loader import load_experiment

    experiment = _run_options(load_experiment(PRESETS / "quickstart.yaml", args.overrides), args)
    summary = train(experiment)
    if summary.get("stopped_by_signal") is not None:  # stopped (and saved) when asked: nothing more runs
        return _exit_status(summary)
    best = experiment.training.resolved_checkpoint_dir / "best_model"
    folder = best if best.is_dir() else Path(summary["checkpoint"])
    print(
        f"\nvalidation: loss {summary.get('val_loss', float('nan')):.4f}, perplexity {summary.get('perplexity', float('nan')):.2f}"
    )
    # the commands' own parser gives their arguments, defaults included, as typed on the command line
    gen = build_parser().parse_args(
        ["generate", "--checkpoint", str(folder), "--prompt", "def ", "--max_new_tokens", "120"]
        + ["--temperature", "0.8", "--top_k", "50", "--seed", "0"]
    )
    print("sample:\n" + "-" * 40)
    cmd_generate(gen)
    _quickstart_scores(folder)
    print("-" * 40 + f"\noutputs in {experiment.training.output_dir}/ (metrics.jsonl, config.yaml, checkpoints/)")
    return 0


def _quickstart_scores(folder: Path) -> None:
    """The shipped offline benchmark tasks on the model the quickstart trained (needs lm-eval)."""
    from .downstream.tasks import BUILTIN

    print("-" * 40 + "\ndownstream (lm-eval, the shipped offline tasks):")
    try:
        _eval_tasks(build_parser().parse_args(["eval", "--checkpoint", str(folder), "--tasks", ",".join(BUILTIN)]))
    except UsageError as exc:  # lm-eval not installed: the rest of the quickstart stands
        print(f"  skipped: {exc}")


# -- watch, tune, keep track: plots, LR finder, sweeps, registry ------------------------------------------------------------


def cmd_plot(args) -> int:
    from .train.plots import plot_runs

    ours = not args.output and len(args.runs) == 1  # RUN_DIR/plots: the run's own figures, redrawn
    output = Path(args.output) if args.output else (Path(args.runs[0]) / "plots" if ours else Path("plots"))
    written = plot_runs(args.runs, output, labels=args.labels, strict=True, replace=ours or args.overwrite)
    for path in written.values():
        print(path)
    return 0


def cmd_status(args) -> int:
    from .tools.status import print_status

    print_status(args.run, args.json)
    return 0


def cmd_lr_find(args) -> int:
    from .tools.lr_finder import run_lr_finder

    experiment = _experiment(args)
    try:
        import matplotlib  # noqa: F401

        if args.output:  # a file of the user's is replaced only when asked; the default one is the run folder's
            from .files.disk import check_output_file

            plot_path = check_output_file(args.output, args.overwrite, example="lr_find.png", suffix=".png")
        else:
            plot_path = experiment.training.local_output_dir / "lr_find.png"
    except ImportError:
        from .logs import warn

        warn("matplotlib is not installed: no plot (pip install 'llm-trainer[tracking]')")
        plot_path = None
    result = run_lr_finder(
        experiment, start_lr=args.start_lr, end_lr=args.end_lr, num_steps=args.num_steps, plot_path=plot_path
    )
    if args.json:
        out = result.to_dict()
        out["plot"] = str(plot_path) if plot_path else None
        print(json.dumps(out))
        return 0
    how = "diverged" if result.diverged else "reached end_lr"
    print(f"lr-find: {len(result.lrs)} steps from {result.lrs[0]:.1e} to {result.lrs[-1]:.1e} ({how})")
    if result.suggested_lr is None:
        print(f"no suggestion: {result.no_suggestion}")
    else:
        print(
            f"suggested learning rate: {result.suggested_lr:.2e}   (training.learning_rate={result.suggested_lr:.2e})"
        )
    print(f"lowest smoothed loss at lr {result.best_lr:.2e}")
    if plot_path:
        print(f"plot: {plot_path}")
    return 0


def cmd_sweep(args) -> int:
    from .tools.sweep import SweepInterrupted, best_command, override, results_table, run_sweep

    config = resolve_config_path(args.config)
    try:
        result = run_sweep(
            config,
            args.search_space,
            args.trials,
            overrides=args.overrides,
            output_dir=args.output_dir,
            storage=args.storage,
            study_name=args.study_name,
            pruner=args.pruner,
        )
    except SweepInterrupted as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        return 130
    print(results_table(result.study))
    best = result.best
    if best is None:
        diverged = sum(t.state.name == "COMPLETE" for t in result.study.trials)
        print(
            f"no trial reached a finite validation loss ({diverged} diverged)" if diverged else "no trial completed yet"
        )
        return 0
    print(f"\nbest trial {best.number}: val_loss {best.value:.4f}  ({best.user_attrs.get('output_dir')})")
    print("overrides: " + " ".join(override(k, v) for k, v in best.params.items()))
    print("train it:  " + best_command(result, args.config, args.overrides))
    print(f"study: {result.storage} (rerun this command to resume; raise --trials to extend)")
    return 0


def _registry(args):
    from .tools.registry import open_registry

    return open_registry(args.db)


def cmd_registry_add(args) -> int:
    registry = _registry(args)
    version = registry.add(args.run_dir, args.name, export_path=args.export, description=args.description)
    if args.json:
        print(json.dumps(version.to_dict(), indent=2))
    elif version.already_registered:
        print(f"already registered as {version.ref} (same run, nothing changed since); no new version")
    else:
        print(f"registered {version.ref} ({version.model_path})")
    return 0


def cmd_registry_list(args) -> int:
    from .tools.registry import format_table, model_folder_state

    registry = _registry(args)
    versions = registry.list(args.name)
    if args.json:
        shown = [
            {**{k: v for k, v in x.to_dict().items() if k != "config"}, "model_folder": model_folder_state(x)}
            for x in versions
        ]
        print(json.dumps(shown, indent=2))
    elif not versions and args.name:
        names = sorted({v.name for v in registry.list(None)})
        print(f"(no model named {args.name}; registered: {', '.join(names)})" if names else "(no models registered)")
    else:
        print(format_table(versions))
    return 0


def cmd_registry_show(args) -> int:
    from .logs import warn
    from .tools.registry import changed_since_registered, parse_ref

    name, version = parse_ref(args.ref)
    found = _registry(args).get(name, version)
    if changed := changed_since_registered(found):
        warn(changed)
    print(json.dumps(found.to_dict(), indent=2))
    return 0


def cmd_registry_promote(args) -> int:
    from .tools.registry import parse_ref

    name, version = parse_ref(args.ref)
    if not isinstance(version, int):
        raise UsageError(f"promote needs NAME:VERSION with a version number, got {args.ref!r}")
    promoted = _registry(args).promote(name, version, args.stage, keep_existing=args.keep_existing)
    print(json.dumps(promoted.to_dict(), indent=2) if args.json else f"{promoted.ref} -> {promoted.stage}")
    return 0


def cmd_estimate(args) -> int:
    from .tools.estimate import estimate_report, format_report

    report = estimate_report(
        _experiment(args),
        world_size=args.world_size,
        sharding=args.sharding,
        device_memory_gb=args.device_memory,
        vocab_size=args.vocab_size,
        batch_size=args.batch_size,
        gradient_checkpointing=True if args.gradient_checkpointing else None,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        advise_layout=args.advise_layout,
        config=args.config,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-trainer", description="Pretrain transformer language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", required=True, help="experiment YAML/JSON file, or a preset name (tiny, small, ...)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.learning_rate=3e-4")
        return p

    p = with_config(sub.add_parser("prepare", help="clean, tokenize and pack the data into token files"))
    p.add_argument("--executor", choices=["local", "slurm", "ray"], help="run as a datatrove pipeline (data.executor)")
    p.add_argument("--tasks", type=int, help="tasks of the per-file stage (data.executor_tasks)")
    p.add_argument("--workers", type=int, help="tasks running at once (data.executor_workers)")
    p.set_defaults(func=cmd_prepare)
    p = with_config(sub.add_parser("train", help="train a model (runs prepare when needed)"))
    p.add_argument(
        "--resume_from_checkpoint",
        "--resume-from-checkpoint",
        help="a checkpoint folder (or its checkpoint-N.pt name), or 'latest'",
    )
    p.add_argument("--overwrite", action="store_true", help=START_OVER)
    # `python -m torch.distributed.launch` passes --local-rank=N; the rank is read from the environment
    p.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint, or its benchmark scores (--tasks)")
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT)
    p.add_argument(
        "--data",
        help="a file to evaluate on: text, or JSONL/Parquet records (default: the run's validation split)",
    )
    p.add_argument(
        "--text-column",
        "--text_column",
        help="the field of --data's JSONL/Parquet records that holds the text (default: the run's data.text_column)",
    )
    p.add_argument(
        "--batch-size", "--batch_size", type=int, help="default: the run's training.batch_size, else 8 (--tasks: 16)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--dtype",
        choices=("run", "float32", "bfloat16", "float16"),
        default="run",
        help="the precision the model is scored in: run (default), the autocast its run trained with; "
        "float32 to compare with lm-eval's hf backend or another float32 score",
    )
    p.add_argument(
        "--tasks",
        help="downstream evaluation through lm-eval: task names or task YAML files/folders, comma-separated "
        "(offline, shipped: llmt_choice, llmt_cloze, llmt_rolling, llmt_exact); without it: loss and perplexity",
    )
    p.add_argument("--num_fewshot", "--num-fewshot", type=int, help="examples before each question (task default)")
    p.add_argument("--limit", type=float, help="at most N items per task (a fraction in (0, 1): that share)")
    p.add_argument("--output", "-o", help="write lm-eval's results JSON here (a new file, or --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the file at --output")
    p.add_argument(
        "--trust_task_code",
        "--trust-task-code",
        action="store_true",
        help="let --tasks files run the Python they name (lm-eval's `!function`, metrics loaded through "
        "Hugging Face evaluate); only for task files you trust",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT)
    p.add_argument("--prompt", default="", help="the text to continue (default: start from the end-of-text token)")
    p.add_argument(
        "--max_new_tokens", "--max-new-tokens", type=int, default=200, help="tokens to generate at most (default 200)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature: lower is more predictable, 0 always takes the likeliest token (default 0.8)",
    )
    p.add_argument("--top_k", "--top-k", type=int, default=None, help="sample only among the K likeliest tokens")
    p.add_argument(
        "--top_p",
        "--top-p",
        type=float,
        default=None,
        help="sample only among the likeliest tokens whose probabilities add up to P (nucleus sampling)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed: the same seed gives the same text")
    p.set_defaults(func=cmd_generate)

    overwrite = "replace the files this command writes in a non-empty --output folder (other files are kept)"
    p = sub.add_parser("export", help="write a Hugging Face transformers model folder, or a GGUF file for llama.cpp")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--output", required=True, help="a folder (--format hf) or a .gguf file (--format gguf)")
    p.add_argument(
        "--format",
        choices=("hf", "gguf"),
        default="hf",
        help="hf: a transformers folder; gguf: one file llama.cpp runs (byte-level BPE with "
        "data.tokenizer_pre_split gpt2 or llama3)",
    )
    p.add_argument("--dtype", choices=("f32", "f16"), default=None, help="the GGUF file's weights (default f32)")
    p.add_argument("--overwrite", action="store_true", help=overwrite)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("consolidate", help="merge a sharded (FSDP) checkpoint into one safetensors model folder")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--overwrite", action="store_true", help=overwrite)
    p.set_defaults(func=cmd_consolidate)

    what = "train the quickstart preset on the built-in corpus (on CPU), evaluate, print a sample"
    p = sub.add_parser("quickstart", help=what, description=what)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=100")
    p.add_argument("--overwrite", action="store_true", help=START_OVER)
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("plot", help="PNG figures of loss, perplexity and lr vs steps and tokens, runs overlaid")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (each with metrics.jsonl)")
    p.add_argument(
        "--output", "-o", help="folder for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)"
    )
    p.add_argument("--labels", nargs="+", help="legend names, one per run (default: the folder names)")
    p.add_argument("--overwrite", action="store_true", help="replace PNGs of the same names in the output folder")
    p.set_defaults(func=cmd_plot)

    what = "a run at a glance: step, losses, speed, ETA, last checkpoint, alerts, whether it is running"
    p = sub.add_parser("status", help=what, description=what)
    p.add_argument("run", metavar="RUN", help="a run's output folder, or its URL output_dir (s3://...)")
    p.add_argument("--json", action="store_true", help="the same as one JSON object, for scripts")
    p.set_defaults(func=cmd_status)

    p = with_config(sub.add_parser("lr-find", help="learning-rate range test on a copy of the model; suggests a rate"))
    p.add_argument("--start-lr", "--start_lr", type=float, default=1e-7)
    p.add_argument("--end-lr", "--end_lr", type=float, default=10.0)
    p.add_argument("--num-steps", "--num_steps", "--num-iter", "--num_iter", type=int, default=100)
    p.add_argument("--output", "-o", help="the loss-vs-lr plot (default: {training.output_dir}/lr_find.png)")
    p.add_argument("--overwrite", action="store_true", help="replace the file at --output if there is one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_lr_find)

    from .tools.sweep import SEARCH_SPACE_FORMAT

    p = with_config(
        sub.add_parser(
            "sweep",
            help="hyperparameter search with Optuna (TPE, pruning, resumable)",
            epilog=SEARCH_SPACE_FORMAT,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    p.add_argument(
        "--search-space",
        "--search_space",
        required=True,
        help="YAML file of dotted config keys to ranges (format below)",
    )
    p.add_argument("--trials", type=int, required=True, help="finished trials the study should hold (a rerun resumes)")
    p.add_argument(
        "--output-dir", "--output_dir", help="folder for trial runs and study.db (default: {training.output_dir}/sweep)"
    )
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///{output-dir}/study.db)")
    p.add_argument("--study-name", "--study_name", help="default: the config file's name")
    p.add_argument(
        "--pruner",
        choices=["median", "none"],
        default="median",
        help="median: stop a trial whose validation loss is worse than the median of earlier trials at the same "
        "step; none: run every trial to its end",
    )
    p.set_defaults(func=cmd_sweep)

    reg = sub.add_parser("registry", help="model registry: add, list, show, promote versions")
    reg_sub = reg.add_subparsers(dest="registry_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db",
        help="registry SQLite file, or mlflow:URI (default: $LLM_TRAINER_REGISTRY or ~/.llm_trainer/registry.db)",
    )
    common.add_argument("--json", action="store_true", help="print JSON")
    p = reg_sub.add_parser("add", parents=[common], help="register a run folder as a new version of NAME")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--name", required=True)
    p.add_argument("--export", help="an exported Hugging Face folder of this model (default: found in RUN_DIR)")
    p.add_argument("--description")
    p.set_defaults(func=cmd_registry_add)
    p = reg_sub.add_parser("list", parents=[common], help="registered versions")
    p.add_argument("name", nargs="?", help="only this model")
    p.set_defaults(func=cmd_registry_list)
    p = reg_sub.add_parser("show", parents=[common], help="one version in full: NAME, NAME:VERSION or NAME:STAGE")
    p.add_argument("ref", metavar="NAME[:VERSION]")
    p.set_defaults(func=cmd_registry_show)
    p = reg_sub.add_parser("promote", parents=[common], help="set the stage of NAME:VERSION")
    p.add_argument("ref", metavar="NAME:VERSION")
    p.add_argument("--stage", required=True, choices=["none", "staging", "production", "archived"])
    p.add_argument(
        "--keep-existing",
        "--keep_existing",
        action="store_true",
        help="do not archive the version that held this stage",
    )
    p.set_defaults(func=cmd_registry_promote)

    p = with_config(sub.add_parser("estimate", help="parameters, FLOPs per token and memory per device; does it fit?"))
    p.add_argument(
        "--world-size", "--world_size", type=int, help="devices to train on (default: training.world_size, else 1)"
    )
    p.add_argument(
        "--sharding",
        choices=["none", "zero1", "zero2", "fsdp"],
        help="zero1: optimizer state sharded; zero2: + gradients; fsdp (ZeRO-3): + parameters "
        "(default: what training.distributed_strategy shards)",
    )
    p.add_argument(
        "--device-memory",
        "--device_memory",
        "--gpu-memory",
        "--gpu_memory",
        type=float,
        metavar="GB",
        help="device memory in GiB: say whether it fits",
    )
    p.add_argument(
        "--nodes", type=int, help="machines to train on: the world is nodes x --gpus-per-node; advises a layout"
    )
    p.add_argument("--gpus-per-node", "--gpus_per_node", type=int, default=8, help="devices per machine (default 8)")
    p.add_argument(
        "--advise-layout",
        "--advise_layout",
        action="store_true",
        help="print the data/tensor/pipeline layout of the world size that fits --gpu-memory, and its settings",
    )
    p.add_argument(
        "--vocab-size",
        "--vocab_size",
        type=int,
        help="when model.vocab_size is unset (default: from the tokenizer settings)",
    )
    p.add_argument(
        "--batch-size", "--batch_size", type=int, help="per-device micro-batch (default: training.batch_size)"
    )
    p.add_argument(
        "--gradient-checkpointing",
        "--gradient_checkpointing",
        action="store_true",
        help="assume activation checkpointing even if the config does not set it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_estimate)
    return parser


_SECTIONS = ("model", "training", "data", "distributed", "parallelism")


def _dotted_options(argv: list[str]) -> list[str]:
    """litgpt/torchtitan's `--training.max_steps 100` and `--training.max_steps=100` as our dotted
    override `training.max_steps=100`."""
    out, i = [], 0
    while i < len(argv):
        item = argv[i]
        key = item[2:].split("=", 1)[0]
        if item.startswith("--") and "." in key and key.split(".", 1)[0] in _SECTIONS:
            if "=" in item:
                out.append(item[2:])
            elif i + 1 < len(argv):
                out.append(f"{key}={argv[i + 1]}")
                i += 1
            else:
                out.append(item)  # no value: argparse reports it
        else:
            out.append(item)
        i += 1
    return out


def _unknown_arguments(unknown: list[str], argv: list[str], args) -> str:
    """One line for what argparse did not take. A setting given as an option, the Hugging Face and
    nanoGPT way (`--max_steps 5`, `--max_iters=100`), is named as the override that sets it."""
    from .config import ExperimentConfig
    from .config_aliases import setting_named

    option = unknown[0]
    key, has_value, value = option[2:].partition("=")
    setting = setting_named(key.replace("-", "_"), ExperimentConfig.known_fields()) if option.startswith("--") else None
    if setting is not None and hasattr(args, "overrides"):
        if not has_value:
            after = argv[argv.index(option) + 1 : argv.index(option) + 2]
            value = after[0] if after and not after[0].startswith("--") else "VALUE"
        return (
            f"{option} is not an option of llm-trainer {args.command}; settings are given as overrides: "
            f"{setting}={value} (or --{setting} {value})"
        )
    return f"unrecognized arguments: {' '.join(unknown)}; see llm-trainer {args.command} --help"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = _dotted_options(sys.argv[1:] if argv is None else list(argv))
    args, extra = parser.parse_known_args(argv)
    # argparse leaves overrides that follow an --option unparsed: they are overrides all the same
    takes_overrides = hasattr(args, "overrides")
    overrides = [x for x in extra if takes_overrides and "=" in x and x.split("=", 1)[0].split(".", 1)[0] in _SECTIONS]
    unknown = [x for x in extra if x not in overrides]
    if unknown:
        print(f"error: {_unknown_arguments(unknown, argv, args)}", file=sys.stderr)
        return 2
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    from .errors import TrainingStopped

    try:
        return args.func(args)
    except (UsageError, TrainingStopped) as exc:
        if not hasattr(exc, "said_by_rank_0") and launched():  # an error before `train`, under a launcher
            from .parallel.distributed import said_by_rank_0

            exc.said_by_rank_0 = said_by_rank_0(str(exc), follows_rank_0=getattr(exc, "follows_rank_0", False))
        if not getattr(exc, "said_by_rank_0", False):  # under torchrun: rank 0 printed this very line
            print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `llm-trainer status RUN | head`: the reader has what it wanted
        from .logs import to_null_device

        to_null_device(sys.stdout)  # nor does the flush at exit complain
        return 141  # as a process that SIGPIPE ended
    except Exception as exc:  # a full disk wherever a library met it (safetensors, torch wrap the OS error)
        from .files.disk import disk_full

        if not disk_full(exc):
            raise
        print(
            f"error: disk full ({first_line(exc, 160)}); free space and run the command again",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
