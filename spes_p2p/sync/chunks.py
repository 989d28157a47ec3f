"""A unit's weights in chunks, from several holders at once.

Holders of a unit serve the same tensors, byte for byte, for the same request of the same round (a payload's
header may differ: safetensors writes its metadata in no fixed order). So a peer that downloads a unit (a
newcomer catching up, a peer that starts training it) asks one holder for the payload's **index**: its
round, its header, the size of its tensor data and the SHA-256 of each ``CHUNK_BYTES`` chunk of that data;
and another holder for its index of that round. Only when the two agree on round, size and chunks does it
fetch the chunks, from every holder at once (``fetch_chunks``): each holder is asked for the next chunk
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


Ask = Callable[[str, int], bytes]  # (holder, chunk) -> its bytes; raises TransportError
Refuse = Callable[[str, str], None]  # (holder, why): a chunk that does not match the index


def fetch_chunks(
    index: ChunkIndex, sources: list[str], ask: Ask, refuse: Refuse, deadline: Deadline
) -> bytes | None:
    """The payload ``index`` describes, put together from ``sources`` (module docstring); None when they
    could not serve all of it before the deadline."""
    return _Chunks(index, ask, refuse, deadline).fetch(sources[:MAX_SOURCES])


class _Chunks:
    def __init__(self, index: ChunkIndex, ask: Ask, refuse: Refuse, deadline: Deadline) -> None:
        self.index, self.ask, self.refuse, self.deadline = index, ask, refuse, deadline
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
                    self.refuse(holder, problem)
                return  # (this holder is asked no more)

    def _one(self, holder: str, chunk: int) -> str | None:
        """None: the chunk came; '': the holder did not serve it; else why it does not match the index."""
        try:
            data = self.ask(holder, chunk)
        except TransportError:
            return ""
        if (
            len(data) != self.index.chunk_size(chunk)
            or hashlib.sha256(data).hexdigest() != self.index.sha256[chunk]
        ):
            return f"chunk {chunk} does not match the index two holders agree on"
        with self.lock:
            self.got.setdefault(chunk, data)
        return None
