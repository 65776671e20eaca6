"""Build the corpora of `bench/multilingual.py` in bench/.cache/multilingual/ (git-ignored, ~4.5 MB).

Two independent, professionally translated corpora of the same six languages (both CC BY-SA 4.0), as
stored in the Helsinki-NLP/OPUS-MT-testsets repository at a pinned commit:

- train: NTREX-128 (newstest2019 translated into 128 languages): 1,997 sentences, 123 news stories
  (document boundaries from its DOCUMENT_IDS.tsv), one document per story, sentences one per line.
- held-out: FLORES-200 devtest: 1,012 sentences of 281 Wikinews/Wikivoyage/Wikibooks articles
  (article boundaries from metadata_devtest.tsv); consecutive articles are joined until a document
  has at least 8 sentences (105 documents), so that documents are paragraphs, not single lines.

Python code comes from this interpreter's standard library (`bench/multilingual.py`), not from here.

    python bench/multilingual_data.py                      # download the 14 files (~5 MB) at the pinned commit
    python bench/multilingual_data.py --git-dir PATH       # or read them from a clone of OPUS-MT-testsets

Every file is checked against its git blob id, so the corpus is byte-for-byte the one measured in
bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = "Helsinki-NLP/OPUS-MT-testsets"
COMMIT = "ac0f19c0be3cb4e0d9450fcb2d7a9847c4bdd180"
CACHE = Path(__file__).resolve().parent / ".cache" / "multilingual"
NTREX = "datasets/microsoft/ntrex/NTREX/"
FLORES = "datasets/facebook/flores/flores200_dataset/"
# language -> (NTREX file, FLORES file)
LANGUAGES = {
    "english": ("newstest2019-ref.eng-US.txt", "eng_Latn.devtest"),
    "hindi": ("newstest2019-ref.hin.txt", "hin_Deva.devtest"),
    "tamil": ("newstest2019-ref.tam.txt", "tam_Taml.devtest"),
    "arabic": ("newstest2019-ref.arb.txt", "arb_Arab.devtest"),
    "russian": ("newstest2019-ref.rus.txt", "rus_Cyrl.devtest"),
    "chinese": ("newstest2019-ref.zho_Hans.txt", "zho_Hans.devtest"),
}
BLOBS = {  # path -> git blob id at COMMIT
    NTREX + "DOCUMENT_IDS.tsv": "2c8a58dffb487c515f6fbded5a3426e973a83028",
    NTREX + "NTREX-128/newstest2019-ref.eng-US.txt": "31b36a30172a0ad22ec26f66118bebadfd6315e7",
    NTREX + "NTREX-128/newstest2019-ref.hin.txt": "683d1a332203bce95de3daf0e071b6ebbad77c47",
    NTREX + "NTREX-128/newstest2019-ref.tam.txt": "4a5c69e5866194fe070d3c81d3056614ffb291ac",
    NTREX + "NTREX-128/newstest2019-ref.arb.txt": "f974c678d14bfbc8e9f24734fa36cd975d451d72",
    NTREX + "NTREX-128/newstest2019-ref.rus.txt": "e4c78ed11a4ad10f9c5a762d4d187f81309884d9",
    NTREX + "NTREX-128/newstest2019-ref.zho_Hans.txt": "3369b00ba4e5acb9d3b5315ca0d907c302777453",
    FLORES + "metadata_devtest.tsv": "3601c9035259c68d9e2117c03609a542ef5bb75c",
    FLORES + "devtest/eng_Latn.devtest": "11140fb3efb291dae0d5778f3d559950f9c79152",
    FLORES + "devtest/hin_Deva.devtest": "7e549704a7b6b02a97afc878be05edcadd6cde37",
    FLORES + "devtest/tam_Taml.devtest": "248375a6e420706728c3f488965b7a4291739e8a",
    FLORES + "devtest/arb_Arab.devtest": "33d3a37db4f0989dccc4302e93c4bb0731925126",
    FLORES + "devtest/rus_Cyrl.devtest": "8d29a5b6384f188fd0734c8b4178606742c82ac4",
    FLORES + "devtest/zho_Hans.devtest": "941563d383bb828c7c21328b3b8478d79fe9f718",
}
MIN_SENTENCES = 8  # a held-out document joins consecutive FLORES articles until it has this many sentences


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fetch(path: str, git_dir: str | None) -> str:
    """One file of the pinned commit, checked against its blob id."""
    if git_dir:
        data = subprocess.run(
            ["git", "--git-dir", git_dir, "show", f"{COMMIT}:{path}"], check=True, capture_output=True
        ).stdout
    else:
        with urllib.request.urlopen(f"https://raw.githubusercontent.com/{REPO}/{COMMIT}/{path}", timeout=60) as r:
            data = r.read()
    if _blob_id(data) != BLOBS[path]:
        raise SystemExit(f"{path}: content differs from {REPO}@{COMMIT[:12]}; delete {CACHE} and build again")
    return data.decode("utf-8")


def _lines(text: str, count: int) -> list[str]:
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if len(lines) != count:
        raise SystemExit(f"expected {count} lines, found {len(lines)}")
    return lines


def _groups(keys: list[str]) -> list[list[int]]:
    """Line indices grouped by runs of equal consecutive keys."""
    groups: list[list[int]] = []
    for i, key in enumerate(keys):
        if i == 0 or key != keys[i - 1]:
            groups.append([])
        groups[-1].append(i)
    return groups


def build(git_dir: str | None = None, cache: Path = CACHE) -> Path:
    doc_ids = _lines(fetch(NTREX + "DOCUMENT_IDS.tsv", git_dir), 1997)
    articles = [row.split("\t")[0] for row in _lines(fetch(FLORES + "metadata_devtest.tsv", git_dir), 1013)[1:]]
    stories = _groups(doc_ids)
    heldout_groups: list[list[int]] = [[]]
    for article in _groups(articles):
        if len(heldout_groups[-1]) >= MIN_SENTENCES:
            heldout_groups.append([])
        heldout_groups[-1] += article
    cache.mkdir(parents=True, exist_ok=True)
    for language, (ntrex_file, flores_file) in LANGUAGES.items():
        train = _lines(fetch(NTREX + "NTREX-128/" + ntrex_file, git_dir), 1997)
        heldout = _lines(fetch(FLORES + "devtest/" + flores_file, git_dir), 1012)
        for split, lines, groups, name in (
            ("train", train, stories, lambda g: doc_ids[g[0]]),
            ("heldout", heldout, heldout_groups, lambda g: f"flores-devtest-{g[0]}"),
        ):
            records = [{"id": name(g), "text": "\n".join(lines[i] for i in g)} for g in groups]
            path = cache / f"{language}.{split}.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    (cache / "SOURCE").write_text(f"{REPO}@{COMMIT}\n")
    return cache


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--git-dir", help="a clone of OPUS-MT-testsets (its .git folder, or a bare repository)")
    args = parser.parse_args(argv)
    folder = build(args.git_dir)
    print(f"wrote {len(LANGUAGES) * 2} files to {folder}", file=sys.stderr)


if __name__ == "__main__":
    main()
