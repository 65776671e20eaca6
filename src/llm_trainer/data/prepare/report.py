"""What `prepare` did: counters while it runs, a progress bar, data_report.json, a printed summary.

Removals are counted by reason, in documents and in bytes, and the first `NAMED_REMOVALS` of each
reason are named: where the document was read (file, file:line, file[row], dataset:split[i]), its
size, and for a quality filter the measured value and the threshold (the DataConfig field) it broke,
so a user whose corpus vanished can see which files went and why. A filter that removes more than
half of the bytes read is also printed as a one-line warning.

The counters are plain JSON so that every committed shard can carry a snapshot of them and a resumed
run continues counting from there (the report of a resumed run equals that of an uninterrupted one).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...logs import log
from ..batches.packing import document_pieces, first_fit_decreasing
from ..text.filters import Removal

if TYPE_CHECKING:
    from ..text.sources import SourceStats

REPORT = "data_report.json"
NAMED_REMOVALS = 20  # removed documents named per reason in data_report.json
WARN_FRACTION = 0.5  # a reason that removes more than this share of the bytes read is printed as a warning


class Counts:
    """documents in/out, removals by reason (documents, bytes, the first ones named), per-source figures."""

    def __init__(self, removed_keys: list[str] = ()):
        self.documents_in = 0
        self.documents_out = 0
        self.bytes_in = 0
        self.removed: Counter = Counter({key: 0 for key in removed_keys})  # zeros: every active filter is listed
        self.removed_bytes: Counter = Counter({key: 0 for key in removed_keys})
        self.named: dict[str, list[dict]] = {}  # reason -> the first NAMED_REMOVALS removed documents
        self.sources: dict[str, Counter] = {}

    def document(
        self,
        source: str,
        nbytes: int,
        reason: str | None,
        tokens: int = 0,
        *,
        origin: str | None = None,
        removal: Removal | None = None,
    ) -> None:
        per = self.sources.setdefault(source, Counter(documents_in=0, documents_out=0, tokens=0, bytes=0))
        self.documents_in += 1
        self.bytes_in += nbytes
        per["documents_in"] += 1
        per["bytes"] += nbytes
        if reason is None:
            self.documents_out += 1
            per["documents_out"] += 1
            per["tokens"] += tokens
            return
        self.removed[reason] += 1
        self.removed_bytes[reason] += nbytes
        named = self.named.setdefault(reason, [])
        if len(named) < NAMED_REMOVALS:
            entry = {"origin": origin or source, "bytes": nbytes}
            if removal is not None and removal.setting is not None:
                entry.update(value=removal.value, threshold=removal.threshold, setting=removal.setting)
            named.append(entry)

    def to_json(self) -> dict:
        return {
            "documents_in": self.documents_in,
            "documents_out": self.documents_out,
            "bytes_in": self.bytes_in,
            "removed": dict(self.removed),
            "removed_bytes": dict(self.removed_bytes),
            "named": self.named,
            "sources": {k: dict(v) for k, v in self.sources.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> Counts:
        counts = cls()
        counts.documents_in, counts.documents_out, counts.bytes_in = (
            data["documents_in"],
            data["documents_out"],
            data["bytes_in"],
        )
        counts.removed = Counter(data["removed"])
        counts.removed_bytes = Counter(data["removed_bytes"])
        counts.named = {k: list(v) for k, v in data["named"].items()}
        counts.sources = {k: Counter(v) for k, v in data["sources"].items()}
        return counts


def padding_fractions(offsets: np.ndarray, length: int) -> dict[str, float]:
    """Share of row positions that are padding under each layout, for rows of `length` tokens.

    greedy has none (windows are cut from one stream; only the last partial window is dropped);
    first_fit and unpacked pad every row to length + 1 tokens (inputs plus the last target).
    """
    sizes = np.diff(offsets)
    total = int(sizes.sum())
    if total == 0:
        return {"greedy": 0.0, "first_fit": 0.0, "unpacked": 0.0}
    capacity = length + 1
    pieces = document_pieces(offsets, capacity)
    first_fit_rows = len(first_fit_decreasing(pieces, capacity))
    return {
        "greedy": 0.0,
        "first_fit": round(1.0 - total / (first_fit_rows * capacity), 6),
        "unpacked": round(1.0 - total / (len(pieces) * capacity), 6),
    }


class Progress:
    """A tqdm bar of bytes read (terminals only: tqdm turns itself off when stderr is not a TTY)."""

    def __init__(self, enabled: bool, initial_bytes: int = 0):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                desc="prepare",
                unit="B",
                unit_scale=True,
                initial=initial_bytes,
                file=sys.stderr,
                disable=None,
                dynamic_ncols=True,
                leave=False,
            )

    def update(self, nbytes: int, documents: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(docs=documents, tokens=tokens, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_report(
    counts: Counts,
    splits: dict,
    *,
    seconds: float,
    reader_skipped: SourceStats,
    padding: dict | None,
    shards: int,
    resumed_from_shard: int | None,
) -> dict:
    tokens = sum(s["tokens"] for s in splits.values())
    return {
        "documents_in": counts.documents_in,
        "documents_out": counts.documents_out,
        "tokens": tokens,
        "splits": splits,
        "removed": dict(counts.removed),
        "removed_bytes": dict(counts.removed_bytes),
        "removed_documents": counts.named,
        "skipped_inputs": dict(reader_skipped.skipped),
        "skipped_inputs_named": reader_skipped.named,
        "sources": {k: dict(v) for k, v in counts.sources.items()},
        "padding_fraction": padding,
        "bytes_in": counts.bytes_in,
        "seconds": round(seconds, 3),
        "bytes_per_second": round(counts.bytes_in / seconds, 1) if seconds > 0 else None,
        "shards": shards,
        "resumed_from_shard": resumed_from_shard,
    }


def write_report(directory: Path, report: dict) -> None:
    (directory / REPORT).write_text(json.dumps(report, indent=2))


def print_summary(report: dict) -> None:
    """The report as a few lines on stderr."""
    removed = ", ".join(f"{k} {v:,}" for k, v in sorted(report["removed"].items()) if v) or "none"
    skipped = ", ".join(f"{k} {v:,}" for k, v in sorted(report["skipped_inputs"].items()) if v)
    mb = report["bytes_in"] / 1e6
    speed = (report["bytes_per_second"] or 0) / 1e6
    log(
        f"data: {report['documents_in']:,} documents in -> {report['documents_out']:,} out, {report['tokens']:,} tokens "
        f"({mb:,.1f} MB in {report['seconds']:.1f}s, {speed:.2f} MB/s)"
    )
    log(f"data: removed: {removed}" + (f"; skipped inputs: {skipped}" if skipped else ""))
    for kind, names in sorted(report.get("skipped_inputs_named", {}).items()):
        more = report["skipped_inputs"][kind] - 1
        log(
            f"data: skipped ({kind}): {names[0]}"
            + (f"; {more:,} more, listed in skipped_inputs_named of {REPORT}" if more else "")
        )
    if len(report["sources"]) > 1:
        for name, per in report["sources"].items():
            log(
                f"data: source {name}: {per['documents_in']:,} in -> {per['documents_out']:,} out, {per['tokens']:,} tokens"
            )
    if report["padding_fraction"]:
        pads = ", ".join(f"{k} {v:.1%}" for k, v in report["padding_fraction"].items())
        log(f"data: padding at max_length: {pads}")
    for line in warnings(report):
        log(line)


_COUNTED = {"min_length": "characters", "max_chars": "characters", "min_words": "words", "max_words": "words"}


def _example(reason: str, entry: dict) -> str:
    """'FILE (alpha_fraction 0.58 vs min_alpha_fraction 0.6)', 'FILE (398 characters vs min_length 1000)'
    where the filter is named as its setting, or just the origin for a duplicate."""
    if "setting" not in entry:
        return entry["origin"]
    measured = f"{entry['value']:,} {_COUNTED[reason]}" if reason in _COUNTED else f"{reason} {entry['value']}"
    return f"{entry['origin']} ({measured} vs {entry['setting']} {entry['threshold']})"


def _fix(reason: str, entry: dict, *, warning: bool = False) -> str:
    if "setting" in entry:
        return (
            "if that text is wanted, " if warning else ""
        ) + f"change data.{entry['setting']} or data.quality_filters"
    if reason.endswith("duplicates"):
        return "check the sources for repeated copies"
    return "the documents are empty after cleaning; check data_files and text_column"


def nothing_kept(counts: Counts) -> str:
    """The one-line error for a prepare that kept no training document: what removed them, with an example."""
    removed = [(reason, n) for reason, n in counts.removed.most_common() if n]
    if counts.documents_in == 0 or counts.documents_out > 0 or not removed:
        return "the data sources produced no training documents; check data_files / dataset_name and min_length"
    reasons = ", ".join(f"{n:,} by {reason}" for reason, n in removed)
    top = removed[0][0]
    first = counts.named[top][0]
    return (
        f"no training documents: all {counts.documents_in:,} documents read were removed ({reasons}), "
        f"e.g. {_example(top, first)}; {_fix(top, first)}"
    )


def warnings(report: dict) -> list[str]:
    """One line per reason that removed more than WARN_FRACTION of the bytes read: how much, an example, the fix."""
    lines = []
    total = report["bytes_in"]
    for reason, nbytes in sorted(report["removed_bytes"].items(), key=lambda item: -item[1]):
        if total == 0 or nbytes <= WARN_FRACTION * total:
            continue
        first = report["removed_documents"][reason][0]
        lines.append(
            f"data: warning: {reason} removed {nbytes / total:.0%} of the bytes read "
            f"({report['removed'][reason]:,} documents), e.g. {_example(reason, first)}; "
            f"see removed_documents in {REPORT}; {_fix(reason, first, warning=True)}"
        )
    return lines
