"""Requests and answers over py-libp2p streams, for the libp2p backend (all of it on the backend's trio loop).

Hivemind's framing: an 8-byte big-endian length, then the payload; an answer starts with a status byte
(``OK`` or ``FAILED``, then the handler's message). A stream carries one request at a time, and the server
answers requests on it until the caller closes it, leaves it idle for ``SERVED_IDLE_SECONDS``, or holds more
than ``KEPT_PER_PEER`` streams. Most callers open a stream for each request; the records protocol keeps
``KEEP_IDLE`` streams per peer for its next requests (``ask(reuse=True)``), because opening a stream costs
about three times the CPU of the request itself (2 peers in one process: 12-14 ms of CPU a request on a new
stream, 3.4 ms on an open one, whatever the payload up to 10 KB).

A server checks the caller against the guard, gives each remote peer ``MAX_STREAMS_PER_PEER`` requests at
once, checks a request's length before reading it and reads it within ``REQUEST_READ_TIMEOUT`` (one too
large, or refused, is read and dropped: ``DRAIN_BYTES``, and its stream closed); handlers run on a pool of
``HANDLER_THREADS`` threads, or on the loop itself when they are quick (``inline``: the records protocol).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from spes_p2p.net.guard import Guard
from spes_p2p.net.transport import (
    ANSWER_FAILED,
    ANSWER_OK,
    ANSWER_WRITE_TIMEOUT,
    REQUEST_READ_TIMEOUT,
    Handler,
    MessageTooLarge,
    StreamSlots,
    TransportStats,
    failed_answer,
)

logger = logging.getLogger(__name__)

OK, FAILED = ANSWER_OK, ANSWER_FAILED
HANDLER_THREADS = 32  # handlers run at once (the rest wait for a thread)
CLOSE_SECONDS = 1.0  # to close a stream
# What a request left unread in its stream is read and dropped before the stream closes: py-libp2p's yamux
# keeps the unread bytes of a closed stream for 60 s, and a flood of oversized or refused requests piled
# them up (8 identities: +260 MiB). A stream holds at most its receive window: 16 MiB once grown.
DRAIN_BYTES = 17 << 20
KEEP_IDLE = 2  # open streams a caller keeps per peer and protocol for its next requests
KEEP_SECONDS = 30.0  # ... each for at most this long unused
MAX_KEPT = 256  # ... and at most this many in all
SERVED_IDLE_SECONDS = 60.0  # a server waits this long for a stream's next request (longer than KEEP_SECONDS)
KEPT_PER_PEER = 8  # a server closes a stream after its answer when the caller has more open
_HEADER = 8


class Requests:
    def __init__(self, host, guard: Guard, stats: TransportStats, slots: StreamSlots) -> None:
        self.host, self.guard, self.stats, self.slots = host, guard, stats, slots
        self.workers = trio.CapacityLimiter(HANDLER_THREADS)
        self.handlers: dict[str, tuple[Handler, int]] = {}  # name -> handler, request size limit
        self._served: Counter[str] = Counter()  # caller -> its streams open to this server
        # (peer, protocol) -> streams kept for the next requests, with when each was last used, oldest first
        self._kept: dict[tuple[ID, str], list[tuple[object, float]]] = {}

    def serve(self, name: str, handler: Handler, limit: int, *, inline: bool = False) -> None:
        self.handlers[name] = (handler, limit)

        async def on_stream(stream) -> None:
            await self._on_stream(name, handler, limit, inline, stream)

        self.host.set_stream_handler(TProtocol(name), on_stream)

    async def _on_stream(self, name: str, handler: Handler, limit: int, inline: bool, stream) -> None:
        """Answers the stream's requests, one at a time, until the caller closes it or leaves it idle."""
        caller = str(stream.muxed_conn.peer_id)
        self._served[caller] += 1
        try:
            with trio.fail_after(REQUEST_READ_TIMEOUT):
                size = await _read_size(stream)
            while await self._answer(name, handler, limit, inline, caller, stream, size):
                if self._served[caller] > KEPT_PER_PEER or (size := await _next_size(stream)) is None:
                    break
        except StreamEOF:  # the caller closed the stream after its last request
            pass
        except Exception as exc:  # a slow, oversized or broken request is dropped, not answered
            logger.info("dropped a %s request from %s: %s", name, caller, str(exc) or type(exc).__name__)
            with trio.move_on_after(CLOSE_SECONDS):
                await stream.reset()
        finally:
            self._served[caller] -= 1
            if not self._served[caller]:
                del self._served[caller]
            with trio.move_on_after(CLOSE_SECONDS):
                await _close(stream)

    async def _answer(
        self, name: str, handler: Handler, limit: int, inline: bool, caller: str, stream, size: int
    ) -> bool:
        """Reads the ``size``-byte request whose length was just read and answers it; whether the stream
        may carry another request (not after a refused or oversized one, whose rest was dropped)."""
        with self.slots.slot(caller) as admitted:
            allowed = self.guard.allows(caller)
            if not allowed or not admitted or size > limit:
                with trio.move_on_after(CLOSE_SECONDS):
                    await _discard(stream, size)
            if not allowed:
                response = FAILED + b"this peer does not serve you"
            elif not admitted:
                response = FAILED + b"too many requests in progress from this peer"
            elif size > limit:
                raise MessageTooLarge(f"a {size}-byte message exceeds the {limit}-byte limit")
            else:
                with trio.fail_after(REQUEST_READ_TIMEOUT):
                    request = await _read_exactly(stream, size)
                self.stats.bytes_received += len(request)
                response = await self._handle(name, handler, caller, request, inline)
            self.stats.requests_served += 1
            with trio.fail_after(ANSWER_WRITE_TIMEOUT):
                await write_frame(stream, response)
            self.stats.bytes_sent += len(response) - 1
            return allowed and admitted

    async def _handle(self, name: str, handler: Handler, caller: str, request: bytes, inline: bool) -> bytes:
        try:
            if inline:
                return OK + handler(caller, request)
            return OK + await trio.to_thread.run_sync(
                handler, caller, request, limiter=self.workers, abandon_on_cancel=True
            )
        except Exception as exc:  # the caller learns that we failed, and why
            return failed_answer(name, caller, exc)

    async def ask(self, peer: ID, name: str, payload: bytes, limit: int, *, reuse: bool = False) -> bytes:
        """Sends ``payload`` to ``peer``'s handler ``name`` and reads the framed answer (its status byte
        first), at most ``limit`` bytes. On a new stream, closed after the answer; with ``reuse``, on a
        stream kept from an earlier request when there is one (a new stream when that one has been closed
        since), and the stream is kept for the next."""
        if reuse and (stream := await self._take(peer, name)) is not None:
            try:
                return await self._exchange(stream, payload, limit, (peer, name))
            except Exception as exc:  # (closed by the server when idle, or its connection gone)
                logger.debug("a kept %s stream to %s failed (%s); opening another", name, peer, exc)
        stream = await self.host.new_stream(peer, [TProtocol(name)])
        return await self._exchange(stream, payload, limit, (peer, name) if reuse else None)

    async def _exchange(self, stream, payload: bytes, limit: int, keep: tuple[ID, str] | None) -> bytes:
        answered = False
        try:
            await write_frame(stream, payload)
            answer = await read_frame(stream, limit)
            answered = True
            return answer
        finally:  # (a stream whose exchange was cut off mid-way is never reused)
            if not (answered and keep is not None and await self._keep(keep, stream)):
                await _close_now(stream)

    async def _take(self, peer: ID, name: str):
        """A kept stream to ``peer``'s ``name`` unused for less than ``KEEP_SECONDS``, or None."""
        kept = self._kept.pop((peer, name), [])
        stream = None
        while kept and stream is None:
            stream, since = kept.pop()
            if time.monotonic() - since >= KEEP_SECONDS:
                await _close_now(stream)
                stream = None
        if kept:
            self._kept[(peer, name)] = kept
        return stream

    async def _keep(self, key: tuple[ID, str], stream) -> bool:
        """Keeps ``stream`` for the next request to its peer and protocol, unless ``KEEP_IDLE`` are kept
        already; the one kept longest is closed to make room when ``MAX_KEPT`` are."""
        if len(self._kept.get(key, ())) >= KEEP_IDLE:
            return False
        if sum(map(len, self._kept.values())) >= MAX_KEPT:
            oldest = min(self._kept, key=lambda k: self._kept[k][0][1])  # (each list is oldest first)
            await _close_now(self._kept[oldest].pop(0)[0])
            if not self._kept[oldest]:
                del self._kept[oldest]
        self._kept.setdefault(key, []).append((stream, time.monotonic()))
        return True


async def _read_exactly(stream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += await stream.read(size - len(data))  # (raises StreamEOF at the end of the stream)
    return bytes(data)


async def _read_size(stream) -> int:
    """The length that starts a frame."""
    return int.from_bytes(await _read_exactly(stream, _HEADER), "big")


async def _next_size(stream) -> int | None:
    """The length of the stream's next request, or None when none starts within ``SERVED_IDLE_SECONDS``."""
    with trio.move_on_after(SERVED_IDLE_SECONDS):
        return await _read_size(stream)
    return None


async def read_frame(stream, limit: int) -> bytes:
    """A length-prefixed message, its length checked against ``limit`` before it is read."""
    size = await _read_size(stream)
    if size > limit:
        with trio.move_on_after(CLOSE_SECONDS):
            await _discard(stream, size)
        raise MessageTooLarge(f"a {size}-byte message exceeds the {limit}-byte limit")
    return await _read_exactly(stream, size)


async def _discard(stream, size: int) -> None:
    """Reads up to ``size`` bytes (at most ``DRAIN_BYTES``) and keeps none of them."""
    left = min(size, DRAIN_BYTES)
    while left > 0:
        left -= len(await stream.read(min(left, 1 << 16)))  # (raises StreamEOF at the end of the stream)


async def write_frame(stream, data: bytes) -> None:
    await stream.write(len(data).to_bytes(_HEADER, "big") + data)


async def _close_now(stream) -> None:
    """Closes ``stream`` within ``CLOSE_SECONDS``, even in a cancelled scope."""
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_SECONDS):
        await _close(stream)


async def _close(stream) -> None:
    try:
        await stream.close()
    except Exception:  # already reset by the other side
        await stream.reset()
