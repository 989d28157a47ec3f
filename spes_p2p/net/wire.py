"""Typed messages between peers: msgpack, size-capped, decoded strictly.

Every structure another peer sends (a DHT record, a request, a gossiped message, a forwarded envelope) is a
``Strict`` subclass with its own size bound and error: a wrong type, a missing or unknown field, a value out
of range or oversized input raises that error, never anything else.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, TypeVar

import msgspec

from spes_p2p.net.transport import RemoteError

Short = Annotated[str, msgspec.Meta(max_length=512)]

S = TypeVar("S", bound="Strict")


class RecordError(ValueError):
    """An entry read from the DHT (or heard by gossip) that does not match its schema."""


class BadRequest(RemoteError):
    """A request that does not decode into its message type: the server answers with a failure."""


class Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A typed message from another peer: msgpack, at most ``MAX_BYTES``, decoded strictly (a missing or
    unknown field, a wrong type or a value out of range raises ``ERROR``)."""

    MAX_BYTES: ClassVar[int]
    ERROR: ClassVar[type[Exception]]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls: type[S], data: bytes) -> S:
        if not isinstance(data, bytes) or len(data) > cls.MAX_BYTES:
            size = len(data) if isinstance(data, bytes) else type(data).__name__
            raise cls.ERROR(f"a {size}-byte {cls.__name__}, over {cls.MAX_BYTES}")
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            raise cls.ERROR(f"malformed {cls.__name__}: {exc}") from None
