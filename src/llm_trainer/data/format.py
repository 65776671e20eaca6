"""The prepared-data format: what a prepared folder `{cache_dir}/{fingerprint}/` holds, as the build
writes it and every reader (the loaders, eval, a folder downloaded from a bucket) opens it.

  train.bin / val.bin          every document's tokens followed by end-of-text, uint16 or uint32
  train.idx.npy / val.idx.npy  int64 offsets: document i is tokens[idx[i]:idx[i+1]]
  train.sources.npy / ...      int16 per document: its source, an index into manifest["source_names"]
  train.scores.npy / ...       per-document curriculum scores (when curriculum_key names a column)
  tokenizer.json, data_report.json, manifest.json (written last: its presence marks a complete folder)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..tokenizer import Tokenizer

# 9: vertical tab, form feed and NEL end lines; a removed end-of-text marker leaves no whitespace; a long
#    file is cut where its line ends are unified and never inside an emoji sequence; a stray NUL is text
# 8: a mark or joiner after a symbol or digit is no letter to the quality filters; a named .json is JSON Lines
# 7: cleaning ends normalised and strips every Unicode space; near-dedup and word lengths read every script alike
# 6: an executor's tasks tokenize the cleaned text (folders an executor wrote from raw text are not reused)
# 5: a fraction split takes each source's own fraction of its documents
FORMAT_VERSION = 9
MANIFEST = "manifest.json"

TOKEN_DTYPES = ("uint16", "uint32")  # what a prepared folder's token files may hold


def manifest_problem(manifest: object) -> str | None:
    """What makes `manifest` (a prepared folder's, which may come from a bucket) unusable, or None: the
    fields every reader of the folder relies on, checked once where the folder is opened."""
    if not isinstance(manifest, dict):
        return "is not a JSON object"
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not all(
        isinstance(splits.get(name), dict) and type(splits[name].get("tokens")) is int and splits[name]["tokens"] >= 0
        for name in ("train", "val")
    ):
        return "has no `splits` with the token counts of train and val"
    if manifest.get("dtype") not in TOKEN_DTYPES:
        return f"has dtype {manifest.get('dtype')!r}, not one of {', '.join(TOKEN_DTYPES)}"
    return None


@dataclass
class PreparedData:
    directory: Path
    tokenizer: Tokenizer
    manifest: dict

    def tokens(self, split: str) -> np.memmap:
        """The split's tokens, memory-mapped; a file whose size is not the manifest's count (cut short,
        replaced) is refused in one line rather than trained on in part."""
        count, dtype = self.manifest["splits"][split]["tokens"], np.dtype(self.manifest["dtype"])
        path = self.directory / f"{split}.bin"
        size = path.stat().st_size if path.is_file() else None
        if size != count * dtype.itemsize:
            held = "is missing" if size is None else f"holds {size // dtype.itemsize:,} tokens"
            self._damaged(f"{path.name} {held} where its manifest.json counts {count:,}")
        if count == 0:  # an empty file cannot be memory-mapped
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")

    def offsets(self, split: str) -> np.ndarray:
        """Where each document of the split starts, and the end: ending at the manifest's token count."""
        offsets = np.load(self.directory / f"{split}.idx.npy")
        count = self.manifest["splits"][split]["tokens"]
        if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != count:
            self._damaged(f"{split}.idx.npy does not end at the {count:,} tokens its manifest.json counts")
        return offsets

    def check_ids(self, split: str, *rows: np.ndarray) -> None:
        """Refuse rows read from the split that hold an id outside the tokenizer's vocabulary: a token file
        of the right size with other bytes in it. Checked on each batch as it is read (a scan of every
        token file at each start would read them whole), so it is one line rather than an index error in
        the model, or a device-side assert on a GPU."""
        top = max(int(r.max(initial=0)) for r in rows)
        if top >= self.tokenizer.vocab_size:
            self._damaged(
                f"{split}.bin holds the token id {top:,}, outside its tokenizer's {self.tokenizer.vocab_size:,} ids"
            )

    def _damaged(self, what: str) -> None:
        raise UsageError(
            f"the prepared data in {self.directory} is damaged: {what}; remove that folder and run the command "
            "again to prepare it anew"
        )

    def sources(self, split: str) -> list[str]:
        """The source name of each document of the split."""
        names = self.manifest["source_names"]
        return [names[i] for i in self.source_ids(split).tolist()]

    def source_ids(self, split: str) -> np.ndarray:
        """The source of each document of the split, as an index into manifest["source_names"]."""
        return np.load(self.directory / f"{split}.sources.npy")

    def scores(self, split: str) -> np.ndarray | None:
        """Per-document curriculum scores (float64, NaN where a document had none), or None."""
        path = self.directory / f"{split}.scores.npy"
        return np.load(path) if path.is_file() else None
