"""One round of the sync protocol on the memory backend: 4 peers, 2 expert shards, replication 2."""

import threading
import time

import pytest
import torch

from spes_p2p.net.guard import BAN_AFTER
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.swarm.records import Announcement, updates_key
from spes_p2p.sync.codecs import CODECS, TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.exchange import dense_grid, dense_group, owner
from spes_p2p.sync.jobs import UnitJob
from spes_p2p.sync.ledger import MISS_LIMIT, RESYNC_LIMIT
from spes_p2p.sync.messages import RPC_UPDATE, UpdateRequest
from spes_p2p.sync.versions import EXACT_WEIGHTS, Want

SPECS = {
    "dense/0": {"embed": TensorSpec((40, 8)), "norm": TensorSpec((8,))},
    "experts/0": {"w1": TensorSpec((8, 16))},
    "experts/1": {"w1": TensorSpec((8, 16))},
}
HOLDERS = {"dense/0": ["p0", "p1", "p2", "p3"], "experts/0": ["p0", "p2"], "experts/1": ["p1", "p3"]}
TOKENS = {"p0": 100, "p1": 200, "p2": 300, "p3": 400}
TOLERANCE = {"none": 2e-5, "fp16": 2e-3, "int8": 3e-2}


def tensors(seed: int, scale: float = 1.0) -> dict[str, dict[str, torch.Tensor]]:
    """Random weights, or updates: a part they all share plus one of their own, as honest updates of one
    unit point the same way (co-holders screen out updates that do not: sync/screening.py)."""
    shared, own = torch.Generator().manual_seed(12345), torch.Generator().manual_seed(seed)
    return {
        u: {
            n: (torch.randn(s.shape, generator=shared) + torch.randn(s.shape, generator=own)) * scale
            for n, s in spec.items()
        }
        for u, spec in SPECS.items()
    }


def run_round(engines, start, ends, peers=None, holders=HOLDERS, grouped=False):
    """Every peer exchanges the units it holds, concurrently, as the training loop would (``grouped``: the
    dense part by reduce-scatter)."""
    results, errors = {}, []

    def one(peer):
        try:
            for unit, members in holders.items():
                if peer in members:
                    r = engines[peer].exchange(
                        UnitJob(
                            0, unit, start[unit], ends[peer][unit], TOKENS[peer], members, grouped=grouped
                        )
                    )
                    engines[peer].serve_weights(0, unit, r.new_weights)
                    results[(peer, unit)] = r
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in (peers or engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def make_swarm(codec="int8", deadline=10.0, peers=("p0", "p1", "p2", "p3"), aggregate="mean", **sync):
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(codec=codec, **{"deadline_min": 0.2, "deadline_max": deadline, **sync})
    return net, {p: SyncEngine(net.join(p), "t", cfg, SPECS, aggregate=aggregate) for p in peers}


def exchange_concurrently(engines, round_, unit, starts, ends, holders, tokens=TOKENS):
    """Peers in ``starts`` exchange ``unit`` of ``round_`` at once, each from its own start and end."""
    out, errors = {}, []

    def one(p):
        try:
            out[p] = engines[p].exchange(
                UnitJob(round_, unit, starts[p], ends[p], tokens.get(p, 100), holders)
            )
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert set(out) == set(starts)
    return out


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_holders_agree_on_the_token_weighted_mean_and_updates_reach_only_holders(codec):
    net, engines = make_swarm(codec)
    start = tensors(0)
    deltas = {p: tensors(i + 1, scale=0.01) for i, p in enumerate(engines)}
    ends = {p: {u: {n: start[u][n] + deltas[p][u][n] for n in start[u]} for u in start} for p in engines}
    results = run_round(engines, start, ends)

    for unit, members in HOLDERS.items():
        total = sum(TOKENS[p] for p in members)
        for name in SPECS[unit]:
            expected = start[unit][name] + sum(TOKENS[p] / total * deltas[p][unit][name] for p in members)
            got = [results[(p, unit)].new_weights[name] for p in members]
            assert all(torch.equal(g, got[0]) for g in got), f"{unit} holders differ"  # bit-identical
            err = (got[0] - expected).norm() / (expected - start[unit][name]).norm()
            assert err <= TOLERANCE[codec], (unit, name, err.item())
        assert all(sorted(results[(p, unit)].participants) == members for p in members)

    # updates of a shard travel only between its holders, and their sizes are what was announced
    for caller, target, name, request, response_bytes in net.log:
        assert name == RPC_UPDATE
        unit = UpdateRequest.decode(request).unit
        assert caller in HOLDERS[unit] and target in HOLDERS[unit]
        assert response_bytes <= CODECS[codec].max_bytes(SPECS[unit])
    fetched = [(c, t, UpdateRequest.decode(r).unit) for c, t, _, r, _ in net.log]
    assert sorted(u for _, _, u in fetched) == sorted(
        ["dense/0"] * 12 + ["experts/0"] * 2 + ["experts/1"] * 2
    )
    sent = sum(e.transport.stats.bytes_sent + e.transport.stats.bytes_received for e in engines.values())
    assert sent == 2 * sum(size for *_, size in net.log) + 2 * sum(len(r) for *_, r, _ in net.log)

    # non-holders refresh their frozen copies from the holders (int8, to its tolerance)
    frozen: dict = {}
    got = engines["p1"].refresh(
        0,
        {"experts/0": ["p0", "p2"]},
        seconds=5.0,
        want=Want("weights", "int8"),
        on_unit=lambda u, fetched: frozen.update(fetched.tensors),
    )
    holder_weights = results[("p0", "experts/0")].new_weights["w1"]
    assert got == {"experts/0": 0}
    assert (frozen["w1"] - holder_weights).abs().max() <= 0.02 * holder_weights.abs().max()


def test_sparseloco_holders_agree_on_the_mean_of_what_their_payloads_carry():
    """Experts among co-holders and the dense part by reduce-scatter, in the sparse codec: holders end
    bit-identical, on the token-weighted mean of what each peer's payload decodes to (the dense part's
    combined parts keep every entry of it, rounded once more to two bits)."""
    from spes_p2p.sync.codecs import part_bounds
    from spes_p2p.sync.payload import decode, encode, flatten, specs_of, unflatten

    _, engines = make_swarm("sparseloco")
    codec = engines["p0"]._ledger.codec

    def coded(update, parts=None):  # as it travels: by tensor, or flattened in parts coded each alone
        if parts is None:
            return decode(encode(update, codec), specs_of(update), codec)
        flat = flatten(update)
        pieces = [{"piece": flat[a:b]} for a, b in part_bounds(flat.numel(), parts)]
        back = [decode(encode(p, codec), specs_of(p), codec)["piece"] for p in pieces]
        return unflatten(torch.cat(back), specs_of(update))

    start = tensors(0)
    deltas = {p: tensors(i + 1, scale=0.01) for i, p in enumerate(engines)}
    ends = {p: {u: {n: start[u][n] + deltas[p][u][n] for n in start[u]} for u in start} for p in engines}
    results = run_round(engines, start, ends, grouped=True)
    for unit, members in HOLDERS.items():
        total = sum(TOKENS[p] for p in members)
        sent = {p: coded(deltas[p][unit], len(members) if unit == "dense/0" else None) for p in members}
        for name in SPECS[unit]:
            expected = sum(TOKENS[p] / total * sent[p][name] for p in members)
            got = [results[(p, unit)].new_weights[name] - start[unit][name] for p in members]
            assert all(torch.equal(g, got[0]) for g in got), f"{unit} holders differ"
            assert torch.equal(got[0] != 0, expected != 0), f"{unit}: entries lost or invented"
            err = (got[0] - expected).norm() / expected.norm()
            assert err <= (0.4 if unit == "dense/0" else 1e-5), (unit, name, err.item())


def test_a_holder_that_never_answers_does_not_stop_the_round():
    _, engines = make_swarm("none", deadline=1.0, peers=("p0", "p1", "p2", "p3", "ghost"))
    holders = {**HOLDERS, "experts/0": ["p0", "p2", "ghost"]}
    start = tensors(0)
    ends = {p: tensors(7 + i) for i, p in enumerate(engines)}
    results = run_round(
        engines,
        start,
        ends,
        peers=["p0", "p1", "p2", "p3"],
        holders={u: [p for p in m] for u, m in holders.items()},
    )
    r = results[("p0", "experts/0")]
    assert r.missing == ["ghost"] and r.participants == ["p0", "p2"]
    assert torch.equal(r.new_weights["w1"], results[("p2", "experts/0")].new_weights["w1"])


@pytest.mark.timeout(60)
def test_a_member_one_peer_banned_is_refused_at_once_and_the_others_still_agree_with_it():
    """A ban is one peer's own: in a reduce-scatter, the peer that banned p3 neither waits for p3's pieces
    (it cannot read p3's announcements) nor parts from the others: every member ends on the same weights."""
    _, engines = make_swarm("none", deadline=20.0)
    for _ in range(BAN_AFTER):
        engines["p2"].transport.guard.reject("p3", "payload", "garbage")
    start = tensors(0)
    ends = {p: tensors(7 + i) for i, p in enumerate(engines)}
    results = run_round(engines, start, ends, holders={"dense/0": HOLDERS["dense/0"]}, grouped=True)
    banning = results[("p2", "dense/0")]
    assert banning.rejected == ["p3"] and banning.missing == []
    for peer in ("p0", "p1"):
        for name, weights in results[(peer, "dense/0")].new_weights.items():
            assert torch.equal(weights, banning.new_weights[name]), (peer, name)


class Roster:
    """The swarm's records as a test sets them: every peer is live; ``later`` came back (a restart) holding
    its units only from a later round, so it takes part in no earlier round."""

    def __init__(self, peers, later=()):
        self.peers, self.later = set(peers), set(later)

    def live_peers(self):
        return set(self.peers)

    def participants(self, unit, round_):
        return self.peers - self.later


@pytest.mark.timeout(60)
def test_a_participant_that_came_back_for_later_rounds_is_not_waited_for():
    """A holder killed and restarted with --resume is live again, but holds its units only from a later round:
    it will never deliver this round's update. The others stop waiting for it as soon as its record says so
    (here at once), not at the deadline (600 s: a wait for it would outlive this test's timeout). The churn
    simulation took 200 s instead of 45 when a restarted peer's first rounds waited for such peers."""
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(codec="none", deadline_min=600.0, deadline_max=600.0)
    roster = Roster({"p0", "p2", "reborn"}, later={"reborn"})
    engines = {p: SyncEngine(net.join(p), "t", cfg, SPECS, roster=roster) for p in ("p0", "p2")}
    net.join("reborn")  # up again, announcing nothing of this round
    unit, start = "experts/0", tensors(0)["experts/0"]
    ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)[unit]["w1"]} for i, p in enumerate(engines)}
    results = exchange_concurrently(
        engines, 3, unit, {p: start for p in engines}, ends, ["p0", "p2", "reborn"]
    )
    assert results["p0"].missing == ["reborn"] and results["p0"].participants == ["p0", "p2"]
    assert torch.equal(results["p0"].new_weights["w1"], results["p2"].new_weights["w1"])


@pytest.mark.timeout(60)
def test_a_participant_that_announces_and_never_serves_stops_being_waited_for():
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(codec="none", deadline_min=2.0, deadline_max=2.0)
    engines = {p: SyncEngine(net.join(p), "t", cfg, SPECS) for p in ("p0", "p2")}
    ghost = net.join("ghost")  # holds the unit, announces every round, serves nothing
    unit, holders = "experts/0", ["p0", "p2", "ghost"]

    def ghost_announces(round_):
        a = Announcement(round=round_, tokens=1, bytes=100, codec="none", sha256="0" * 64, base="0" * 16)
        ghost.publish(updates_key("t", round_, unit), a.encode(), ghost.now() + 60)

    start = tensors(0)[unit]
    for round_ in range(MISS_LIMIT):
        ghost_announces(round_)
        ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)[unit]["w1"]} for i, p in enumerate(engines)}
        results = exchange_concurrently(engines, round_, unit, {p: start for p in engines}, ends, holders)
        assert results["p0"].missing == ["ghost"] and results["p0"].participants == ["p0", "p2"]
        start = results["p0"].new_weights
    assert (
        engines["p0"]._gatherer._deadline(unit).mean_wait is not None
    )  # it learns from the answers, whoever is missing
    for engine in engines.values():  # from now on a wait for the ghost would outlive this test's timeout
        engine._gatherer._deadline(unit).low = engine._gatherer._deadline(unit).high = 600.0
    ghost_announces(MISS_LIMIT)
    ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)[unit]["w1"]} for i, p in enumerate(engines)}
    results = exchange_concurrently(engines, MISS_LIMIT, unit, {p: start for p in engines}, ends, holders)
    assert results["p0"].missing == ["ghost"] and results["p0"].participants == ["p0", "p2"]


def test_corrupt_payloads_are_rejected_and_counted():
    net, engines = make_swarm("int8", deadline=1.0)
    net.corrupt = 1.0
    start = tensors(0)
    results = run_round(engines, start, {p: tensors(3) for p in engines})
    r = results[("p0", "experts/0")]
    assert r.rejected == ["p2"] and r.participants == ["p0"]
    assert sum(e.rejected_payloads for e in engines.values()) == net.faults["corrupted"] > 0


def test_different_start_weights_are_resynced_by_averaging_end_weights():
    _, engines = make_swarm("int8")
    start = tensors(0)
    other_start = tensors(9)  # p2 drifted: its start of experts/0 differs from p0's
    ends = {p: tensors(i + 20) for i, p in enumerate(engines)}
    results = {}

    def one(peer, s):
        results[peer] = engines[peer].exchange(
            UnitJob(0, "experts/0", s["experts/0"], ends[peer]["experts/0"], TOKENS[peer], ["p0", "p2"])
        )

    threads = [
        threading.Thread(target=one, args=("p0", start)),
        threading.Thread(target=one, args=("p2", other_start)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    expected = (100 * ends["p0"]["experts/0"]["w1"] + 300 * ends["p2"]["experts/0"]["w1"]) / 400
    for peer in ("p0", "p2"):
        assert results[peer].resynced
        torch.testing.assert_close(results[peer].new_weights["w1"], expected)
    assert torch.equal(results["p0"].new_weights["w1"], results["p2"].new_weights["w1"])


def test_end_weights_for_a_resync_may_take_longer_than_the_round_deadline():
    """A deadline sized for compressed updates cut off every fetch of whole end weights on slow uplinks,
    and holders that had parted ways never came back together. Here each end-weights answer takes 1 s,
    the round's deadline 0.3 s."""
    _, engines = make_swarm("int8", deadline=0.3, peers=("p0", "p2"))
    for engine in engines.values():
        handler, limit = engine.transport.handlers[RPC_UPDATE]

        def slow_ends(caller, request, handler=handler):
            if UpdateRequest.decode(request).kind == "end":
                time.sleep(1.0)
            return handler(caller, request)

        engine.transport.handlers[RPC_UPDATE] = (slow_ends, limit)
    starts = {"p0": tensors(0)["experts/0"], "p2": tensors(9)["experts/0"]}  # p2 drifted
    ends = {p: tensors(i + 20)["experts/0"] for i, p in enumerate(engines)}
    results = exchange_concurrently(engines, 0, "experts/0", starts, ends, ["p0", "p2"])
    expected = (100 * ends["p0"]["w1"] + 300 * ends["p2"]["w1"]) / 400
    for peer in ("p0", "p2"):
        assert results[peer].resynced
        torch.testing.assert_close(results[peer].new_weights["w1"], expected)


def test_each_unit_has_a_deadline_of_its_own():
    """Quick answers for one unit (a dense block's reduce-scatter pieces) must not cut short the wait for
    another's larger updates: with one deadline for both, 4 holders of a model on 50 Mbit/s uplinks missed
    each other's expert updates every round and trained apart. Here dense/0's answers are instant and
    experts/0's take 1 s."""
    _, engines = make_swarm("none", deadline=5.0, peers=("p0", "p1"))  # deadline_min 0.2
    handler, limit = engines["p1"].transport.handlers[RPC_UPDATE]

    def slow_experts(caller, request):
        if UpdateRequest.decode(request).unit.startswith("experts/"):
            time.sleep(1.0)
        return handler(caller, request)

    engines["p1"].transport.handlers[RPC_UPDATE] = (slow_experts, limit)
    for round_, unit in enumerate(["dense/0", "dense/0", "experts/0"]):
        starts = {p: tensors(0)[unit] for p in engines}
        ends = {p: tensors(i + 1)[unit] for i, p in enumerate(engines)}
        results = exchange_concurrently(engines, round_, unit, starts, ends, ["p0", "p1"])
        assert results["p0"].participants == ["p0", "p1"], (unit, results["p0"].missing)
    assert engines["p0"].deadline_seconds() >= 2.0  # (the longest of the units': experts/0's)


def test_dense_grids_are_bounded_and_consistent():
    peers = [f"p{i}" for i in range(37)]
    grid = dense_grid(peers, round_=4, run_id="r", size=8)
    assert [len(row) for row in grid] == [8, 8, 7, 7, 7] and sorted(sum(grid, ())) == sorted(peers)
    assert dense_grid(list(reversed(peers)), 4, "r", 8) == grid  # every peer computes the same rows
    assert all(dense_group(grid, p) == row for row in grid for p in row)
    assert dense_group(grid, "newcomer") in grid  # a peer outside the grid follows one of its rows
    assert dense_grid(peers, 5, "r", 8) != grid  # rows change between rounds
    assert [owner(grid[2], j) for j in range(8)] == [*grid[2], grid[2][0]]  # a short row: the first owns two


def test_a_late_update_counts_in_the_next_round():
    _, engines = make_swarm("none", deadline=0.5, peers=("p0", "p1", "p2"))
    unit, holders = "experts/0", ["p0", "p1", "p2"]
    start = tensors(0)[unit]
    end = {p: tensors(i + 40)[unit] for i, p in enumerate(holders)}
    same = {p: start for p in holders}
    first = exchange_concurrently(engines, 0, unit, {p: start for p in ("p0", "p1")}, end, holders)
    assert first["p0"].missing == ["p2"]  # p2 is late for round 0...
    engines["p2"].exchange(
        UnitJob(0, unit, start, end["p2"], TOKENS["p2"], holders)
    )  # ...and announces afterwards
    base = first["p0"].new_weights
    late_delta = end["p2"]["w1"] - start["w1"]
    steps = {p: 0.5 * late_delta + tensors(60 + i, 0.5)[unit]["w1"] for i, p in enumerate(("p0", "p1"))}
    two = {p: base for p in ("p0", "p1")}
    second = exchange_concurrently(
        engines, 1, unit, two, {p: {"w1": base["w1"] + steps[p]} for p in two}, holders
    )
    for p in ("p0", "p1"):
        assert second[p].participants == ["p0", "p1", "p2"]  # p2 counts, with its late update
    # the mean of round 1's updates and the late one, weighted by their tokens
    mean = sum(TOKENS[p] * d for p, d in [*steps.items(), ("p2", late_delta)]) / sum(
        TOKENS[p] for p in ("p0", "p1", "p2")
    )
    torch.testing.assert_close(second["p0"].new_weights["w1"], base["w1"] + mean)
    assert torch.equal(second["p0"].new_weights["w1"], second["p1"].new_weights["w1"])
    assert same  # (every holder started round 0 from the same weights)


def test_a_non_participant_cannot_slip_in_a_late_update():
    _, engines = make_swarm("none", deadline=5.0, peers=("p0", "p1", "intruder"))
    unit, holders = "experts/0", ["p0", "p1"]
    start = tensors(0)[unit]
    end = {p: tensors(i + 40)[unit] for i, p in enumerate(engines)}
    first = exchange_concurrently(engines, 0, unit, {p: start for p in holders}, end, holders)
    # the intruder announces a round-0 update on the holders' public base hash, after the round
    engines["intruder"].exchange(
        UnitJob(
            0,
            unit,
            start,
            end["intruder"],
            10**6,
            ["intruder"],
        )
    )
    base = first["p0"].new_weights
    two = {p: base for p in holders}
    steps = {p: tensors(60 + i, 0.01)[unit]["w1"] for i, p in enumerate(holders)}
    ends = {p: {"w1": base["w1"] + steps[p]} for p in holders}
    second = exchange_concurrently(engines, 1, unit, two, ends, holders, tokens={**TOKENS, "intruder": 1})
    mean = sum(TOKENS[p] * steps[p] for p in holders) / sum(TOKENS[p] for p in holders)
    for p in holders:  # the intruder's update did not count
        assert second[p].participants == ["p0", "p1"]
        torch.testing.assert_close(second[p].new_weights["w1"], base["w1"] + mean)


def poisoned_round(attack, aggregate="clipped_mean"):
    """p0 and p1 train honestly; p2, a holder too, sends ``attack(start, honest end)``."""
    _, engines = make_swarm(
        "int8",
        deadline=5.0,
        peers=("p0", "p1", "p2"),
        aggregate=aggregate,
    )
    unit, holders = "experts/0", ["p0", "p1", "p2"]
    start = tensors(0)[unit]
    ends = {p: {"w1": start["w1"] + tensors(i + 1, scale=0.01)[unit]["w1"]} for i, p in enumerate(holders)}
    ends["p2"] = attack(start, ends["p2"])
    return (
        exchange_concurrently(engines, 0, unit, {p: start for p in holders}, ends, holders),
        engines,
        start,
        ends,
    )


def test_an_update_scaled_a_thousandfold_is_rejected_and_the_honest_holders_agree():
    results, engines, _, ends = poisoned_round(lambda s, e: {"w1": s["w1"] + 1000 * (e["w1"] - s["w1"])})
    for p in ("p0", "p1"):
        assert results[p].rejected == ["p2"] and results[p].participants == ["p0", "p1"]
        assert engines[p].rejected_payloads == 1
    assert torch.equal(results["p0"].new_weights["w1"], results["p1"].new_weights["w1"])
    # p2 measures the same: its own update is left out, and it does not count that against itself
    assert results["p2"].participants == ["p0", "p1"] and results["p2"].rejected == []
    assert engines["p2"].rejected_payloads == 0 and engines["p2"].transport.guard.total() == 0
    honest = (100 * ends["p0"]["w1"] + 200 * ends["p1"]["w1"]) / 300
    assert (results["p0"].new_weights["w1"] - honest).abs().max() < 1e-3


def test_an_update_refused_in_its_round_does_not_come_back_as_a_late_one():
    """Late updates are those that came after their round closed: one that came in time and was refused is
    settled. Taken again the next round, it was refused twice (toward a ban), and co-holders that had
    combined different sets of updates in that round ended on different weights (seen in an honest swarm,
    where one holder's screening then kept what the other's refused)."""
    results, engines, _, _ = poisoned_round(lambda s, e: {"w1": s["w1"] + 1000 * (e["w1"] - s["w1"])})
    unit, honest = "experts/0", ("p0", "p1")
    base = results["p0"].new_weights
    steps = {p: tensors(70 + i, 0.01)[unit]["w1"] for i, p in enumerate(honest)}
    ends = {p: {"w1": base["w1"] + steps[p]} for p in honest}
    second = exchange_concurrently(engines, 1, unit, {p: base for p in honest}, ends, list(honest))
    mean = sum(TOKENS[p] * steps[p] for p in honest) / sum(TOKENS[p] for p in honest)
    for p in honest:
        assert second[p].participants == ["p0", "p1"] and second[p].rejected == []
        assert engines[p].rejected_payloads == 1  # (round 0's refusal, once)
        assert (second[p].new_weights["w1"] - (base["w1"] + mean)).abs().max() < 1e-3  # (int8's rounding)
    assert torch.equal(second["p0"].new_weights["w1"], second["p1"].new_weights["w1"])


def test_a_newcomer_takes_a_peers_own_copy_of_a_late_round_when_the_holders_cannot_serve():
    """Catching up, a unit whose holders are newcomers too comes from another peer's copy, of whatever round
    it is, though not of a round far past the swarm's (a swarm past round 16 had its honest peers' copies
    refused as "far past round -1", counted toward a ban: 2 of 4 honest peers banned in a 96-round run)."""
    _, engines = make_swarm("none", peers=("p0", "p1"))
    unit, weights = "experts/0", tensors(5)["experts/0"]
    engines["p0"].serve_weights(40, unit, weights)
    got = engines["p1"].refresh(39, {unit: []}, 5.0, want=EXACT_WEIGHTS, fallback=["p0"])
    assert got == {unit: 40} and engines["p1"].rejected_payloads == 0
    engines["p0"].serve_weights(39 + 17, unit, weights)  # (a round no honest peer of this swarm is at)
    assert engines["p1"].refresh(39, {unit: []}, 1.0, want=EXACT_WEIGHTS, fallback=["p0"]) == {}
    assert engines["p1"].rejected_payloads >= 1


def test_an_update_in_another_codec_than_the_swarms_is_refused_unfetched():
    net = MemoryNetwork(seed=0)
    engines = {
        p: SyncEngine(net.join(p), "t", SyncConfig(codec=codec, deadline_min=5.0, deadline_max=5.0), SPECS)
        for p, codec in (("p0", "int8"), ("p1", "none"))
    }
    start = tensors(0)["experts/0"]
    ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)["experts/0"]["w1"]} for i, p in enumerate(engines)}
    results = exchange_concurrently(engines, 0, "experts/0", {p: start for p in engines}, ends, ["p0", "p1"])
    assert results["p0"].rejected == ["p1"] and results["p0"].participants == ["p0"]
    assert not any(caller == "p0" for caller, *_ in net.log)  # nothing was fetched from p1


def test_token_counts_are_clamped_to_what_a_round_can_hold():
    tokens = {"p0": 100, "p1": 100, "p2": 10**15}
    _, engines = make_swarm(
        "none", deadline=5.0, peers=("p0", "p1", "p2"), aggregate="mean", max_round_tokens=100
    )
    unit, holders = "experts/0", ["p0", "p1", "p2"]
    start = tensors(0)[unit]
    ends = {p: {"w1": start["w1"] + tensors(i + 1, scale=0.01)[unit]["w1"]} for i, p in enumerate(holders)}
    results = exchange_concurrently(engines, 0, unit, {p: start for p in holders}, ends, holders, tokens)
    expected = sum(ends[p]["w1"] for p in holders) / 3  # every update weighs the same: 100 tokens
    torch.testing.assert_close(results["p0"].new_weights["w1"], expected)


def test_a_diverged_peer_sends_nothing_and_takes_the_others_result():
    results, engines, _, _ = poisoned_round(lambda s, e: {"w1": e["w1"] * float("nan")})
    assert results["p2"].diverged and not results["p0"].diverged
    assert results["p0"].missing == ["p2"] and results["p0"].participants == ["p0", "p1"]
    for p in ("p0", "p2"):
        assert torch.equal(results[p].new_weights["w1"], results["p1"].new_weights["w1"])
    assert engines["p0"].rejected_payloads == 0  # nothing bad was sent


def test_the_majority_base_wins_and_far_end_weights_are_not_averaged_in():
    _, engines = make_swarm("none", deadline=5.0, peers=("p0", "p1", "p2"))
    unit, holders = "experts/0", ["p0", "p1", "p2"]
    start = tensors(0)[unit]
    ends = {p: {"w1": start["w1"] + tensors(i + 1, scale=0.01)[unit]["w1"]} for i, p in enumerate(holders)}
    starts = {"p0": start, "p1": start, "p2": tensors(9)[unit]}  # p2 started elsewhere
    results = exchange_concurrently(engines, 0, unit, starts, ends, holders)
    for p in ("p0", "p1"):  # the two on one base average their updates, without p2's
        assert not results[p].resynced and results[p].participants == ["p0", "p1"]
        assert results[p].apart == ["p2"] and not results[p].missing  # (it came: set aside, and said so)
    assert results["p2"].resynced  # p2 moves to the majority's end weights...
    assert results["p2"].download_from == ["p0", "p1"]  # ...until it has their result, bit for bit
    expected = (100 * ends["p0"]["w1"] + 200 * ends["p1"]["w1"]) / 300
    torch.testing.assert_close(results["p2"].new_weights["w1"], expected)
    torch.testing.assert_close(results["p0"].new_weights["w1"], expected)


def test_far_end_weights_drag_nobody():
    _, engines = make_swarm("none", deadline=5.0, peers=("p0", "x"))
    unit, holders = "experts/0", ["p0", "x"]
    start = tensors(0)[unit]
    starts = {"p0": start, "x": {"w1": start["w1"] + 1}}  # a tie of bases, one of them far off
    ends = {"p0": {"w1": start["w1"] + tensors(1, 0.01)[unit]["w1"]}, "x": {"w1": starts["x"]["w1"] + 1e4}}
    results = exchange_concurrently(engines, 0, unit, starts, ends, holders)
    assert results["p0"].resynced and results["p0"].rejected == ["x"]
    assert torch.equal(results["p0"].new_weights["w1"], ends["p0"]["w1"])  # p0 did not move


def test_a_peer_outnumbered_and_out_of_reach_downloads_the_unit():
    _, engines = make_swarm("none", deadline=5.0, peers=("p0", "p1", "x"))
    unit, holders = "experts/0", ["p0", "p1", "x"]
    start = tensors(0)[unit]
    for round_ in range(RESYNC_LIMIT):
        starts = {"p0": start, "p1": start, "x": {"w1": start["w1"] + 1 + round_}}  # x: elsewhere, far
        ends = {
            p: {"w1": s["w1"] + tensors(i + 1, 1e-4)[unit]["w1"]} for i, (p, s) in enumerate(starts.items())
        }
        results = exchange_concurrently(engines, round_, unit, starts, ends, holders)
        assert not results["p0"].resynced and results["p0"].participants == ["p0", "p1"]
        assert results["x"].resynced and results["x"].rejected == ["p0", "p1"]
        assert torch.equal(results["x"].new_weights["w1"], ends["x"]["w1"])  # out of reach: it stays...
        assert results["x"].download_from == (["p0", "p1"] if round_ == RESYNC_LIMIT - 1 else [])  # ...then
        start = results["p0"].new_weights


def test_the_deadline_adapts_within_its_bounds():
    from spes_p2p.sync.gather import AdaptiveDeadline

    d = AdaptiveDeadline(low=1.0, high=30.0, factor=2.0)
    assert d.seconds() == 30.0  # nothing observed yet: the maximum
    d.observe(3.0)
    assert d.seconds() == 6.0
    for _ in range(20):
        d.observe(0.01)
    assert d.seconds() == 1.0
    for _ in range(20):
        d.observe(100.0)
    assert d.seconds() == 30.0


def test_a_deadline_that_cut_off_a_peer_still_training_waits_longer_next_round():
    """p1 and p2 train the unit; p2 is behind (it has not announced when the deadline passes): the deadline
    grows round after round, so a peer that ran ahead falls back into step instead of landing alone. A holder
    that never announces (a fake one) is waited for no more after MISS_LIMIT rounds: before, it cost the
    whole deadline every round, forever."""
    _, engines = make_swarm("none", deadline=5.0, peers=("p0", "p1"))  # deadline_min 0.2
    unit, holders = "experts/0", ["p0", "p1", "p2"]
    engines["p0"]._gatherer._deadline(unit).observe(0.5)  # a 1 s deadline
    start, waits = tensors(0)[unit], []
    for round_ in range(MISS_LIMIT + 1):
        waits.append(engines["p0"]._gatherer.deadline_seconds(unit))
        ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)[unit]["w1"]} for i, p in enumerate(engines)}
        results = exchange_concurrently(engines, round_, unit, {p: start for p in engines}, ends, holders)
        assert results["p0"].missing == ["p2"] and results["p0"].participants == ["p0", "p1"]
        start = results["p0"].new_weights
    assert waits[0] < waits[1] < waits[2]  # each wait the whole deadline: 1.3x or more a round
    assert not engines["p0"]._ledger.waited_for("p2")
    for engine in engines.values():  # from now on a wait for p2 would outlive this test's timeout
        engine._gatherer._deadline(unit).low = engine._gatherer._deadline(unit).high = 600.0
    ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)[unit]["w1"]} for i, p in enumerate(engines)}
    results = exchange_concurrently(engines, MISS_LIMIT + 1, unit, {p: start for p in engines}, ends, holders)
    assert results["p0"].missing == ["p2"] and results["p0"].participants == ["p0", "p1"]


@pytest.mark.parametrize("last", [False, True], ids=["a-round", "the-last-round"])
def test_the_last_round_waits_for_a_late_holder_up_to_deadline_max(last):
    """p1 comes to the round late. A round's wait (0.2 s after fast rounds) cuts it off, and a later
    round would make that up; the run's last round has no later one, so it waits up to deadline_max and both
    end on the same weights (a process test's holders ended apart when one came late to the last round)."""
    _, engines = make_swarm("none", deadline=30.0, peers=("p0", "p1"))  # deadline_min 0.2
    unit, holders = "experts/0", ["p0", "p1"]
    engines["p0"]._gatherer._deadline(unit).observe(0.05)  # rounds so far: everyone at once
    if last:
        engines["p0"].last_round()
    start = tensors(0)[unit]
    ends = {p: {"w1": start["w1"] + tensors(i + 1, 0.01)[unit]["w1"]} for i, p in enumerate(engines)}
    out = {}

    def one(p):
        out[p] = engines[p].exchange(UnitJob(0, unit, start, ends[p], 100, holders))

    first = threading.Thread(target=one, args=("p0",))
    first.start()
    first.join(timeout=None if not last else 1.5)  # (without its last round: p0 is done, p1 not begun)
    one("p1")
    first.join(timeout=40)
    assert out["p0"].missing == ([] if last else ["p1"]) and out["p1"].missing == []
    agree = torch.equal(out["p0"].new_weights["w1"], out["p1"].new_weights["w1"])
    assert agree == last


def test_a_lone_holders_int8_updates_do_not_accumulate_rounding():
    """A sole holder applies its own coded update every round: with error feedback its weights stay within
    one round's rounding of where its training took them, over 30 rounds."""
    _, engines = make_swarm("int8", peers=("p0",))
    g = torch.Generator().manual_seed(3)
    synced = true = {"w1": torch.randn(8, 16, generator=g)}
    drift = torch.randn(8, 16, generator=g) * 1e-3
    for round_ in range(30):
        step = drift + torch.randn(8, 16, generator=g) * 1e-4
        end = {"w1": synced["w1"] + step}
        true = {"w1": true["w1"] + step}
        synced = engines["p0"].exchange(UnitJob(round_, "experts/0", synced, end, 100, ["p0"])).new_weights
    one_round = (drift.abs().max() * 2 / 127).item()  # int8's step on an update of this size
    assert (synced["w1"] - true["w1"]).abs().max() < one_round


@pytest.mark.parametrize("drop", [0.0, 1.0], ids=["gossip", "all-gossip-lost"])
def test_announcements_come_by_gossip_and_the_dht_covers_what_gossip_loses(drop):
    net, engines = make_swarm("none", deadline_min=2.0)  # (gossip lost: a DHT read every 0.5 s)
    net.gossip_drop = drop
    start = tensors(0)
    deltas = {p: tensors(i + 1, scale=0.01) for i, p in enumerate(engines)}
    ends = {p: {u: {n: start[u][n] + deltas[p][u][n] for n in start[u]} for u in start} for p in engines}
    results = run_round(engines, start, ends)
    for unit, members in HOLDERS.items():
        got = [results[(p, unit)].new_weights for p in members]
        assert all(torch.equal(g[n], got[0][n]) for g in got for n in got[0]), unit
        assert all(sorted(results[(p, unit)].participants) == members for p in members)
    heard = {p: set(engines[p]._gatherer.gossip.heard(0, "experts/0")) for p in HOLDERS["experts/0"]}
    if drop:
        assert heard == {"p0": set(), "p2": set()} and net.faults["gossip dropped"] > 0
    else:  # (whoever posted first was told before the other subscribed: it heard nothing, or the other)
        assert heard["p0"] <= {"p2"} and heard["p2"] <= {"p0"} and heard["p0"] | heard["p2"]


def test_gossip_for_another_unit_or_past_a_peers_share_is_not_kept():
    from spes_p2p.swarm.gossip import MAX_HEARD_PER_PEER, Told, topic_of

    net, engines = make_swarm(peers=("p0", "p1"))
    gossip = engines["p0"]._gatherer.gossip
    gossip.follow("experts/0")
    liar = net.peers["p1"]

    def told(round_, unit="experts/0"):
        hexes = {"sha256": "0" * 64, "base": "0" * 64}
        return Told(unit, Announcement(round=round_, tokens=1, bytes=1, codec="int8", **hexes)).encode()

    liar.gossip(topic_of("t", "experts/0"), told(0, unit="experts/1"))  # another unit, on this topic
    liar.gossip(topic_of("t", "experts/0"), b"\x93garbage")
    assert gossip.heard(0, "experts/0") == {} and liar.peer_id not in engines["p0"].transport.guard.banned()
    assert engines["p0"].transport.guard.rejections["p1"] == 1  # (each kind counts once per peer)
    for round_ in range(MAX_HEARD_PER_PEER + 10):
        liar.gossip(topic_of("t", "experts/0"), told(round_))
    kept = [r for r in range(MAX_HEARD_PER_PEER + 10) if gossip.heard(r, "experts/0")]
    assert kept == list(range(MAX_HEARD_PER_PEER))
    gossip.forget_before(MAX_HEARD_PER_PEER)  # old rounds forgotten make room again
    liar.gossip(topic_of("t", "experts/0"), told(MAX_HEARD_PER_PEER + 5))
    assert set(gossip.heard(MAX_HEARD_PER_PEER + 5, "experts/0")) == {"p1"}
    gossip.follow_only([])
    liar.gossip(topic_of("t", "experts/0"), told(MAX_HEARD_PER_PEER + 6))
    assert gossip.heard(MAX_HEARD_PER_PEER + 6, "experts/0") == {}
