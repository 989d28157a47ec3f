"""The libp2p backend: py-libp2p in pure Python, no daemon binary.

Process layout: py-libp2p runs only on trio, so its host (TCP, Noise, Yamux), its Kademlia DHT and gossipsub
run on a trio loop in a thread of this process (``swarm/trio_loop.py``); every Transport method is a bounded
call into that loop. A process that uses this backend never imports hivemind (both register the protobuf
package ``crypto.pb``, so they cannot share a process).

Records: Kademlia finds the ``REPLICAS`` peers closest to a key (this one among them, when it is); each
keeps the signed entries written under that key (``swarm/libp2p_records.py``), and a read asks all of them
and keeps each writer's entry that expires last. The identity is an ed25519 key in a file, so a restarted
peer keeps its peer id and can overwrite its own entries.

Streams: one libp2p stream per request, in hivemind's framing (an 8-byte big-endian length, then the
payload; an answer starts with a status byte), so the two backends can answer each other's ``spes.hello``
and a peer of the wrong backend is told which one the swarm uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from spes_p2p.errors import ConfigError
from spes_p2p.swarm.guard import Guard
from spes_p2p.swarm.libp2p_records import Fetch, Found, RecordStore, SignedEntry, latest, valid_entry
from spes_p2p.swarm.records import RecordError
from spes_p2p.swarm.transport import (
    ANSWER_WRITE_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    HELLO,
    MAX_GOSSIP_BYTES,
    REQUEST_READ_TIMEOUT,
    BootstrapError,
    Entry,
    GossipHandler,
    Handler,
    ListenError,
    MessageTooLarge,
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
    StreamSlots,
    Transport,
    TransportError,
    TransportStats,
    WrongBackend,
    check_gossip_size,
    check_ports_free,
    check_record_size,
    tcp_probe,
)
from spes_p2p.swarm.trio_loop import LoopClosed, TrioLoop

logger = logging.getLogger(__name__)

BACKEND = "libp2p"
REPLICAS = 5  # peers that keep each key's entries
DHT_TIMEOUT = 10.0  # one publish or read
LOOKUP_SECONDS = 3.0  # finding the peers closest to a key
LOOKUP_REUSE_SECONDS = 5.0  # ... and using what was found again
MAX_LOOKUPS = 4096  # lookups kept for reuse
STARTUP_TIMEOUT = 20.0
DIAL_TIMEOUT = 5.0
CLOSE_SECONDS = 2.0  # to close connections and listeners on shutdown
BOOTSTRAP_RETRY_SECONDS = 3.0
HANDLER_THREADS = 32  # handlers run at once (the rest wait for a thread)
_STORE, _FETCH = "spes.records.store", "spes.records.fetch"
_OK, _FAILED = b"\x00", b"\x01"
_HEADER = 8


def load_identity(path: Path | None) -> KeyPair:
    """The key pair in ``path`` (a libp2p private key, protobuf-encoded), created there if missing (0400);
    a throwaway one without a path."""
    if path is None:
        return create_new_key_pair()
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_pair = create_new_key_pair()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pair.private_key.serialize())
        return key_pair
    try:
        private = deserialize_private_key(path.read_bytes())
    except Exception as exc:
        raise ConfigError(
            f"{path} is not a libp2p private key ({exc}); move it away to create a new one"
        ) from None
    return KeyPair(private, private.get_public_key())


class Libp2pTransport(Transport):
    backend = BACKEND

    def __init__(
        self,
        *,
        initial_peers: Sequence[str] = (),
        listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce: Sequence[str] = (),
        identity_path: Path | None = None,
        client_mode: bool = False,
        startup_timeout: float = STARTUP_TIMEOUT,
    ) -> None:
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # (it logs every peer gone as an error)
        self.stats = TransportStats()
        self.guard = Guard()
        self.streams = StreamSlots()
        self._handlers: dict[str, tuple[Handler, int]] = {}
        self._store = RecordStore()
        self._known: set[str] = set()
        self._lookups: dict[str, tuple[tuple[ID, ...], float]] = {}  # key -> its closest peers, when found
        self._key_pair = load_identity(identity_path)
        self.peer_id = str(ID.from_pubkey(self._key_pair.public_key))
        self._listen = [_maddr(a) for a in listen]
        self._announce = [_maddr(a) for a in announce]
        self._client_mode = client_mode
        self._workers = trio.CapacityLimiter(HANDLER_THREADS)
        check_ports_free(listen)
        self._loop = TrioLoop(self._main, name=f"spes-libp2p-{self.peer_id[-6:]}")
        try:
            self._loop.start(startup_timeout)
        except OSError as exc:
            raise ListenError(f"cannot listen on {', '.join(listen)}: {exc}") from None
        except TimeoutError:
            raise ListenError(f"the libp2p host did not start within {startup_timeout:.0f}s") from None
        self.serve(HELLO, lambda caller, request: BACKEND.encode())
        self._serve_inline(_STORE, self._on_store, SignedEntry.MAX_BYTES)
        self._serve_inline(_FETCH, self._on_fetch, Fetch.MAX_BYTES)
        if initial_peers:
            try:
                self._bootstrap(list(initial_peers), startup_timeout)
            except BaseException:
                self.shutdown()
                raise

    async def _main(self, ready, stopping: trio.Event) -> None:
        self.host = new_host(key_pair=self._key_pair, announce_addrs=self._announce or None)
        async with self.host.run(self._listen):
            mode = DHTMode.CLIENT if self._client_mode else DHTMode.SERVER
            self.dht = KadDHT(self.host, mode)
            self._router = GossipSub([PROTOCOL_ID_V11], 6, 4, 12, heartbeat_interval=1)
            self._pubsub = Pubsub(self.host, self._router)
            async with (
                background_trio_service(self.dht),
                background_trio_service(self._pubsub),
                background_trio_service(self._router),
            ):
                ready()
                await stopping.wait()
            with trio.move_on_after(CLOSE_SECONDS):  # (leaving host.run alone would not close the sockets)
                await self.host.close()

    # ------------------------------------------------------------------------------------- bootstrap

    def _bootstrap(self, initial_peers: list[str], timeout: float) -> None:
        """Dials the initial peers until one answers or ``timeout`` has passed; a peer of another backend
        is a WrongBackend error."""
        infos = []
        for address in initial_peers:
            try:
                infos.append(info_from_p2p_addr(_maddr(address)))
            except Exception:
                raise ConfigError(
                    f"malformed peer address {address!r}: it must end in /p2p/<peer id>"
                ) from None
        deadline = time.monotonic() + timeout
        while True:
            reached = self._loop.call(self._dial_all, infos, timeout=DIAL_TIMEOUT + 1)
            if reached:
                break
            if time.monotonic() + BOOTSTRAP_RETRY_SECONDS > deadline:
                raise BootstrapError(
                    f"none of the initial peers answered ({', '.join(initial_peers)}); check the addresses, "
                    "or start a new swarm with --new-swarm"
                )
            logger.warning("no initial peer answered yet; retrying in %.0fs", BOOTSTRAP_RETRY_SECONDS)
            time.sleep(BOOTSTRAP_RETRY_SECONDS)
        for peer in reached:
            self._check_backend(peer)
        self._loop.call(self._populate, timeout=DHT_TIMEOUT)

    async def _dial_all(self, infos: list[PeerInfo]) -> list[str]:
        reached: list[str] = []

        async def dial(info: PeerInfo) -> None:
            with trio.move_on_after(DIAL_TIMEOUT):
                try:
                    await self.host.connect(info)
                except Exception as exc:
                    logger.debug("cannot dial %s: %s", info.peer_id, exc)
                    return
                reached.append(str(info.peer_id))
                await self._add_to_routing(info)

        async with trio.open_nursery() as nursery:
            for info in infos:
                nursery.start_soon(dial, info)
        return reached

    def _check_backend(self, peer: str) -> None:
        try:
            answer = self.request(peer, HELLO, b"", timeout=DIAL_TIMEOUT, max_response_bytes=64)
        except TransportError as exc:  # a peer that says nothing is not told off for it
            logger.debug("no hello from %s: %s", peer, exc)
            return
        if answer != BACKEND.encode():
            name = answer.decode(errors="replace")
            raise WrongBackend(f"the swarm at {peer} uses the {name} backend; join it with --backend {name}")

    async def _populate(self) -> None:
        """A lookup of this peer's own id fills the routing table with the peers near it."""
        for peer in await self.dht.peer_routing.find_closest_peers_network(self.host.get_id().to_bytes()):
            await self._add_to_routing(peer)

    async def _add_to_routing(self, peer: PeerInfo | ID) -> None:
        try:
            await self.dht.routing_table.add_peer(peer)
        except Exception as exc:  # the table decides; a peer it cannot check is simply not added
            logger.debug("not added to the routing table: %s", exc)

    def addresses(self) -> list[str]:
        try:
            return [str(a) for a in self.host.get_addrs()]
        except Exception:  # stopped
            return []

    def learn(self, peer_id: str, addresses: list[str]) -> None:
        """A peer's record says where it is: its addresses go to the peerstore and the routing table."""
        if peer_id in self._known or peer_id == self.peer_id or not addresses:
            return
        self._known.add(peer_id)
        try:
            info = PeerInfo(ID.from_base58(peer_id), [_maddr(a.rsplit("/p2p/", 1)[0]) for a in addresses])
        except Exception:  # a record's addresses were checked for length, not for sense
            return
        self._loop.spawn(self._learn, info)

    async def _learn(self, info: PeerInfo) -> None:
        self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
        await self._add_to_routing(info)

    def now(self) -> float:
        return time.time()

    # ------------------------------------------------------------------------------------- records

    def publish(self, key: str, value: bytes, expires_at: float) -> bool:
        check_record_size(value)
        entry = SignedEntry.sign(key, bytes(value), expires_at, self._key_pair.private_key)
        started = time.perf_counter()
        try:
            return self._loop.call(self._publish, entry, timeout=DHT_TIMEOUT) > 0
        except (TimeoutError, LoopClosed) as exc:
            logger.warning("DHT store of %s failed: %s", key, exc)
            return False
        finally:
            self.stats.dht_op(started)

    async def _publish(self, entry: SignedEntry) -> int:
        stored = 0
        data = entry.encode()

        async def store(peer: ID) -> None:
            nonlocal stored
            if str(peer) == self.peer_id:
                stored += self._store.put(self.peer_id, entry, self.now())
            else:
                stored += await self._ask(peer, _STORE, data, 1) == _OK

        async with trio.open_nursery() as nursery:
            for peer in await self._closest(entry.key):
                nursery.start_soon(store, peer)
        return stored

    def read(self, key: str) -> dict[str, Entry]:
        started = time.perf_counter()
        try:
            found = self._loop.call(self._read, key, timeout=DHT_TIMEOUT)
        except (TimeoutError, LoopClosed) as exc:
            logger.warning("DHT get of %s failed: %s", key, exc)
            return {}
        finally:
            self.stats.dht_op(started)
        now = self.now()
        return {peer: entry for peer, entry in latest(found).items() if self.readable(peer, entry, now)}

    async def _read(self, key: str) -> list[tuple[str, SignedEntry]]:
        found: set[SignedEntry] = set()
        request = Fetch(key).encode()

        async def fetch(peer: ID) -> None:
            if str(peer) == self.peer_id:
                found.update(self._store.get(key, self.now()))
                return
            answer = await self._ask(peer, _FETCH, request, Found.MAX_BYTES)
            if answer is None:
                return
            try:
                found.update(Found.decode(answer).entries)
            except RecordError as exc:
                self.guard.reject(str(peer), "records answer", str(exc))

        async with trio.open_nursery() as nursery:
            for peer in await self._closest(key):
                nursery.start_soon(fetch, peer)
        now = self.now()
        return [(writer, e) for e in found if (writer := valid_entry(e, key, now)) is not None]

    async def _closest(self, key: str) -> list[ID]:
        """The REPLICAS peers closest to ``key`` that Kademlia knows of, this one included; a lookup is
        reused for ``LOOKUP_REUSE_SECONDS`` (a swarm reads its few keys several times a round)."""
        now = time.monotonic()
        found, at = self._lookups.get(key, ((), -LOOKUP_REUSE_SECONDS))
        if now - at < LOOKUP_REUSE_SECONDS:
            return list(found)
        found = self.dht.routing_table.find_local_closest_peers(key.encode(), REPLICAS)
        with trio.move_on_after(LOOKUP_SECONDS):  # (past it: the closest this peer knows of itself)
            found = await self.dht.peer_routing.find_closest_peers_network(key.encode(), count=REPLICAS)
        closest = sort_peer_ids_by_distance(key.encode(), [self.host.get_id(), *found])[:REPLICAS]
        if len(self._lookups) >= MAX_LOOKUPS:
            self._lookups.clear()
        self._lookups[key] = (tuple(closest), now)
        return closest

    async def _ask(self, peer: ID, name: str, payload: bytes, max_response: int) -> bytes | None:
        """One records request to ``peer``: its answer, or None when it gave none in time."""
        with trio.move_on_after(DHT_TIMEOUT / 2):
            try:
                answer = await self._exchange(peer, name, payload, max_response + 1)
            except Exception as exc:  # an unreachable or slow replica: the others answer
                logger.debug("%s to %s failed: %s", name, peer, exc)
                return None
            return answer[1:] if answer[:1] == _OK else None
        return None

    def _on_store(self, caller: str, request: bytes) -> bytes:
        try:
            entry = SignedEntry.decode(request)
        except RecordError as exc:
            self.guard.reject(caller, "record", str(exc))
            raise RemoteError(f"malformed record: {exc}") from None
        writer = valid_entry(entry, entry.key, self.now())
        if writer is None or not self.guard.allows(writer):
            self.guard.reject(caller, "record", "a bad signature, expiry or writer")
            raise RemoteError("record refused: a bad signature, expiry or writer")
        return _OK if self._store.put(writer, entry, self.now()) else _FAILED

    def _on_fetch(self, caller: str, request: bytes) -> bytes:
        try:
            key = Fetch.decode(request).key
        except RecordError as exc:
            raise RemoteError(f"malformed fetch: {exc}") from None
        return Found(self._store.get(key, self.now())).encode()

    # ------------------------------------------------------------------------------------- streams

    def serve(self, name: str, handler: Handler, max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._register(name, handler, max_request_bytes, inline=False)

    def _serve_inline(self, name: str, handler: Handler, max_request_bytes: int) -> None:
        """A handler quick enough to run on the loop itself (the records protocol)."""
        self._register(name, handler, max_request_bytes, inline=True)

    def _register(self, name: str, handler: Handler, limit: int, *, inline: bool) -> None:
        self._handlers[name] = (handler, limit)

        async def on_stream(stream) -> None:
            await self._on_stream(name, handler, limit, inline, stream)

        self.host.set_stream_handler(TProtocol(name), on_stream)

    async def _on_stream(self, name: str, handler: Handler, limit: int, inline: bool, stream) -> None:
        caller = str(stream.muxed_conn.peer_id)
        with self.streams.slot(caller) as admitted:
            try:
                if not self.admits(caller):
                    response = _FAILED + b"this peer does not serve you"
                elif not admitted:
                    response = _FAILED + b"too many requests in progress from this peer"
                else:
                    with trio.fail_after(REQUEST_READ_TIMEOUT):
                        request = await _read_frame(stream, limit)
                    self.stats.bytes_received += len(request)
                    response = await self._answer(name, handler, caller, request, inline)
                self.stats.requests_served += 1
                with trio.fail_after(ANSWER_WRITE_TIMEOUT):
                    await _write_frame(stream, response)
                self.stats.bytes_sent += len(response) - 1
            except Exception as exc:  # a slow, oversized or broken request is dropped, not answered
                logger.info("dropped a %s request from %s: %s", name, caller, exc or type(exc).__name__)
            finally:
                with trio.move_on_after(1.0):
                    await _close(stream)

    async def _answer(self, name: str, handler: Handler, caller: str, request: bytes, inline: bool) -> bytes:
        try:
            if inline:
                return _OK + handler(caller, request)
            return _OK + await trio.to_thread.run_sync(
                handler, caller, request, limiter=self._workers, abandon_on_cancel=True
            )
        except RemoteError as exc:  # a refusal (Unavailable) or a malformed request (BadRequest)
            logger.debug("%s for %s: %s", name, caller, exc)
            return _FAILED + str(exc).encode()
        except Exception as exc:  # the caller learns that we failed, and why
            logger.warning("handler %s failed for %s: %s", name, caller, exc, exc_info=True)
            return _FAILED + str(exc).encode()

    def request(
        self,
        peer_id: str,
        name: str,
        payload: bytes,
        *,
        timeout: float,
        max_response_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> bytes:
        try:
            peer = ID.from_base58(peer_id)
        except Exception:
            raise PeerUnreachable(f"{peer_id!r} is not a peer id") from None
        try:
            answer = self._loop.call(
                self._exchange, peer, name, payload, max_response_bytes + 1, timeout=timeout
            )
        except TimeoutError:
            raise RequestTimeout(f"{name} to {peer_id} timed out after {timeout:.1f}s") from None
        except MessageTooLarge:
            raise
        except LoopClosed:
            raise TransportError(f"{self.peer_id} has shut down") from None
        except Exception as exc:  # dial failures, resets, an unsupported protocol
            raise PeerUnreachable(f"cannot reach {peer_id} for {name}: {exc or type(exc).__name__}") from None
        if answer[:1] != _OK:
            raise RemoteError(f"{peer_id} failed to answer {name}: {answer[1:].decode(errors='replace')}")
        self.stats.bytes_sent += len(payload)
        self.stats.bytes_received += len(answer) - 1
        self.stats.requests_sent += 1
        return answer[1:]

    async def _exchange(self, peer: ID, name: str, payload: bytes, limit: int) -> bytes:
        """Opens a stream to ``peer``'s handler ``name``, sends ``payload`` and reads the framed answer."""
        stream = await self.host.new_stream(peer, [TProtocol(name)])
        try:
            await _write_frame(stream, payload)
            return await _read_frame(stream, limit)
        finally:
            with trio.move_on_after(1.0):
                await _close(stream)

    # ------------------------------------------------------------------------------------- gossip

    def subscribe(self, topic: str, on_message: GossipHandler) -> bool:
        try:
            self._loop.call(self._subscribe, topic, on_message, timeout=DIAL_TIMEOUT)
        except (TimeoutError, LoopClosed) as exc:
            logger.warning("cannot subscribe to %s: %s", topic, exc)
            return False
        return True

    async def _subscribe(self, topic: str, on_message: GossipHandler) -> None:
        if topic not in self._pubsub.topic_ids:
            self._loop.spawn(self._deliver, await self._pubsub.subscribe(topic), on_message)

    async def _deliver(self, subscription, on_message: GossipHandler) -> None:
        """Hands ``on_message`` what others gossip on the subscription's topic, until it is unsubscribed.
        (Pubsub checked each message's signature against its sender's key.)"""
        async for message in subscription:
            try:
                sender = str(ID(message.from_id))
            except Exception:  # (not a peer id: nobody to blame)
                continue
            if sender == self.peer_id or not self.guard.allows(sender):
                continue
            if len(message.data) > MAX_GOSSIP_BYTES:
                self.guard.reject(sender, "gossip", f"{len(message.data)} bytes", counts_toward_ban=False)
                continue
            try:
                on_message(sender, bytes(message.data))
            except Exception:  # the handler's bug must not end the subscription
                logger.exception("a gossip handler failed")

    def unsubscribe(self, topic: str) -> None:
        with contextlib.suppress(TimeoutError, LoopClosed):
            self._loop.call(self._pubsub.unsubscribe, topic, timeout=DIAL_TIMEOUT)

    def gossip(self, topic: str, data: bytes) -> bool:
        check_gossip_size(data)
        try:
            self._loop.call(self._pubsub.publish, topic, bytes(data), timeout=DIAL_TIMEOUT)
        except Exception as exc:  # gossip is best effort: the DHT carries what matters
            logger.debug("gossip on %s failed: %s", topic, exc)
            return False
        return True

    def probe(self, address: str, timeout: float) -> bool:
        return tcp_probe(address, timeout)

    # ------------------------------------------------------------------------------------- lifecycle

    def shutdown(self, timeout: float = 5.0) -> None:
        """Closes the host (its connections and listeners) and stops the loop, within ``timeout``."""
        self._loop.stop(timeout)


def _maddr(address: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(address)
    except Exception as exc:
        raise ConfigError(f"malformed multiaddr {address!r}: {exc}") from None


async def _read_exactly(stream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += await stream.read(size - len(data))  # (raises StreamEOF at the end of the stream)
    return bytes(data)


async def _read_frame(stream, limit: int) -> bytes:
    """A length-prefixed message, its length checked against ``limit`` before it is read."""
    size = int.from_bytes(await _read_exactly(stream, _HEADER), "big")
    if size > limit:
        raise MessageTooLarge(f"a {size}-byte message exceeds the {limit}-byte limit")
    return await _read_exactly(stream, size)


async def _write_frame(stream, data: bytes) -> None:
    await stream.write(len(data).to_bytes(_HEADER, "big") + data)


async def _close(stream) -> None:
    try:
        await stream.close()
    except Exception:  # already reset by the other side
        await stream.reset()
