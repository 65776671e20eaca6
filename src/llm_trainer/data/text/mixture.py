"""A weighted mixture of document streams, drawn document by document from a seeded generator.

Weights are in documents read: with weights 3 and 1, three of every four documents read come from
the first source on average (filters and deduplication then act on each document as usual, and the
report counts what each source kept). Reproducible from the seed, so an interrupted `prepare` can
replay the same stream and resume.

When one source runs out, `first_exhausted` stops (the weights hold to the end, the rest of the other
sources is unused) and `all_exhausted` goes on with the remaining sources (every document is used
once; the weights hold until the first source ends). Sources are never repeated: deduplication would
remove the repeats anyway. So under `all_exhausted` the weights order the documents and decide which
ones a `data.max_documents` limit keeps, but not which are trained on: the loader shuffles the whole
split (`weights_without_effect` says so when that is the case).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .sources import Document

if TYPE_CHECKING:
    from ...config import DataConfig

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


def weights_without_effect(config: DataConfig) -> str | None:
    """A warning when `data.sources` gives its sources different weights that cannot change what is trained:
    every document is used once (`all_exhausted`, no `max_documents` to cut the draw short), and the
    loader's shuffle undoes the order they drew. None otherwise."""
    sources = config.sources or []
    if len({source.weight for source in sources}) <= 1:
        return None
    if config.mixture_stopping != "all_exhausted" or config.max_documents is not None:
        return None
    weights = ", ".join(f"{source.name} {source.weight:g}" for source in sources)
    return (
        f"data.sources' weights ({weights}) do not change what is trained: with data.mixture_stopping: "
        "all_exhausted (the default) every document of every source is used once, and the training order is "
        "shuffled; set data.mixture_stopping: first_exhausted for the weights to hold to the end (the draw "
        "stops when one source runs out, the rest of the others unused), or data.max_documents to draw that "
        "many by weight"
    )
