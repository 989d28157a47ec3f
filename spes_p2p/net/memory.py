"""The in-process backend: every peer of a ``MemoryNetwork`` lives in one process.

Deterministic for a given seed, and instant unless told otherwise. Fault hooks act on requests: ``drop``
(the call times out), ``delay`` (seconds added to each call), ``corrupt`` (one byte of the answer flipped)
and ``partition`` (peers in different groups neither reach each other nor see each other's records), and
on gossip: ``gossip_drop`` (a message does not reach one subscriber). Gossip is delivered at once, on the
sender's thread.
The clock is injectable, so record expiry can be tested without waiting.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from spes_p2p.net.guard import Guard
from spes_p2p.net.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    HELLO,
    HELLO_MAX_BYTES,
    Entry,
    GossipHandler,
    Handler,
    MessageTooLarge,
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
    StreamSlots,
    Transport,
    TransportError,
    TransportStats,
    check_gossip_size,
    check_record_size,
)

SERVER_WORKERS = 32  # requests a peer answers at once (a caller holds at most MAX_STREAMS_PER_PEER)


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class MemoryNetwork:
    """The shared medium: records, live peers, and the faults applied to requests."""

    def __init__(self, seed: int = 0, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.records: dict[str, dict[str, Entry]] = {}
        self.peers: dict[str, MemoryTransport] = {}
        self.drop = 0.0  # probability that a request is lost
        self.delay = 0.0  # seconds added to every request
        self.corrupt = 0.0  # probability that a response has one byte flipped
        self.groups: dict[str, int] = {}  # peer id -> partition group; empty: fully connected
        self.unreachable: set[str] = set()  # peers nobody can dial (they dial out), as behind NAT
        self.gossip_drop = 0.0  # probability that a gossip message does not reach one of its subscribers
        self.topics: dict[str, dict[str, GossipHandler]] = {}  # topic -> subscriber -> its handler
        self.faults = {"dropped": 0, "corrupted": 0, "partitioned": 0, "gossip dropped": 0}
        self.log: list[
            tuple[str, str, str, bytes, int]
        ] = []  # (caller, target, name, request, response bytes)
        self.served: Counter[str] = Counter()  # DHT key -> the value bytes its reads returned, exactly

    def serve_bytes(self, key: str, size: int) -> None:
        with self.lock:
            self.served[key] += size

    def join(self, peer_id: str) -> MemoryTransport:
        with self.lock:
            if peer_id in self.peers:
                raise ValueError(f"peer id {peer_id!r} is already on this network")
            transport = MemoryTransport(self, peer_id)
            self.peers[peer_id] = transport
            return transport

    def partition(self, *groups: Iterable[str]) -> None:
        """Splits the network: peers reach only peers of their own group (unlisted peers: group -1)."""
        with self.lock:
            self.groups = {peer: i for i, group in enumerate(groups) for peer in group}

    def heal(self) -> None:
        with self.lock:
            self.groups = {}

    def connected(self, a: str, b: str) -> bool:
        return not self.groups or self.groups.get(a, -1) == self.groups.get(b, -1)

    def roll(self, probability: float) -> bool:
        """Whether a fault of this probability strikes now (drawn from the network's seeded generator)."""
        with self.lock:
            return probability > 0 and self.rng.random() < probability


class MemoryTransport(Transport):
    backend = "memory"

    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self.network, self.peer_id = network, peer_id
        self.handlers: dict[str, tuple[Handler, int]] = {}
        # its own workers, as a server has: a peer whose handlers hang (a slow attacker) holds up no other
        self.workers = ThreadPoolExecutor(SERVER_WORKERS, thread_name_prefix=f"spes-memory-{peer_id}")
        self.streams = StreamSlots()
        self.guard = Guard()
        self.stats = TransportStats()
        self.alive = True
        self.serve(HELLO, lambda caller, request: self.backend.encode(), max_request_bytes=HELLO_MAX_BYTES)

    def addresses(self) -> list[str]:
        return [f"/memory/p2p/{self.peer_id}"]

    def now(self) -> float:
        return self.network.clock()

    def _check_alive(self) -> None:
        if not self.alive:
            raise TransportError(f"{self.peer_id} has shut down")

    def publish(self, key: str, value: bytes, expires_at: float) -> bool:
        self._check_alive()
        check_record_size(value)
        self.stats.dht_write(key, time.perf_counter(), len(value))  # (in memory: no latency to speak of)
        with self.network.lock:
            entries = self.network.records.setdefault(key, {})
            old = entries.get(self.peer_id)
            if old is not None and old.expires_at > expires_at:
                return False  # like hivemind's DHT: the entry that expires later wins
            entries[self.peer_id] = Entry(bytes(value), expires_at)
        return True

    def read(self, key: str, *, banned: bool = False) -> dict[str, Entry]:
        self._check_alive()
        started, now = time.perf_counter(), self.now()
        with self.network.lock:
            entries = dict(self.network.records.get(key, {}))
        served = {
            p: e for p, e in entries.items() if e.expires_at > now and self.network.connected(self.peer_id, p)
        }
        self.network.serve_bytes(key, sum(len(e.value) for e in served.values()))
        self.stats.dht_read(key, started, (len(e.value) for e in served.values()))
        return {peer: entry for peer, entry in served.items() if self.readable(peer, entry, now, banned)}

    def serve(self, name: str, handler: Handler, *, max_request_bytes: int) -> None:
        self.handlers[name] = (handler, max_request_bytes)

    def request(
        self,
        peer_id: str,
        name: str,
        payload: bytes,
        *,
        timeout: float,
        max_response_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> bytes:
        self._check_alive()
        net = self.network
        target = net.peers.get(peer_id)
        if target is None or not target.alive or name not in target.handlers:
            raise PeerUnreachable(f"peer {peer_id} is not reachable (or does not serve {name!r})")
        if not net.connected(self.peer_id, peer_id):
            net.faults["partitioned"] += 1
            raise PeerUnreachable(f"peer {peer_id} is on the other side of a network partition")
        if net.delay:
            time.sleep(min(net.delay, timeout))
            if net.delay >= timeout:
                raise RequestTimeout(f"{name} to {peer_id} timed out after {timeout:.1f}s")
        if net.roll(net.drop):
            net.faults["dropped"] += 1
            raise RequestTimeout(f"{name} to {peer_id} timed out (message dropped)")
        handler, max_request = target.handlers[name]
        if len(payload) > max_request:
            raise RemoteError(f"{peer_id} refused a {len(payload)}-byte {name} request (limit {max_request})")
        if not target.admits(self.peer_id):
            raise RemoteError(f"{peer_id} refused {name}: it does not serve this peer")
        response = target.answer(handler, self.peer_id, name, payload, timeout - net.delay)
        if len(response) > max_response_bytes:
            raise MessageTooLarge(
                f"{name} answer from {peer_id} has {len(response)} bytes, over {max_response_bytes}"
            )
        if net.roll(net.corrupt):
            net.faults["corrupted"] += 1
            response = _flip_one_byte(response, net)
        with net.lock:
            net.log.append((self.peer_id, peer_id, name, payload, len(response)))
        self.stats.bytes_sent += len(payload)
        self.stats.bytes_received += len(response)
        self.stats.requests_sent += 1
        target.stats.bytes_received += len(payload)
        target.stats.bytes_sent += len(response)
        target.stats.requests_served += 1
        return response

    def answer(self, handler: Handler, caller: str, name: str, payload: bytes, timeout: float) -> bytes:
        """This peer's answer to ``caller``, on a worker thread as a server would run it, within ``timeout``.
        The caller's slot is held until the handler is done, even when the caller gave up waiting."""
        me = self.peer_id
        if not self.streams.acquire(caller):
            raise RemoteError(f"{me} refused {name}: too many requests in progress from this peer")
        future = self.workers.submit(handler, caller, payload)
        future.add_done_callback(lambda _: self.streams.release(caller))
        try:
            return future.result(timeout=max(timeout, 0.0))
        except FutureTimeout:
            raise RequestTimeout(f"{name} to {me} timed out after {timeout:.1f}s") from None
        except Exception as exc:  # a failing remote handler is the remote's problem, reported to the caller
            raise RemoteError(f"{me} failed to answer {name}: {exc}") from None

    def subscribe(self, topic: str, on_message: GossipHandler) -> bool:
        self._check_alive()
        with self.network.lock:
            self.network.topics.setdefault(topic, {})[self.peer_id] = on_message
        return True

    def unsubscribe(self, topic: str) -> None:
        with self.network.lock:
            self.network.topics.get(topic, {}).pop(self.peer_id, None)

    def gossip(self, topic: str, data: bytes) -> bool:
        self._check_alive()
        check_gossip_size(data)
        net = self.network
        with net.lock:
            subscribers = dict(net.topics.get(topic, {}))
        for peer, on_message in subscribers.items():
            target = net.peers.get(peer)
            if peer == self.peer_id or target is None or not net.connected(self.peer_id, peer):
                continue
            if net.roll(net.gossip_drop):
                net.faults["gossip dropped"] += 1
            elif target.guard.allows(self.peer_id):
                on_message(self.peer_id, bytes(data))
        return True

    def probe(self, address: str, timeout: float) -> bool:
        """A memory address names a peer: it opens when that peer is on the network and this side of any
        partition (``unreachable`` lists peers that nobody can dial, as if behind NAT)."""
        peer = address.rsplit("/p2p/", 1)[-1]
        target = self.network.peers.get(peer)
        return (
            target is not None
            and target.alive
            and peer not in self.network.unreachable
            and self.network.connected(self.peer_id, peer)
        )

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops answering; records stay until they expire, as in a real DHT."""
        self.alive = False
        with self.network.lock:
            self.network.peers.pop(self.peer_id, None)
            for subscribers in self.network.topics.values():
                subscribers.pop(self.peer_id, None)
        self.workers.shutdown(wait=False, cancel_futures=True)


def _flip_one_byte(data: bytes, net: MemoryNetwork) -> bytes:
    if not data:
        return data
    with net.lock:
        i = net.rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
