"""The seam between the swarm protocol and the network.

A Transport gives a peer these, whatever the backend:

- a small DHT of expiring records, where every peer writes its **own entry** (bytes, at most
  ``MAX_RECORD_BYTES``) under a shared key (``publish``) and anyone reads all live entries of a key
  (``read``); what the bytes mean is ``spes_p2p.swarm.records``'s business;
- request/response of bytes with named handlers (``serve`` / ``request``), streamed for large payloads,
  with a timeout and a size limit on every call; a server reads each request within
  ``REQUEST_READ_TIMEOUT``, drops an answer not taken within ``ANSWER_WRITE_TIMEOUT``, and serves each
  remote peer at most ``MAX_STREAMS_PER_PEER`` requests at once (``StreamSlots``);
- its own peer id and dialable addresses, and a bounded ``shutdown``;
- gossip, where the backend has it (libp2p; memory): small messages (at most ``MAX_GOSSIP_BYTES``) to the
  peers subscribed to a topic (``subscribe`` / ``gossip``). It is lossy by nature: whatever rides on it
  must also be found another way (update announcements stay in the DHT);
- a ``guard`` (``spes_p2p.net.guard``): entries of peers it does not allow are not read, and their
  requests and gossip are refused.

Errors (all ``TransportError``, a ``SpesError``)::

    TransportError
     +-- BootstrapError     no initial peer answered
     |    +-- WrongBackend  the initial peers run the other backend (``HELLO`` says which)
     +-- ListenError        cannot listen on the requested address (port in use, bad address)
     +-- PeerUnreachable    the remote peer cannot be reached, or it has no such handler
     +-- RequestTimeout     no complete answer within the timeout
     +-- MessageTooLarge    a request, response or record over its size limit
     +-- RemoteError        the remote handler failed; the message is the remote's
     +-- Unavailable        raised by a handler: it cannot answer this (yet); not a failure, no traceback
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from spes_p2p.errors import SpesError
from spes_p2p.net.guard import Guard

logger = logging.getLogger(__name__)

# DHT records are small by design (and values over about 64 KB break hivemind's DHT loop).
MAX_RECORD_BYTES = 16 * 1024
MAX_EXPIRY_AHEAD = 600.0  # an entry set to outlive every honest TTL by this much is not read
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
MAX_GOSSIP_BYTES = 4096  # (py-libp2p's gossipsub silently drops messages of 1 MiB or more)
# What a server grants one remote peer: requests in progress at once, seconds to send its request (a few KB
# at most), and seconds to take the answer before the stream is dropped.
MAX_STREAMS_PER_PEER = 8
REQUEST_READ_TIMEOUT = 10.0
ANSWER_WRITE_TIMEOUT = 300.0

# Every backend answers this request with its name, so a peer of the other backend learns which to use.
HELLO = "spes.hello"
HELLO_MAX_BYTES = 64  # its request is empty, and so is every handler's limit: no request is read unbounded
# On the network backends an answer starts with a status byte (hivemind's markers), then the handler's
# answer, or its error message in UTF-8.
ANSWER_OK, ANSWER_FAILED = b"\x00", b"\x01"

Handler = Callable[[str, bytes], bytes]  # (caller's peer id, request) -> response
GossipHandler = Callable[[str, bytes], None]  # (sender's peer id, message)


class TransportError(SpesError):
    pass


class BootstrapError(TransportError):
    pass


class WrongBackend(BootstrapError):
    pass


class ListenError(TransportError):
    pass


class PeerUnreachable(TransportError):
    pass


class RequestTimeout(TransportError):
    pass


class MessageTooLarge(TransportError):
    pass


class RemoteError(TransportError):
    pass


class Unavailable(RemoteError):
    """A handler's polite refusal (e.g. an update that is not ready yet); callers see a RemoteError."""


def key_kind(key: str) -> str:
    """What a DHT key is counted under: its second part (keys are ``<run id>/<kind>/...``)."""
    parts = key.split("/", 2)
    return parts[1] if len(parts) > 1 else key


@dataclass
class DhtCounts:
    """One kind of key's DHT operations: reads with the entries and value bytes they returned, writes with
    the value bytes they stored, and the seconds all of them took."""

    reads: int = 0
    entries: int = 0
    read_bytes: int = 0
    writes: int = 0
    written_bytes: int = 0
    seconds: float = 0.0

    @property
    def ops(self) -> int:
        return self.reads + self.writes

    def since(self, earlier: DhtCounts | None) -> DhtCounts:
        """What was counted after ``earlier`` (a snapshot of these counts)."""
        earlier = earlier or DhtCounts()
        return DhtCounts(**{f: getattr(self, f) - getattr(earlier, f) for f in self.__dataclass_fields__})


@dataclass
class TransportStats:
    """Payload bytes this peer moved through requests (records not counted), and its DHT operations by the
    kind of key (``key_kind``). Thread-safe."""

    bytes_sent: int = 0
    bytes_received: int = 0
    requests_sent: int = 0
    requests_served: int = 0
    dht: dict[str, DhtCounts] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def dht_read(self, key: str, started: float, sizes: Iterable[int]) -> None:
        """Counts a read of ``key`` that began at ``started`` (time.perf_counter()) and returned entries of
        ``sizes`` bytes (every entry that came, readable or not)."""
        sizes = list(sizes)
        with self._lock:
            counts = self.dht.setdefault(key_kind(key), DhtCounts())
            counts.reads += 1
            counts.entries += len(sizes)
            counts.read_bytes += sum(sizes)
            counts.seconds += time.perf_counter() - started

    def dht_write(self, key: str, started: float, size: int) -> None:
        """Counts a store of ``size`` bytes under ``key`` that began at ``started``."""
        with self._lock:
            counts = self.dht.setdefault(key_kind(key), DhtCounts())
            counts.writes += 1
            counts.written_bytes += size
            counts.seconds += time.perf_counter() - started

    def dht_snapshot(self) -> dict[str, DhtCounts]:
        with self._lock:
            return {kind: dataclasses.replace(c) for kind, c in self.dht.items()}

    @property
    def dht_ops(self) -> int:
        """Reads and writes, every key."""
        return sum(c.ops for c in self.dht_snapshot().values())


@dataclass(frozen=True)
class Entry:
    """One peer's entry under a DHT key."""

    value: bytes
    expires_at: float  # in the transport's clock (``Transport.now``)


class StreamSlots:
    """Each remote peer's requests in progress on a server, at most ``limit`` at once (thread-safe)."""

    def __init__(self, limit: int = MAX_STREAMS_PER_PEER) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def in_progress(self, peer: str) -> int:
        with self._lock:
            return self._open[peer]

    def acquire(self, peer: str) -> bool:
        """Whether ``peer`` may have one more request served now (then ``release`` it when done)."""
        with self._lock:
            admitted = self._open[peer] < self.limit
            if admitted:
                self._open[peer] += 1
            return admitted

    def release(self, peer: str) -> None:
        with self._lock:
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]

    @contextmanager
    def slot(self, peer: str) -> Iterator[bool]:
        """Yields whether ``peer`` may have one more request served now; the slot is freed on exit."""
        admitted = self.acquire(peer)
        try:
            yield admitted
        finally:
            if admitted:
                self.release(peer)


def failed_answer(name: str, caller: str, exc: Exception) -> bytes:
    """The answer to a request ``name`` whose handler raised ``exc``: the caller learns why. A refusal
    (RemoteError: Unavailable, a malformed request) is routine; any other failure is logged with its
    traceback."""
    if isinstance(exc, RemoteError):
        logger.debug("%s for %s: %s", name, caller, exc)
    else:
        logger.warning("handler %s failed for %s: %s", name, caller, exc, exc_info=exc)
    return ANSWER_FAILED + str(exc).encode()


def check_gossip_size(data: bytes) -> None:
    """Raises MessageTooLarge past MAX_GOSSIP_BYTES."""
    if len(data) > MAX_GOSSIP_BYTES:
        raise MessageTooLarge(f"a {len(data)}-byte gossip message exceeds {MAX_GOSSIP_BYTES}")


def check_record_size(data: bytes) -> None:
    """Raises MessageTooLarge past MAX_RECORD_BYTES."""
    if len(data) > MAX_RECORD_BYTES:
        raise MessageTooLarge(
            f"DHT record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}; keep records small"
        )


class Transport(ABC):
    """One peer's connection to the swarm. Thread-safe; every call returns within its timeout. Its
    ``guard`` says whose entries ``read`` returns and whose requests are served (``readable``, ``admits``)."""

    backend: ClassVar[str]  # its name, as --backend spells it
    peer_id: str
    stats: TransportStats
    guard: Guard
    streams: StreamSlots  # each remote peer's requests this one is serving now

    def readable(self, peer: str, entry: Entry, now: float, banned: bool = False) -> bool:
        """Whether ``read`` returns ``peer``'s entry: it is live, does not outlive every honest TTL by
        ``MAX_EXPIRY_AHEAD``, and was written by this peer or one its guard allows (with ``banned``, one the
        allowlist names, banned or not)."""
        live = now < entry.expires_at <= now + MAX_EXPIRY_AHEAD
        allowed = self.guard.listed(peer) if banned else self.guard.allows(peer)
        return live and (peer == self.peer_id or allowed)

    def latest_readable(
        self, entries: Iterable[tuple[str, Entry]], now: float, banned: bool = False
    ) -> dict[str, Entry]:
        """Per peer, the entry ``read`` returns: of its readable entries, the one that expires last."""
        latest: dict[str, Entry] = {}
        for peer, entry in entries:
            if self.readable(peer, entry, now, banned) and (
                peer not in latest or entry.expires_at > latest[peer].expires_at
            ):
                latest[peer] = entry
        return latest

    def admits(self, caller: str) -> bool:
        """Whether a request from ``caller`` is served."""
        return self.guard.allows(caller)

    @abstractmethod
    def addresses(self) -> list[str]:
        """Multiaddrs other peers can dial, each ending in /p2p/<peer id>."""

    def learn(self, peer_id: str, addresses: list[str]) -> None:  # noqa: B027 - most backends route alone
        """What ``peer_id``'s record says it is reached at (a relayed peer's circuit addresses)."""

    @abstractmethod
    def now(self) -> float:
        """The clock record expiry is measured in (shared across peers, roughly)."""

    @abstractmethod
    def publish(self, key: str, value: bytes, expires_at: float) -> bool:
        """Writes this peer's own entry under ``key``; True when the DHT accepted it."""

    @abstractmethod
    def read(self, key: str, *, banned: bool = False) -> dict[str, Entry]:
        """All live entries under ``key`` (bytes values only), by the peer id that wrote them; with
        ``banned``, those of the peers this one banned too (a ban is this peer's own: where every peer must
        count the same peers, as in the grid of a grouped exchange, the banned still count)."""

    @abstractmethod
    def serve(self, name: str, handler: Handler, *, max_request_bytes: int) -> None:
        """Answers requests named ``name``; the handler runs on a worker thread. A request over
        ``max_request_bytes`` is refused unread (a handler states its own limit: there is no default)."""

    @abstractmethod
    def request(
        self,
        peer_id: str,
        name: str,
        payload: bytes,
        *,
        timeout: float,
        max_response_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> bytes:
        """Sends ``payload`` to ``peer_id``'s handler ``name`` and returns its answer."""

    def subscribe(self, topic: str, on_message: GossipHandler) -> bool:
        """Calls ``on_message(sender, data)`` for every message another peer (one the guard allows) gossips
        on ``topic``, on a thread of the transport's: keep it quick. False: this backend has no gossip."""
        return False

    def unsubscribe(self, topic: str) -> None:  # noqa: B027 - a backend without gossip has nothing to stop
        """Ends ``subscribe``'s deliveries on ``topic``."""

    def gossip(self, topic: str, data: bytes) -> bool:
        """Sends ``data`` to the peers subscribed to ``topic``, best effort: it may be lost on the way.
        MessageTooLarge past ``MAX_GOSSIP_BYTES``; False when nothing was sent (no gossip here)."""
        check_gossip_size(data)
        return False

    @abstractmethod
    def probe(self, address: str, timeout: float) -> bool:
        """Whether a connection to ``address`` (another peer's announced multiaddr) opens from here."""

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops serving and leaves the network within ``timeout`` seconds."""


def check_ports_free(listen: Sequence[str]) -> None:
    """A fixed TCP port another program (or peer) already listens on is a ListenError. p2pd binds with
    SO_REUSEPORT, so a second peer on the first one's port would otherwise start and share its connections."""
    for addr in listen:  # (a malformed one is the daemon's to report)
        parts = addr.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        if not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((parts[2], int(parts[4])))
            except OSError as exc:
                raise ListenError(
                    f"cannot listen on {addr}: {exc.strerror.lower()} (another peer or program holds port "
                    f"{parts[4]}); pick another --listen port, or tcp/0 for any free one"
                ) from None


def tcp_probe(address: str, timeout: float) -> bool:
    """Whether a TCP connection to a multiaddr's host and port opens (nothing is sent): what a dial needs."""
    parts = address.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp":
        return False
    try:
        with socket.create_connection((parts[2], int(parts[4])), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
