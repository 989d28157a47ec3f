"""The libp2p backend: py-libp2p in pure Python, no daemon binary.

Process layout: py-libp2p runs only on trio, so its host (TCP, Noise, Yamux), its Kademlia DHT and gossipsub
run on a trio loop in a thread of this process (``trio_loop.py``); every Transport method is a bounded call
into that loop. A process that uses this backend never imports hivemind (both register the protobuf
package ``crypto.pb``, so they cannot share a process).

Records (``net/libp2p/kad_records.py``): Kademlia finds the peers closest to a key, and they keep the
signed entries written under it. Requests (``net/libp2p/streams.py``): on libp2p streams in hivemind's
framing, so the two backends answer each other's ``spes.hello`` and a peer of the wrong backend is told
which one the swarm uses; the records protocol keeps its streams open for the next request. Gossip:
gossipsub. The identity is an ed25519 key in a file, so a restarted peer keeps its peer id and can
overwrite its own entries.
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
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.tools.anyio_service import background_trio_service

from spes_p2p.errors import ConfigError
from spes_p2p.net.forwarding import Forwarding, Keys
from spes_p2p.net.guard import Guard
from spes_p2p.net.libp2p.kad_records import RecordKeeping, SignedEntry, signed_by
from spes_p2p.net.libp2p.neighbours import Neighbours
from spes_p2p.net.libp2p.pubsub import Topics
from spes_p2p.net.libp2p.streams import OK, Requests
from spes_p2p.net.libp2p.trio_loop import LoopClosed, TrioLoop
from spes_p2p.net.relays import Relays
from spes_p2p.net.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    HELLO,
    HELLO_MAX_BYTES,
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

logger = logging.getLogger(__name__)
# py-libp2p configures its logger when imported (``LIBP2P_DEBUG``), and logs every peer gone and stream
# closed as a warning or an error; we report what fails ourselves. Its logs show at our debug level only.
_QUIET = logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else logging.CRITICAL
logging.getLogger("libp2p").setLevel(_QUIET)

BACKEND = "libp2p"
DHT_TIMEOUT = 10.0  # one publish or read
STARTUP_TIMEOUT = 20.0
DIAL_TIMEOUT = 5.0
CLOSE_SECONDS = 2.0  # to close connections and listeners on shutdown
BOOTSTRAP_RETRY_SECONDS = 3.0
MAX_KNOWN = 4096  # peers whose addresses were learned, remembered so as not to learn them at every read


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
        relays: Sequence[str] = (),
        startup_timeout: float = STARTUP_TIMEOUT,
    ) -> None:
        self.stats = TransportStats()
        self.guard = Guard()
        self.streams = StreamSlots()
        self._known: set[str] = set()
        self._key_pair = load_identity(identity_path)
        self.peer_id = str(ID.from_pubkey(self._key_pair.public_key))
        self._listen = [_maddr(a) for a in listen]
        self._announce = [_maddr(a) for a in announce]
        self.relays = Relays(relays)
        self._client_mode = client_mode or self.relays.relayed  # (no records kept, no requests relayed)
        check_ports_free(listen)
        self._loop = TrioLoop(self._main, name=f"spes-libp2p-{self.peer_id[-6:]}")
        try:
            self._loop.start(startup_timeout)
        except OSError as exc:
            raise ListenError(f"cannot listen on {', '.join(listen)}: {exc}") from None
        except TimeoutError:
            raise ListenError(f"the libp2p host did not start within {startup_timeout:.0f}s") from None
        self.serve(HELLO, lambda caller, request: BACKEND.encode(), max_request_bytes=HELLO_MAX_BYTES)
        public_key, sign = self._key_pair.public_key.serialize(), self._key_pair.private_key.sign
        self.forwarding = Forwarding(
            self, Keys(self.peer_id, public_key, sign, signed_by), self._requests.handlers.get
        )
        self.forwarding.serve(relay=not self._client_mode)
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
            self._neighbours = Neighbours(self.host, self.dht, DIAL_TIMEOUT)
            self._requests = Requests(self.host, self.guard, self.stats, self.streams)
            self._records = RecordKeeping(
                self.dht,
                self._requests,
                self.guard,
                self.now,
                keeps=not self._client_mode,
                relayed=self.relays.is_relayed,
            )
            self._topics = Topics(self.host, self.guard, self._loop.spawn)
            async with (
                background_trio_service(self.dht),
                background_trio_service(self._topics.pubsub),
                background_trio_service(self._topics.router),
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
            reached = self._loop.call(self._neighbours.dial, infos, timeout=DIAL_TIMEOUT + 1)
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
        with contextlib.suppress(TimeoutError):  # (the peers' records fill the table later: ``learn``)
            self._loop.call(self._neighbours.populate, timeout=DHT_TIMEOUT)

    def _check_backend(self, peer: str) -> None:
        try:
            answer = self.request(peer, HELLO, b"", timeout=DIAL_TIMEOUT, max_response_bytes=64)
        except TransportError as exc:  # a peer that says nothing is not told off for it
            logger.debug("no hello from %s: %s", peer, exc)
            return
        if answer != BACKEND.encode():
            name = answer.decode(errors="replace")
            raise WrongBackend(f"the swarm at {peer} uses the {name} backend; join it with --backend {name}")

    def addresses(self) -> list[str]:
        """A relayed peer's circuit addresses (never its own: nobody can dial them); else the host's."""
        if self.relays.relayed:
            return self.relays.addresses(self.peer_id)
        try:
            return [str(a) for a in self.host.get_addrs()]
        except Exception:  # stopped
            return []

    def learn(self, peer_id: str, addresses: list[str]) -> None:
        """A peer's record says where it is: its addresses go to the peerstore and the routing table, unless
        they are circuits (``relays``). A relayed peer dials the others itself."""
        dial = self.relays.learn(self.peer_id, peer_id, addresses)
        if dial and (info := _info(peer_id, dial)):
            self._loop.spawn(self._neighbours.dial, [info])
        if peer_id in self._known or peer_id == self.peer_id or self.relays.is_relayed(peer_id):
            return
        if len(self._known) >= MAX_KNOWN:
            self._known.clear()  # (learning a peer again costs a routing-table check)
        self._known.add(peer_id)
        if info := _info(peer_id, addresses):
            self._loop.spawn(self._neighbours.learn, info)

    def now(self) -> float:
        return time.time()

    # ------------------------------------------------------------------------------------- records

    def publish(self, key: str, value: bytes, expires_at: float) -> bool:
        check_record_size(value)
        entry = SignedEntry.sign(key, bytes(value), expires_at, self._key_pair.private_key)
        started = time.perf_counter()
        try:
            return self._loop.call(self._records.publish, entry, timeout=DHT_TIMEOUT) > 0
        except (TimeoutError, LoopClosed) as exc:
            logger.warning("DHT store of %s failed: %s", key, exc)
            return False
        finally:
            self.stats.dht_write(key, started, len(value))

    def read(self, key: str, *, banned: bool = False) -> dict[str, Entry]:
        started = time.perf_counter()
        try:
            found = self._loop.call(self._records.read, key, timeout=DHT_TIMEOUT)
        except (TimeoutError, LoopClosed) as exc:
            logger.warning("DHT get of %s failed: %s", key, exc)
            self.stats.dht_read(key, started, ())
            return {}
        self.stats.dht_read(key, started, (len(e.value) for _, e in found))
        entries = ((w, Entry(e.value, e.expires_at)) for w, e in found)
        return self.latest_readable(entries, self.now(), banned)

    # ------------------------------------------------------------------------------------- streams

    def serve(self, name: str, handler: Handler, *, max_request_bytes: int) -> None:
        self._requests.serve(name, handler, max_request_bytes)

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
        forwarder = self.relays.forwarder(peer_id, self.peer_id)
        if forwarder is not None and not self.host.get_network().get_connections(peer):
            return self.forwarding.request(
                forwarder, peer_id, name, payload, timeout=timeout, max_response_bytes=max_response_bytes
            )
        try:
            answer = self._loop.call(
                self._requests.ask, peer, name, payload, max_response_bytes + 1, timeout=timeout
            )
        except TimeoutError:
            raise RequestTimeout(f"{name} to {peer_id} timed out after {timeout:.1f}s") from None
        except MessageTooLarge:
            raise
        except LoopClosed:
            raise TransportError(f"{self.peer_id} has shut down") from None
        except Exception as exc:  # dial failures, resets, an unsupported protocol
            why = str(exc) or type(exc).__name__
            raise PeerUnreachable(f"cannot reach {peer_id} for {name}: {why}") from None
        if answer[:1] != OK:
            raise RemoteError(f"{peer_id} failed to answer {name}: {answer[1:].decode(errors='replace')}")
        self.stats.bytes_sent += len(payload)
        self.stats.bytes_received += len(answer) - 1
        self.stats.requests_sent += 1
        return answer[1:]

    # ------------------------------------------------------------------------------------- gossip

    def subscribe(self, topic: str, on_message: GossipHandler) -> bool:
        try:
            self._loop.call(self._topics.subscribe, topic, on_message, timeout=DIAL_TIMEOUT)
        except (TimeoutError, LoopClosed) as exc:
            logger.warning("cannot subscribe to %s: %s", topic, exc)
            return False
        return True

    def unsubscribe(self, topic: str) -> None:
        with contextlib.suppress(TimeoutError, LoopClosed):
            self._loop.call(self._topics.unsubscribe, topic, timeout=DIAL_TIMEOUT)

    def gossip(self, topic: str, data: bytes) -> bool:
        check_gossip_size(data)
        try:
            self._loop.call(self._topics.publish, topic, bytes(data), timeout=DIAL_TIMEOUT)
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


def _info(peer_id: str, addresses: list[str]) -> PeerInfo | None:
    """Where ``peer_id`` is, from its addresses (``/p2p/<id>`` ends dropped); None when there is no peer id
    or no address to read (a record's addresses were checked for length, not for sense)."""
    try:
        peer = ID.from_base58(peer_id)
    except Exception:
        return None
    maddrs = []
    for address in addresses:
        with contextlib.suppress(ConfigError):
            maddrs.append(_maddr(address.rsplit("/p2p/", 1)[0]))
    return PeerInfo(peer, maddrs) if maddrs else None


def _maddr(address: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(address)
    except Exception as exc:
        raise ConfigError(f"malformed multiaddr {address!r}: {exc}") from None
