"""What a peer keeps of the relayed peers it learns of, and whom a relayed peer dials (net/relays.py)."""

from spes_p2p.net import relays as relays_module
from spes_p2p.net.relays import REDIAL_SECONDS, Relays

RELAY = "/ip4/10.77.0.2/tcp/31337/p2p/R"


def test_a_relayed_peer_announces_one_circuit_per_relay():
    assert Relays([RELAY]).addresses("N") == [f"{RELAY}/p2p-circuit/p2p/N"]
    assert Relays([]).addresses("P") == [] and not Relays([]).relayed


def test_a_reader_keeps_only_circuits_that_end_in_the_records_own_id_and_knows_the_forwarder():
    reader = Relays([])
    forged = f"{RELAY}/p2p-circuit/p2p/SOMEONE-ELSE"
    assert reader.learn("P", "N", [f"{RELAY}/p2p-circuit/p2p/N", forged]) == []
    assert reader.circuit("N") == [f"{RELAY}/p2p-circuit/p2p/N"] and reader.is_relayed("N")
    assert reader.forwarder("N", me="P") == "R"
    assert reader.forwarder("N", me="R") is None  # the relay itself asks N directly
    assert reader.learn("P", "Q", ["/ip4/10.77.0.3/tcp/31337/p2p/Q"]) == []  # a reachable peer
    assert not reader.is_relayed("Q") and reader.forwarder("Q", me="P") is None
    assert reader.learn("P", "N", ["/ip4/10.77.0.5/tcp/31337/p2p/N"]) == []  # N came back reachable
    assert not reader.is_relayed("N") and reader.forwarder("N", me="P") is None


def test_a_relayed_peer_dials_each_reachable_peer_at_most_every_redial_interval(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(relays_module.time, "monotonic", lambda: clock[0])
    natted = Relays([RELAY])
    public = ["/ip4/10.77.0.3/tcp/31337/p2p/Q"]
    assert natted.learn("N", "Q", public) == public
    assert natted.learn("N", "Q", public) == []
    clock[0] += REDIAL_SECONDS
    assert natted.learn("N", "Q", public) == public
    assert natted.learn("N", "M", ["/ip4/10.77.0.4/tcp/31337/p2p/M/p2p-circuit/p2p/M2"]) == []  # not its id
    assert natted.learn("N", "N", natted.addresses("N")) == []  # itself
