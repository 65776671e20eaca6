"""A weighted mixture of document streams, drawn document by document from a seeded generator.

Weights are in documents read: with weights 3 and 1, three of every four documents read come from
the first source on average (filters and deduplication then act on each document as usual, and the
report counts what each source kept). Reproducible from the seed, so an interrupted `prepare` can
replay the same stream and resume.

When one source runs out, `first_exhausted` stops (the weights hold to the end, the rest of the other
sources is unused) and `all_exhausted` goes on with the remaining sources (every document is used
once; the weights hold until the first source ends). Sources are never repeated: deduplication would
remove the repeats anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .sources import Document

_BLOCK = 4096  # draws made at once; a source running out discards the rest of its block


def interleave(
    streams: Sequence[Iterator[Document]], weights: Sequence[float], *, seed: int, stopping: str = "all_exhausted"
) -> Iterator[Document]:
    if len(streams) == 1:
        yield from streams[0]
        return
    heads = [next(stream, None) for stream in streams]  # an empty source leaves before the first draw
    active = [i for i, head in enumerate(heads) if head is not None]
    weight = np.asarray(weights, dtype=np.float64)
    rng = np.random.default_rng(seed)
    while active:
        p = weight[active] / weight[active].sum()
        for j in rng.choice(len(active), size=_BLOCK, p=p).tolist():
            i = active[j]
            yield heads[i]
            heads[i] = next(streams[i], None)
            if heads[i] is None:
                if stopping == "first_exhausted":
                    return
                active.remove(i)
                break  # draw again with the remaining sources' weights
