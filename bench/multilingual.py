"""Text in every script: tokenizer compression per pre-split and quality-filter survival per language.

For English, Hindi (Devanagari), Tamil, Arabic, Russian, Chinese and Python code:

1. BPE (`tokenizer_vocab_size`, default 8192) is trained on the language's training corpus once for
   each `data.tokenizer_pre_split` (`unicode`, ours; `gpt2`; `llama3`), and each encodes the held-out
   corpus: characters per token, ours over GPT-2's, and whether every held-out and training document
   round-trips with ours.
2. `prepare` runs with `quality_filters: prose` (`code` for Python) on the held-out corpus (and on the
   training corpus, which the filters were designed against): the share of bytes each filter kept.

Corpora: `bench/multilingual_data.py` (NTREX-128 news to train, FLORES-200 devtest to hold out; built
into bench/.cache/multilingual/ on the first run, or with `python bench/multilingual_data.py`); Python: this interpreter's standard library, files
alternating between train (3 of 4, 600 KB) and held-out (1 of 4, 200 KB). Nothing is tuned on the
held-out text.

    python bench/multilingual.py [--vocab-size N] [--languages hindi,tamil] [--out FILE]

Prints one JSON object (also written to --out, default bench/out/multilingual.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from llm_trainer.config import DataConfig  # noqa: E402
from llm_trainer.data.prepare import prepare_data  # noqa: E402
from llm_trainer.data.prepare.report import REPORT  # noqa: E402
from llm_trainer.data.text.clean import Cleaner  # noqa: E402
from llm_trainer.data.text.filters import FILTERS  # noqa: E402
from llm_trainer.data.text.sources import stdlib_files  # noqa: E402
from llm_trainer.tokenizer import PRE_SPLITS, Tokenizer  # noqa: E402
from multilingual_data import CACHE, LANGUAGES, build  # noqa: E402

CODE_BYTES = {"train": 600_000, "heldout": 200_000}  # Python files read for each split
TARGETS = {
    "filters_keep_clean_prose": 0.95,  # held-out bytes kept by the prose filters, every language
    "indic_ratio": 1.5,  # chars/token over the GPT-2 pre-split: Devanagari and Tamil at least
    "english_code_ratio_within": 0.02,  # English and code: within 2% of the GPT-2 pre-split
}


def chars_per_token(encode, texts: list[str]) -> float:
    return sum(map(len, texts)) / sum(len(encode(t)) for t in texts)


def read_jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def python_corpus() -> tuple[list[str], list[str]]:
    """Standard-library files alternating 3:1 between train and held-out, until CODE_BYTES of each."""
    corpus: dict[str, list[str]] = {"train": [], "heldout": []}
    size = dict.fromkeys(corpus, 0)
    for i, path in enumerate(stdlib_files()):
        split = "heldout" if i % 4 == 3 else "train"
        if size[split] < CODE_BYTES[split]:
            text = path.read_text(encoding="utf-8", errors="replace")
            corpus[split].append(text)
            size[split] += len(text.encode())
        if all(size[s] >= CODE_BYTES[s] for s in size):
            break
    return corpus["train"], corpus["heldout"]


def filter_survival(texts: list[str], preset: str, corpus_type: str, tokenizer: Path, work: Path) -> dict:
    """Run prepare on `texts` (one JSONL record each) and read what its filters kept, from data_report.json."""
    work.mkdir(parents=True)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    config = DataConfig(
        data_files=str(data),
        quality_filters=preset,
        corpus_type=corpus_type,
        tokenizer=str(tokenizer),
        validation_split=0.0,
        cache_dir=str(work / "cache"),
        progress_bar=False,
    )
    prepared = prepare_data(config)
    report = json.loads((prepared.directory / REPORT).read_text())
    total = report["bytes_in"]
    removed = {k: v for k, v in report["removed_bytes"].items() if k in FILTERS}
    return {
        "documents": report["documents_in"],
        "bytes": total,
        "kept_fraction": round(1 - sum(removed.values()) / total, 4),
        "kept_by_filter": {k: round(1 - v / total, 4) for k, v in removed.items()},
        "removed_documents": {k: v[:3] for k, v in report["removed_documents"].items() if k in FILTERS},
    }


def measure(name: str, train: list[str], heldout: list[str], vocab_size: int, work: Path) -> dict:
    corpus_type = "code" if name == "python" else "prose"
    clean = Cleaner(DataConfig(data_files="unused", corpus_type=corpus_type))
    train_clean, heldout_clean = [clean(t) for t in train], [clean(t) for t in heldout]
    started = time.perf_counter()
    trained = {
        pre_split: Tokenizer.train_bpe(train_clean, vocab_size=vocab_size, max_chars=10**9, pre_split=pre_split)
        for pre_split in PRE_SPLITS
    }
    ours = trained["unicode"]
    cpt = {pre_split: chars_per_token(tokenizer.encode, heldout_clean) for pre_split, tokenizer in trained.items()}
    failures = sum(ours.decode(ours.encode(t)) != t for t in train + heldout + train_clean + heldout_clean)
    tokenizer_seconds = time.perf_counter() - started
    ours.save(work / name / "tokenizer")
    preset = "code" if name == "python" else "prose"
    return {
        "train_bytes": sum(len(t.encode()) for t in train),
        "heldout_bytes": sum(len(t.encode()) for t in heldout),
        "chars_per_token": {
            "ours": round(cpt["unicode"], 3),
            "gpt2_presplit": round(cpt["gpt2"], 3),
            "llama3_presplit": round(cpt["llama3"], 3),
            "ratio": round(cpt["unicode"] / cpt["gpt2"], 4),
        },
        "round_trip": {"texts": 2 * (len(train) + len(heldout)), "failures": failures},  # raw and cleaned
        "filters": {
            "preset": preset,
            "heldout": filter_survival(
                heldout, preset, corpus_type, work / name / "tokenizer", work / name / "heldout"
            ),
            "train": filter_survival(train, preset, corpus_type, work / name / "tokenizer", work / name / "train"),
        },
        "tokenizer_seconds": round(tokenizer_seconds, 2),
    }


def verdicts(results: dict) -> dict:
    out = {}
    prose = {k: v["filters"]["heldout"]["kept_fraction"] for k, v in results.items() if k != "python"}
    if prose:
        out["filters_keep_95pct_of_clean_prose"] = {
            "pass": min(prose.values()) >= TARGETS["filters_keep_clean_prose"],
            "min": min(prose.values()),
            "by_language": prose,
        }
    indic = {k: results[k]["chars_per_token"]["ratio"] for k in ("hindi", "tamil") if k in results}
    if indic:
        out["indic_ratio_at_least_1.5"] = {"pass": min(indic.values()) >= TARGETS["indic_ratio"], "ratios": indic}
    near = {k: results[k]["chars_per_token"]["ratio"] for k in ("english", "python") if k in results}
    if near:
        out["english_code_within_2pct"] = {
            "pass": all(abs(r - 1) <= TARGETS["english_code_ratio_within"] for r in near.values()),
            "ratios": near,
        }
    out["exact_round_trip_everywhere"] = {
        "pass": all(v["round_trip"]["failures"] == 0 for v in results.values()),
        "failures": {k: v["round_trip"]["failures"] for k, v in results.items()},
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=DataConfig(data_files="u").tokenizer_vocab_size)
    parser.add_argument("--languages", default=",".join([*LANGUAGES, "python"]))
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "multilingual.json"))
    args = parser.parse_args(argv)
    names = args.languages.split(",")
    unknown = [n for n in names if n != "python" and n not in LANGUAGES]
    if unknown:
        print(
            f"unknown language {', '.join(unknown)}; choose from {', '.join([*LANGUAGES, 'python'])}", file=sys.stderr
        )
        return 2
    if not all((CACHE / f"{n}.{s}.jsonl").is_file() for n in LANGUAGES for s in ("train", "heldout")):
        try:
            build()
        except OSError as exc:
            print(
                f"could not download the corpora ({exc}); build them from a clone of OPUS-MT-testsets: "
                f"python bench/multilingual_data.py --git-dir PATH",
                file=sys.stderr,
            )
            return 2
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="multilingual-") as tmp:
        for name in names:
            if name == "python":
                train, heldout = python_corpus()
            else:
                train, heldout = read_jsonl(CACHE / f"{name}.train.jsonl"), read_jsonl(CACHE / f"{name}.heldout.jsonl")
            results[name] = measure(name, train, heldout, args.vocab_size, Path(tmp))
    output = {
        "vocab_size": args.vocab_size,
        "corpora": {
            "prose": (CACHE / "SOURCE").read_text().strip(),
            "python": f"stdlib of Python {platform.python_version()}",
        },
        "languages": results,
        "targets": verdicts(results),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    text = json.dumps(output, indent=2, ensure_ascii=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
