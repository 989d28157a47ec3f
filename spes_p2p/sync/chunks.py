"""A unit's weights in chunks, from several holders at once.

Holders of a unit serve the same tensors, byte for byte, for the same request of the same round (a payload's
header may differ: safetensors writes its metadata in no fixed order). So a peer that downloads a unit (a
newcomer catching up, a peer that starts training it) asks one holder for the payload's **index**: its
round, its header, the size of its tensor data and the SHA-256 of each ``CHUNK_BYTES`` chunk of that data;
and another holder for its index of that round. Only when the two agree on round, size and chunks (or no
other holder answers: a unit then need not fit in one request's timeout either) does it fetch the chunks,
from every holder at once (``download``): each holder is asked for the next chunk
nobody has been asked for as soon as it has served its last one, so a fast holder serves more of the unit,
and a slow one holds up only the chunk it has; once every chunk has been asked for, an idle holder is asked
too for a chunk still on its way from another. Every chunk is checked against the index: one that does not
match, or is not served, is asked of another holder, and the holder that failed it is asked no more (a
mismatch counts toward a ban). The payload put together (the first holder's header, the chunks) is then
checked as a payload from one holder is (``sync/refresh.py``): its header cannot make other tensors of the
chunks two holders agree on.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import msgspec

from spes_p2p.net.transport import TransportError
from spes_p2p.net.waiting import Deadline
from spes_p2p.net.wire import Strict
from spes_p2p.swarm.records import Hex
from spes_p2p.sync.codecs import PayloadError

CHUNK_BYTES = 2 << 20
MAX_HEADER_BYTES = 1 << 20
MAX_CHUNKS = 4096  # payloads of up to 8 GiB
MAX_SOURCES = 8  # holders asked at once for one unit's chunks
RACED = 2  # holders asked at once for one chunk (the second: once every chunk has been asked for)
POLL_SECONDS = 0.02


class ChunkIndex(Strict):
    """What a holder serves for a request: of which round, its header, and its tensor data's size and
    chunks' SHA-256."""

    MAX_BYTES = MAX_HEADER_BYTES + 64 + MAX_CHUNKS * 67
    ERROR = PayloadError

    round: Annotated[int, msgspec.Meta(ge=-1)]
    header: Annotated[bytes, msgspec.Meta(min_length=8, max_length=MAX_HEADER_BYTES)]
    size: Annotated[int, msgspec.Meta(ge=0)]
    sha256: Annotated[list[Hex], msgspec.Meta(max_length=MAX_CHUNKS)]

    def __post_init__(self) -> None:
        chunks = math.ceil(self.size / CHUNK_BYTES)
        if len(self.sha256) != chunks:
            raise ValueError(f"{self.size} bytes are {chunks} chunks, not {len(self.sha256)}")
        if int.from_bytes(self.header[:8], "little") != len(self.header) - 8:
            raise ValueError("the header's length prefix is not its length")

    @classmethod
    def of(cls, payload: bytes, round_: int) -> ChunkIndex:
        start = _data_start(payload)
        data = memoryview(payload)[start:]
        hashes = [
            hashlib.sha256(data[i : i + CHUNK_BYTES]).hexdigest() for i in range(0, len(data), CHUNK_BYTES)
        ]
        return cls(round_, payload[:start], len(data), hashes)

    def agrees(self, other: ChunkIndex) -> bool:
        return (self.round, self.size, self.sha256) == (other.round, other.size, other.sha256)

    def chunk_size(self, chunk: int) -> int:
        return min(CHUNK_BYTES, self.size - chunk * CHUNK_BYTES)


def chunk_of(payload: bytes, chunk: int) -> bytes:
    start = _data_start(payload) + chunk * CHUNK_BYTES
    return payload[start : start + CHUNK_BYTES]


def _data_start(payload: bytes) -> int:
    """Where a safetensors payload's tensor data begins: after its 8-byte length prefix and its header."""
    return 8 + int.from_bytes(payload[:8], "little")


@dataclass(frozen=True)
class Asking:
    """How to ask holders for one unit's payload: ``ask`` sends a request to a holder, with a bound on the
    answer's bytes, and raises ``TransportError``; ``request`` makes a request of a round (with ``index`` or
    ``chunk``); ``refuse`` counts a holder's bad answer (what, why) toward its ban; ``limit`` bounds the
    payload."""

    ask: Callable[[str, bytes, int], bytes]
    request: Callable[..., bytes]
    refuse: Callable[[str, str, str], None]
    limit: int
    deadline: Deadline


def download(asking: Asking, holders: list[str], min_round: int, max_round: int) -> tuple[str, bytes] | None:
    """The payload of a round from ``min_round`` to ``max_round``, in chunks from ``holders`` (module
    docstring), and the holder whose header it has; None when the first two holders that answer disagree
    on its index, or its chunks did not all come in time. With no other holder to agree, the first one's
    index is used (as a payload with nobody to confirm it is kept)."""
    first: tuple[str, ChunkIndex] | None = None
    for holder in holders:
        index = _index(asking, holder, min_round if first is None else first[1].round)
        if index is None:
            continue
        if first is not None:  # (the holder that agrees is asked first, the index's source last)
            return _fetch(asking, first, [holder, *holders]) if index.agrees(first[1]) else None
        if not min_round <= index.round <= max_round:
            return None  # (not of a round we want: asked again later)
        first = (holder, index)
    return None if first is None else _fetch(asking, first, holders)


def _index(asking: Asking, holder: str, round_: int) -> ChunkIndex | None:
    """``holder``'s index of what it serves of round ``round_`` (or later)."""
    try:
        index = ChunkIndex.decode(
            asking.ask(holder, asking.request(round_, index=True), ChunkIndex.MAX_BYTES)
        )
        if len(index.header) + index.size > asking.limit:
            raise PayloadError(f"its index is of {len(index.header) + index.size} bytes, over {asking.limit}")
    except TransportError:
        return None
    except PayloadError as exc:
        asking.refuse(holder, "index", str(exc))
        return None
    return index


def _fetch(asking: Asking, first: tuple[str, ChunkIndex], holders: list[str]) -> tuple[str, bytes] | None:
    source, index = first
    payload = _Chunks(index, asking).fetch(list(dict.fromkeys([*holders, source]))[:MAX_SOURCES])
    return None if payload is None else (source, payload)


class _Chunks:
    def __init__(self, index: ChunkIndex, asking: Asking) -> None:
        self.index, self.asking, self.deadline = index, asking, asking.deadline
        self.got: dict[int, bytes] = {}
        self.asked: dict[int, set[str]] = {}  # chunk -> the holders it is on its way from
        self.lock = threading.Lock()

    def fetch(self, sources: list[str]) -> bytes | None:
        with ThreadPoolExecutor(len(sources), thread_name_prefix="spes-chunks") as pool:
            list(pool.map(self._serve_from, sources))
        if len(self.got) < len(self.index.sha256):
            return None
        return b"".join([self.index.header, *(self.got[i] for i in range(len(self.index.sha256)))])

    def _next(self, holder: str) -> int | None:
        """The chunk to ask ``holder`` for: one nobody was asked for, else one on its way from another holder
        only; None when every chunk is here, -1 when none is for this holder now."""
        with self.lock:
            waiting = [i for i in range(len(self.index.sha256)) if i not in self.got]
            if not waiting:
                return None
            open_ = [i for i in waiting if len(self.asked.get(i, ())) < RACED]
            if not open_:
                return -1  # (a chunk on its way from two others may fail, and come back)
            chunk = min(open_, key=lambda i: (len(self.asked.get(i, ())), i))
            self.asked.setdefault(chunk, set()).add(holder)
            return chunk

    def _serve_from(self, holder: str) -> None:
        while not self.deadline.passed():
            chunk = self._next(holder)
            if chunk is None:
                return
            if chunk < 0:
                self.deadline.sleep(POLL_SECONDS)
                continue
            problem = self._one(holder, chunk)
            with self.lock:
                self.asked[chunk].discard(holder)
            if problem is not None:
                if problem:
                    self.asking.refuse(holder, "chunk", problem)
                return  # (this holder is asked no more)

    def _one(self, holder: str, chunk: int) -> str | None:
        """None: the chunk came; '': the holder did not serve it; else why it does not match the index."""
        try:
            data = self.asking.ask(holder, self.asking.request(self.index.round, chunk=chunk), CHUNK_BYTES)
        except TransportError:
            return ""
        if (
            len(data) != self.index.chunk_size(chunk)
            or hashlib.sha256(data).hexdigest() != self.index.sha256[chunk]
        ):
            return f"chunk {chunk} does not match its index"
        with self.lock:
            self.got.setdefault(chunk, data)
        return None
