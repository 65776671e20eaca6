"""FSDP2 checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shards.

A sharded checkpoint folder holds `sharded/` (DCP files for the model and optimizer, keyed by
parameter name) in place of `model.safetensors` and the optimizer files; the rest of the folder is as
for any checkpoint. DCP reshards on load, so the same files load at another world size, and
`consolidate` turns them into one safetensors model in a single process.

DCP's own reader unpickles `.metadata` with plain `pickle` and its planner `torch.load`s non-tensor
items without `weights_only`: a crafted folder would run code. So `SafeWriter` writes `.metadata`
with `torch.save` (protocol 2, which torch's weights-only unpickler reads; the folder as a string,
not a path object), and every load goes through `SafeReader` (`.metadata` read once, checked against
meta.json, and unpickled by `files.safe_pickle` with exactly DCP's metadata records allowed; every data
file under `files.folder_files`' rule) and `SafePlanner` (non-tensor items with `weights_only=True`).
A `.metadata` in DCP's own format (an FSDP checkpoint written before) is refused, not unpickled.

Into a store (training.checkpoint_dir a URL), every rank writes its DCP files straight to the
checkpoint's `sharded/` folder there through torch's fsspec writer (`StoreWriter`: `.metadata` as
above; each file hashed as its bytes go out, never read back). The (name, size, checksum) records of
all ranks are gathered, and meta.json lists them under `in_store` beside the local files, which are
uploaded as before (`remote`). A resume reads those files from the store through `StoreReader`: each
file a rank needs is read whole into memory once and checked against meta.json before DCP parses a
byte of it, so each rank reads only the files holding its shards, and no plain pickle runs.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..config import ModelConfig
from ..errors import CheckpointError, first_line
from ..files import buckets
from ..files.atomic import write_file
from ..files.checksums import StreamChecksum, data_checksum
from ..files.folder_files import SHARDED_DIR, FolderFiles
from ..files.safe_pickle import DCP_METADATA, load_pickle
from ..limits import check_dcp_items
from .durable import save_failure
from .fused_projections import is_fused, split_fused, split_fused_shapes
from .layout import STAGING
from .model_folder import check_fits, clean_name, current_names

METADATA = ".metadata"  # DCP's index of the shards, inside `sharded/`


class SafeWriter(FileSystemWriter):
    """FileSystemWriter whose `.metadata` torch's weights-only unpickler can read: DCP writes its own,
    then it is replaced (an atomic rename) by the same records through `torch.save`."""

    def finish(self, metadata: Metadata, results: list) -> None:
        super().finish(metadata, results)  # fills in metadata.storage_data and storage_meta
        write_file(Path(self.path) / METADATA, _metadata_bytes(metadata))


def _metadata_bytes(metadata: Metadata) -> bytes:
    """`.metadata` as the weights-only unpickler reads it: `torch.save`, the checkpoint id a string (not a
    pathlib object)."""
    if metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id is not None:
        metadata.storage_meta.checkpoint_id = str(metadata.storage_meta.checkpoint_id)
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return buffer.getvalue()


# The optimizer state as DCP saves it: each parameter's settings under its own name
# (`optimizer.param_groups.<name>.lr`), so ranks that hold different parameters (pipeline stages) each
# save their own, and a run at another layout reads every parameter's back.
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER),
    }


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read once, checked against the checkpoint's meta.json and
    unpickled by torch's weights-only unpickler; every data file it names must be one the folder may
    be read for (`files.folder_files`)."""

    def __init__(self, path: str, files: FolderFiles | None = None):
        super().__init__(path)
        folder = Path(path)
        self.files = files if files is not None else FolderFiles.of(folder.parent)  # the checkpoint folder
        self.source = str(self.files.folder / SHARDED_DIR / METADATA)  # how errors name `.metadata`
        self.metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} holds per-rank DCP metadata, which llm-trainer never writes")
        if self.metadata is None:  # read once: `_load` checks it before DCP asks for it
            self.metadata = self._read_metadata()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def _read_metadata(self) -> Metadata:
        name = f"{SHARDED_DIR}/{METADATA}"
        source = str(self.files.folder / name)
        in_store = (self.files.meta or {}).get("in_store")
        if isinstance(in_store, list) and name in in_store and not os.path.lexists(source):
            raise CheckpointError(
                f"{self.files.folder} keeps its shards in the store ({name} is not on disk); pass the checkpoint's "
                "URL instead, or resume with training.checkpoint_dir set to its store"
            )
        return _checked_metadata(self.files.read(name), source, self._file_size)

    def _file_size(self, data_file: str) -> int:
        return self.files.path(f"{SHARDED_DIR}/{data_file}").stat().st_size  # the rule first: else refused


def _checked_metadata(data: bytes, source: str, file_size: Callable[[str], int]) -> Metadata:
    """DCP metadata from `data` (checked bytes of `.metadata`), unpickled under the allow-list; every data
    file it names must be a plain file name that `file_size` accepts (it raises otherwise, and returns
    the file's size), and every item must lie inside its file."""
    metadata = load_pickle(data, source, DCP_METADATA)
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(metadata.storage_data, dict)
        or not isinstance(metadata.state_dict_metadata, dict)
    ):
        raise CheckpointError(f"{source} is not DCP metadata; the checkpoint is corrupt")
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        data_file = getattr(info, "relative_path", None)
        if not isinstance(data_file, str) or "/" in data_file:
            raise CheckpointError(f"{source} names the data file {data_file!r}, which is not a file name")
        if data_file not in sizes:
            sizes[data_file] = file_size(data_file)  # inside, a regular file, listed: else refused
        _check_extent(index, info, sizes[data_file], source)
    check_dcp_items(metadata.storage_data, source)  # compressed items: refused before any is read
    if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader.read_metadata adds
        metadata.storage_meta = StorageMeta()
    return metadata


class _HashingStream:
    """A writable stream that hashes every byte on its way to the store (DCP writes each file through one)."""

    def __init__(self, raw: Any, checksum: StreamChecksum):
        self._raw, self._checksum = raw, checksum

    def write(self, data: Any) -> int:
        self._checksum.update(data)
        return self._raw.write(data)

    def __getattr__(self, name: str) -> Any:  # tell, flush, close: the store's file object
        return getattr(self._raw, name)


class _HashedWrites:
    """torch's fsspec file system for a DCP writer, recording {file name: size and checksum} of each file
    once it is closed (the object is then complete in the store)."""

    def __init__(self, inner: Any, written: dict[str, dict]):
        self._inner, self.written = inner, written

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        checksum = StreamChecksum()
        with self._inner.create_stream(path, mode) as stream:
            yield _HashingStream(stream, checksum)
        self.written[os.path.basename(os.fspath(path))] = checksum.entry()

    def rm_file(self, path: Any) -> None:
        """Delete by name: fsspec's `rm` would expand `[`, `*` and `?` in the URL into other folders' files."""
        buckets.remove(os.fspath(path))

    def rename(self, path: Any, new_path: Any) -> None:
        """Copy, then delete, by name (fsspec's `mv` expands patterns as `rm` does; a store cannot rename)."""
        buckets.copy(os.fspath(path), os.fspath(new_path))
        buckets.remove(os.fspath(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StoreWriter(FsspecWriter):
    """FsspecWriter into a store folder (a URL): `.metadata` as `SafeWriter` writes it, and `written`
    holds the size and checksum of every file this rank wrote, computed from the bytes as they went out."""

    def __init__(self, url: str):
        super().__init__(url, sync_files=False)  # an object is complete once closed: nothing to fsync
        self.url = url.rstrip("/")
        self.written: dict[str, dict] = {}
        self.fs = _HashedWrites(self.fs, self.written)

    def finish(self, metadata: Metadata, results: list) -> None:
        super().finish(metadata, results)  # fills in metadata.storage_data (DCP's own .metadata, replaced now)
        data = _metadata_bytes(metadata)
        buckets.write_bytes(buckets.join(self.url, METADATA), data)
        self.written.pop(f"{METADATA}.tmp", None)
        self.written[METADATA] = {"size": len(data), "checksum": data_checksum(data)}


class _CheckedReads:
    """torch's fsspec file system for a DCP reader: each file read whole from the store (with retries)
    and checked against meta.json before DCP reads a byte of it."""

    def __init__(self, inner: Any, url: str, files: FolderFiles):
        self._inner, self.url, self.files = inner, url, files

    def read(self, name: str) -> bytes:
        url = buckets.join(self.url, name)
        data = buckets.read_bytes(url)
        self.files.check(f"{SHARDED_DIR}/{name}", data, url)
        return data

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.BytesIO]:
        assert mode == "rb", mode  # a reader never writes
        yield io.BytesIO(self.read(os.path.basename(os.fspath(path))))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StoreReader(FsspecReader):
    """FsspecReader of a checkpoint's `sharded/` folder in a store: every file (`.metadata` too) must be
    listed in the local copy's meta.json (`files`) and match its size and checksum; `.metadata` is
    unpickled under the allow-list, as by `SafeReader`."""

    def __init__(self, url: str, files: FolderFiles):
        super().__init__(url)
        self.url = url.rstrip("/")
        self.checked = _CheckedReads(self.fs, self.url, files)
        self.fs = self.checked
        self.metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.url} holds per-rank DCP metadata, which llm-trainer never writes")
        if self.metadata is None:
            self.metadata = _checked_metadata(self.checked.read(METADATA), self.source, self._listed_size)
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    @property
    def source(self) -> str:
        return buckets.join(self.url, METADATA)

    def _listed_size(self, data_file: str) -> int:
        """The size meta.json records for `data_file` (its bytes are checked against it as they are read)."""
        files = self.checked.files
        entry = (files.meta or {}).get("files", {}).get(f"{SHARDED_DIR}/{data_file}")
        if f"{SHARDED_DIR}/{data_file}" not in (files.listed or ()) or not isinstance(entry, dict):
            raise CheckpointError(f"{self.source} names {data_file}, which meta.json does not list; refusing it")
        return entry["size"]


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor items (optimizer hyperparameters) with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"the sharded checkpoint's item {read_item.dest_index.fqn} holds more than plain data "
                f"({first_line(exc, 120)}); refusing to load it"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# What dcp.load warns whenever it reads in one process, even where it was told to (`no_dist=True`).
ONE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _load(state: dict, directory: Path, no_dist: bool = False, store: str | None = None) -> None:
    """dcp.load through the safe reader (of `store`, the URL of the `sharded/` folder, when the shards
    live there) and planner. The metadata is checked here first, so a refusal comes out as itself (not
    as DCP's per-rank CheckpointException, after DCP logged a traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if store is None:
        reader = SafeReader(str(directory))
    else:
        reader = StoreReader(store, FolderFiles.of(Path(directory).parent))
    _check_records(reader.read_metadata(), state, reader.source)
    try:
        with warnings.catch_warnings():
            if no_dist:  # asked for: DCP's warning that it assumes one process would be noise on the console
                warnings.filterwarnings("ignore", message=ONE_PROCESS_WARNING, category=UserWarning)
            dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        for failure in failures:
            if isinstance(failure, CheckpointError):
                raise failure from None
        # every record was checked against the files and the model: what is left is a damaged item
        raise CheckpointError(
            f"{reader.source}: an item could not be read ({first_line(failures[0]) if failures else exc}); "
            "the checkpoint is damaged, resume from another one"
        ) from None


# ----------------------------------------------------------------------------------------------
# The records of `.metadata`, checked before DCP reads an item: it trusts them, and a record that
# describes what is not there ends in a traceback, an allocation of whatever it declares, or a tensor
# filled from outside its own bytes.


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_extent(index: Any, info: Any, file_size: int, source: str) -> None:
    """The item `index` (its storage record `info`) lies inside its data file of `file_size` bytes."""
    fqn = getattr(index, "fqn", index)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(index, MetadataIndex) or not _is_count(offset) or not _is_count(length):
        raise CheckpointError(f"{source} has a malformed record of {fqn!r} (offset {offset!r}, length {length!r})")
    if offset + length > file_size:
        raise CheckpointError(
            f"{source} places {fqn} at bytes [{offset:,}, {offset + length:,}) of {info.relative_path}, "
            f"past the end of its {file_size:,} bytes; the checkpoint is damaged or was crafted"
        )


def _check_records(metadata: Metadata, state: dict, source: str) -> None:
    """Each item `state` (the model's and optimizer's state to fill) will read: recorded, a tensor where
    the model has one and bytes where it has plain data, of the model's shape, its chunks inside that
    shape covering it exactly once, each with its data."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    for fqn, value in flat.items():
        record = metadata.state_dict_metadata.get(fqn)
        if record is None:
            raise CheckpointError(
                f"{source} has no record of {fqn}, which this model (or optimizer) has: the checkpoint holds "
                "another model, or is damaged"
            )
        if not isinstance(value, torch.Tensor):
            if not isinstance(record, BytesStorageMetadata):
                raise CheckpointError(
                    f"{source} records {fqn} as {type(record).__name__}, where this run has plain data"
                )
            _require_data(metadata, MetadataIndex(fqn), fqn, source)
            continue
        if not isinstance(record, TensorStorageMetadata):
            kind = "bytes" if isinstance(record, BytesStorageMetadata) else type(record).__name__
            raise CheckpointError(f"{source} records {fqn} as {kind}, where this model has a tensor")
        _check_tensor_record(metadata, fqn, record, tuple(value.size()), source)


def _fewer_vocab_rows(fqn: str, size, shape: tuple[int, ...]) -> str:
    """The way out when an embedding or head has fewer rows than this model's padded vocabulary: a
    checkpoint written before the vocabulary was padded."""
    vocab_rows = fqn.endswith(("tok_emb.weight", "lm_head.weight"))
    if vocab_rows and len(size) == len(shape) == 2 and size[1] == shape[1] and size[0] < shape[0]:
        return "; written with unpadded vocabulary rows? set model.vocab_pad_multiple: 1 to load it"
    return ""


def _check_tensor_record(
    metadata: Metadata, fqn: str, record: TensorStorageMetadata, shape: tuple[int, ...], source: str
) -> None:
    size, chunks = getattr(record, "size", None), getattr(record, "chunks", None)
    if not isinstance(size, (tuple, list)) or not all(map(_is_count, size)):
        raise CheckpointError(f"{source} records {fqn} with a malformed shape ({size!r})")
    if tuple(size) != shape:
        raise CheckpointError(
            f"{source} records {fqn} of shape {tuple(size)}, this model's is {shape}{_fewer_vocab_rows(fqn, size, shape)}"
        )
    if not isinstance(getattr(getattr(record, "properties", None), "dtype", None), torch.dtype):
        raise CheckpointError(f"{source} records {fqn} without a tensor type")
    if not isinstance(chunks, list):
        raise CheckpointError(f"{source} records {fqn} with malformed chunks")
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        ok = all(
            isinstance(v, (tuple, list)) and len(v) == len(shape) and all(map(_is_count, v)) for v in (offsets, sizes)
        )
        if not ok or any(o + n > s for o, n, s in zip(offsets, sizes, shape)):
            raise CheckpointError(
                f"{source} records a chunk of {fqn} at offsets {offsets!r} of sizes {sizes!r}, outside its shape "
                f"{shape}; the checkpoint is damaged or was crafted"
            )
        _require_data(metadata, MetadataIndex(fqn, torch.Size(offsets)), fqn, source)
        boxes.append((tuple(offsets), tuple(sizes)))
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape) or _overlap(boxes):
        raise CheckpointError(
            f"{source} records chunks of {fqn} that do not cover its shape {shape} exactly once; "
            "the checkpoint is damaged or was crafted"
        )


def _require_data(metadata: Metadata, index: MetadataIndex, fqn: str, source: str) -> None:
    if index not in metadata.storage_data:
        offset = "" if index.offset is None else f" at offsets {tuple(index.offset)}"
        raise CheckpointError(f"{source} names no data for {fqn}{offset}; the checkpoint is damaged")


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two non-empty boxes (offsets, sizes) share an element: a sweep along the first dimension,
    so chunks side by side along it (FSDP's shards) are each compared with their neighbours only."""
    boxes = sorted(box for box in boxes if all(box[1]) and box[1])
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1 :]:
            if other[0] >= offsets[0] + sizes[0]:
                break
            if all(b < a + n and a < b + m for a, n, b, m in zip(offsets, sizes, other, other_sizes)):
                return True
    return False


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the whole model on rank 0 (CPU); a collective, every rank must call it. Empty on others."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_name(k): v for k, v in state.items()}


class BackgroundShards:
    """What `dcp.async_save` keeps from one sharded save to the next (as torchtitan does): the host
    buffers each rank's shards are copied into (DCP's `DefaultStager`, which reuses them; pinned for
    CUDA tensors) and gloo process groups of their own. DCP's writer thread runs its collectives on
    `group` while the training thread runs its own on the default group, and checks whether every
    rank's write is complete on `agree`: collectives on one group from two threads would interleave.
    Every rank creates it at the same point (`new_group` is a collective)."""

    def __init__(self, cuda: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,  # the write runs in a thread of this process
                use_async_staging=False,  # the copy completes before the step that changes the weights
                use_non_blocking_copy=cuda,
            )
        )
        self.group = torch.distributed.new_group(backend="gloo")
        self.agree = torch.distributed.new_group(backend="gloo")

    def all_done(self, done: bool) -> bool:
        """Whether every rank's background write is complete (each says whether its own is)."""
        flag = torch.tensor([int(done)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.agree)
        return bool(flag.item())

    def close(self) -> None:
        self.stager.close()
        for group in (self.group, self.agree):
            torch.distributed.destroy_process_group(group)


def _save(state: dict, writer: Any, background: BackgroundShards | None, failed: Callable[[Exception], Exception]):
    """`dcp.save`, or with `background` `dcp.async_save`: the shards copied into host memory now, written by
    DCP's thread. Returns a function that waits for the write to complete (at once for `dcp.save`), every
    rank's (DCP gathers each rank's result before it finishes); a failure of any rank is raised there, on
    every rank, as `failed(the first rank's error)`."""
    from torch.distributed.checkpoint.api import CheckpointException

    def finish(result: Callable[[], Any]) -> None:
        try:
            result()
        except CheckpointException as exc:
            failure = next(iter(exc.failures.values()))
            raise failed(failure[0] if isinstance(failure, tuple) else failure) from None

    if background is None:
        finish(lambda: dcp.save(state, storage_writer=writer))
        return lambda: None
    future = dcp.async_save(
        state, storage_writer=writer, process_group=background.group, async_stager=background.stager
    )
    return lambda: finish(future.result)


def save_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, background: BackgroundShards | None = None
) -> Callable[[], None]:
    """Every rank writes its shards of model and optimizer into `directory` (a collective), now or with
    `background` in DCP's thread (see `_save`). Returns the wait for the write."""
    checkpoint = Path(directory).name.removeprefix(STAGING)  # the checkpoint folder the shards are for

    def failed(error: Exception) -> Exception:
        return save_failure(error, Path(directory).parent / checkpoint) or CheckpointError(
            f"writing the shards of {checkpoint} failed ({first_line(error)}); the earlier checkpoints and "
            "`latest` are intact"
        )

    return _save(_sharded_state(model, optimizer), SafeWriter(str(directory)), background, failed)


def save_sharded_to_store(
    model: nn.Module, optimizer: torch.optim.Optimizer, url: str, background: BackgroundShards | None = None
) -> Callable[[], dict[str, dict]]:
    """Every rank writes its shards straight into the store folder `url` (a collective), now or with
    `background` in DCP's thread. Returns the wait for the write, which returns the
    {"sharded/NAME": {"size", "checksum"}} of the files all ranks wrote, on every rank (gathered on
    `background.group` in the background)."""
    writer = StoreWriter(url)

    def failed(error: Exception) -> Exception:
        return CheckpointError(
            f"writing the shards to {url} failed ({first_line(error)}); "
            "the earlier checkpoints and `latest` are intact. Check the store, then resume from latest"
        )

    wait = _save(_sharded_state(model, optimizer), writer, background, failed)

    def records() -> dict[str, dict]:
        wait()
        mine = {f"{SHARDED_DIR}/{name}": entry for name, entry in writer.written.items()}
        if not torch.distributed.is_initialized():
            return mine
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine, group=None if background is None else background.group)
        return {name: entry for written in everyone for name, entry in written.items()}

    return records


def load_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Path, store: str | None = None
) -> None:
    """Load model (and optimizer) shards for this rank's part, whatever world size wrote them; into a
    model that is not sharded (one process, DDP), the whole of each tensor. `store`: the URL of the
    `sharded/` folder whose DCP files the local `directory` does not hold."""
    state = {"model": get_model_state_dict(model)}
    records = _reader(directory, store).read_metadata().state_dict_metadata
    _refuse_fused(model, directory, records)
    # checkpoints written before the optimizer state was saved per parameter keep one list of groups
    options = FLAT_OPTIMIZER if any(name.startswith("optimizer.param_groups.") for name in records) else None
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=options)
    _load(state, directory, no_dist=not torch.distributed.is_initialized(), store=store)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def load_whole(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict,
    optimizer_state: dict,
    source: str,
    *,
    saved_order: list[str] | None = None,
    elsewhere: frozenset[str] = frozenset(),
) -> None:
    """A whole checkpoint's weights and optimizer state (`optimizer.state_dict()` of the same model and
    parameter groups, in one process or DDP) into a sharded model: each rank keeps its own shards.

    Where `model` holds only part of the whole (a pipeline stage), `elsewhere` names the tensors the other
    parts hold, and `saved_order` the names of the whole model's parameters in the order the saved
    optimizer state numbers them (its groups one after another); this part takes its own by name."""
    weights = current_names(model, weights)
    check_fits(model, weights, source, elsewhere)
    weights = {name: tensor for name, tensor in weights.items() if name not in elsewhere}
    options = StateDictOptions(full_state_dict=True, strict=False)  # a tied output head is saved once
    set_model_state_dict(model, weights, options=options)
    by_param = {id(p): clean_name(name) for name, p in model.named_parameters()}
    mine = [by_param[id(p)] for group in optimizer.param_groups for p in group["params"]]
    names = mine if saved_order is None else saved_order  # the saved ids' order
    saved = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    if sorted(saved) != list(range(len(names))):
        raise ValueError(f"it numbers {len(saved)} parameters, this model has {len(names)}")
    held = set(mine)
    state = {
        "state": {names[i]: value for i, value in optimizer_state["state"].items() if names[i] in held},
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[i] for i in group["params"] if names[i] in held],
            }
            for group in optimizer_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, state, options=options)


def _reader(directory: Path, store: str | None = None):
    """The checked reader of a sharded checkpoint's `sharded/` folder (`directory`), or of its store copy."""
    return SafeReader(str(directory)) if store is None else StoreReader(store, FolderFiles.of(Path(directory).parent))


def _fused_records(model: nn.Module, records: dict) -> dict[str, tuple[int, ...]]:
    """The model tensors a sharded checkpoint's DCP `records` hold under the old fused names
    (`fused_projections`), with their shapes; empty for a checkpoint of the present layout."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        return {}
    names = {fqn[len("model.") :]: record for fqn, record in records.items() if fqn.startswith("model.")}
    fused = [name for name in names if is_fused([name], config)]
    return {name: tuple(getattr(names[name], "size", ())) for name in fused}


def _refuse_fused(model: nn.Module, directory: Path, records: dict) -> None:
    """Resuming needs the optimizer state per matrix, which an old sharded checkpoint keeps per fused one."""
    if _fused_records(model, records):
        checkpoint = Path(directory).parent
        raise CheckpointError(
            f"{checkpoint} was saved when attention's q, k, v (and SwiGLU's gate, up) were one matrix and cannot "
            f"resume; run `llm-trainer consolidate --checkpoint {checkpoint} --output DIR` and start a new run with "
            "model.init_from=DIR"
        )


def consolidate(checkpoint: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, read in one process into `model`'s layout (an old
    checkpoint's fused projections read whole, then cut into their parts)."""
    directory = Path(checkpoint) / SHARDED_DIR
    fused = _fused_records(model, _reader(directory).read_metadata().state_dict_metadata)
    present = {k: v for k, v in model.state_dict().items()}
    if fused:
        present = {k: v for k, v in present.items() if k not in split_fused_shapes(fused, model.config)}
        dtype = next(iter(present.values())).dtype
        present.update({name: torch.empty(shape, dtype=dtype) for name, shape in fused.items()})
    state = {"model": present}
    _load(state, directory, no_dist=True)
    return split_fused(state["model"], model.config) if fused else state["model"]
