"""The hivemind backend beyond the Transport contract (``transport_contract.py``): a request that never
arrives is dropped, p2pd runs with a lower GOGC, and a peer killed with SIGKILL leaves no DHT process nor
p2pd behind."""

import contextlib
import os
import subprocess
import sys

import psutil
import pytest
from hivemind.p2p import PeerID

from spes_p2p.errors import ConfigError
from spes_p2p.net.hivemind import daemon as hivemind_backend
from spes_p2p.net.hivemind.daemon import HivemindTransport

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


def test_a_request_that_never_arrives_is_dropped(pair, monkeypatch):
    a, b, _ = pair
    monkeypatch.setattr(hivemind_backend, "REQUEST_READ_TIMEOUT", 0.5)
    a.serve("patient", lambda caller, data: data, max_request_bytes=1024)

    async def open_and_say_nothing() -> bytes:
        _, reader, writer = await b._p2p.call_binary_stream_handler(PeerID.from_base58(a.peer_id), "patient")
        try:
            return await reader.read()  # b"" once a drops the stream
        finally:
            writer.close()

    assert b._run(open_and_say_nothing(), timeout=30) == b""


def test_p2pd_collects_its_garbage_early_unless_told_otherwise(pair):
    # (a request flood is mostly garbage in p2pd: at Go's default GOGC=100 it grew by three times as much)
    daemons = [p for p in psutil.Process().children(recursive=True) if p.name() == "p2pd"]
    assert len(daemons) == 2
    for daemon in daemons:
        assert daemon.environ().get("GOGC") == os.environ.get("GOGC", hivemind_backend.P2PD_GOGC)


def test_a_peer_killed_with_sigkill_leaves_no_dht_process_nor_daemon():
    code = (
        "import time; from spes_p2p.net.hivemind.daemon import HivemindTransport\n"
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


def test_an_identity_of_the_libp2p_backend_is_refused_naming_the_fix(tmp_path):
    from hivemind.proto import crypto_pb2

    key = tmp_path / "ed25519.key"
    key.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=bytes(64)).SerializeToString())
    with pytest.raises(ConfigError, match="needs an RSA identity: give it another --identity"):
        HivemindTransport(identity_path=key)
