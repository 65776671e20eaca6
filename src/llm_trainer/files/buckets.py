"""Paths that are URLs (s3://, gs://, az://, hf://, ...): the one place that reads and writes them.

Every other module keeps working on local paths. Whether a path is a URL is decided in one of two
places: the config's validation and properties (`config.py`) for a setting, and `Location` for a path
a command or function is given (a checkpoint to read, an `--output` to write, a run to look at). When it
is one, the work happens in a local folder and this module moves files between that folder and the store:

  `Location(path).local(download)`  the local copy a reader reads (`download` is the folder's own kind)
  `Location(path).staged(name)`     the local file or folder a writer fills, then `put_file` or an upload
  `list_files`, `fetch_file`        data_files (a file, a folder or a glob) downloaded into a local mirror
  `put_folder(local, url, ...)`     every file of a folder uploaded, the commit marker last
  `get_folder(url, local, ...)`     the files a commit record lists downloaded, each checksummed on arrival

Everything goes through fsspec (s3fs, gcsfs, adlfs, huggingface_hub are the stores' own packages);
credentials come from each store's usual environment variables and config files and are never logged.
A call that fails to reach the store (connection refused or reset, a timeout) is retried a few times
with backoff, then ends in one `UsageError` line; a missing bucket or a refused access is one line at
once. No message carries more than the URL and the store's error code.

Names are literal: `[`, `*` and `?` in a URL are characters of it (only `list_files`, for data_files,
takes a glob). fsspec's recursive `rm`, `mv` and `get`/`put` expand them as patterns, so a folder is
deleted object by object from a listing by prefix (`remove`), and files move one by one by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..errors import StoreFull, UsageError, first_line
from ..limits import parse_json
from ..logs import warn
from .atomic import move_into_place, put_in_place, temporary_folder, through_link
from .checksums import file_checksum
from .disk import lock_exclusive, lock_shared
from .folder_files import plain_name

T = TypeVar("T")

RETRIES = 4  # tries of one call to the store that cannot be reached before it is reported
S3_ATTEMPTS = 3  # botocore's attempts of each S3 request, the first included (`_store_options`)
OWN_RETRIES = {"gs", "gcs"}  # schemes whose library retries its calls itself (gcsfs: 6 tries, backoff)
QUIET_LOGGERS = ("gcsfs", "s3fs", "fsspec", "aiobotocore", "botocore", "adlfs")  # they log tracebacks per retry
BACKOFF_S = 0.5  # first wait between tries; doubled each time
FILES_RECORD = "files.json"  # a folder's commit record in a store: each file's size and checksum
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
S3_SCHEMES = ("s3", "s3a")  # both go to s3fs


def _scheme(url: str) -> str:
    """`s3` of `s3://bucket/key`: which store's library serves a URL."""
    return url.split("://", 1)[0]


_ONE_SLASH = re.compile(r"^(s3a?|gs|gcs|az|abfss?|adl|hf|https?|r2):/(?!/)", re.IGNORECASE)
# Schemes of object stores, whose keys are names taken literally. Another scheme's URL (a tracker's
# `sqlite:////abs/path.db`, `http://host:5000`) is the business of the library it goes to.
_STORE_URL = re.compile(r"^(s3a?|gs|gcs|az|abfss?|adl|hf|r2|memory)://", re.IGNORECASE)


def check_url_shape(value: str, where: str) -> None:
    """Refuse what reads as a store's URL but would not be taken as the one meant: `s3:/bucket/x` (one
    slash: a local folder named `s3:`), or a URL whose key holds `.`, `..` or an empty part (`//`): a
    store takes a key literally, so they would become part of the names written."""
    if (match := _ONE_SLASH.match(value)) is not None:
        scheme = match.group(1)
        raise UsageError(
            f"{where} {value!r} has one slash after {scheme}:, so it would be a local folder named {scheme}:; "
            f"write {scheme}://{value[match.end() :]}"
        )
    if not _STORE_URL.match(value):
        return
    key = value.split("://", 1)[1].partition("/")[2]
    parts = key.removesuffix("/").split("/") if key else []
    if key.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise UsageError(
            f"{where} {value!r} holds '.', '..' or '//' in its key, which a store would take literally as part of "
            "the names it writes; give the URL without them"
        )


def is_url(path: Any) -> bool:
    """Whether `path` names a location in a store (scheme://...) rather than a local path (file:// is local)."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


def same_bucket(url: str, other: str | Path | None) -> bool:
    """Whether `url` and `other` are both URLs of one bucket (the same scheme and bucket name)."""
    if other is None or not (is_url(url) and is_url(str(other))):
        return False
    mine, named = urlsplit(str(other)), urlsplit(url)
    return (mine.scheme, mine.netloc) == (named.scheme, named.netloc)


@dataclass(frozen=True)
class Location:
    """A path a command or function is given that may be a URL: whether it is one is decided here, once,
    and what is read or written on this machine follows from it. `url` is the URL, or None for a local
    path (then `where` itself is read and written, unchanged)."""

    where: str | Path

    @property
    def url(self) -> str | None:
        return str(self.where) if is_url(str(self.where)) else None

    def refuse_url(self, message: str) -> None:
        """A `UsageError(message)` when this is a URL: for an argument that takes a local path only."""
        if self.url is not None:
            raise UsageError(message)

    def local(self, download: Callable[[str], Path]) -> str | Path:
        """What a reader opens: `where` itself, or for a URL the local copy `download(url)` makes (each
        kind of folder has its own: `fetch_tree` for a model folder, `checkpoint.remote` for a checkpoint)."""
        return download(self.url) if self.url is not None else self.where

    @contextmanager
    def staged(self, name: str) -> Iterator[Path]:
        """What a writer fills: `where` itself (a symlink's target: `atomic.through_link`), or for a URL the
        path `name` in a temporary local folder, removed when the block ends (the writer uploads it before
        that: `put_file`, `put_folder`)."""
        if self.url is None:
            yield through_link(Path(self.where))
            return
        with tempfile.TemporaryDirectory(prefix="upload-") as folder:
            yield Path(folder) / name

    def put_file(self, written: Path, final: Path) -> None:
        """A file written whole takes its place: renamed onto `final` (`atomic.put_in_place`), or
        uploaded to the URL."""
        if self.url is not None:
            upload(written, self.url)
        else:
            put_in_place(written, final)


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def mirror_name(url: str) -> str:
    """A local folder name for `url`: readable, and distinct for distinct URLs."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[-1]).strip("_")[-48:]
    return f"{readable}-{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:12]}"


# ----------------------------------------------------------------------------------------------
# the store, with retries and one-line errors


def _quiet_libraries() -> None:
    """The stores' libraries log a traceback for each of their retries; our one line says what failed."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _store_options(url: str) -> dict:
    """fsspec options for the store of `url`. For S3:

    - a botocore session whose requests carry no `Expect: 100-continue` header. With it, aiohttp waits
      for the server's interim answer before it sends an upload's body, and no timeout covers that wait:
      a store that accepts the connection and then falls silent would hold the upload (and the run
      waiting for it) forever. Without it, the read timeout ends the wait. The header is not signed.
    - botocore's standard retry mode, `S3_ATTEMPTS` attempts of each request, the first included: it
      retries throttling (SlowDown) and 5xx answers with jittered backoff, and a read timeout. s3fs tries
      each call 5 times over that. An endpoint that takes connections and has never answered is given
      botocore's attempts only (`_after_attempt`), and `call` does not try it again either: 3 read
      timeouts (15 s each) before it is reported, not s3fs's 5 x 3 (or, with the libraries' defaults
      under our 4 tries, half an hour).

    The user's own fsspec configuration for s3 (`FSSPEC_S3`, fsspec's conf.json) wins over these."""
    if _scheme(url) not in S3_SCHEMES:
        return {}
    import fsspec.config

    theirs = fsspec.config.conf.get("s3", {})
    attempts = {"retries": {"total_max_attempts": S3_ATTEMPTS, "mode": "standard"}}
    return {"session": _s3_session(), **theirs, "config_kwargs": {**attempts, **theirs.get("config_kwargs", {})}}


def _s3_attempts() -> int:
    """botocore's attempts of each S3 request, the first included: ours, or the user's fsspec configuration's."""
    import fsspec.config

    retries = fsspec.config.conf.get("s3", {}).get("config_kwargs", {}).get("retries", {})
    if "total_max_attempts" in retries:
        return retries["total_max_attempts"]
    return retries["max_attempts"] + 1 if "max_attempts" in retries else S3_ATTEMPTS


_S3_SESSION = None


def _s3_session():
    """One aiobotocore session for every S3 filesystem of the process (fsspec caches filesystems by
    their options, so it must be the same object each time)."""
    global _S3_SESSION
    if _S3_SESSION is None:
        from aiobotocore.session import AioSession

        session = AioSession()
        session.register("before-sign.s3", _without_expect_header)
        session.register("needs-retry.s3", _after_attempt)
        _S3_SESSION = session
    return _S3_SESSION


class StoreSilent(ConnectionError):
    """An S3 endpoint that took the connection and has not answered a request in this process."""


_ANSWERED: set[str] = set()  # S3 endpoints that have answered a request in this process
_SILENCE_SAID: set[str] = set()  # those whose silence a warning has said


def _after_attempt(endpoint, attempts: int, response=None, caught_exception=None, **_) -> None:
    """After each attempt of an S3 request (botocore's `needs-retry` event): the first read timeout of an
    endpoint is said at once, and an endpoint that has never answered fails after botocore's attempts
    rather than under s3fs's 5 tries of them. One that answered before keeps every retry (a slow spell).
    Decides no retry itself (returns None)."""
    host = endpoint.host
    if response is not None:
        _ANSWERED.add(host)
        return None
    if caught_exception is None or type(caught_exception).__name__ != "ReadTimeoutError":
        return None
    if host not in _SILENCE_SAID:
        _SILENCE_SAID.add(host)
        warn(
            f"the store at {host} took the connection and sent no answer ({first_line(caught_exception)}); trying again"
        )
    if host not in _ANSWERED and attempts >= _s3_attempts():
        raise StoreSilent(f"{host} took the connection and answered none of {attempts} tries") from None
    return None


def _without_expect_header(request, **_) -> None:
    if "Expect" in request.headers:
        del request.headers["Expect"]


def _filesystem(url: str):
    _quiet_libraries()
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with torch's and datasets' dependencies
        raise UsageError(f"{url} is a URL and fsspec is not installed: pip install 'llm-trainer[s3]'") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **_store_options(url))
    except (ImportError, ValueError) as exc:
        scheme = _scheme(url)
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme)
        fix = f"pip install 'llm-trainer[{extra}]'" if extra else f"install the fsspec package for {scheme}://"
        raise UsageError(f"cannot open {url} ({first_line(exc)}); {fix}") from None
    return fs, path


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` means the store could not be reached (worth another try), not that it said no."""
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)):  # gaierror: a name not resolved
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    transient = {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientOSError",
        "ClientPayloadError",
    }
    if names & transient:
        return True
    text = str(exc).lower()
    return "connection refused" in text or "connection reset" in text or "could not connect" in text


def _silent(exc: BaseException, url: str) -> bool:
    """Whether an S3 store took the connection and then sent no answer in time: s3fs and botocore have
    tried the call several times already (`_store_options`), so another round of theirs would only
    multiply the wait."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return _scheme(url) in S3_SCHEMES and (
        isinstance(exc, StoreSilent) or "ReadTimeoutError" in names or "read timeout" in str(exc).lower()
    )


def _endpoint_setting(url: str) -> str:
    """What to check when the store of `url` cannot be reached: the environment variable that points its
    library at another endpoint, where there is one, and the address itself otherwise (http, hf, az)."""
    scheme = _scheme(url)
    if scheme in S3_SCHEMES:
        return "the endpoint (AWS_ENDPOINT_URL)"
    if scheme in ("gs", "gcs"):
        return "the endpoint (STORAGE_EMULATOR_HOST)"
    return "the address"


def _no_bucket(exc: FileNotFoundError) -> bool:
    """Whether the store said that the bucket (not an object in it) does not exist."""
    text = str(exc).lower()
    return "nosuchbucket" in text or "bucket does not exist" in text or "container does not exist" in text


# how stores say a write found no space or quota left: S3-compatible stores' error codes (Ceph RGW,
# MinIO), HTTP 507's reason and a filesystem's ENOSPC (S3 and GCS buckets themselves have no quota; a
# "quota exceeded" of GCS is a rate limit, not space)
_STORE_FULL = ("quotaexceeded", "xminiostoragefull", "insufficient storage", "no space left")


def _store_full(exc: BaseException) -> bool:
    """Whether the store refused a write for lack of space or quota."""
    text = f"{type(exc).__name__} {exc}".lower()
    return any(marker in text for marker in _STORE_FULL)


def _full_is_said(what: str, url: str, fn: Callable[[], T]) -> Callable[[], T]:
    """`fn`, its store's refusal for lack of space or quota raised as `StoreFull` (never retried)."""

    def run() -> T:
        try:
            return fn()
        except UsageError:
            raise
        except Exception as exc:
            if not _store_full(exc):
                raise
            raise StoreFull(
                f"{what}: the store refused {url} for lack of space or quota ({first_line(exc)}); free space "
                "in the bucket or raise its quota (a run goes on from its last checkpoint with resume_from_checkpoint=latest)"
            ) from None

    return run


def call(what: str, url: str, fn: Callable[[], T]) -> T:
    """`fn()` (one operation on the store at `url`), retried while the store cannot be reached; its
    failures as one-line `UsageError`s that say `what` was being done (`StoreFull` when it found no
    space or quota left). A library that retries its own calls (`OWN_RETRIES`) gets one try, after a
    connection to its endpoint, tried as often as a call, has shown that something answers there."""
    fn = _full_is_said(what, url, fn)
    if _scheme(url) in OWN_RETRIES:
        _tried(what, url, lambda: _connect(url), RETRIES)
        return _tried(what, url, fn, 1)
    return _tried(what, url, fn, RETRIES)


CONNECT_S = 5.0  # a TCP connection to a store's endpoint: an endpoint that answers does so at once
_CONNECTED: set[tuple[str, int]] = set()  # endpoints this process has reached


def _connect(url: str) -> None:
    """One TCP connection to the endpoint the store's library sends `url`'s requests to, once per
    endpoint and process: gcsfs tries a call to an endpoint where nothing answers six times over about
    35 s before it gives up, where a refused connection says so at once. Not when the user's fsspec
    configuration gives gcsfs's HTTP session settings of its own (a proxy: `trust_env`), where the
    library's connections are not ours to predict."""
    fs, _ = _filesystem(url)
    if getattr(fs, "session_kwargs", None):
        return
    endpoint = urlsplit(getattr(fs, "base", None) or "https://storage.googleapis.com")
    address = (endpoint.hostname or "", endpoint.port or (443 if endpoint.scheme == "https" else 80))
    if address not in _CONNECTED:
        socket.create_connection(address, timeout=CONNECT_S).close()
        _CONNECTED.add(address)


def _tried(what: str, url: str, fn: Callable[[], T], tries: int) -> T:
    """`fn()`, tried up to `tries` times while the store cannot be reached (`call`)."""
    wait = BACKOFF_S
    for attempt in range(1, tries + 1):
        try:
            return fn()
        except UsageError:
            raise
        except FileNotFoundError as exc:
            bucket = url.split("://", 1)[-1].split("/", 1)[0]
            if _no_bucket(exc):
                raise UsageError(
                    f"{what}: the bucket {bucket!r} of {url} does not exist; create it or fix the URL"
                ) from None
            raise UsageError(f"{what}: {url} does not exist in its store; fix the URL") from None
        except PermissionError as exc:
            raise UsageError(
                f"{what}: access to {url} was denied ({first_line(exc)}); check the store's credentials "
                "(environment variables or config file) and the bucket's permissions"
            ) from None
        except Exception as exc:
            if not _unreachable(exc):
                raise UsageError(f"{what}: {url} failed ({type(exc).__name__}: {first_line(exc)})") from None
            if attempt == tries or _silent(exc, url):
                raise UsageError(
                    f"{what}: cannot reach the store for {url} ({first_line(exc)}); check "
                    f"{_endpoint_setting(url)} and the network, then run again"
                ) from None
            warn(f"{what}: the store for {url} cannot be reached ({first_line(exc)}); trying again in {wait:g} s")
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def exists(url: str) -> bool:
    """Whether the store holds `url` now (asked of the store: a listing cached earlier in this process
    would miss what another process wrote since)."""
    fs, path = _filesystem(url)
    fs.invalidate_cache(path)
    return call("reading", url, lambda: fs.exists(path))


def read_text(url: str) -> str | None:
    """The text of the object at `url`, or None when there is none (asked of the store, as `exists`)."""
    fs, path = _filesystem(url)
    fs.invalidate_cache(path)

    def read() -> str | None:
        try:
            return fs.cat_file(path).decode("utf-8")
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise
            return None

    return call("reading", url, read)


def write_text(url: str, text: str) -> None:
    fs, path = _filesystem(url)
    call("writing", url, lambda: fs.pipe_file(path, text.encode("utf-8")))


def read_bytes(url: str, start: int | None = None, end: int | None = None, *, what: str = "reading") -> bytes:
    """The bytes of the object at `url`, or of its range [start, end) (an error when there is none)."""
    fs, path = _filesystem(url)
    return call(what, url, lambda: fs.cat_file(path, start=start, end=end))


def write_bytes(url: str, data: bytes) -> None:
    fs, path = _filesystem(url)
    call("writing", url, lambda: fs.pipe_file(path, data))


def upload(local: Path, url: str) -> None:
    fs, path = _filesystem(url)
    call("uploading", url, lambda: fs.put_file(str(local), path))


def _below(fs, path: str) -> list[str]:
    """The store's paths of the object `path` and of every object under the folder `path`, from a
    listing by prefix: `[`, `*` and `?` are characters of a name here, never a pattern."""
    base = path.rstrip("/")
    fs.invalidate_cache(base)
    try:
        found = fs.find(base, withdirs=False)
    except FileNotFoundError as exc:
        if _no_bucket(exc):
            raise
        return []
    return sorted(name for name in found if name == base or name.startswith(base + "/"))


def files_under(url: str) -> list[str]:
    """The path inside the folder `url` of every object under it (a literal listing, never a glob)."""
    fs, path = _filesystem(url)
    base = path.rstrip("/")
    return [name[len(base) + 1 :] for name in call("listing", url, lambda: _below(fs, path)) if name != base]


def remove(url: str) -> None:
    """Delete the object `url`, or every object under the folder `url`: one by one, each by the name the
    store listed. fsspec's recursive `rm` would expand `[`, `*` and `?` in the URL and delete what
    another folder's name matches (`runs/exp[1]` matching `runs/exp1`)."""
    fs, path = _filesystem(url)

    def delete(name: str) -> None:
        try:
            fs.rm_file(name)
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise

    for name in call("listing", url, lambda: _below(fs, path)):
        call("deleting", url, lambda name=name: delete(name))
    fs.invalidate_cache(path.rstrip("/"))


def copy(source: str, target: str) -> None:
    """Copy the object `source` to `target` inside its store (both literal names)."""
    fs, path = _filesystem(source)
    _, target_path = _filesystem(target)
    call("copying", source, lambda: fs.cp_file(path, target_path))


def children(url: str) -> list[str]:
    """The names directly under the folder `url` (none when it does not exist)."""
    fs, path = _filesystem(url)

    def listing() -> list[str]:
        try:
            fs.invalidate_cache(path)
            return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise
            return []

    return call("listing", url, listing)


def check_writable(url: str, what: str) -> None:
    """Write and delete a probe object under `url`: a missing bucket or a refused write is said now,
    in one line naming `what` (the setting), not after the first hours of a run."""
    probe = join(url, f".write-probe-{os.getpid()}")
    fs, path = _filesystem(probe)
    try:
        call(f"writing into {what}", url, lambda: fs.pipe_file(path, b""))
        call(f"writing into {what}", url, lambda: fs.rm_file(path))
    except UsageError as exc:
        raise UsageError(str(exc)) from None


# ----------------------------------------------------------------------------------------------
# data files: a file, a folder or a glob in a store, mirrored locally


GLOB_CHARACTERS = "*?["


def looks_like_glob(spec: str) -> bool:
    """Whether a data spec has a wildcard; where a file or folder of exactly that name exists, it is
    still read literally (`corpus[2024]/`): the callers check that first."""
    return any(ch in spec for ch in GLOB_CHARACTERS)


def list_files(spec: str) -> tuple[list[tuple[str, dict]], bool]:
    """(URL, info) of each file `spec` names: the file itself, every file below a folder, or a glob's
    matches; and whether it was read as a glob (no object or folder of that exact name)."""
    fs, path = _filesystem(spec)
    protocol = _scheme(spec)
    globbed = False

    def find() -> list[tuple[str, dict]]:
        nonlocal globbed
        fs.invalidate_cache()
        if looks_like_glob(path) and not fs.exists(path):
            globbed = True
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
        elif fs.isfile(path):
            found = {path: fs.info(path)}
        elif protocol in (*S3_SCHEMES, "gs", "gcs") and not fs.exists(bucket := path.split("/", 1)[0]):
            raise FileNotFoundError(f"NoSuchBucket: {bucket}")  # (said as for every setting in a missing bucket)
        else:
            return []
        files = [(name, info) for name, info in found.items() if info.get("type") == "file"]
        return [(f"{protocol}://{name}", info) for name, info in sorted(files)]

    found = call("listing data files", spec, find)
    for url, _ in found:
        check_object_name(url, spec)
    return found, globbed


def check_object_name(url: str, where: str) -> None:
    """Refuse an object whose key would not be a plain local file name (`.`, `..`, an empty last part):
    its copy would land outside its folder, or over it."""
    parts = url.split("://", 1)[-1].split("/")
    if parts[-1] in ("", ".", "..") or any(part in (".", "..") for part in parts):
        raise UsageError(
            f"{where} holds the object {url!r}, whose name is not a plain file name; rename or remove it in the store"
        )


def identity(info: dict) -> list:
    """What identifies one version of an object: its size and its ETag / modification time."""
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return [int(info.get("size") or 0), str(version)]


def fetch_file(url: str, info: dict, cache: Path) -> Path:
    """The object at `url` as a local file in `cache` (downloaded once per version; a partial download
    never takes the final name)."""
    size, version = identity(info)
    name = url.rsplit("/", 1)[-1]
    folder = cache / "sources" / mirror_name(f"{url}#{size}#{version}")
    local = folder / name
    if local.is_file() and local.stat().st_size == size:
        return local
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{name}.partial-{os.getpid()}"
    fs, path = _filesystem(url)
    call("downloading", url, lambda: fs.get_file(path, str(partial)))
    put_in_place(partial, local)
    return local


# ----------------------------------------------------------------------------------------------
# folders: uploaded with a commit marker last; downloaded with every file checksummed


def put_folder(
    local: Path, url: str, *, last: Iterable[str] = (), unchanged: dict | None = None, present: dict | None = None
) -> dict:
    """Upload every file of the local folder `local` (its subfolders too) to the folder `url`, a
    `files.json` record of their sizes and checksums, and then the files named in `last`, in order.
    Returns the record. `unchanged`: the record of an earlier upload of this folder to `url`; a file
    it holds with the same size and checksum is not uploaded again. `present`: the records of files
    already written into `url` by others (sharded checkpoints' shards), listed but not uploaded.

    The last file is the commit marker: a reader that finds it finds every other file complete. A
    crash part-way leaves no marker, and the folder is not taken as complete.
    """

    last = list(last)
    files = sorted(p for p in local.rglob("*") if p.is_file() and not p.is_symlink())
    names = [p.relative_to(local).as_posix() for p in files]
    early = [(p, n) for p, n in zip(files, names) if n not in last and n != FILES_RECORD]
    record = {n: {"size": p.stat().st_size, "checksum": file_checksum(p)} for p, n in zip(files, names)}
    record.update(present or {})
    for path, name in early:
        if (unchanged or {}).get(name) != record[name]:
            upload(path, join(url, name))
    write_text(join(url, FILES_RECORD), json.dumps(record, sort_keys=True))
    for name in last:
        upload(local / name, join(url, name))
    return record


class UnverifiedFolder(UsageError):
    """A folder in a store whose files cannot be checked: its `files.json` is damaged, or a file does not
    match it (an upload cut short between a file and the record, or damage in the store)."""


def read_record(url: str) -> dict[str, tuple[int, str]] | None:
    """The `files.json` of the folder `url` as {path inside it: (size, checksum)}; None when there is
    none. An `UnverifiedFolder` error when it is not a record we could have written: not JSON, a size
    that is not a whole number of bytes, a path outside the folder, or a path both a file and a folder."""

    where = join(url, FILES_RECORD)
    text = read_text(where)
    if text is None:
        return None
    try:
        record = parse_json(text, where)
        entries = {name: (v["size"], v["checksum"]) for name, v in record.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise UnverifiedFolder(f"{where} is not a file record; the folder in the store is damaged") from None
    for name, (size, checksum) in entries.items():
        if not all(plain_name(part) for part in name.split("/")):  # no "..", no absolute paths
            raise UnverifiedFolder(f"{where} names {name!r}, a path outside its folder; refusing it")
        if not (isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 1 << 63):
            raise UnverifiedFolder(f"{where} gives {name} the size {str(size)[:40]}, not a byte count; it is damaged")
        if not isinstance(checksum, str):
            raise UnverifiedFolder(f"{where} gives {name} no checksum; it is damaged")
    if clash := _file_and_folder(entries):
        raise UnverifiedFolder(f"{where} names {clash} both as a file and as a folder; it is damaged")
    return entries


def _file_and_folder(names: Iterable[str]) -> str | None:
    """A name that is also the folder of another (`a` and `a/b`): no local folder can hold both."""
    names = set(names)
    folders = {"/".join(name.split("/")[:i]) for name in names for i in range(1, name.count("/") + 1)}
    clash = sorted(folders & names)
    return clash[0] if clash else None


def get_folder(
    url: str,
    local: Path,
    *,
    last: Iterable[str] = (),
    room: Callable[[int], None] | None = None,
    skip: Iterable[str] = (),
) -> bool:
    """Download the folder `url` that `put_folder` wrote into `local` (filled as a temporary
    folder, then moved into place), each file checked against its recorded size and checksum. False when
    the folder is not complete in the store (no record or no commit marker); an `UnverifiedFolder`
    error when its record is damaged or a file does not match it. `room(bytes)` is called before the
    download starts, to make room for it. Files named in `skip` stay in the store (read from there later).
    An older copy at `local` is replaced in one atomic exchange (`atomic.move_into_place`)."""

    entries = read_record(url)
    if entries is None:
        return False
    if any(name not in entries for name in last) or not all(exists(join(url, name)) for name in last):
        return False
    entries = {name: entry for name, entry in entries.items() if name not in set(skip)}
    if room is not None:
        room(sum(size for size, _ in entries.values()))
    tmp = temporary_folder(local)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name, (size, checksum) in entries.items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            fs, path = _filesystem(join(url, name))
            call("downloading", join(url, name), lambda fs=fs, path=path, target=target: fs.get_file(path, str(target)))
            if target.stat().st_size != size or file_checksum(target) != checksum:
                raise UnverifiedFolder(
                    f"{join(url, name)} does not match its recorded checksum (damaged in the store or in transit); "
                    "prepare or save it again"
                )
        move_into_place(tmp, local)  # an older copy swapped out: never a moment without a whole one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def fetch_tree(url: str, cache: Path) -> Path:
    """The folder `url` (a model folder) as a local copy under `cache`: checked against its `files.json`
    when it has one (we uploaded it), else every file below it, each a plain name (no path outside)."""

    local = cache / mirror_name(url)
    local.parent.mkdir(parents=True, exist_ok=True)
    if get_folder(url, local):
        return local
    names = [(join(url, name), name) for name in files_under(url)]
    if not names:
        raise UsageError(f"{url} holds no files; point model.init_from at a model folder")
    if clash := _file_and_folder(name for _, name in names):
        raise UsageError(f"{join(url, clash)} is both an object and a folder in the store; refusing the folder")
    tmp = temporary_folder(local)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for file_url, name in names:
            if not all(plain_name(part) for part in name.split("/")):
                raise UsageError(f"{file_url} is not a plain file name inside {url}; refusing the folder")
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            fs, path = _filesystem(file_url)
            call("downloading", file_url, lambda fs=fs, path=path, target=target: fs.get_file(path, str(target)))
        move_into_place(tmp, local)  # an older copy swapped out: never a moment without a whole one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


IN_USE = ".in-use"  # in a cache folder: every process using the folder holds a shared lock on it
_in_use: dict[Path, object] = {}  # this process's marks (their locks end with the process)


def mark_in_use(folder: Path) -> bool:
    """Mark the cache folder `folder` as used by this process until it ends, so that no process evicts
    it meanwhile (`make_room`); False when the folder is gone (evicted before the mark was taken)."""

    folder = Path(folder).resolve()
    if folder in _in_use:
        return True
    try:
        handle = open(folder / IN_USE, "a")
    except FileNotFoundError:
        return False
    lock_shared(handle)
    _in_use[folder] = handle
    return True


def _evict(entry: Path) -> bool:
    """Remove the cache entry `entry` unless a live process marked it in use (`mark_in_use`): its mark is
    taken exclusively while the entry is removed, so no process can mark it half-removed."""

    if not entry.is_dir():
        entry.unlink(missing_ok=True)
        return True
    try:
        handle = open(entry / IN_USE, "a")
    except FileNotFoundError:  # removed by another process meanwhile
        return True
    with handle:
        if not lock_exclusive(handle, wait=False):
            return False
        shutil.rmtree(entry, ignore_errors=True)
    return True


def make_room(cache: Path, needed: int, limit: int, keep: Iterable[Path] = ()) -> None:
    """Evict the least recently used folders of `cache` (each of its subfolders' entries) until `needed`
    more bytes fit within `limit`; `keep` and the folders a live process uses are never evicted. A
    `UsageError` when they cannot fit."""
    keep = {Path(k).resolve() for k in keep}
    entries = [e for e in (cache / "sources").glob("*")] + [e for e in (cache / "prepared").glob("*/*")]
    entries = [e for e in entries if not e.name.startswith(".") and e.resolve() not in keep]
    used = sum(folder_size(e) if e.is_dir() else e.stat().st_size for e in entries)
    kept = sum(folder_size(k) for k in keep if k.is_dir())
    if needed + kept > limit:
        raise UsageError(
            f"{needed + kept:,} bytes do not fit in data.stream_cache_limit ({limit:,} bytes) of "
            f"data.stream_cache_dir {cache}; raise the limit"
        )
    for entry in sorted(entries, key=lambda e: e.stat().st_mtime):  # oldest use first
        if used + kept + needed <= limit:
            break
        size = folder_size(entry) if entry.is_dir() else entry.stat().st_size
        if _evict(entry):
            used -= size


def touch(path: Path) -> None:
    """Mark `path` as just used (eviction takes the least recently used first)."""
    try:
        os.utime(path)
    except OSError:
        pass
