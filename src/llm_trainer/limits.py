"""Limits on what an input may make us build, decompress or read: far above anything a real input
reaches, and always reached by a crafted one (a few hundred bytes of YAML aliases, a deflate bomb,
a model config asking for a billion layers). Each refusal is one line naming the limit and the file
or setting that reached it.

    MAX_NESTING            levels of lists and mappings in a config, meta.json, model_config.json or
                           a JSONL record
    MAX_EXPANDED_VALUES    values of a config once its YAML aliases are expanded
    MAX_ARCHIVE_BYTES      decompressed size of a small torch file read back (rng.pt, DeepSpeed's
                           small files), and MAX_COMPRESSION_RATIO for each of its compressed entries
    MAX_LAYERS, MAX_PARAMETERS, MAX_SEQ_LEN
                           a model's dimensions, checked arithmetically before anything is built;
                           `check_model_memory` also weighs its parameters against this machine's memory
    MAX_DOCUMENT_CHARS     one document read from data files: longer plain-text files are cut into
                           pieces, longer JSONL lines are bad input (both counted in the data report)
    MAX_DECOMPRESSED_TEXT_BYTES
                           a compressed text file, which is read whole: also at most MAX_COMPRESSION_RATIO
                           times its size beyond its first 64 MiB (`decompressed_text_allowance`)
    MAX_EXECUTOR_TASKS     data.executor_tasks: each task has its own log, completion marker, stats
                           file and part folder, and the plan assigns files to every task
    MAX_SKIPPED_BATCHES, MAX_SKIP_RANGES
                           a saved data position's `skip` ranges (a rewind's): the batches a resume
                           passes over one by one before its first step, and how many ranges each
                           batch is checked against; and a position in a DataLoader that cannot
                           seek (the batches read to get there)
    MAX_SPIKE_WINDOW       training.loss_spike_window: the steps of history kept on the device
    MAX_TASK_FILE_BYTES, MAX_TASK_REPEATS, MAX_GEN_TOKS
                           a downstream task YAML's size, its `repeats:` and `max_gen_toks:` (`check_count`)
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any

from .errors import UsageError

MAX_NESTING = 64
MAX_EXPANDED_VALUES = 1_000_000
MAX_ARCHIVE_BYTES = 256 << 20
MAX_COMPRESSION_RATIO = 100
MAX_LAYERS = 10_000
MAX_PARAMETERS = 10**14
MAX_SEQ_LEN = 1 << 24
MAX_DOCUMENT_CHARS = 16 << 20
MAX_LINE_BYTES = 4 * MAX_DOCUMENT_CHARS  # a JSONL line holding one document of MAX_DOCUMENT_CHARS, escaped
MAX_DECOMPRESSED_TEXT_BYTES = 4 << 30
_RATIO_FREE_BYTES = 64 << 20  # a small file of repetitive text may expand past the ratio up to this
MAX_EXECUTOR_TASKS = 100_000  # a task has one file at least to do its work: cut the corpus into files first
MAX_SKIPPED_BATCHES = 10**7  # a rewind skips what was read since the last checkpoint: save_steps x accumulation
MAX_SKIP_RANGES = 10_000  # one range per rewind (training.max_rewinds, 3 by default)
MAX_SPIKE_WINDOW = 100_000  # float32 values per watched metric, on the device, sorted every step
_MODULE_BYTES_PER_LAYER = 64 << 10  # Python objects of one built block (modules, parameters), beside the weights


# ----------------------------------------------------------------------------------------------
# Structured text: nesting and alias expansion


def check_structure(value: Any, where: str, *, max_values: int = MAX_EXPANDED_VALUES) -> Any:
    """`value` (parsed JSON or YAML) if its nesting is at most MAX_NESTING and it holds at most
    `max_values` values with every alias expanded; a UsageError naming `where` otherwise. Shared
    objects (YAML aliases) are counted as often as they appear, without expanding them."""
    sizes: dict[int, int] = {}  # id -> values below and including it, for containers done
    depths: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, done = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        key = id(item)
        children = list(item.keys()) + list(item.values()) if isinstance(item, dict) else list(item)
        if done:
            active.discard(key)
            nested = [c for c in children if isinstance(c, (dict, list, tuple))]
            sizes[key] = 1 + sum(sizes[id(c)] for c in nested) + len(children) - len(nested)
            depths[key] = 1 + max((depths[id(c)] for c in nested), default=0)
            if depths[key] > MAX_NESTING:
                raise UsageError(f"{where} is nested more than {MAX_NESTING} levels deep (the nesting limit)")
            if sizes[key] > max_values:
                raise UsageError(
                    f"{where} expands to more than {max_values:,} values (YAML aliases included; the size limit)"
                )
            continue
        if key in sizes:
            continue
        if key in active:
            raise UsageError(f"{where} refers to itself (a recursive YAML alias)")
        if len(active) >= MAX_NESTING:
            raise UsageError(f"{where} is nested more than {MAX_NESTING} levels deep (the nesting limit)")
        active.add(key)
        stack.append((item, True))
        stack.extend((c, False) for c in children if isinstance(c, (dict, list, tuple)) and id(c) not in sizes)
    return value


def parse_json(text: str | bytes, where: str) -> Any:
    """json.loads, with nesting past MAX_NESTING refused in one line (json.JSONDecodeError for bad JSON)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise UsageError(f"{where} is nested more than {MAX_NESTING} levels deep (the nesting limit)") from None
    return check_structure(value, where)


def read_json_file(path: Path, where: str | None = None) -> Any:
    return parse_json(Path(path).read_text(encoding="utf-8"), where or str(path))


# ----------------------------------------------------------------------------------------------
# Compressed archives


def check_archive(path: Path | bytes, where: str | None = None, *, max_bytes: int = MAX_ARCHIVE_BYTES) -> Path | bytes:
    """Refuse a torch zip archive whose entries declare more than `max_bytes` decompressed, or whose
    compressed entries expand more than MAX_COMPRESSION_RATIO times (torch.save stores entries
    uncompressed). The reader holds each entry to its declared size, so this bounds what loading
    it allocates. A file that is not a zip archive is left to torch.load. `path`: the file, or its bytes
    already read. Returns `path`."""
    where = where or ("the archive" if isinstance(path, bytes) else str(path))
    try:
        with zipfile.ZipFile(io.BytesIO(path) if isinstance(path, bytes) else path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return path
    total = sum(entry.file_size for entry in entries)
    if total > max_bytes:
        raise UsageError(
            f"{where} declares {total:,} bytes once decompressed, over the limit of {max_bytes:,} for this file"
        )
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED and entry.file_size > MAX_COMPRESSION_RATIO * max(
            entry.compress_size, 1024
        ):
            raise UsageError(
                f"{where}: entry {entry.filename} expands {entry.file_size:,} bytes from {entry.compress_size:,}, "
                f"over the compression ratio limit of {MAX_COMPRESSION_RATIO}"
            )
    return path


def decompressed_text_allowance(compressed_bytes: int) -> tuple[int, str]:
    """How many bytes a compressed text file of `compressed_bytes` may decompress to, and that limit in words."""
    by_ratio = max(_RATIO_FREE_BYTES, MAX_COMPRESSION_RATIO * compressed_bytes)
    if by_ratio < MAX_DECOMPRESSED_TEXT_BYTES:
        return by_ratio, f"{MAX_COMPRESSION_RATIO} times its {compressed_bytes:,} bytes (limits.MAX_COMPRESSION_RATIO)"
    return MAX_DECOMPRESSED_TEXT_BYTES, (
        f"the limit of {MAX_DECOMPRESSED_TEXT_BYTES:,} bytes for a text file, which is read whole "
        "(limits.MAX_DECOMPRESSED_TEXT_BYTES)"
    )


# ----------------------------------------------------------------------------------------------
# Model dimensions


def parameter_estimate(
    *, vocab_size: int, d_model: int, n_layers: int, d_ff: int, n_heads: int, n_kv_heads: int, max_seq_len: int
) -> int:
    """The parameters of a decoder with these dimensions, by arithmetic (an upper bound of ours: untied
    head, learned positions, gated MLP, biases), so a size can be judged before anything is built."""
    head_dim = d_model // max(n_heads, 1)
    attention = d_model * (d_model + 2 * n_kv_heads * head_dim) + d_model * d_model + 4 * d_model
    mlp = 3 * d_model * d_ff + d_ff + d_model
    return 2 * vocab_size * d_model + max_seq_len * d_model + n_layers * (attention + mlp + 4 * d_model) + 2 * d_model


def check_model_dimensions(values: dict[str, int], where: str = "ModelConfig") -> int:
    """The parameter estimate of `values` (resolved model dimensions); a ValueError naming the key that
    passes a limit no real model reaches."""
    if values["n_layers"] > MAX_LAYERS:
        raise ValueError(f"{where}.n_layers ({values['n_layers']:,}) is over the limit of {MAX_LAYERS:,} layers")
    if values["max_seq_len"] > MAX_SEQ_LEN:
        raise ValueError(
            f"{where}.max_seq_len ({values['max_seq_len']:,}) is over the limit of {MAX_SEQ_LEN:,} positions"
        )
    parameters = parameter_estimate(**values)
    if parameters > MAX_PARAMETERS:
        largest = "d_ff" if values["d_ff"] > 8 * values["d_model"] else max(("vocab_size", "d_model"), key=values.get)
        raise ValueError(
            f"{where} has about {parameters:.3g} parameters, over the limit of {MAX_PARAMETERS:.0e} "
            f"(from {where}.{largest}={values[largest]:,})"
        )
    return parameters


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory() -> int | None:
    """Memory a new allocation can have on this machine now, in bytes (Linux's MemAvailable: free memory
    plus the page cache it can drop); the physical memory where that cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return machine_memory()


def check_model_memory(values: dict[str, int], where: str) -> None:
    """Refuse, before building it, a model whose fp32 weights (and the objects of its layers) would not
    fit in this machine's memory; `where` names the file or setting the dimensions come from."""
    needed = 4 * parameter_estimate(**values) + values["n_layers"] * _MODULE_BYTES_PER_LAYER
    available = machine_memory()
    if available is not None and needed > available:
        raise UsageError(
            f"{where} describes a model of about {needed / 2**30:,.1f} GiB (n_layers={values['n_layers']:,}, "
            f"d_model={values['d_model']:,}, vocab_size={values['vocab_size']:,}), more than this machine's "
            f"{available / 2**30:,.1f} GiB of memory"
        )


def check_dcp_items(storage_data: dict, where: str) -> None:
    """Refuse DCP items stored through a transform (compression): we write none, and a small compressed
    item expands to whatever it declares (the decompression limit, at zero for this format)."""
    for info in storage_data.values():
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            raise UsageError(
                f"{where} stores an item through {', '.join(map(str, transforms))}; llm-trainer writes DCP items "
                "uncompressed, and a compressed one may expand without bound (the decompression limit)"
            )


# ----------------------------------------------------------------------------------------------
# A saved data position


def check_skip(skip: list[list[int]], samples: int, per_batch: int) -> None:
    """Refuse `skip` ranges ([start, end) global sample indices, well-formed) that a resume at global
    sample `samples` could not pass over in bounded time: the loader passes over a skipped batch one at
    a time (`per_batch` samples each) and checks every batch against every range. A rewind's range only
    covers what was read since the last checkpoint, so a real one is far inside both limits."""
    where = "train_state.json's data.skip"
    if len(skip) > MAX_SKIP_RANGES:
        raise UsageError(
            f"{where} holds {len(skip):,} skipped ranges, over the limit of {MAX_SKIP_RANGES:,} (one per rewind); "
            "the file is damaged or was edited: resume from another checkpoint"
        )
    ahead = sum(-(-max(0, end - max(start, samples)) // per_batch) for start, end in skip)
    if ahead > MAX_SKIPPED_BATCHES:
        raise UsageError(
            f"{where} skips {ahead:,} batches ahead of its position (sample {samples:,}), over the limit of "
            f"{MAX_SKIPPED_BATCHES:,} (a rewind skips only what was read since the last checkpoint); the file "
            "is damaged or was edited: resume from another checkpoint"
        )


def check_skip_forward(batches: int) -> None:
    """Refuse a saved position `batches` into an epoch of an iterable that cannot seek (a DataLoader of
    the user's): a resume reads every batch before it, one at a time, to get there."""
    if batches > MAX_SKIPPED_BATCHES:
        raise UsageError(
            f"train_state.json puts the data position {batches:,} batches into an epoch of a "
            f"DataLoader that cannot seek, over the limit of {MAX_SKIPPED_BATCHES:,} batches read to get there; "
            "the file is damaged or was edited: resume from another checkpoint"
        )


# Downstream task configs (lm-eval task YAMLs)

MAX_TASK_FILE_BYTES = 1 << 20  # one task YAML (lm-eval's own are a few hundred bytes to a few KB)
MAX_TASK_REPEATS = 10_000  # `repeats:` of a task (lm-eval copies each request that many times)
MAX_GEN_TOKS = MAX_SEQ_LEN  # `generation_kwargs.max_gen_toks` of a task


def check_count(value: Any, where: str, maximum: int, *, minimum: int = 1) -> int:
    """`value` if it is an integer in [minimum, maximum]; a UsageError naming `where` otherwise (a word,
    a float, a bool or a count no real input reaches)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{where} must be a whole number, got {value!r}")
    if not minimum <= value <= maximum:
        raise UsageError(f"{where} must be from {minimum:,} to {maximum:,}, got {value:,}")
    return value
