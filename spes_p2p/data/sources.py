"""Where a dataset's files come from, and the local copy of its shards that training reads.

A source serves a dataset's files by their names in the dataset's folder (``index.json``,
``tokenizer.json``, ``train/000000.safetensors``, ...):
    a folder        a prepared dataset on this machine (or a mounted share)
    http(s)://...   a base URL under which the folder is served as it is (any static web server)
    hf://datasets/OWNER/NAME[@REVISION][/FOLDER]   a Hugging Face dataset repository holding the folder

``ShardStore`` keeps the shards a peer reads in a local folder, bounded in size: a shard it lacks is fetched
from the sources in turn, and one whose bytes are not the index's (hash, schema, length, token range) is
refused, counted against that source, and fetched from the next. Nothing is trained from an unchecked shard.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import tempfile
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from spes_p2p.data.shards import (
    INDEX,
    MAX_INDEX_BYTES,
    TOKENIZER,
    DatasetIndex,
    Shard,
    decode_shard,
    read_shard,
)
from spes_p2p.errors import DataError
from spes_p2p.files import atomic_write_bytes

logger = logging.getLogger(__name__)

TIMEOUT = 30.0  # seconds for one HTTP request to answer (and for each read of its body)
MAX_TOKENIZER_BYTES = 64 << 20


class SourceUnavailable(Exception):
    """A source that does not have a file, or cannot be reached (the next source is tried)."""


class FolderSource:
    def __init__(self, root: Path) -> None:
        self.root, self.name = root, str(root)

    def read(self, name: str, max_bytes: int) -> bytes:
        path = self.root / name
        try:
            if path.stat().st_size > max_bytes:
                raise SourceUnavailable(f"{path} is larger than {max_bytes} bytes")
            return path.read_bytes()
        except OSError as exc:
            raise SourceUnavailable(f"{path}: {exc.strerror}") from None


class HttpSource:
    def __init__(self, base: str) -> None:
        self.base, self.name = base.rstrip("/") + "/", base

    def read(self, name: str, max_bytes: int) -> bytes:
        url = self.base + name
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT) as answer:
                data = answer.read(max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:  # (HTTPError is a URLError)
            raise SourceUnavailable(f"{url}: {getattr(exc, 'reason', None) or exc}") from None
        if len(data) > max_bytes:
            raise SourceUnavailable(f"{url} is larger than {max_bytes} bytes")
        return data


class HubSource:
    """A Hugging Face dataset repository at a revision, read through huggingface_hub (which uses the token
    of ``huggingface-cli login`` for a private one): ``hf://datasets/OWNER/NAME[@REVISION][/FOLDER]``."""

    SPEC = re.compile(r"hf://datasets/([\w.-]+/[\w.-]+)(?:@([\w.-]+))?(/.*)?")

    def __init__(self, spec: str, endpoint: str | None = None) -> None:
        found = self.SPEC.fullmatch(spec.rstrip("/"))
        if found is None:
            raise DataError(f"{spec}: a Hugging Face dataset is hf://datasets/OWNER/NAME[@REVISION][/FOLDER]")
        self.repo, self.revision = found[1], found[2] or "main"
        self.folder, self.name, self.endpoint = (found[3] or "").strip("/"), spec, endpoint

    def read(self, name: str, max_bytes: int) -> bytes:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            raise SourceUnavailable(
                "a Hugging Face source needs the optional extra: pip install 'spes-p2p[hf]'"
            ) from None
        with tempfile.TemporaryDirectory() as folder:
            try:
                path = Path(
                    hf_hub_download(
                        self.repo,
                        f"{self.folder}/{name}".lstrip("/"),
                        repo_type="dataset",
                        revision=self.revision,
                        local_dir=folder,
                        endpoint=self.endpoint,
                        etag_timeout=TIMEOUT,
                    )
                )
            except Exception as exc:  # the hub's errors: no such repository, revision or file, or no network
                raise SourceUnavailable(
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None
            if path.stat().st_size > max_bytes:
                raise SourceUnavailable(f"{name} is larger than {max_bytes} bytes")
            return path.read_bytes()


def source_of(spec: str) -> FolderSource | HttpSource | HubSource:
    if spec.startswith(("http://", "https://")):
        return HttpSource(spec)
    if spec.startswith("hf://"):
        return HubSource(spec)
    return FolderSource(Path(spec).expanduser())


def fetch(
    sources: list, name: str, max_bytes: int, check, refused: Counter | None = None
) -> tuple[bytes, Any]:
    """The first source's copy of ``name`` that ``check`` accepts, and what ``check`` made of it (it raises
    DataError for a copy it refuses, counted in ``refused`` by source); DataError naming every source tried
    when none has it."""
    tried = []
    for source in sources:
        try:
            data = source.read(name, max_bytes)
        except SourceUnavailable as exc:
            tried.append(f"{source.name} ({exc})")
            continue
        try:
            return data, check(data)
        except DataError as exc:
            logger.warning("refused %s from %s: %s", name, source.name, exc)
            tried.append(f"{source.name} (refused: {exc})")
            if refused is not None:
                refused[source.name] += 1
            if hasattr(source, "refused"):  # (a peer: its guard counts it too)
                source.refused(f"{name}: {exc}")
    raise DataError(f"cannot get {name} from any source; tried {'; '.join(tried) or 'none'}")


class ShardStore:
    """A dataset's shards in ``folder``. A prepared folder of this machine is read in place (a damaged shard
    there is an error: it is the user's); a cache folder (``cached``) is filled from the sources (a list, or
    a function that lists them when a shard is fetched: the swarm's peers), a shard at a time when first read
    (or ahead of it, ``prefetch``), checked, and kept within ``max_bytes`` (the least recently read go
    first)."""

    def __init__(
        self,
        index: DatasetIndex,
        folder: Path,
        sources: list | Callable[[], list],
        cached: bool,
        max_bytes: int,
    ) -> None:
        self.index, self.folder, self.sources = index, folder, sources
        self.cached, self.max_bytes = cached, max_bytes
        self.refused: Counter[str] = Counter()  # shards refused, by source
        self.fetched = 0
        self._lock = threading.Lock()  # (the cache's files and the fetches in flight)
        self._fetching: dict[str, threading.Thread] = {}

    def tokens(self, split: str, number: int) -> np.ndarray:
        shard = getattr(self.index, split)[number]
        if not self.cached:
            return read_shard(self.folder, shard, self.index)
        with self._lock:
            ahead = self._fetching.get(shard.name)
        if ahead is not None:
            ahead.join()
        path = self.folder / shard.name
        if path.exists():
            try:
                tokens = decode_shard(path.read_bytes(), shard, self.index)
                os.utime(path)  # (recently read: kept longest)
                return tokens
            except (OSError, DataError):
                path.unlink(missing_ok=True)  # a damaged copy in the cache is fetched again, never trusted
        return self._fetch(shard)

    def prefetch(self, split: str, number: int) -> None:
        """Starts fetching a shard in the background unless it is here or on its way (a failure is left to
        ``tokens``, which tries again)."""
        shard = getattr(self.index, split)[number]
        with self._lock:
            if not self.cached or shard.name in self._fetching or (self.folder / shard.name).exists():
                return
            thread = threading.Thread(target=self._fetch_quietly, args=(shard,), daemon=True)
            self._fetching[shard.name] = thread
        thread.start()

    def wait(self) -> None:
        """Waits for the fetches in flight."""
        with self._lock:
            threads = list(self._fetching.values())
        for thread in threads:
            thread.join()

    def _fetch_quietly(self, shard: Shard) -> None:
        try:
            self._fetch(shard)
        except DataError as exc:
            logger.info("prefetching %s: %s", shard.name, exc)
        finally:
            with self._lock:
                self._fetching.pop(shard.name, None)

    def _fetch(self, shard: Shard) -> np.ndarray:
        limit = shard.tokens * np.dtype(self.index.dtype).itemsize + (1 << 16)
        check = functools.partial(decode_shard, shard=shard, index=self.index)
        sources = self.sources() if callable(self.sources) else self.sources
        data, tokens = fetch(sources, shard.name, limit, check, self.refused)
        with self._lock:
            self._make_room(len(data))
            atomic_write_bytes(self.folder / shard.name, data)
            self.fetched += 1
        return tokens

    def file(self, name: str) -> bytes | None:
        """The bytes of one of the dataset's files this machine has (to serve them to others), or None: the
        index, the tokenizer, or a shard the index names (a name it does not is never a path)."""
        if name not in self._names:
            return None
        with self._lock:
            try:
                return (self.folder / name).read_bytes()
            except OSError:
                return None

    @functools.cached_property
    def _names(self) -> frozenset[str]:
        index = self.index
        return frozenset([INDEX, TOKENIZER, *(s.name for split in (index.train, index.val) for s in split)])

    def _make_room(self, size: int) -> None:
        kept = sorted(self.folder.glob("*/*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
        total = sum(p.stat().st_size for p in kept)
        while kept and total + size > self.max_bytes:
            oldest = kept.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink()


def open_dataset(spec: str, cache: Path, max_bytes: int) -> ShardStore:
    """The shards of the dataset ``spec`` names: a prepared folder, read in place; or a URL, whose index and
    tokenizer are fetched into the cache (under the index's digest) at once, and its shards when read."""
    source = source_of(spec)
    if isinstance(source, FolderSource):
        return ShardStore(DatasetIndex.read(source.root), source.root, [source], False, 0)
    return fetch_dataset([source], cache, max_bytes)


def fetch_dataset(
    sources: list | Callable[[], list], cache: Path, max_bytes: int, digest: str | None = None
) -> ShardStore:
    """A dataset whose index and tokenizer are fetched from ``sources`` into the cache at once (the index's
    digest must be ``digest``, when given), and its shards when read."""

    def index_of(data: bytes) -> DatasetIndex:
        index = DatasetIndex.decode(data, INDEX)
        if digest and index.digest != digest:
            raise DataError(f"it is dataset {index.digest[:16]}, not {digest[:16]}")
        return index

    listed = sources() if callable(sources) else sources
    raw, index = fetch(listed, INDEX, MAX_INDEX_BYTES, index_of)
    folder = cache / "datasets" / index.digest[:16]
    if not (folder / TOKENIZER).exists():
        tokenizer, _ = fetch(
            listed, TOKENIZER, MAX_TOKENIZER_BYTES, lambda data: _same_hash(data, index.tokenizer_sha256)
        )
        atomic_write_bytes(folder / TOKENIZER, tokenizer)
    atomic_write_bytes(folder / INDEX, raw)
    return ShardStore(index, folder, sources, True, max_bytes)


def cached_copy(cache: Path, digest: str) -> Path | None:
    """A whole dataset with this digest in the cache (a corpus prepared there), if there is one."""
    for path in sorted((cache / "datasets").glob("*/" + INDEX)):
        try:
            index = DatasetIndex.decode(path.read_bytes(), str(path))
        except (OSError, DataError):
            continue
        shards = (s.name for split in (index.train, index.val) for s in split)
        if index.digest == digest and all((path.parent / name).exists() for name in shards):
            return path.parent
    return None


def _same_hash(data: bytes, sha256: str) -> None:
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DataError("its SHA-256 is not the index's")
