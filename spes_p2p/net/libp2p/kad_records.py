"""Records on the libp2p backend: signed entries, each stored by the peers closest to its key.

py-libp2p's Kademlia keeps one value per key (the one its validator selects), with no expiry, and answers a
read from a stale local copy first. Our records are one entry per writer under a shared key, each with its
own expiry. So the libp2p backend uses Kademlia to find the peers closest to a key, and those peers keep
the entries with this module:

- ``SignedEntry``: the key, the value, its expiry, the writer's public key and its signature over the first
  three. The writer's peer id is derived from the key (``writer``): nobody writes under another's id, and a
  peer that stores or forwards an entry cannot change it.
- ``RecordStore``: the entries a peer keeps for the swarm: per (key, writer) the one that expires last,
  expired ones dropped, bounded in bytes in all and per writer.
- ``Fetch`` / ``Found``: the wire messages of a read (a store sends one ``SignedEntry``);
- ``RecordKeeping``: the protocol, on the backend's trio loop: a write goes to the ``REPLICAS`` peers
  closest to its key (this one, when it is among them), a read asks them all and keeps each writer's entry
  that expires last; and the handlers by which this peer keeps entries for the others.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Annotated

import msgspec
import trio
from libp2p.crypto.keys import PrivateKey
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID

from spes_p2p.net.guard import Guard
from spes_p2p.net.libp2p.streams import FAILED, OK, Requests
from spes_p2p.net.transport import MAX_EXPIRY_AHEAD, MAX_RECORD_BYTES, RemoteError
from spes_p2p.net.wire import RecordError, Strict

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 256
MAX_WRITERS_PER_KEY = 1024
STORE_BYTES = 64 << 20  # all entries a peer keeps for others
WRITER_BYTES = 2 << 20  # ... of which one writer's
ENTRY_OVERHEAD = 1024  # a public key, a signature and msgpack around the value
_DOMAIN = b"spes-record/1"
REPLICAS = 5  # peers that keep each key's entries
LOOKUP_SECONDS = 3.0  # finding the peers closest to a key
# ... and using what was found again: the closest peers of a key change only as peers join and leave, and
# each lookup is a walk of several requests (8 libp2p founders on 2 cores, reusing lookups for 30 s instead
# of 5: median sync wait 7.5-7.9 s instead of 18.6-44.6 s, CPU 108-134 s instead of 173-254 s, 2 seeds)
LOOKUP_REUSE_SECONDS = 30.0
# ... but a lookup cut off by LOOKUP_SECONDS gave only the peers this one knew of, maybe none of the key's
# keepers (a newcomer knows its initial peers), and is tried again sooner: reused for 30 s, it could leave
# a newcomer under load reading nothing of the swarm for longer than it waits to join
PARTIAL_REUSE_SECONDS = 3.0
# A walk that met no peer this one did not know says its routing table holds the swarm's peers near the
# key; for this long after one, the keepers of a key not looked up yet are taken from the table, not walked
# for (a swarm's keys of a round, such as its updates', are new each round: 8 libp2p peers with virtual
# compute spent a sixth of their interpreter's time on those walks, each query signing and checking records)
SETTLED_SECONDS = 30.0
MAX_LOOKUPS = 4096  # lookups kept for reuse
ASK_SECONDS = 5.0  # one replica's answer
STORE, FETCH = "spes.records.store", "spes.records.fetch"


class SignedEntry(Strict):
    MAX_BYTES = MAX_RECORD_BYTES + MAX_KEY_CHARS + ENTRY_OVERHEAD
    ERROR = RecordError

    key: Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]
    value: Annotated[bytes, msgspec.Meta(max_length=MAX_RECORD_BYTES)]
    expires_at: float
    public_key: Annotated[bytes, msgspec.Meta(max_length=ENTRY_OVERHEAD // 2)]
    signature: Annotated[bytes, msgspec.Meta(max_length=ENTRY_OVERHEAD // 2)]

    @classmethod
    def sign(cls, key: str, value: bytes, expires_at: float, private_key: PrivateKey) -> SignedEntry:
        signature = private_key.sign(_signed_bytes(key, value, expires_at))
        return cls(key, value, expires_at, private_key.get_public_key().serialize(), signature)

    def writer(self) -> str | None:
        """The peer id whose key signed this entry; None when the signature does not verify."""
        peer = _peer_id_of(self.public_key)
        data = _signed_bytes(self.key, self.value, self.expires_at)
        return peer if peer is not None and signed_by(peer, self.public_key, data, self.signature) else None

    @property
    def size(self) -> int:
        return len(self.key) + len(self.value) + len(self.public_key) + len(self.signature)


class Fetch(Strict):
    MAX_BYTES = MAX_KEY_CHARS + 64
    ERROR = RecordError

    key: Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]


class Found(Strict):
    MAX_BYTES = 32 << 20
    ERROR = RecordError

    entries: Annotated[list[SignedEntry], msgspec.Meta(max_length=MAX_WRITERS_PER_KEY)]


def _signed_bytes(key: str, value: bytes, expires_at: float) -> bytes:
    return msgspec.msgpack.encode((_DOMAIN, key, value, expires_at))


@functools.lru_cache(maxsize=4096)
def _peer_id_of(public_key: bytes) -> str | None:
    try:
        return str(ID.from_pubkey(deserialize_public_key(public_key)))
    except Exception:  # not a key py-libp2p can read
        return None


def signed_by(peer: str, public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``public_key`` (serialized) is ``peer``'s and signed ``data``."""
    if _peer_id_of(public_key) != peer:
        return False
    try:
        return deserialize_public_key(public_key).verify(data, signature)
    except Exception:  # a malformed key or signature of any kind is simply not valid
        return False


def valid_entry(entry: SignedEntry, key: str, now: float) -> str | None:
    """The writer of ``entry`` when it is a signed, live entry of ``key`` that does not outlive every honest
    TTL by ``MAX_EXPIRY_AHEAD``; None otherwise."""
    if entry.key != key or not now < entry.expires_at <= now + MAX_EXPIRY_AHEAD:
        return None
    return entry.writer()


class RecordStore:
    """The entries this peer keeps for the swarm (thread-safe). Entries arrive already checked
    (``valid_entry``); the store keeps the later of two by one writer and bounds what it holds."""

    def __init__(self, max_bytes: int = STORE_BYTES, max_writer_bytes: int = WRITER_BYTES) -> None:
        self.max_bytes, self.max_writer_bytes = max_bytes, max_writer_bytes
        self._entries: dict[str, dict[str, SignedEntry]] = {}
        self._bytes: Counter[str] = Counter()  # writer -> bytes held for it
        self._lock = threading.Lock()

    def put(self, writer: str, entry: SignedEntry, now: float) -> bool:
        """Keeps ``entry`` unless the writer's entry under its key expires later, or the store is full."""
        with self._lock:
            entries = self._entries.get(entry.key, {})
            old = entries.get(writer)
            if old is not None and old.expires_at >= entry.expires_at:
                return old == entry
            grows = entry.size - (old.size if old is not None else 0)
            if not self._fits(writer, grows):
                self._expire(now)
                if not self._fits(writer, grows):
                    return False
            if old is None and len(entries) >= MAX_WRITERS_PER_KEY:
                self._expire_key(entry.key, now)  # (a flood of short-lived writers holds no slot for good)
                if len(self._entries.get(entry.key, {})) >= MAX_WRITERS_PER_KEY:
                    return False
            self._entries.setdefault(entry.key, {})[writer] = entry
            self._bytes[writer] += grows
            return True

    def _fits(self, writer: str, grows: int) -> bool:
        total = self._bytes.total() + grows <= self.max_bytes
        return total and self._bytes[writer] + grows <= self.max_writer_bytes

    def get(self, key: str, now: float) -> list[SignedEntry]:
        with self._lock:
            return [e for e in self._entries.get(key, {}).values() if e.expires_at > now]

    def _expire(self, now: float) -> None:
        for key in list(self._entries):
            self._expire_key(key, now)

    def _expire_key(self, key: str, now: float) -> None:
        entries = self._entries.get(key, {})
        for writer in [w for w, e in entries.items() if e.expires_at <= now]:
            self._bytes[writer] -= entries.pop(writer).size
            if not self._bytes[writer]:
                del self._bytes[writer]
        if not entries:
            self._entries.pop(key, None)


class RecordKeeping:
    """Records through the peers that keep them. A peer that nobody can dial (``keeps`` False) keeps none
    for the others, and ``relayed`` names the others that keep none: py-libp2p puts every peer that asks
    its Kademlia into the routing table, such peers too, so lookups find them."""

    def __init__(
        self,
        dht,
        requests: Requests,
        guard: Guard,
        now: Callable[[], float],
        *,
        keeps: bool = True,
        relayed: Callable[[str], bool] = lambda peer: False,
    ) -> None:
        self.dht, self.requests, self.guard, self.now = dht, requests, guard, now
        self.me = dht.host.get_id()
        self.keeps, self.relayed = keeps, relayed
        self.store = RecordStore()
        # key -> its closest peers, reused until, among the peers known then
        self._lookups: dict[str, tuple[tuple[ID, ...], float, frozenset[ID]]] = {}
        self._settled_until = float("-inf")  # (time.monotonic) the routing table answers lookups until then
        if keeps:
            requests.serve(STORE, self._on_store, SignedEntry.MAX_BYTES, inline=True)
            requests.serve(FETCH, self._on_fetch, Fetch.MAX_BYTES, inline=True)

    async def publish(self, entry: SignedEntry) -> int:
        """How many of the key's closest peers kept ``entry``."""
        stored = 0
        data = entry.encode()

        async def store(peer: ID) -> None:
            nonlocal stored
            if peer == self.me:
                stored += self.store.put(str(peer), entry, self.now())
            else:
                stored += await self._ask(peer, STORE, data, 1) == OK

        async with trio.open_nursery() as nursery:
            for peer in await self._closest(entry.key):
                nursery.start_soon(store, peer)
        return stored

    async def read(self, key: str) -> list[tuple[str, SignedEntry]]:
        """Every valid entry the key's closest peers keep, with its writer (several per writer, maybe)."""
        found: set[SignedEntry] = set()
        request = Fetch(key).encode()

        async def fetch(peer: ID) -> None:
            if peer == self.me:
                found.update(self.store.get(key, self.now()))
                return
            answer = await self._ask(peer, FETCH, request, Found.MAX_BYTES)
            if answer is None:
                return
            try:
                found.update(Found.decode(answer).entries)
            except RecordError as exc:
                self.guard.reject(str(peer), "records answer", str(exc), counts_toward_ban=False)

        async with trio.open_nursery() as nursery:
            for peer in await self._closest(key):
                nursery.start_soon(fetch, peer)
        now = self.now()
        return [(writer, e) for e in found if (writer := valid_entry(e, key, now)) is not None]

    async def _closest(self, key: str) -> list[ID]:
        """The REPLICAS peers closest to ``key`` that Kademlia knows of and that keep records, this one
        included when it does; a lookup is reused for ``LOOKUP_REUSE_SECONDS`` (a swarm reads its few keys
        several times a round), or ``PARTIAL_REUSE_SECONDS`` when it was cut off, and only while the routing
        table has gained no peer (a founder's lookups found only itself: reused while the others joined,
        it kept its records to itself, and newcomers reading from the closest of them found no swarm).
        Within ``SETTLED_SECONDS`` of a walk that met nobody new, the routing table answers without a walk."""
        now = time.monotonic()
        table = self.dht.routing_table
        known = frozenset((*table.get_peer_ids(), self.me))
        found, until, then = self._lookups.get(key, ((), now, known))
        if now < until and known <= then:
            return list(found)
        target, count = key.encode(), 2 * REPLICAS
        found = table.find_local_closest_peers(target, count)
        reuse = LOOKUP_REUSE_SECONDS
        if now >= self._settled_until:
            reuse = PARTIAL_REUSE_SECONDS
            with trio.move_on_after(LOOKUP_SECONDS):  # (past it: the closest this peer knows of itself)
                found = await self.dht.peer_routing.find_closest_peers_network(target, count=count)
                reuse = LOOKUP_REUSE_SECONDS
                if {*found, *table.get_peer_ids()} <= known:  # (the walk met nobody new)
                    self._settled_until = now + SETTLED_SECONDS
        keepers = [p for p in found if p != self.me and not self.relayed(str(p))]
        if self.keeps:
            keepers.append(self.me)
        closest = sort_peer_ids_by_distance(target, keepers)[:REPLICAS]
        if len(self._lookups) >= MAX_LOOKUPS:
            self._lookups.clear()
        self._lookups[key] = (tuple(closest), now + reuse, frozenset((*table.get_peer_ids(), self.me)))
        return closest

    async def _ask(self, peer: ID, name: str, payload: bytes, max_response: int) -> bytes | None:
        """One records request to ``peer``: its answer, or None when it gave none in time."""
        # (the try is outside the timeout's scope: a dial cut off by it fails as a group of the dial's error
        # and the scope's Cancelled, which only the scope strips; inside it, nothing would catch the group)
        try:
            with trio.move_on_after(ASK_SECONDS):
                answer = await self.requests.ask(peer, name, payload, max_response + 1, reuse=True)
                return answer[1:] if answer[:1] == OK else None
        except Exception as exc:  # an unreachable or slow replica: the others answer
            logger.debug("%s to %s failed: %s", name, peer, exc)
        return None

    def _on_store(self, caller: str, request: bytes) -> bytes:
        """Keeps a valid entry. A bad one is refused and counted, never toward a ban, as a bad record is
        where it is read: peers that banned a forger at different times would see different swarms."""
        try:
            entry = SignedEntry.decode(request)
        except RecordError as exc:
            self.guard.reject(caller, "record", str(exc), counts_toward_ban=False)
            raise RemoteError(f"malformed record: {exc}") from None
        writer = valid_entry(entry, entry.key, self.now())
        if writer is None or not self.guard.allows(writer):
            self.guard.reject(caller, "record", "a bad signature, expiry or writer", counts_toward_ban=False)
            raise RemoteError("record refused: a bad signature, expiry or writer")
        return OK if self.store.put(writer, entry, self.now()) else FAILED

    def _on_fetch(self, caller: str, request: bytes) -> bytes:
        try:
            key = Fetch.decode(request).key
        except RecordError as exc:
            raise RemoteError(f"malformed fetch: {exc}") from None
        return Found(self.store.get(key, self.now())).encode()
