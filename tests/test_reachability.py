"""Reachability is tested, not guessed: peers dial each other back, and the verdict names the fix."""

import msgspec
import pytest

from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.reachability import (
    DIALBACKS_PER_MINUTE,
    RPC_DIALBACK,
    DialbackRequest,
    DialbackServer,
    assess,
    dial_back,
)
from spes_p2p.net.transport import RemoteError

PID = "/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"
PRIVATE = f"/ip4/192.168.1.20/tcp/4001{PID}"


@pytest.fixture
def net():
    net = MemoryNetwork()
    for name in ("helper", "home", "natted"):
        DialbackServer(net.join(name))
    net.unreachable.add("natted")  # nobody can dial it: it only dials out
    return net


def test_a_peer_is_dialed_back_at_its_addresses(net):
    home, natted = net.peers["home"], net.peers["natted"]
    assert dial_back(home, ["helper"], home.addresses()) == {"/memory/p2p/home": True}
    assert dial_back(natted, ["helper"], natted.addresses()) == {"/memory/p2p/natted": False}
    assert dial_back(home, [], home.addresses()) == {"/memory/p2p/home": None}  # nobody to ask


def test_a_peer_is_dialed_back_only_at_its_own_addresses_and_only_so_often(net):
    home = net.peers["home"]
    other = DialbackRequest(address="/memory/p2p/natted").encode()
    with pytest.raises(RemoteError, match="only at its own addresses"):
        home.request("helper", RPC_DIALBACK, other, timeout=1)
    own = DialbackRequest(address="/memory/p2p/home").encode()
    for _ in range(DIALBACKS_PER_MINUTE):
        home.request("helper", RPC_DIALBACK, own, timeout=1)
    with pytest.raises(RemoteError, match="too many"):
        home.request("helper", RPC_DIALBACK, own, timeout=1)
    with pytest.raises(RemoteError, match="malformed"):
        home.request("helper", RPC_DIALBACK, msgspec.msgpack.encode({"address": 7}), timeout=1)


def test_the_verdict_follows_the_dial_backs_and_names_the_fix():
    yes = assess([PRIVATE], relayed=False, announced=False, dialed={PRIVATE: True})
    assert yes.reachable == "yes" and PRIVATE in yes.message
    no = assess([PRIVATE], relayed=False, announced=False, dialed={PRIVATE: False})
    assert no.reachable == "no" and "--announce" in no.message and "--use-relay" in no.message
    announced = assess([PRIVATE], relayed=False, announced=True, dialed={PRIVATE: False})
    assert "its port is forwarded" in announced.message
    unknown = assess([PRIVATE], relayed=False, announced=False, dialed={PRIVATE: None})
    assert unknown.reachable == "unknown" and "not checked yet" in unknown.message
    loopback = f"/ip4/127.0.0.1/tcp/1{PID}"
    local = assess([loopback], relayed=False, announced=False, dialed={loopback: False})
    assert "loopback" in local.message and "--listen /ip4/0.0.0.0/tcp/PORT" in local.message
    circuit = f"/ip4/10.0.0.1/tcp/31337/p2p/RELAYPEER/p2p-circuit/p2p/{PID}"
    relayed = assess([circuit], relayed=True, announced=False, dialed={})
    assert relayed.reachable == "no" and "RELAYPEER" in relayed.message and "holds shards" in relayed.message
