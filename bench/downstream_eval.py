"""Downstream evaluation speed: our lm-eval adapter against lm-eval's own `hf` backend, same requests.

One model (random weights: speed does not depend on them; shape from --shape), exported to a
transformers folder for the `hf` backend. The shipped offline tasks (llmt_choice, llmt_cloze,
llmt_rolling, llmt_exact) are turned into requests once, with --num_fewshot examples before each
question, and both backends answer exactly those requests: loglikelihood (multiple choice + cloze),
loglikelihood_rolling, generate_until. Runners alternate (ours, hf, ours, hf, ...) for --rounds rounds
in this one process, both in float32 with the same batch size, after an untimed warm-up of each.

    python bench/downstream_eval.py                  # JSON in bench/out/downstream_eval.json

Figures: per round and backend, seconds and requests/s per request type and in total; the ratio
hf / ours of total wall time per round (>1: ours faster), its median, and the ratio of each runner's
fastest round (`ratio_of_best`: on a shared machine, the least disturbed figure); the largest
per-request log-likelihood difference between the two, and whether the generations are the same.
"""

import time

START = time.perf_counter()

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

BENCH = Path(__file__).resolve().parent
SHAPES = {
    "quickstart": dict(architecture="llama", d_model=128, n_heads=4, n_layers=4, max_seq_len=128),
    "small": dict(architecture="llama", d_model=256, n_heads=4, n_layers=4, max_seq_len=512),
    "gpt2": dict(architecture="gpt2", d_model=256, n_heads=4, n_layers=4, max_seq_len=512),
}


def build(shape: str, folder: Path, vocab_size: int | None = None):
    """(our model, its tokenizer, the exported transformers folder). `vocab_size`: the model's output
    width when larger than the tokenizer's (rows no token reaches, as models padded to a round size
    have): the head's share of the work of a model with a real vocabulary."""
    from llm_trainer.checkpoint.model_folder import save_model_folder
    from llm_trainer.config import ModelConfig
    from llm_trainer.downstream.tasks import BUILTIN_DIR
    from llm_trainer.hf.interop import export_to_hf
    from llm_trainer.model import Transformer
    from llm_trainer.tokenizer import Tokenizer

    texts = [line for file in sorted(BUILTIN_DIR.glob("*.jsonl")) for line in file.read_text().splitlines()]
    tokenizer = Tokenizer.train_bpe(texts * 8, 1024, 10**7)
    torch.manual_seed(0)
    vocab = max(vocab_size or 0, tokenizer.vocab_size)
    model = Transformer(ModelConfig(**SHAPES[shape], vocab_size=vocab)).eval()
    save_model_folder(model, folder / "ours")
    tokenizer.save(folder / "ours")
    return model, tokenizer, export_to_hf(folder / "ours", folder / "hf")


def requests(num_fewshot: int) -> dict[str, list]:
    from llm_trainer.downstream.tasks import BUILTIN, load_tasks

    grouped: dict[str, list] = {}
    for task in load_tasks(list(BUILTIN)):
        if task.config.output_type != "loglikelihood_rolling":
            task.set_config(key="num_fewshot", value=num_fewshot)
        task.build_all_requests(limit=None, rank=0, world_size=1)
        for instance in task.instances:
            grouped.setdefault(instance.request_type, []).append(instance)
    return grouped


def run(lm, grouped: dict[str, list]) -> tuple[dict, dict]:
    """({request type: seconds}, {request type: answers})."""
    seconds, answers = {}, {}
    for kind, reqs in grouped.items():
        start = time.perf_counter()
        answers[kind] = getattr(lm, kind)(reqs)
        seconds[kind] = time.perf_counter() - start
    return seconds, answers


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--num_fewshot", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--vocab_size", type=int, help="the model's vocabulary (default: the tokenizer's, 897)")
    parser.add_argument("--out", default=str(BENCH / "out" / "downstream_eval.json"))
    args = parser.parse_args(argv)

    from lm_eval.models.huggingface import HFLM

    from llm_trainer.downstream.adapter import LLMTrainerLM

    folder = Path(tempfile.mkdtemp(prefix="downstream-bench-"))
    model, tokenizer, exported = build(args.shape, folder, args.vocab_size)
    grouped = requests(args.num_fewshot)
    runners = {
        "ours": LLMTrainerLM(model, tokenizer, batch_size=args.batch_size),
        "hf": HFLM(pretrained=str(exported), device="cpu", batch_size=args.batch_size, dtype="float32"),
    }
    counts = {kind: len(reqs) for kind, reqs in grouped.items()}
    total_requests = sum(counts.values())
    for lm in runners.values():  # untimed warm-up: first-call costs (allocator, kernels) out of round 0
        run(lm, {kind: reqs[:4] for kind, reqs in grouped.items()})
    rounds, last = [], {}
    for r in range(args.rounds):
        order = ["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]  # alternated: neither always goes first
        record = {}
        for name in order:
            seconds, last[name] = run(runners[name], grouped)
            total = sum(seconds.values())
            record[name] = {
                "seconds": seconds,
                "requests_per_s": {kind: counts[kind] / s for kind, s in seconds.items()},
                "total_s": total,
                "total_requests_per_s": total_requests / total,
            }
        record["ratio_hf_over_ours"] = record["hf"]["total_s"] / record["ours"]["total_s"]
        record["ratio_by_kind"] = {k: record["hf"]["seconds"][k] / record["ours"]["seconds"][k] for k in counts}
        rounds.append(record)
        print(json.dumps({"round": r, **record}), file=sys.stderr, flush=True)

    ll_diff = max(abs(a[0] - b[0]) for kind in ("loglikelihood",) for a, b in zip(last["ours"][kind], last["hf"][kind]))
    roll_diff = max(
        abs(a - b) for a, b in zip(last["ours"]["loglikelihood_rolling"], last["hf"]["loglikelihood_rolling"])
    )
    result = {
        "name": "downstream_eval",
        "shape": {**SHAPES[args.shape], "vocab_size": model.config.vocab_size},
        "num_fewshot": args.num_fewshot,
        "batch_size": args.batch_size,
        "requests": counts,
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "rounds": rounds,
        "ratio_min": min(r["ratio_hf_over_ours"] for r in rounds),
        "ratio_median": sorted(r["ratio_hf_over_ours"] for r in rounds)[len(rounds) // 2],
        # each runner's fastest round: the figure least disturbed by other work on a shared machine
        "best_total_s": {name: min(r[name]["total_s"] for r in rounds) for name in runners},
        "best_by_kind_s": {name: {k: min(r[name]["seconds"][k] for r in rounds) for k in counts} for name in runners},
        "ratio_of_best": min(r["hf"]["total_s"] for r in rounds) / min(r["ours"]["total_s"] for r in rounds),
        "best_requests_per_s": {name: total_requests / min(r[name]["total_s"] for r in rounds) for name in runners},
        "max_abs_loglikelihood_diff": ll_diff,
        "max_abs_rolling_diff": roll_diff,
        "same_generations": last["ours"]["generate_until"] == last["hf"]["generate_until"],
        "process_wall_s": time.perf_counter() - START,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
