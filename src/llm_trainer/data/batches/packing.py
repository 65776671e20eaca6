"""Packing arithmetic without torch: documents cut into row-sized pieces, pieces packed first-fit-decreasing.

Used by the loader's rows and by `prepare`'s report (padding fraction per strategy), which must not
need torch.
"""

from __future__ import annotations

import numpy as np


def document_pieces(offsets: np.ndarray, capacity: int) -> np.ndarray:
    """Cut documents longer than `capacity` into capacity-sized pieces; (N, 2) [start, end) pairs."""
    out = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for s in range(start, end, capacity):
            out.append((s, min(s + capacity, end)))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def first_fit_decreasing(pieces: np.ndarray, capacity: int) -> list[list[tuple[int, int]]]:
    """Longest first, each into the first bin with room; a segment tree finds that bin in O(log n)."""
    order = np.argsort(-(pieces[:, 1] - pieces[:, 0]), kind="stable")
    size = 1
    while size < max(1, len(pieces)):
        size *= 2
    room = [0] * (2 * size)  # max free space in each subtree; leaves = bins (a list: scalar ops are hot here)
    bins: list[list[tuple[int, int]]] = []
    starts, ends = pieces[:, 0].tolist(), pieces[:, 1].tolist()
    for i in order.tolist():
        start, end = starts[i], ends[i]
        need = end - start
        if room[1] >= need:  # descend to the leftmost bin with enough room
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= need else 2 * node + 1
            b = node - size
        else:
            b = len(bins)
            bins.append([])
            node = b + size
            room[node] = capacity
        bins[b].append((start, end))
        room[node] -= need
        node //= 2
        while node:
            left, right = room[2 * node], room[2 * node + 1]
            room[node] = left if left > right else right
            node //= 2
    return bins
