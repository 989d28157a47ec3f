"""Requests forwarded whole by a relay between two peers that cannot dial each other (net/forwarding.py),
on the memory backend with real RSA identity keys: the answer arrives as the target gave it, and whoever
alters a request or an answer on the way is the one blamed, never the honest end."""

import threading

import msgspec
import pytest
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from spes_p2p.net.forwarding import (
    MAX_FORWARD_BYTES,
    MAX_FORWARDS,
    RPC_FORWARD,
    RPC_RELAYED,
    Answer,
    Envelope,
    Forwarding,
    Keys,
)
from spes_p2p.net.guard import BAN_AFTER
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.transport import PeerUnreachable, RemoteError, TransportError

pytestmark = pytest.mark.timeout(60)
PUBLIC = {}  # peer -> its public key: what a peer id derives from, in this test's world


def verify(peer: str, key: bytes, data: bytes, signature: bytes) -> bool:
    return PUBLIC.get(peer) == key and RSAPublicKey.from_bytes(key).verify(data, signature)


@pytest.fixture(scope="module")
def private_keys():
    return {p: RSAPrivateKey() for p in ("a", "r", "b")}


@pytest.fixture
def swarm(private_keys):
    """A asks B through R; B answers ``echo`` with who asked and what."""
    net = MemoryNetwork(seed=0)
    peers = {}
    for p, key in private_keys.items():
        transport = net.join(p)
        PUBLIC[p] = key.get_public_key().to_bytes()
        keys = Keys(p, PUBLIC[p], key.sign, verify)
        peers[p] = Forwarding(transport, keys, transport.handlers.get)
        peers[p].serve(relay=p == "r")
    echo = lambda caller, request: caller.encode() + b":" + request * 1000  # noqa: E731
    peers["b"].transport.serve("echo", echo, max_request_bytes=64)
    return peers


def ask(swarm, payload=b"hi", limit=1 << 20):
    return swarm["a"].request("r", "b", "echo", payload, timeout=10, max_response_bytes=limit)


def rejections(swarm):
    return {p: dict(f.transport.guard.rejections) for p, f in swarm.items() if f.transport.guard.total()}


def tamper(swarm, peer: str, name: str, change):
    """``peer``'s handler ``name`` passes on ``change(its request, its answer)`` instead."""
    handler, limit = swarm[peer].transport.handlers[name]
    changed = lambda caller, request: change(request, handler, caller)  # noqa: E731
    swarm[peer].transport.serve(name, changed, max_request_bytes=limit)


def test_the_target_answers_the_asker_through_the_relay(swarm):
    assert ask(swarm) == b"a:" + b"hi" * 1000  # B served A (not the relay), whole
    assert swarm["r"].transport.stats.bytes_received > 2000  # the relay carried it
    assert not rejections(swarm)


def test_an_answer_the_relay_altered_is_blamed_on_the_relay_never_the_target(swarm):
    def alter(request, handler, caller):
        answer = Answer.decode(handler(caller, request))
        return msgspec.structs.replace(answer, body=answer.body.replace(b"hi", b"ho", 1)).encode()

    tamper(swarm, "r", RPC_FORWARD, alter)
    for _ in range(BAN_AFTER):
        with pytest.raises(PeerUnreachable, match="intact"):
            ask(swarm)
    guard = swarm["a"].transport.guard
    assert rejections(swarm) == {"a": {"r": BAN_AFTER}}
    assert guard.banned() == ["r"] and guard.allows("b")


def test_an_old_answer_replayed_by_the_relay_is_refused(swarm):
    first = {}

    def replay(request, handler, caller):
        first.setdefault("answer", handler(caller, request))
        return first["answer"]

    tamper(swarm, "r", RPC_FORWARD, replay)
    ask(swarm, b"hi")
    with pytest.raises(PeerUnreachable):  # B signed its answer to the first request, not to this one
        ask(swarm, b"yo")
    assert rejections(swarm) == {"a": {"r": 1}}


def test_a_request_the_relay_altered_is_blamed_on_the_relay_never_the_asker(swarm):
    def alter(request, handler, caller):
        envelope = Envelope.decode(request)
        changed = msgspec.structs.replace(envelope, payload=b"rm")  # still signed by A: over "hi"
        return swarm["r"].transport.request("b", RPC_RELAYED, changed.encode(), timeout=5)

    tamper(swarm, "r", RPC_FORWARD, alter)
    with pytest.raises(RemoteError):
        ask(swarm)
    assert rejections(swarm) == {"b": {"r": 1}}


def test_an_answer_the_target_signed_wrongly_is_blamed_on_the_target(swarm):
    b = swarm["b"]
    b.keys = Keys("b", b.keys.public_key, lambda data: b"forged", verify)
    with pytest.raises(RemoteError, match="failed its signature"):
        ask(swarm)
    assert rejections(swarm) == {"r": {"b": 1}}  # the relay checked it; A blames nobody


def test_a_request_signed_under_another_id_is_refused_by_the_relay(swarm):
    a = swarm["a"]
    a.keys = Keys("b", a.keys.public_key, a.keys.sign, verify)  # A's key, B's name
    with pytest.raises(RemoteError, match="not by the peer that sent it"):
        ask(swarm)
    assert rejections(swarm) == {"r": {"a": 1}}


def test_an_answer_over_the_askers_limit_is_not_sent(swarm):
    with pytest.raises(RemoteError, match="over your 100-byte limit"):
        ask(swarm, limit=100)
    assert not rejections(swarm)


def test_a_relay_forwards_only_so_many_at_once(swarm):
    release, busy = threading.Event(), threading.Semaphore(0)

    def slow(caller, request):
        busy.release()
        release.wait(20)
        return b"done"

    swarm["b"].transport.serve("echo", slow, max_request_bytes=64)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ask(swarm))) for _ in range(MAX_FORWARDS)]
    for t in threads:
        t.start()
    for _ in threads:
        assert busy.acquire(timeout=20)  # every slot taken
    with pytest.raises(RemoteError, match="already forwarding"):
        ask(swarm)
    release.set()
    for t in threads:
        t.join(20)
    assert results == [b"done"] * MAX_FORWARDS


def test_a_reachable_peer_alone_relays(swarm):
    with pytest.raises(TransportError):  # A is relayed itself: it serves no spes/forward
        swarm["r"].request("a", "b", "echo", b"hi", timeout=5, max_response_bytes=1 << 20)


def test_a_relay_refuses_to_hold_an_answer_over_its_cap(swarm):
    a = swarm["a"]
    envelope = Envelope("a", a.keys.public_key, "b", "echo", b"hi", MAX_FORWARD_BYTES + 1, 10.0)
    envelope = msgspec.structs.replace(envelope, signature=a.keys.sign(envelope.digest()))
    with pytest.raises(RemoteError, match="malformed Envelope"):
        a.transport.request("r", RPC_FORWARD, envelope.encode(), timeout=5)
    assert rejections(swarm) == {"r": {"a": 1}}
