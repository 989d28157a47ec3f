"""The swarm layer on the in-process backend: records, claims, expiry, rebalance, partitions, faults."""

import logging
import threading
from types import SimpleNamespace

import msgspec
import pytest
from conftest import TOKENIZER

from spes_p2p.net.guard import BAN_AFTER, BAN_SCORE
from spes_p2p.net.memory import FakeClock, MemoryNetwork
from spes_p2p.net.transport import (
    MAX_EXPIRY_AHEAD,
    MAX_STREAMS_PER_PEER,
    MessageTooLarge,
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
)
from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.peer.heartbeat import Heartbeat
from spes_p2p.peer.setup import member_config
from spes_p2p.settings import Settings
from spes_p2p.swarm.claims import tiebreak
from spes_p2p.swarm.manifest import ManifestServer, manifest_key
from spes_p2p.swarm.member import SwarmMember, SwarmMismatch, read_view
from spes_p2p.swarm.records import peers_key

TTL = 20.0


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def net(clock):
    return MemoryNetwork(seed=0, clock=clock)


def make_settings(shards=2) -> Settings:
    return Settings().override(
        {"model.shards": shards, "model.dense_blocks": 1, "swarm.record_ttl_seconds": TTL}
    )


@pytest.fixture
def member(manifest_of):
    """member(net, name, settings=None): a SwarmMember that serves its manifest, as a peer does."""

    def make(net, name, settings=None) -> SwarmMember:
        settings = settings or make_settings()
        manifest, transport = manifest_of(settings), net.join(name)
        ManifestServer(transport, manifest, TOKENIZER)
        return SwarmMember(transport, manifest, member_config(settings))

    return make


def coverage(m: SwarmMember) -> dict[str, int]:
    return {u: len(h) for u, h in m.view().holders.items()}


# ------------------------------------------------------------------------------------------- transport


def test_records_expire_and_the_later_expiry_wins(net, clock):
    a, b = net.join("a"), net.join("b")
    assert a.publish("k", b"1", clock() + 10)
    assert b.publish("k", b"2", clock() + 30)
    assert {p: e.value for p, e in a.read("k").items()} == {"a": b"1", "b": b"2"}
    assert not a.publish("k", b"3", clock() + 5)  # older expiry than what is stored: refused
    clock.advance(11)
    assert set(b.read("k")) == {"b"}
    with pytest.raises(MessageTooLarge):
        a.publish("k", b"x" * 20_000, clock() + 10)


def test_requests_count_bytes_and_report_failures(net):
    a, b = net.join("a"), net.join("b")
    a.serve("echo", lambda caller, data: caller.encode() + data, max_request_bytes=1024)
    assert b.request("a", "echo", b"hello", timeout=1) == b"bhello"
    assert (b.stats.bytes_sent, b.stats.bytes_received) == (5, 6)
    assert (a.stats.bytes_received, a.stats.bytes_sent, a.stats.requests_served) == (5, 6, 1)

    def boom(caller, data):
        raise ValueError("bad request")

    a.serve("boom", boom, max_request_bytes=1024)
    with pytest.raises(RemoteError, match="bad request"):
        b.request("a", "boom", b"", timeout=1)
    with pytest.raises(PeerUnreachable):
        b.request("a", "missing", b"", timeout=1)
    with pytest.raises(MessageTooLarge):
        b.request("a", "echo", b"x" * 100, timeout=1, max_response_bytes=10)
    a.shutdown()
    with pytest.raises(PeerUnreachable):
        b.request("a", "echo", b"", timeout=1)


def test_a_hanging_handler_times_out_and_a_flood_is_capped_per_peer(net):
    a, b, c = net.join("a"), net.join("b"), net.join("c")
    release = threading.Event()
    a.serve("hang", lambda caller, data: b"late" if release.wait(30) else b"", max_request_bytes=1024)
    a.serve("echo", lambda caller, data: data, max_request_bytes=1024)
    with pytest.raises(RequestTimeout):
        b.request("a", "hang", b"", timeout=0.2)  # (its handler still runs, and holds one of b's slots)
    flood = [
        threading.Thread(target=lambda: b.request("a", "hang", b"", timeout=30))
        for _ in range(MAX_STREAMS_PER_PEER - 1)
    ]
    try:
        for t in flood:
            t.start()
        assert poll(lambda: a.streams.in_progress("b") == MAX_STREAMS_PER_PEER or None, Deadline(20), 0.01)
        with pytest.raises(RemoteError, match="too many requests in progress"):
            b.request("a", "echo", b"x", timeout=1)
        assert c.request("a", "echo", b"y", timeout=1) == b"y"  # the others are served as before
    finally:
        release.set()
        for t in flood:
            t.join(timeout=10)
    assert b.request("a", "echo", b"z", timeout=1) == b"z"


def test_an_allowlist_hides_and_refuses_everyone_else(net, clock):
    a, b, stranger = net.join("a"), net.join("b"), net.join("stranger")
    a.guard.allow_only(("b",))
    for t in (a, b, stranger):
        t.publish("k", t.peer_id.encode(), clock() + 10)
        t.serve("echo", lambda caller, data: data, max_request_bytes=1024)
    assert set(a.read("k")) == {"a", "b"} and set(b.read("k")) == {"a", "b", "stranger"}
    assert stranger.request("b", "echo", b"x", timeout=1) == b"x"
    with pytest.raises(RemoteError, match="does not serve this peer"):
        stranger.request("a", "echo", b"x", timeout=1)
    assert b.request("a", "echo", b"y", timeout=1) == b"y"


def test_a_peer_rejected_again_and_again_is_banned_until_the_end(net, clock):
    a, bad, flaky = net.join("a"), net.join("bad"), net.join("flaky")
    for t in (bad, flaky):
        t.publish("k", b"record", clock() + 10)
    a.serve("echo", lambda caller, data: data, max_request_bytes=1024)
    for _ in range(BAN_AFTER - 1):
        a.guard.reject("bad", "payload", "garbage")
        a.guard.reject("flaky", "payload", "a flipped bit")
    a.guard.accept("flaky")  # one good payload: the count starts again
    a.guard.reject("bad", "payload", "garbage")
    a.guard.reject("flaky", "payload", "a flipped bit")
    assert a.guard.banned() == ["bad"]
    assert set(a.read("k")) == {"flaky"}  # a banned peer's records are not read...
    with pytest.raises(RemoteError, match="does not serve this peer"):
        bad.request("a", "echo", b"x", timeout=1)  # ...nor its requests served
    a.guard.accept("bad")
    assert a.guard.banned() == ["bad"]  # for the rest of the run


def test_a_peer_whose_contributions_keep_being_refused_scores_low_and_is_banned(net):
    """What passes every payload check and is refused later, by screening, resets no streak: the score
    catches it. An honest peer refused once, or counted for half, recovers."""
    a = net.join("a")
    for _ in range(2):
        a.guard.accept("freerider")  # (its payloads decode)
        a.guard.score("freerider", 0.0)  # (and are refused by its co-holders)
        a.guard.score("honest", 1.0)
    a.guard.score("honest", 0.0)
    a.guard.score("honest", 1.0)
    assert a.guard.banned() == ["freerider"]
    assert a.guard.scores()["freerider"] < BAN_SCORE < a.guard.scores()["honest"] < 1.0
    for _ in range(5):
        a.guard.score("honest", 1.0)
    assert a.guard.scores()["honest"] > 0.95 and a.guard.banned() == ["freerider"]


def test_an_entry_set_to_outlive_every_ttl_is_not_read(net, clock):
    a, b = net.join("a"), net.join("b")
    a.publish("k", b"sane", clock() + 20)
    b.publish("k", b"forever", clock() + 10 * MAX_EXPIRY_AHEAD)
    assert set(a.read("k")) == {"a"}


def test_fault_hooks(net):
    a, b = net.join("a"), net.join("b")
    a.serve("echo", lambda caller, data: data, max_request_bytes=1024)
    net.drop = 1.0
    with pytest.raises(RequestTimeout):
        b.request("a", "echo", b"x", timeout=1)
    net.drop, net.corrupt = 0.0, 1.0
    assert b.request("a", "echo", b"abcdef", timeout=1) != b"abcdef"
    net.corrupt, net.delay = 0.0, 0.05
    with pytest.raises(RequestTimeout):
        b.request("a", "echo", b"x", timeout=0.01)
    assert b.request("a", "echo", b"x", timeout=1) == b"x"
    assert net.faults["dropped"] == 1 and net.faults["corrupted"] == 1


# ------------------------------------------------------------------------------------------ membership


def test_join_and_claim_cover_every_shard(member, net):
    members = [member(net, f"p{i}") for i in range(4)]
    for m in members:
        m.join()
    view = members[0].view()
    assert set(view.peers) == {"p0", "p1", "p2", "p3"}
    assert {u: len(h) for u, h in view.holders.items()} == {"dense/0": 4, "experts/0": 2, "experts/1": 2}
    record = view.peers["p2"]
    assert record.units == members[2].units_held and record.addresses == ["/memory/p2p/p2"]


def test_a_ban_hides_the_banned_peer_but_not_from_the_grid_every_member_computes(member, net):
    """A ban is one peer's own. The grid of a grouped exchange still counts the banned peer, as the others
    do, so the rows and part owners stay the ones they compute (seen in CI: a peer that banned a noisy
    attacker dealt the dense part into other parts than its co-holders, and missed them for the rest of the
    run); its update is refused at once, never waited for."""
    members = [member(net, f"p{i}") for i in range(4)]
    for m in members:
        m.join()
    for _ in range(BAN_AFTER):
        members[2].transport.guard.reject("p3", "payload", "garbage")
    banning, other = members[2].view(), members[0].view()
    assert "p3" not in banning.peers and "p3" not in banning.participants("dense/0", 0)
    assert "p3" in banning.banned and "p3" in members[2].transport.read(peers_key("spes-demo"), banned=True)
    assert banning.members("dense/0", 0) == other.participants("dense/0", 0) == {"p0", "p1", "p2", "p3"}
    assert banning.members("dense/0", 0) == other.members("dense/0", 0)
    assert not other.banned and "p3" not in members[2].transport.read(peers_key("spes-demo"))


def test_founders_that_claimed_alike_at_the_same_moment_settle_before_the_first_round(member, net):
    """Four founders each read the swarm before any of the others published (a race, under load): some
    claim the same shard and leave another uncovered for the first rounds, until ``settle``."""
    settings = make_settings(shards=4)
    members = [member(net, f"p{i}", settings) for i in range(4)]
    empty = members[0].view()
    for m in members:
        m.view = lambda: empty  # (what each read before the others' records were out)
        m.join()
        del m.view
    shards = [f"experts/{s}" for s in range(4)]
    assert 0 in [coverage(members[0])[u] for u in shards]  # the race
    for m in members:
        m.settle()
    assert [coverage(members[0])[u] for u in shards] == [1, 1, 1, 1]


def test_a_failed_read_of_the_swarm_is_not_everyone_leaving(member, net, monkeypatch):
    """A DHT read that times out finds nothing: a peer whose own record is out keeps its last view, rather
    than stop waiting for every participant or count every unit uncovered."""
    members = [member(net, f"p{i}") for i in range(3)]
    for m in members:
        m.join()
    before = members[0].view()
    monkeypatch.setattr(members[0].transport, "read", lambda key, banned=False: {})
    assert members[0].view() is before and set(before.peers) == {"p0", "p1", "p2"}
    assert members[0].live_peers() == {"p0", "p1", "p2"}
    assert members[0].rebalance() == set() and coverage(members[0]) == coverage(members[1])


def test_silent_peer_expires_and_its_sole_unit_is_taken_over(member, net, clock):
    members = [member(net, f"p{i}") for i in range(3)]
    for m in members:
        m.join()
    sole = next(u for u, h in members[0].view().holders.items() if len(h) == 1 and u.startswith("experts/"))
    (victim,) = members[0].view().holders[sole]
    survivors = [m for m in members if m.transport.peer_id != victim]
    clock.advance(TTL / 2)
    for m in survivors:
        m.heartbeat()
    clock.advance(TTL / 2 + 1)  # the victim's records are past their expiry, the survivors' are not
    assert victim not in survivors[0].view().peers
    assert survivors[0].view().holders[sole] == set()
    for m in survivors:
        m.rebalance()
    assert all(n >= 1 for n in coverage(survivors[0]).values())


def test_an_uncovered_shard_is_not_left_to_a_peer_that_stopped_refreshing_its_record(member, net, clock):
    """Both holders of a shard die; so does, a little later, the holder of the other shard that every plan
    picks to move to it. Its record lives on for up to a TTL: a plan that still moved it would move nobody,
    and leave the shard uncovered until that record expired. It is stale (half a TTL without a refresh), so
    another peer moves."""
    members = {f"p{i}": member(net, f"p{i}") for i in range(5)}
    for m in members.values():
        m.join()
    holders = members["p0"].view().holders
    crowded, other = sorted(("experts/0", "experts/1"), key=lambda u: -len(holders[u]))
    assert [len(holders[crowded]), len(holders[other])] == [3, 2]
    planned = min(holders[crowded], key=lambda p: tiebreak(p, other))  # whom every plan would move
    survivors = [members[p] for p in sorted(holders[crowded] - {planned})]
    clock.advance(TTL / 2 - 1)
    for m in [*survivors, members[planned]]:
        m.heartbeat()  # (the last refresh of the planned peer, which then dies)
    clock.advance(TTL / 2 + 2)  # the other shard's holders have expired; the planned peer is stale
    for m in survivors:
        m.heartbeat()
    view = survivors[0].view()
    assert view.holders[other] == set() and planned in view.peers and view.stale == {planned}
    for m in survivors:
        m.rebalance(first_round=3)  # (a boundary well after everyone's claims)
    assert len(survivors[0].view().holders[other]) == 1


def test_leaving_releases_claims_at_once(member, net):
    a, b = member(net, "a"), member(net, "b")
    a.join()
    b.join()
    a.leave()
    view = b.view()
    assert set(view.peers) == {"b"}
    assert all("a" not in h for h in view.holders.values())


def test_a_heartbeat_late_after_leaving_does_not_bring_the_peer_back(member, net, clock):
    """The heartbeat thread may be mid-beat when the peer leaves: its refresh, landing later, must not
    outlive the tombstone (a swarm whose peers all left would read as live)."""
    a, b = member(net, "a"), member(net, "b")
    a.join()
    b.join()
    a.leave()
    clock.advance(2.0)  # (past the second by which a tombstone outlives a refresh)
    a.heartbeat()
    clock.advance(TTL / 2)  # (the DHT keeps the entry that expires last: a refresh written now would)
    b.heartbeat()
    view = b.view()
    assert set(view.peers) == {"b"}
    assert all("a" not in h for h in view.holders.values())


def test_the_progress_record_is_written_when_a_round_ends_and_every_third_of_a_ttl(member, net, clock):
    """People alone read it: heartbeats that would change only its traffic counters refresh the peer
    record alone."""
    a = member(net, "a")
    a.join()

    def progress_writes() -> int:
        return a.transport.stats.dht_snapshot()["progress"].writes

    first = progress_writes()
    a.heartbeat()
    a.transport.stats.bytes_sent += 1000
    clock.advance(1.0)
    a.heartbeat()
    assert progress_writes() == first
    a.transport.guard.reject("b", "request", "garbage")  # a refusal: news
    a.heartbeat()
    assert progress_writes() == first + 1
    first += 1
    a.report(1, a.progress, 0)  # a round ended
    a.heartbeat()
    assert progress_writes() == first + 1
    clock.advance(TTL / 3)
    a.heartbeat()
    assert progress_writes() == first + 2


def test_slow_writes_of_other_records_do_not_hold_the_peer_record_back():
    """The data claims' heartbeat hangs (a DHT call of seconds, on a busy libp2p peer): the peer record is
    refreshed all the same, on a thread of its own (in one thread, such peers read the swarm without
    themselves, their records lapsed)."""
    refreshed, stuck, release = threading.Semaphore(0), threading.Event(), threading.Event()

    def hang() -> None:
        stuck.set()
        release.wait(30)

    member = SimpleNamespace(heartbeat=refreshed.release)
    beat = Heartbeat(member, 0.01, after=[hang])
    beat.start()
    try:
        assert stuck.wait(10)
        assert all(refreshed.acquire(timeout=10) for _ in range(5))
    finally:
        beat.stop()
        release.set()


def test_mismatched_settings_are_refused_naming_the_fields_and_write_nothing(member, net):
    member(net, "a").join()
    stranger = member(net, "b", make_settings(shards=4))
    with pytest.raises(SwarmMismatch, match=r"model\.shards: 4 here vs 2 in the swarm"):
        stranger.join()
    assert set(stranger.transport.read(peers_key("spes-demo"))) == {"a"}
    assert set(stranger.transport.read(manifest_key("spes-demo"))) == {"a"}


def test_one_peer_on_another_manifest_locks_nobody_out_and_is_left_out_of_views(member, net):
    member(net, "a").join()
    member(net, "evil", make_settings(shards=4)).heartbeat()  # live, on another manifest, without a join
    newcomer = member(net, "b")
    newcomer.join()  # a and b share a manifest: evil's record alone does not stop b
    assert set(newcomer.view().peers) == {"a", "b"}
    assert newcomer.transport.guard.rejections["evil"] >= 1
    with pytest.raises(SwarmMismatch):  # but a peer whom every other live peer contradicts is refused
        member(net, "c", make_settings(shards=8)).join()


def test_records_of_the_wrong_schema_are_ignored_counted_and_logged_once(member, net, caplog):
    good = member(net, "good")
    good.join()
    evil = net.join("evil")
    wrong_schema = msgspec.msgpack.encode({"peer_id": "evil", "units": "experts/0"})
    evil.publish(peers_key("spes-demo"), wrong_schema, net.clock() + TTL)
    wrong_manifest = msgspec.msgpack.encode({"hash": "0" * 64, "protocol": "two", "bytes": 10})
    evil.publish(manifest_key("spes-demo"), wrong_manifest, net.clock() + TTL)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            view = good.view()
            good.check_manifest()  # the bogus manifest record is not trusted
    assert set(view.peers) == {"good"}
    assert caplog.text.count("rejecting evil's peer record") == 1  # once, however often it is read
    assert caplog.text.count("rejecting evil's manifest record") == 1
    guard = good.transport.guard
    assert guard.rejections["evil"] == 2 and guard.banned() == []  # once per kind; records never ban


def test_partition_hides_the_other_side_until_healed(member, net):
    members = [member(net, f"p{i}") for i in range(4)]
    for m in members:
        m.join()
    net.partition(["p0", "p1"], ["p2", "p3"])
    assert set(members[0].view().peers) == {"p0", "p1"}
    assert set(members[3].view().peers) == {"p2", "p3"}
    with pytest.raises(PeerUnreachable):
        members[0].transport.request("p2", "anything", b"", timeout=1)
    net.heal()
    assert set(members[0].view().peers) == {"p0", "p1", "p2", "p3"}


def test_view_reads_only_active_holders(member, net):
    a = member(net, "a")
    a.join()
    view = read_view(net.join("observer"), "spes-demo", a.units)
    assert view.holders["dense/0"] == {"a"} and len(view.uncovered()) == 1
