"""Which source each validation target token comes from, so that one evaluation pass gives the loss of
every source of a mixture (`data.sources`) beside the mixed one.

Each source keeps its own held-out part: the validation split holds documents of every source (a
fraction of each one's documents, or of each document's tokens), recorded per document in
`val.sources.npy`. Rows may pack documents of several sources; every target token counts for the
source of the document it belongs to, so the per-source losses are token-weighted parts of the mixed
one (their token-weighted mean is the mixed loss).
"""

from __future__ import annotations

import numpy as np

from .loader import DocumentRows, WindowRows


def of_split(rows, prepared, split: str = "val") -> SourceLabels | None:
    """The labels of a prepared split's rows when the data has several sources (None for one)."""
    names = prepared.manifest["source_names"]
    if len(names) < 2:
        return None
    doc_sources = prepared.source_ids(split)
    offsets = prepared.offsets(split)
    if len(doc_sources) != len(offsets) - 1 or (
        len(doc_sources) and not 0 <= doc_sources.min() <= doc_sources.max() < len(names)
    ):
        raise ValueError(f"{split}.sources.npy does not match {split}.idx.npy")
    return SourceLabels(rows, offsets, doc_sources, names)


class SourceLabels:
    """`labels(indices)`: (B, L) int64, the source index of each target token of those rows (-1 past the data)."""

    def __init__(self, rows, doc_offsets: np.ndarray, doc_sources: np.ndarray, names: list[str]):
        self.rows, self.names = rows, list(names)
        self.starts = np.asarray(doc_offsets[:-1], dtype=np.int64)
        self.doc_sources = np.asarray(doc_sources, dtype=np.int64)
        self.n_tokens = int(doc_offsets[-1]) if len(doc_offsets) else 0

    def _of_positions(self, positions: np.ndarray) -> np.ndarray:
        doc = np.searchsorted(self.starts, positions, side="right") - 1
        valid = (positions >= 0) & (positions < self.n_tokens) & (doc >= 0)
        return np.where(valid, self.doc_sources[np.clip(doc, 0, max(len(self.doc_sources) - 1, 0))], -1)

    def labels(self, indices: np.ndarray) -> np.ndarray:
        rows, L = self.rows, self.rows.length
        if isinstance(rows, WindowRows):  # row i's targets are tokens offset + i*L + 1 ... + L
            starts = rows.offset + np.asarray(indices, dtype=np.int64) * L
            return self._of_positions(starts[:, None] + np.arange(1, L + 1))
        assert isinstance(rows, DocumentRows)
        out = np.full((len(indices), L), -1, dtype=np.int64)
        for r, i in enumerate(indices):
            positions = np.concatenate([np.arange(s, e) for s, e in rows.rows[i]])[1 : L + 1]
            out[r, : len(positions)] = self._of_positions(positions)
        return out

    def for_loader(self, loader):
        """The labels of each batch `iter(loader)` yields, in the same order."""
        for indices, _ in loader.eval_batch_indices():
            yield self.labels(indices)
