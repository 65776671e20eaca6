"""Evaluate an llm_trainer model folder (checkpoint or best_model) with the shared validation definition.

Cross-check for the benchmark: llm_trainer reports its own val_loss; this recomputes it with
bench/shakespeare.py's definition (same validation characters, same non-overlapping 65-token windows,
token-weighted mean CE), encoding the validation text with the run's own char tokenizer.

    python bench/eval_ours.py <model_dir>        # prints one JSON line
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shakespeare as sh  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    args = parser.parse_args(argv)

    from llm_trainer.checkpoint.model_folder import load_model_folder
    from llm_trainer.tokenizer import Tokenizer

    start = time.perf_counter()
    data = sh.load_data()
    tokenizer = Tokenizer.load(args.model_dir)
    ids = torch.tensor(tokenizer.encode(data.val_text), dtype=torch.long)
    if len(ids) != len(data.val_text):
        raise SystemExit(f"tokenizer is not one token per character: {len(ids)} ids for {len(data.val_text)} chars")
    model = load_model_folder(args.model_dir, device="cpu")
    model.eval()
    val = sh.evaluate_val_loss(model, ids)
    result = {
        "name": "eval_ours",
        "model_dir": args.model_dir,
        **val,
        "vocab_size": tokenizer.vocab_size,
        "eval_s": time.perf_counter() - start,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
