"""The hivemind backend: hivemind's Kademlia DHT plus libp2p streams through its p2pd daemon.

Process layout: ``hivemind.DHT`` runs in a child process that owns the p2pd daemon; this process talks to the
DHT through hivemind's pipe and opens its own connection to the same daemon (``replicate_p2p``) for streams,
on an asyncio loop in a background thread. Handlers therefore run here, next to the model.

Records are signed: every entry is stored under the subkey ``<peer id>[owner:<RSA public key>]`` and
hivemind's ``RSASignatureValidator`` on every DHT node rejects writes to it that the owner did not sign. The
RSA key is the peer's libp2p identity key (a throwaway one when none is given), so a restarted peer keeps
both its peer id and its records, and a reader accepts an entry only under the peer id that its key
derives: nobody writes under another peer's id.

Peers that nobody can dial (behind NAT, or in client mode) are reached through relays
(``net/relays.py``); two of them exchange requests forwarded whole by a relay (``net/forwarding.py``),
signed with the same identity key. A relayed peer's p2pd also reserves a slot on each of its relays
(circuit relay v2, which every reachable p2pd serves), but p2pd ends each circuit after 128 KiB, far less
than one update: requests go over the connection the relayed peer dialed, or are forwarded. A peer that
announces an address (``announce``: a forwarded port) tells its p2pd that it is public, so it serves as a
relay at once rather than after AutoNAT's checks.

Stream framing (both directions) is hivemind's own (``P2P.send_raw_data``): an 8-byte big-endian length, then
the payload; we read it back with our size limit, checked before the payload is read. An answer starts with
hivemind's status marker: ``P2P.MESSAGE_MARKER`` (ok) or ``P2P.ERROR_MARKER`` (the handler failed; the
payload is its message, UTF-8).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import hivemind
import msgspec
import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time
from multiaddr import Multiaddr

from spes_p2p.compat import die_with_parent
from spes_p2p.errors import ConfigError
from spes_p2p.net.forwarding import Forwarding, Keys
from spes_p2p.net.guard import Guard
from spes_p2p.net.relays import CIRCUIT, Relays
from spes_p2p.net.transport import (
    ANSWER_FAILED,
    ANSWER_OK,
    ANSWER_WRITE_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    HELLO,
    HELLO_MAX_BYTES,
    REQUEST_READ_TIMEOUT,
    BootstrapError,
    Entry,
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
    check_ports_free,
    check_record_size,
    failed_answer,
    tcp_probe,
)

logger = logging.getLogger(__name__)

DHT_TIMEOUT = 10.0  # one DHT store or get
STARTUP_TIMEOUT = 20.0  # starting p2pd and reaching the initial peers
BOOTSTRAP_RETRY_SECONDS = 3.0
HELLO_TIMEOUT = 10.0  # asking an initial peer which backend it runs
REFUSED_READ_BYTES = 1 << 16  # the most of a refused request that is read (and dropped) before the refusal
# p2pd's Go heap may grow by this percentage of what is live before it is collected (Go's default is 100): a
# request flood is mostly garbage in p2pd (buffers of streams already closed), and at 100 a flood of 16
# identities grew p2pd by 47 MiB, at 25 by 15 MiB; bulk stream throughput stayed within noise. A GOGC in
# the environment is kept.
P2PD_GOGC = "25"
_OK, _FAILED = ANSWER_OK, ANSWER_FAILED  # (hivemind's P2P.MESSAGE_MARKER and P2P.ERROR_MARKER)


def ensure_identity(path: Path) -> Path:
    """Creates the peer's private key file at ``path`` if it does not exist yet (mode 0400)."""
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        P2P.generate_identity(str(path))
    return path


def _signing_key(identity_path: Path):
    """The RSA private key inside a libp2p identity file, as hivemind's RSAPrivateKey."""
    proto = crypto_pb2.PrivateKey.FromString(Path(identity_path).read_bytes())
    if proto.key_type != crypto_pb2.RSA:
        kind = crypto_pb2.KeyType.Name(proto.key_type)
        raise ConfigError(
            f"{identity_path} holds an {kind} key (made by the libp2p backend); the hivemind backend needs "
            "an RSA identity: give it another --identity file (one is created if missing)"
        )
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})  # the pickling path: DER bytes -> key
    return key


class HivemindTransport(Transport):
    backend = "hivemind"

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
        self.streams = StreamSlots()
        self.guard = Guard()
        self.relays = Relays(relays)
        self._handlers: dict[str, tuple[Handler, int]] = {}
        check_ports_free(listen)
        ephemeral = None
        if identity_path is None:  # a throwaway identity: its key still signs this peer's records
            ephemeral = tempfile.TemporaryDirectory(prefix="spes-identity-")
            identity_path = Path(ephemeral.name) / "identity.key"
        identity_path = ensure_identity(identity_path)
        key = _signing_key(identity_path)
        self._validator = RSASignatureValidator(key)
        dht_kwargs = dict(
            initial_peers=list(initial_peers),
            start=True,
            client_mode=client_mode,
            host_maddrs=list(listen),
            announce_maddrs=list(announce) or None,
            identity_path=str(identity_path),
            use_auto_relay=bool(relays),
            trusted_relays=list(relays) or None,
            force_reachability="private" if relays else "public" if announce else None,
            use_relay=True,
            startup_timeout=startup_timeout,
            record_validators=[self._validator],
            await_ready=False,
        )
        try:
            self.dht = _start_dht(dht_kwargs, initial_peers, startup_timeout)
        finally:
            if ephemeral is not None:
                ephemeral.cleanup()  # p2pd has read it
        self.peer_id = str(self.dht.peer_id)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="spes-p2p", daemon=True)
        self._thread.start()
        self._p2p = self._run(self.dht.replicate_p2p(), timeout=startup_timeout)
        keys = Keys(self.peer_id, key.get_public_key().to_bytes(), key.sign, _signed_by)
        self.forwarding = Forwarding(self, keys, self._handlers.get)
        self.forwarding.serve(relay=not self.relays.relayed)
        self.serve(HELLO, lambda caller, request: self.backend.encode(), max_request_bytes=HELLO_MAX_BYTES)

    # -------------------------------------------------------------------------------------------- DHT

    def addresses(self) -> list[str]:
        """A relayed peer's circuit addresses (never its own: nobody can dial them); else what p2pd sees."""
        if self.relays.relayed:
            return self.relays.addresses(self.peer_id)
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def learn(self, peer_id: str, addresses: list[str]) -> None:
        dial = self.relays.learn(self.peer_id, peer_id, addresses)
        if dial:
            connect = self._p2p._client.connect(PeerID.from_base58(peer_id), [Multiaddr(a) for a in dial])
            asyncio.run_coroutine_threadsafe(_quietly(connect), self._loop)

    def now(self) -> float:
        return get_dht_time()

    def publish(self, key: str, value: bytes, expires_at: float) -> bool:
        check_record_size(value)  # before it reaches the DHT
        subkey = self.peer_id.encode() + self._validator.local_public_key
        started = time.perf_counter()
        future = self.dht.store(key, value, expires_at, subkey=subkey, return_future=True)
        try:
            return bool(future.result(timeout=DHT_TIMEOUT))
        except TimeoutError:
            logger.warning("DHT store of %s timed out after %.0fs", key, DHT_TIMEOUT)
            return False
        finally:
            self.stats.dht_write(key, started, len(value))

    def read(self, key: str, *, banned: bool = False) -> dict[str, Entry]:
        started = time.perf_counter()
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            found = future.result(timeout=DHT_TIMEOUT)
        except TimeoutError:
            logger.warning("DHT get of %s timed out after %.0fs", key, DHT_TIMEOUT)
            self.stats.dht_read(key, started, ())
            return {}
        values = found.value if found is not None and isinstance(found.value, dict) else {}
        entries = []
        for subkey, item in values.items():
            peer, value = _owner_peer_id(subkey), _as_bytes(item.value)
            if peer is None or value is None:
                logger.debug("ignoring an unsigned or unreadable entry under %s", key)
                continue
            entries.append((peer, Entry(value, item.expiration_time)))
        self.stats.dht_read(key, started, (len(e.value) for _, e in entries))
        return self.latest_readable(entries, self.now(), banned)

    # --------------------------------------------------------------------------------------- streams

    def serve(self, name: str, handler: Handler, *, max_request_bytes: int) -> None:
        self._handlers[name] = (handler, max_request_bytes)

        async def rpc_handler(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            caller = str(info.peer_id)
            with self.streams.slot(caller) as admitted:
                try:
                    served = admitted and self.admits(caller)
                    # a refused request is read too (up to a small size): p2pd resets a stream closed with
                    # the request unread, and the reset can lose the refusal on its way
                    limit = max_request_bytes if served else min(max_request_bytes, REFUSED_READ_BYTES)
                    request = await asyncio.wait_for(_read_frame(reader, limit), REQUEST_READ_TIMEOUT)
                    if not self.admits(caller):
                        response = _FAILED + b"this peer does not serve you"
                    elif admitted:
                        response = await self._answer(name, handler, caller, request)
                    else:
                        response = _FAILED + b"too many requests in progress from this peer"
                    self.stats.requests_served += 1
                    await asyncio.wait_for(P2P.send_raw_data(response, writer), ANSWER_WRITE_TIMEOUT)
                    self.stats.bytes_sent += len(response) - 1
                except (asyncio.IncompleteReadError, ConnectionError, MessageTooLarge, TimeoutError) as exc:
                    why = str(exc) or type(exc).__name__
                    logger.info("dropped a %s request from %s: %s", name, caller, why)
                finally:
                    writer.close()

        self._run(self._p2p.add_binary_stream_handler(name, rpc_handler), timeout=DHT_TIMEOUT)

    async def _answer(self, name: str, handler: Handler, caller: str, request: bytes) -> bytes:
        self.stats.bytes_received += len(request)
        try:
            return _OK + await self._loop.run_in_executor(None, handler, caller, request)
        except Exception as exc:  # the caller learns that we failed, and why
            return failed_answer(name, caller, exc)

    def request(
        self,
        peer_id: str,
        name: str,
        payload: bytes,
        *,
        timeout: float,
        max_response_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> bytes:
        forwarder = self.relays.forwarder(peer_id, self.peer_id)
        if forwarder is not None and not self._connected_directly(peer_id):  # only a circuit, if anything
            return self.forwarding.request(
                forwarder, peer_id, name, payload, timeout=timeout, max_response_bytes=max_response_bytes
            )

        async def call_rpc() -> bytes:
            peer = PeerID.from_base58(peer_id)
            circuit = [Multiaddr(a) for a in self.relays.circuit(peer_id)]
            if circuit:  # reached through a relay: p2pd's peerstore may not know how
                with contextlib.suppress(Exception):
                    await self._p2p._client.connect(peer, circuit)
            _, reader, writer = await self._p2p.call_binary_stream_handler(peer, name)
            try:
                await P2P.send_raw_data(payload, writer)
                return await _read_frame(reader, max_response_bytes + 1)
            finally:
                writer.close()

        try:
            answer = self._run(call_rpc(), timeout=timeout)
        except TimeoutError:
            raise RequestTimeout(f"{name} to {peer_id} timed out after {timeout:.1f}s") from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise PeerUnreachable(f"{peer_id} closed the {name} stream: {exc}") from None
        except MessageTooLarge:
            raise
        except Exception as exc:  # p2pd reports dial failures as ControlFailure and friends
            raise PeerUnreachable(f"cannot reach {peer_id} for {name}: {exc}") from None
        if answer[:1] != _OK:
            raise RemoteError(f"{peer_id} failed to answer {name}: {answer[1:].decode(errors='replace')}")
        self.stats.bytes_sent += len(payload)
        self.stats.bytes_received += len(answer) - 1
        self.stats.requests_sent += 1
        return answer[1:]

    def _connected_directly(self, peer_id: str) -> bool:
        """Whether p2pd has a connection to ``peer_id`` outside any relay (one that a relayed peer dialed)."""
        try:
            peers = self._run(self._p2p.list_peers(), timeout=DHT_TIMEOUT)
        except Exception:  # the daemon is going away: the request itself will say so
            return False
        return any(str(p.peer_id) == peer_id and any(CIRCUIT not in str(a) for a in p.addrs) for p in peers)

    def probe(self, address: str, timeout: float) -> bool:
        return tcp_probe(address, timeout)

    # ------------------------------------------------------------------------------------- lifecycle

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop).result(
            timeout + 1
        )

    def shutdown(self, timeout: float = 5.0) -> None:
        """Bounded: the DHT process gets ``timeout`` seconds to leave, then is killed."""
        with contextlib.suppress(Exception):
            self._run(self._p2p.shutdown(), timeout=1.0)
        with contextlib.suppress(Exception):
            self._run(_cancel_other_tasks(), timeout=1.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
        if not self._loop.is_running():
            self._loop.close()
        self.dht.shutdown_timeout = timeout
        with contextlib.suppress(Exception):
            self.dht.shutdown()
        self._kill_dht()

    def _kill_dht(self) -> None:
        if self.dht.is_alive():
            self.dht.kill()
            self.dht.join(1.0)


def _start_dht(kwargs: dict, initial_peers: Sequence[str], timeout: float):
    """Starts the DHT; an initial peer that does not answer (a busy or restarting machine) is retried
    until ``timeout`` has passed since the first try."""
    deadline = time.monotonic() + timeout
    asked = False  # which backend the initial peers run, once
    while True:
        dht = None
        try:
            dht = _DHT(**kwargs)
            dht.wait_until_ready(timeout=timeout + 5)
            return dht
        except (P2PDaemonError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and "bootstrap failed" not in str(exc):
                raise  # (hivemind's RuntimeError when no initial peer answered a DHT ping is retried)
            if dht is not None:
                dht.join(5.0)  # (its process ends once it has failed)
            error = _daemon_error(exc, initial_peers)
            if isinstance(error, BootstrapError) and not asked:
                asked, other = True, _backend_of(initial_peers)
                if other not in (None, HivemindTransport.backend):
                    raise WrongBackend(
                        f"the swarm at {', '.join(initial_peers)} uses the {other} backend; join it with "
                        f"--backend {other}"
                    ) from None
            if not isinstance(error, BootstrapError) or time.monotonic() + BOOTSTRAP_RETRY_SECONDS > deadline:
                raise error from None
            logger.warning("no initial peer answered yet; retrying in %.0fs", BOOTSTRAP_RETRY_SECONDS)
            time.sleep(BOOTSTRAP_RETRY_SECONDS)
        except TimeoutError:
            raise BootstrapError(f"the peer did not start within {timeout:.0f}s") from None


def _backend_of(initial_peers: Sequence[str]) -> str | None:
    """The backend an initial peer says it runs (``HELLO``), asked through a p2p daemon of its own; None
    when none answers (the swarm's DHT did not answer either: it is down, or runs an older version)."""

    async def ask() -> str | None:
        p2p = await P2P.create(initial_peers=list(initial_peers))
        try:
            for address in initial_peers:
                with contextlib.suppress(Exception):
                    peer = PeerID.from_base58(address.rsplit("/p2p/", 1)[-1])
                    _, reader, writer = await p2p.call_binary_stream_handler(peer, HELLO)
                    await P2P.send_raw_data(b"", writer)
                    answer = await _read_frame(reader, 64)
                    writer.close()
                    if answer[:1] == _OK:
                        return answer[1:].decode(errors="replace")
            return None
        finally:
            await p2p.shutdown()

    try:
        return asyncio.run(asyncio.wait_for(ask(), HELLO_TIMEOUT))
    except Exception:  # no daemon, no answer: the caller reports the bootstrap failure itself
        return None


def relays_without_discovery() -> None:
    """p2pd reserves on the given relays at once only with ``-relayDiscovery=0``, which hivemind does not
    pass: with discovery on, go-libp2p's autorelay waits minutes for more candidates before it reserves.
    (Called in the DHT's process, before it starts p2pd.)"""
    make_args = P2P._make_process_args

    def with_static_relays(*args, **kwargs):
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_args(*args, **kwargs)

    P2P._make_process_args = staticmethod(with_static_relays)


class _DHT(hivemind.DHT):
    """hivemind's DHT process, made to die with this process even when it is SIGKILLed."""

    def run(self) -> None:
        die_with_parent(signal.SIGKILL)  # (no orphaned DHT after a crash)
        relays_without_discovery()
        os.environ.setdefault("GOGC", P2PD_GOGC)  # (this process's environment is p2pd's, started below)
        # Ctrl-C reaches the terminal's whole process group. Leaving it (with p2pd, started below) lets the
        # parent release its claims through this DHT before shutting it down in order.
        os.setpgrp()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        super().run()


async def _quietly(coro) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(coro, DHT_TIMEOUT)


async def _cancel_other_tasks() -> None:
    """Cancels the p2p client's background tasks, so the loop can close without orphaned tasks."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _as_bytes(value) -> bytes | None:
    """An entry's bytes. Peers of protocol 1 stored msgpack values rather than bytes: those are re-encoded,
    so that the records layer reads their identity and refuses them with a message naming the protocol."""
    if isinstance(value, bytes):
        return value
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _owner_peer_id(subkey) -> str | None:
    """The peer id of a signed subkey ``<peer id>[owner:<RSA public key>]``, when it is the id that key
    derives (the DHT checked the signature against that key); None for unsigned or forged subkeys."""
    raw = subkey if isinstance(subkey, bytes) else str(subkey).encode()
    peer, marker, rest = raw.partition(b"[owner:")
    if not (marker and peer and rest.endswith(b"]")):
        return None
    claimed = peer.decode(errors="replace")
    return claimed if claimed == _peer_id_of_key(rest[:-1]) else None


def _signed_by(peer: str, key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``key`` is ``peer``'s RSA public key and signed ``data``."""
    if _peer_id_of_key(key) != peer:
        return False
    try:
        return RSAPublicKey.from_bytes(key).verify(data, signature)
    except (ValueError, UnsupportedAlgorithm):
        return False


@functools.lru_cache(maxsize=4096)
def _peer_id_of_key(ssh_public_key: bytes) -> str | None:
    """The libp2p peer id of an RSA public key (a multihash of its protobuf-wrapped DER form)."""
    try:
        key = serialization.load_ssh_public_key(ssh_public_key)
    except (ValueError, UnsupportedAlgorithm):
        return None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def _daemon_error(exc: Exception, initial_peers: Sequence[str]) -> TransportError:
    text = str(exc)
    if "failed to connect to bootstrap peers" in text or "bootstrap failed" in text:
        return BootstrapError(
            f"none of the initial peers answered ({', '.join(initial_peers)}); check the addresses, or start "
            "a new swarm with --new-swarm"
        )
    if "address already in use" in text:
        return ListenError(
            f"cannot listen: the port is already in use ({_tail(text)}); pick another --listen "
            "port, or port 0 for any free one"
        )
    if "failed to parse multiaddr" in text:
        return ConfigError(f"malformed multiaddr: {_tail(text)}")
    return ListenError(f"the p2p daemon failed to start: {_tail(text)}")


def _tail(text: str) -> str:
    return text.rsplit(" failed to ", 1)[-1].strip() if " failed to " in text else text.strip()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """``P2P.receive_raw_data`` with a size limit: the length is checked before the payload is read."""
    size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if size > limit:
        raise MessageTooLarge(f"a {size}-byte message exceeds the {limit}-byte limit")
    return await reader.readexactly(size)
