"""Requests and answers over py-libp2p streams, for the libp2p backend (all of it on the backend's trio loop).

One stream per request, in hivemind's framing: an 8-byte big-endian length, then the payload; an answer
starts with a status byte (``OK`` or ``FAILED``, then the handler's message). A server checks the caller
against the guard, gives each remote peer ``MAX_STREAMS_PER_PEER`` requests at once, checks a request's
length before reading it and reads it within ``REQUEST_READ_TIMEOUT`` (one too large, or refused, is read
and dropped: ``DRAIN_BYTES``); handlers run on a pool of
``HANDLER_THREADS`` threads, or on the loop itself when they are quick (``inline``: the records protocol).
"""

from __future__ import annotations

import logging

import trio
from libp2p.custom_types import TProtocol
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
_HEADER = 8


class Requests:
    def __init__(self, host, guard: Guard, stats: TransportStats, slots: StreamSlots) -> None:
        self.host, self.guard, self.stats, self.slots = host, guard, stats, slots
        self.workers = trio.CapacityLimiter(HANDLER_THREADS)
        self.handlers: dict[str, tuple[Handler, int]] = {}  # name -> handler, request size limit

    def serve(self, name: str, handler: Handler, limit: int, *, inline: bool = False) -> None:
        self.handlers[name] = (handler, limit)

        async def on_stream(stream) -> None:
            await self._on_stream(name, handler, limit, inline, stream)

        self.host.set_stream_handler(TProtocol(name), on_stream)

    async def _on_stream(self, name: str, handler: Handler, limit: int, inline: bool, stream) -> None:
        caller = str(stream.muxed_conn.peer_id)
        with self.slots.slot(caller) as admitted:
            try:
                allowed = self.guard.allows(caller)
                if not allowed or not admitted:
                    with trio.move_on_after(CLOSE_SECONDS):
                        await _discard_frame(stream)
                if not allowed:
                    response = FAILED + b"this peer does not serve you"
                elif not admitted:
                    response = FAILED + b"too many requests in progress from this peer"
                else:
                    with trio.fail_after(REQUEST_READ_TIMEOUT):
                        request = await read_frame(stream, limit)
                    self.stats.bytes_received += len(request)
                    response = await self._answer(name, handler, caller, request, inline)
                self.stats.requests_served += 1
                with trio.fail_after(ANSWER_WRITE_TIMEOUT):
                    await write_frame(stream, response)
                self.stats.bytes_sent += len(response) - 1
            except Exception as exc:  # a slow, oversized or broken request is dropped, not answered
                logger.info("dropped a %s request from %s: %s", name, caller, exc or type(exc).__name__)
                with trio.move_on_after(CLOSE_SECONDS):
                    await stream.reset()
            finally:
                with trio.move_on_after(CLOSE_SECONDS):
                    await _close(stream)

    async def _answer(self, name: str, handler: Handler, caller: str, request: bytes, inline: bool) -> bytes:
        try:
            if inline:
                return OK + handler(caller, request)
            return OK + await trio.to_thread.run_sync(
                handler, caller, request, limiter=self.workers, abandon_on_cancel=True
            )
        except Exception as exc:  # the caller learns that we failed, and why
            return failed_answer(name, caller, exc)

    async def ask(self, peer: ID, name: str, payload: bytes, limit: int) -> bytes:
        """Opens a stream to ``peer``'s handler ``name``, sends ``payload`` and reads the framed answer (its
        status byte first), at most ``limit`` bytes."""
        stream = await self.host.new_stream(peer, [TProtocol(name)])
        try:
            await write_frame(stream, payload)
            return await read_frame(stream, limit)
        finally:
            with trio.move_on_after(CLOSE_SECONDS):
                await _close(stream)


async def _read_exactly(stream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += await stream.read(size - len(data))  # (raises StreamEOF at the end of the stream)
    return bytes(data)


async def read_frame(stream, limit: int) -> bytes:
    """A length-prefixed message, its length checked against ``limit`` before it is read."""
    size = int.from_bytes(await _read_exactly(stream, _HEADER), "big")
    if size > limit:
        with trio.move_on_after(CLOSE_SECONDS):
            await _discard(stream, size)
        raise MessageTooLarge(f"a {size}-byte message exceeds the {limit}-byte limit")
    return await _read_exactly(stream, size)


async def _discard_frame(stream) -> None:
    """Reads a message we will not use and drops it."""
    await _discard(stream, int.from_bytes(await _read_exactly(stream, _HEADER), "big"))


async def _discard(stream, size: int) -> None:
    """Reads up to ``size`` bytes (at most ``DRAIN_BYTES``) and keeps none of them."""
    left = min(size, DRAIN_BYTES)
    while left > 0:
        left -= len(await stream.read(min(left, 1 << 16)))  # (raises StreamEOF at the end of the stream)


async def write_frame(stream, data: bytes) -> None:
    await stream.write(len(data).to_bytes(_HEADER, "big") + data)


async def _close(stream) -> None:
    try:
        await stream.close()
    except Exception:  # already reset by the other side
        await stream.reset()
