"""Requests between two peers that nobody can dial, carried whole by a reachable peer (a relay).

A peer behind NAT dials the reachable peers itself, and they answer it over the connection it opened. Two
such peers have no connection of their own. libp2p's relayed circuits would give them one, but p2pd's relay
ends every circuit after 128 KiB (it runs a second relay with libp2p's default limits beside the one it is
configured with), far less than one update. So the reachable peer that the target reserved a slot on (the
relay in its circuit address) forwards the request and carries the answer back, whole::

    A --spes/forward--> R --spes/relayed--> B        (and B's answer back the same way)

Both ends sign, so that a relay can neither put words in a peer's mouth nor get an honest peer blamed:

- A signs its request (target, handler, payload, answer limit, timeout) with its identity key. B checks the
  signature, and that the key is A's (it derives A's peer id), then answers exactly as it would answer A
  directly: A's standing with B's guard, A's malformed payload counted against A. A request that fails its
  signature at B was altered by the relay: counted against the relay.
- B signs its answer together with the digest of A's signed request, so that no other answer can be passed
  off as this one. The relay checks that signature before passing the answer on (a bad one is B's fault,
  counted against B); an answer that fails it at A was altered on the way: counted against the relay, and
  the call fails for A as if B were unreachable (a miss, never B's fault).

A relay forwards at most ``MAX_FORWARDS`` requests at once (more are refused as busy), answers of at most
``MAX_FORWARD_BYTES``, holds each only while it is in flight, and waits for B no longer than the caller's
timeout, itself at most ``MAX_FORWARD_SECONDS``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec

from spes_p2p.net.transport import (
    Handler,
    PeerUnreachable,
    RemoteError,
    Transport,
    TransportError,
    Unavailable,
)
from spes_p2p.net.wire import BadRequest, Short, Strict

RPC_FORWARD = "spes/forward"  # to a relay: pass this signed request on
RPC_RELAYED = "spes/relayed"  # from a relay: a request another peer signed
MAX_FORWARDS = 2
MAX_FORWARD_BYTES = 256 << 20
MAX_FORWARD_SECONDS = 300.0
MAX_FORWARDED_REQUEST = 4096  # a forwarded request's own payload (ours are at most a few hundred bytes)
ANSWER_OVERHEAD = 4096  # an answer's key, signature and framing


@dataclass(frozen=True)
class Keys:
    """A peer's identity as forwarding needs it: its id, its public key, signing with its private key, and
    checking another peer's signature (whether ``key`` is ``peer``'s and signed ``data``)."""

    peer_id: str
    public_key: bytes
    sign: Callable[[bytes], bytes]
    verify: Callable[[str, bytes, bytes, bytes], bool]  # (peer, key, data, signature)


class Envelope(Strict):
    """A's request, as the relay and B see it."""

    MAX_BYTES = MAX_FORWARDED_REQUEST + 4096
    ERROR = BadRequest

    sender: Short
    key: Annotated[bytes, msgspec.Meta(max_length=1024)]
    to: Short
    name: Short
    payload: Annotated[bytes, msgspec.Meta(max_length=MAX_FORWARDED_REQUEST)]
    limit: Annotated[int, msgspec.Meta(ge=0, le=MAX_FORWARD_BYTES)]  # the most answer bytes A takes
    timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_FORWARD_SECONDS)]
    signature: Annotated[bytes, msgspec.Meta(max_length=1024)] = b""

    def digest(self) -> bytes:
        """What A signs: everything but the signature."""
        fields = [b"spes-forward", self.sender, self.key, self.to, self.name, self.payload, self.limit]
        return hashlib.sha256(msgspec.msgpack.encode([*fields, float(self.timeout)])).digest()


class Answer(Strict):
    """B's answer (or refusal), signed over the request it answers."""

    MAX_BYTES = MAX_FORWARD_BYTES + ANSWER_OVERHEAD
    ERROR = BadRequest

    ok: bool
    body: bytes  # the handler's answer, or (not ok) why it failed
    key: Annotated[bytes, msgspec.Meta(max_length=1024)]
    signature: Annotated[bytes, msgspec.Meta(max_length=1024)]

    @staticmethod
    def digest(request: Envelope, ok: bool, body: bytes) -> bytes:
        return hashlib.sha256(b"spes-answer" + request.digest() + bytes([ok]) + body).digest()

    def signed_by(self, keys: Keys, peer: str, request: Envelope) -> bool:
        return keys.verify(peer, self.key, Answer.digest(request, self.ok, self.body), self.signature)


class Forwarding:
    """Forwarding for one transport: asks through a relay (``request``), relays (``spes/forward``, served
    only by reachable peers) and answers what a relay brings (``spes/relayed``, with ``handlers``: the
    transport's own handlers by name, with their request size limits)."""

    def __init__(
        self, transport: Transport, keys: Keys, handlers: Callable[[str], tuple[Handler, int] | None]
    ) -> None:
        self.transport, self.keys, self.handlers = transport, keys, handlers
        self._slots = threading.BoundedSemaphore(MAX_FORWARDS)

    def serve(self, relay: bool) -> None:
        self.transport.serve(RPC_RELAYED, self.rpc_relayed, max_request_bytes=Envelope.MAX_BYTES)
        if relay:
            self.transport.serve(RPC_FORWARD, self.rpc_forward, max_request_bytes=Envelope.MAX_BYTES)

    # ----------------------------------------------------------------------------------- A: asking

    def request(
        self, relay: str, to: str, name: str, payload: bytes, *, timeout: float, max_response_bytes: int
    ) -> bytes:
        """``to``'s answer to ``payload`` (its handler ``name``), carried by ``relay``."""
        if len(payload) > MAX_FORWARDED_REQUEST:
            raise PeerUnreachable(f"a {len(payload)}-byte request is too large to forward to {to}")
        limit = min(max_response_bytes, MAX_FORWARD_BYTES)
        seconds = min(timeout, MAX_FORWARD_SECONDS)
        envelope = Envelope(self.keys.peer_id, self.keys.public_key, to, name, payload, limit, seconds)
        envelope = msgspec.structs.replace(envelope, signature=self.keys.sign(envelope.digest()))
        raw = self.transport.request(
            relay, RPC_FORWARD, envelope.encode(), timeout=timeout, max_response_bytes=limit + ANSWER_OVERHEAD
        )
        try:
            answer = Answer.decode(raw)
            if not answer.signed_by(self.keys, to, envelope):
                raise BadRequest(f"{to}'s answer fails its signature")
        except BadRequest as exc:
            self.transport.guard.reject(relay, "forwarded answer", str(exc))
            raise PeerUnreachable(f"{relay} did not carry {to}'s answer intact: {exc}") from None
        self.transport.guard.accept(relay)
        if not answer.ok:
            raise RemoteError(f"{to} failed to answer {name}: {answer.body.decode(errors='replace')}")
        return answer.body

    # ----------------------------------------------------------------------------------- R: relaying

    def rpc_forward(self, caller: str, request: bytes) -> bytes:
        """Passes a signed request on to its target and the target's signed answer back."""
        envelope = self._envelope(request, caller, sender=caller)
        if not self._slots.acquire(blocking=False):
            raise Unavailable(f"this relay is already forwarding {MAX_FORWARDS} requests")
        try:
            raw = self.transport.request(
                envelope.to,
                RPC_RELAYED,
                request,
                timeout=envelope.timeout,
                max_response_bytes=envelope.limit + ANSWER_OVERHEAD,
            )
        except TransportError as exc:
            raise Unavailable(f"could not forward to {envelope.to}: {exc}") from None
        finally:
            self._slots.release()
        try:
            intact = Answer.decode(raw).signed_by(self.keys, envelope.to, envelope)
        except BadRequest:
            intact = False
        if not intact:
            self.transport.guard.reject(envelope.to, "relayed answer", "it fails its signature")
            raise Unavailable(f"{envelope.to}'s answer failed its signature")
        return raw

    # ----------------------------------------------------------------------------------- B: answering

    def rpc_relayed(self, caller: str, request: bytes) -> bytes:
        """A request that ``caller`` (a relay) brings from another peer, answered as that peer and signed."""
        envelope = self._envelope(request, caller, to=self.keys.peer_id)
        sender = envelope.sender
        served = self.handlers(envelope.name)
        if not self.transport.admits(sender):
            ok, body = False, b"this peer does not serve you"
        elif served is None or envelope.name in (RPC_FORWARD, RPC_RELAYED):
            ok, body = False, f"no handler {envelope.name} here".encode()
        elif len(envelope.payload) > served[1]:
            self.transport.guard.reject(sender, "request", f"a {len(envelope.payload)}-byte {envelope.name}")
            ok, body = False, b"request too large"
        else:
            ok, body = self._run(served[0], sender, envelope)
        signature = self.keys.sign(Answer.digest(envelope, ok, body))
        return Answer(ok, body, self.keys.public_key, signature).encode()

    def _run(self, handler: Handler, sender: str, envelope: Envelope) -> tuple[bool, bytes]:
        try:
            body = handler(sender, envelope.payload)
        except RemoteError as exc:  # a refusal, or a malformed request (counted against the sender)
            return False, str(exc).encode()
        if len(body) > envelope.limit:
            return False, f"the answer ({len(body)} bytes) is over your {envelope.limit}-byte limit".encode()
        return True, body

    # ----------------------------------------------------------------------------------- checks

    def _envelope(self, request: bytes, caller: str, *, sender: str = "", to: str = "") -> Envelope:
        """The request, decoded and its signature checked; a bad one counts against ``caller``, who sent
        it (the relay, when it reaches the target: the relay checked it first)."""
        try:
            envelope = Envelope.decode(request)
        except BadRequest as exc:
            self.transport.guard.reject(caller, "forwarded request", str(exc))
            raise
        problem = ""
        if sender and envelope.sender != sender:
            problem = f"it is signed by {envelope.sender}, not by the peer that sent it"
        elif to and envelope.to != to:
            problem = f"it is addressed to {envelope.to}"
        elif not self.keys.verify(envelope.sender, envelope.key, envelope.digest(), envelope.signature):
            problem = "its signature does not match"
        if problem:
            self.transport.guard.reject(caller, "forwarded request", problem)
            raise BadRequest(f"a forwarded request refused: {problem}")
        return envelope
