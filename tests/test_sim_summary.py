"""What a simulation's summary says of newcomers, of a swarm that split and of its DHT traffic, from the
peers' rows alone."""

from spes_p2p.sim.summary import dht_traffic, newcomers, splits


def row(peer, round_, **participants):
    return {"peer": peer, "round": round_, "participants": participants}


def test_a_newcomer_counts_from_the_first_round_its_update_is_in():
    rows = {
        "peer0": [row("A", r, **{"dense/0": ["A", "B"]}) for r in range(6)],
        "peer1": [
            row("B", 3, **{"dense/0": ["A"]}),
            row("B", 4, **{"dense/0": ["A", "B"]}),
        ],  # adopts round 3
    }
    events = [{"type": "join", "peer": "peer1", "round": 3}, {"type": "kill", "peer": "peer0", "round": 5}]
    (entry,) = newcomers(rows, events, {"peer1": {"joined": 9.5}})
    assert entry == {
        "name": "peer1",
        "join_round": 3,
        "first_counted_round": 4,
        "rounds_late": 1,
        "startup_seconds": {"joined": 9.5},
    }
    never = {"peer0": rows["peer0"], "peer1": []}
    assert newcomers(never, events)[0]["first_counted_round"] is None


def test_peers_that_never_met_are_a_split():
    together = {
        "peer0": [row("A", 0, **{"dense/0": ["A", "B"]})],
        "peer1": [row("B", 0, **{"dense/0": ["A", "B"], "experts/0": ["B", "C"]})],
        "peer2": [row("C", 0, **{"experts/0": ["B", "C"]})],
    }
    assert splits(together) == []
    apart = {**together, "peer3": [row("D", r, **{"dense/0": ["D"]}) for r in range(3)]}  # trained alone
    (split,) = splits(apart)
    assert "peer0, peer1, peer2 | peer3" in split


def test_peers_that_share_no_unit_or_only_adopted_are_not_a_split():
    lone_blocks = {  # one holder per dense block; the experts' holders meet only within their shard
        "peer0": [row("A", 0, **{"dense/0": ["A"], "experts/0": ["A", "B"]})],
        "peer1": [row("B", 0, **{"dense/1": ["B"], "experts/0": ["A", "B"]})],
        "peer2": [row("C", 0, **{"dense/2": ["C"], "experts/1": ["C", "D"]})],
        "peer3": [row("D", 0, **{"dense/3": ["D"], "experts/1": ["C", "D"]})],
    }
    assert splits(lone_blocks) == []
    adopted = {  # a newcomer whose only round adopted the others' result (its own update did not count)
        "peer0": [row("A", 5, **{"dense/0": ["A", "B"]})],
        "peer1": [row("B", 5, **{"dense/0": ["A", "B"]})],
        "peer2": [row("C", 5, **{"dense/0": ["A", "B"]})],
    }
    assert splits(adopted) == []


def dht_row(peers_reads: int, peer_bytes: int, updates_reads: int) -> dict:
    kinds = {
        "peers": {"reads": peers_reads, "entries": 4 * peers_reads, "read_bytes": peer_bytes, "writes": 1},
        "updates": {"reads": updates_reads, "entries": updates_reads, "read_bytes": 100, "writes": 2},
    }
    kinds = {k: {"written_bytes": 0, **c} for k, c in kinds.items()}
    ops = sum(c["reads"] + c["writes"] for c in kinds.values())
    return {"dht": kinds, "dht_ops": ops, "dht_bytes": peer_bytes + 100}


def test_the_dht_traffic_is_the_median_peer_round_and_the_busiest_keys():
    rows = {"peer0": [dht_row(3, 3000, 2), dht_row(4, 4000, 2)], "peer1": [dht_row(5, 5000, 4)]}
    traffic = dht_traffic(rows, completed=2, served=None)
    assert traffic["ops_per_peer_round"] == 9 and traffic["bytes_per_peer_round"] == 4100
    assert traffic["by_kind"]["peers"] == {
        "reads": 4,
        "entries": 16,
        "read_bytes": 4000,
        "writes": 1,
        "written_bytes": 0,
    }
    # no store counted: what the readers got, by kind of key, per round
    assert traffic["served_counted_at"] == "readers"
    assert traffic["served_bytes_per_round"] == {"peers": 6000.0, "updates": 150.0}
    counted = dht_traffic(rows, completed=2, served={"run/peers": 13000, "run/manifest": 10})
    assert counted["served_counted_at"] == "store"
    assert counted["served_bytes_per_round"] == {"run/peers": 6500.0, "run/manifest": 5.0}
