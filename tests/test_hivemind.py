"""The hivemind backend in this process: signed records, streams, identity, and its error paths."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
from hivemind.p2p import PeerID

from spes_p2p.errors import ConfigError
from spes_p2p.swarm import hivemind_backend
from spes_p2p.swarm.hivemind_backend import HivemindTransport
from spes_p2p.swarm.transport import (
    BootstrapError,
    ListenError,
    MessageTooLarge,
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # DHT processes and p2p daemons
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    key = tmp_path_factory.mktemp("identity") / "a.key"
    a = HivemindTransport(listen=LOOPBACK, identity_path=key)
    b = HivemindTransport(listen=LOOPBACK, initial_peers=a.addresses())
    yield a, b, key
    for t in (b, a):
        t.shutdown(timeout=3)


def test_entries_count_only_under_the_id_their_signing_key_derives(pair):
    a, b, _ = pair
    assert a.publish("test/records", b"a", a.now() + 30)
    assert b.publish("test/records", b"b", b.now() + 30)
    b.dht.store("test/records", b"forged", b.now() + 30, subkey=a.peer_id)  # no owner signature
    # signed, by b's key, under a's id (a "left" tombstone with a far expiry, say): not a's entry
    forged = a.peer_id.encode() + b._validator.local_public_key
    assert b.dht.store("test/records", b"forged", b.now() + 3600, subkey=forged)
    for reader in (a, b):
        entries = reader.read("test/records")
        assert {p: e.value for p, e in entries.items()} == {a.peer_id: b"a", b.peer_id: b"b"}


def test_streams_move_large_payloads_and_count_bytes(pair):
    a, b, _ = pair
    a.serve("reverse", lambda caller, data: data[::-1])
    payload = os.urandom(8 * 2**20)
    sent, received = b.stats.bytes_sent, b.stats.bytes_received
    assert b.request(a.peer_id, "reverse", payload, timeout=30) == payload[::-1]
    assert b.stats.bytes_sent - sent == len(payload) and b.stats.bytes_received - received == len(payload)


def test_request_failures_are_named(pair):
    a, b, _ = pair

    def slow(caller, data):
        time.sleep(2)
        return b"late"

    def boom(caller, data):
        raise ValueError("no such unit")

    a.serve("slow", slow)
    a.serve("boom", boom)
    a.serve("echo", lambda caller, data: data)
    with pytest.raises(RequestTimeout):
        b.request(a.peer_id, "slow", b"", timeout=0.5)
    with pytest.raises(RemoteError, match="no such unit"):
        b.request(a.peer_id, "boom", b"", timeout=5)
    with pytest.raises(PeerUnreachable):
        b.request(a.peer_id, "not-served", b"", timeout=5)
    with pytest.raises(MessageTooLarge):
        b.request(a.peer_id, "echo", b"x" * 5000, timeout=5, max_response_bytes=100)


def test_a_request_that_never_arrives_is_dropped(pair, monkeypatch):
    a, b, _ = pair
    monkeypatch.setattr(hivemind_backend, "REQUEST_READ_TIMEOUT", 0.5)
    a.serve("patient", lambda caller, data: data)

    async def open_and_say_nothing() -> bytes:
        _, reader, writer = await b._p2p.call_binary_stream_handler(PeerID.from_base58(a.peer_id), "patient")
        try:
            return await reader.read()  # b"" once a drops the stream
        finally:
            writer.close()

    assert b._run(open_and_say_nothing(), timeout=30) == b""


def test_restarted_peer_keeps_its_id(pair, tmp_path):
    _, b, _ = pair
    key = tmp_path / "restart.key"
    first = HivemindTransport(listen=LOOPBACK, identity_path=key, initial_peers=b.addresses())
    peer_id = first.peer_id
    first.shutdown(timeout=3)
    second = HivemindTransport(listen=LOOPBACK, identity_path=key, initial_peers=b.addresses())
    try:
        assert second.peer_id == peer_id
    finally:
        second.shutdown(timeout=3)


def test_unreachable_bootstrap_suggests_a_new_swarm():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"
    with pytest.raises(BootstrapError, match="--new-swarm"):  # (bounded by startup_timeout and the test's)
        HivemindTransport(listen=LOOPBACK, initial_peers=[dead], startup_timeout=10)


def test_port_in_use_and_bad_multiaddr():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ListenError, match="already in use"):
            HivemindTransport(listen=[f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"])
    with pytest.raises(ConfigError, match="malformed multiaddr"):
        HivemindTransport(listen=["/ip4/127.0.0.1/tcp/notaport"])


def test_a_peer_killed_with_sigkill_leaves_no_dht_process_nor_daemon():
    code = (
        "import time; from spes_p2p.swarm.hivemind_backend import HivemindTransport\n"
        "HivemindTransport(); print('up', flush=True); time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    descendants = []
    try:
        assert proc.stdout.readline().strip() == "up"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert any(p.name() == "p2pd" for p in descendants), [p.name() for p in descendants]
        proc.kill()
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, [p.name() for p in alive]
    finally:
        for p in [proc, *descendants]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()
