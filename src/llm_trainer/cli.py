"""`llm-trainer prepare | train | eval | generate | export | quickstart`: a thin layer over the Python API.

A user error prints one line, `error: ...`, and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from .errors import UsageError

PRESETS = Path(__file__).parent / "configs"


def resolve_config_path(name: str) -> Path:
    """A path, or the name of a shipped preset (`tiny`, `small`, `gpt2-small`, ...)."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (PRESETS / name, PRESETS / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    raise UsageError(f"config {name} not found; pass a YAML/JSON file or a preset ({presets})")


def _experiment(args):
    from .config import load_experiment

    return load_experiment(resolve_config_path(args.config), args.overrides)


def cmd_prepare(args) -> int:
    from .data.prepare import prepare_data

    prepared = prepare_data(_experiment(args).data)
    print(json.dumps({"directory": str(prepared.directory), **{k: prepared.manifest[k] for k in ("splits", "documents_out", "removed", "vocab_size")}}))
    return 0


def cmd_train(args) -> int:
    from .pipeline import train

    experiment = _experiment(args)
    if args.resume_from_checkpoint:
        from dataclasses import replace

        experiment = replace(experiment, training=replace(experiment.training, resume_from_checkpoint=args.resume_from_checkpoint))
    summary = train(experiment)
    if summary.get("stopped_early", "") and str(summary["stopped_early"]).startswith("received "):
        return 128 + signal.Signals[str(summary["stopped_early"]).split()[1]].value
    return 0


def _eval_loader(model, tokenizer, experiment: dict, data_file: str | None, batch_size: int):
    """Validation batches: a text file's windows, or the run's own validation split."""
    from .config import ExperimentConfig
    from .data.loader import BatchLoader, WindowRows
    from .data.prepare import prepare_data
    from .pipeline import build_rows, sequence_length

    length = model.config.max_seq_len
    if data_file is not None:
        from .data.sources import SourceStats, read_text_file

        path = Path(data_file)
        if not path.is_file():
            raise UsageError(f"--data {path} not found")
        import numpy as np

        tokens = np.asarray(tokenizer.encode(read_text_file(path, True, SourceStats())), dtype=np.int64)
        if len(tokens) < 2:
            raise UsageError(f"--data {path} has fewer than two tokens; nothing to evaluate")
        rows = WindowRows(tokens, length, keep_partial=True)
    else:
        if not experiment:
            raise UsageError("this folder has no saved config to find its validation data; pass --data FILE")
        exp = ExperimentConfig.from_dict({k: v for k, v in experiment.items() if k in ExperimentConfig.SECTIONS})
        prepared = prepare_data(exp.data)
        if prepared.manifest["splits"]["val"]["tokens"] < 2:
            raise UsageError("the run has no validation split; pass --data FILE")
        rows = build_rows(prepared, "val", exp.data, sequence_length(exp), seed=None)
    return BatchLoader(rows, batch_size, shuffle=False, drop_last=False)


def cmd_eval(args) -> int:
    from .evaluate import evaluate
    from .pipeline import load_for_inference

    model, tokenizer, experiment = load_for_inference(args.checkpoint)
    metrics = evaluate(model, _eval_loader(model, tokenizer, experiment, args.data, args.batch_size))
    if args.json:
        print(json.dumps({"loss": metrics["val_loss"], "perplexity": metrics["perplexity"], "tokens": metrics["tokens"]}))
    else:
        print(f"loss {metrics['val_loss']:.4f}  perplexity {metrics['perplexity']:.3f}  tokens {metrics['tokens']:,}")
    return 0


def cmd_generate(args) -> int:
    from .generate import generate
    from .pipeline import load_for_inference

    model, tokenizer, _ = load_for_inference(args.checkpoint)
    prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eot_id]
    new = generate(
        model, prompt or [tokenizer.eot_id], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=tokenizer.eot_id,
    )
    print(args.prompt + tokenizer.decode(new))
    return 0


def cmd_export(args) -> int:
    try:
        from .hf_interop import export_to_hf
    except ImportError:
        raise UsageError("export needs transformers: pip install 'llm-trainer[hf]'") from None
    from .pipeline import load_for_inference

    path = Path(args.checkpoint)
    if not (path / "model_config.json").is_file():
        from .checkpoint import resolve_checkpoint

        found = resolve_checkpoint("latest", path / "checkpoints" if (path / "checkpoints").is_dir() else path)
        if found is None:
            raise UsageError(f"{path} holds no checkpoint to export")
        path = found
    load_for_inference(path)  # validates the folder with our own loader first
    tokenizer_file = path / "tokenizer.json"
    out = export_to_hf(path, args.output, tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None)
    print(f"exported to {out}")
    return 0


def cmd_quickstart(args) -> int:
    """Prepare the built-in corpus, train the tiny preset on CPU, evaluate, print a sample."""
    from .config import load_experiment
    from .pipeline import train

    experiment = load_experiment(PRESETS / "quickstart.yaml", args.overrides)
    summary = train(experiment)
    best = experiment.training.resolved_checkpoint_dir / "best_model"
    folder = best if best.is_dir() else Path(summary["checkpoint"])
    print(f"\nvalidation: loss {summary.get('val_loss', float('nan')):.4f}, perplexity {summary.get('perplexity', float('nan')):.2f}")
    gen = argparse.Namespace(checkpoint=str(folder), prompt="def ", max_new_tokens=120, temperature=0.8, top_k=50, top_p=None, seed=0)
    print("sample:\n" + "-" * 40)
    cmd_generate(gen)
    print("-" * 40 + f"\noutputs in {experiment.training.output_dir}/ (metrics.jsonl, config.yaml, checkpoints/)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-trainer", description="Pretrain transformer language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", required=True, help="experiment YAML/JSON file, or a preset name (tiny, small, ...)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.learning_rate=3e-4")
        return p

    with_config(sub.add_parser("prepare", help="clean, tokenize and pack the data into token files")).set_defaults(func=cmd_prepare)
    p = with_config(sub.add_parser("train", help="train a model (runs prepare when needed)"))
    p.add_argument("--resume_from_checkpoint", "--resume-from-checkpoint", help="a checkpoint folder or 'latest'")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="loss and perplexity of a checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", help="a text file to evaluate on (default: the run's validation split)")
    p.add_argument("--batch-size", "--batch_size", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", "--top-k", type=int, default=None)
    p.add_argument("--top_p", "--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="write a Hugging Face transformers model folder")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--output", required=True)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("quickstart", help="train the tiny preset on the built-in corpus, evaluate, sample")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=100")
    p.set_defaults(func=cmd_quickstart)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .trainer import TrainingStopped

    try:
        return args.func(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
