"""The dense part's reduce-scatter among a group of 4 peers on the memory backend: members end bit-identical
on the token-weighted mean, move about half what the all-to-all exchange moves, and survive an owner that
vanishes or lies."""

import threading

import pytest
import torch

from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.transport import TransportError
from spes_p2p.sim.byzantine import rewrite
from spes_p2p.sync.codecs import TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.exchange import dense_grid, dense_group
from spes_p2p.sync.fetching import NotYet
from spes_p2p.sync.jobs import UnitJob
from spes_p2p.sync.messages import RPC_UPDATE, UpdateRequest

UNIT = "dense/0"
SPECS = {UNIT: {"embed": TensorSpec((256, 64)), "norm": TensorSpec((64,))}}
GROUP = ["p2", "p0", "p3", "p1"]  # a group in its agreed (shuffled) order: p2 owns part 0
TOKENS = {"p0": 100, "p1": 200, "p2": 300, "p3": 400}

pytestmark = pytest.mark.timeout(120)


def swarm(dense_exchange="reduce_scatter", codec="int8", deadline=5.0, peers=GROUP, patient=False):
    """``patient``: every wait lasts up to ``deadline`` (the adaptive deadline never shortens it), so a slow
    owner under CPU load is still heard from rather than replaced by the fallback."""
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(
        codec=codec,
        deadline_min=deadline if patient else 0.2,
        deadline_max=deadline,
        dense_exchange=dense_exchange,
        request_timeout=2.0,
    )
    return {p: SyncEngine(net.join(p), "t", cfg, SPECS, aggregate="mean") for p in peers}


def weights(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random weights, or updates: a part they all share plus one of their own, as honest updates of one
    unit point the same way (co-holders screen out updates that do not: sync/screening.py)."""
    shared, own = torch.Generator().manual_seed(12345), torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s.shape, generator=shared) + torch.randn(s.shape, generator=own)) * scale
        for n, s in SPECS[UNIT].items()
    }


START = weights(0)
ENDS = {p: {n: START[n] + d for n, d in weights(i + 1, 0.01).items()} for i, p in enumerate(sorted(TOKENS))}


def at_once(engines, peers, job_of):
    """Each of ``peers`` (default: all) runs its ``job_of(p)`` at once; their results."""
    out, errors = {}, []

    def one(p):
        try:
            out[p] = engines[p].exchange(job_of(p))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in peers or engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


def exchange(engines, peers=None, start=None, round_=0):
    """The peers in ``peers`` (default: all) run the round at once; the group is always GROUP."""

    def job(p):
        return UnitJob(round_, UNIT, (start or {}).get(p, START), ENDS[p], TOKENS[p], GROUP, grouped=True)

    return at_once(engines, peers, job)


def exchange_with_newcomer(engines):
    """GROUP's round, which newcomer p4 (its update not counted) runs too: every result, p4's included."""
    newcomer, joined = engines.pop("p4"), {}

    def join():
        joined["p4"] = newcomer.exchange(
            UnitJob(0, UNIT, START, weights(9), 50, GROUP, counted=False, grouped=True)
        )

    thread = threading.Thread(target=join)
    thread.start()
    results = exchange(engines)
    thread.join(timeout=60)
    engines["p4"] = newcomer
    return {**results, **joined}


def mean_of(peers):
    total = sum(TOKENS[p] for p in peers)
    return {n: START[n] + sum(TOKENS[p] / total * (ENDS[p][n] - START[n]) for p in peers) for n in START}


def assert_identical(results):
    first = next(iter(results.values())).new_weights
    for r in results.values():
        for n in first:
            assert torch.equal(r.new_weights[n], first[n]), n


def gap(got, want):
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def test_members_end_identical_on_the_token_weighted_mean():
    results = exchange(swarm(codec="none"))
    assert_identical(results)
    assert gap(results["p0"].new_weights, mean_of(GROUP)) < 1e-6
    assert all(r.participants == sorted(GROUP) and not r.missing for r in results.values())


def test_int8_members_end_identical_within_the_codecs_error():
    results = exchange(swarm(codec="int8"))
    assert_identical(results)
    assert gap(results["p0"].new_weights, mean_of(GROUP)) < 2e-3  # updates of 0.01: int8's step is ~1e-4


def test_each_member_moves_about_half_of_what_all_to_all_moves():
    moved = {}
    for how in ("reduce_scatter", "all_to_all"):
        engines = swarm(how)
        exchange(engines)
        stats = [engines[p].transport.stats for p in GROUP]
        moved[how] = sorted(s.bytes_sent + s.bytes_received for s in stats)[len(stats) // 2]
    unit_int8 = sum(s.numel for s in SPECS[UNIT].values())  # one byte per element
    # all-to-all: 3 updates out and 3 in; reduce-scatter: 2 x 3/4 of one out and as much in
    assert moved["all_to_all"] == pytest.approx(6 * unit_int8, rel=0.05)
    assert moved["reduce_scatter"] == pytest.approx(3 * unit_int8, rel=0.1)


def test_a_member_that_never_shows_up_costs_only_its_part_and_the_rest_agree():
    engines = swarm(deadline=1.0)
    results = exchange(engines, peers=["p0", "p1", "p2"])  # p3 owns part 2 and never comes
    assert_identical(results)
    assert gap(results["p0"].new_weights, mean_of(["p0", "p1", "p2"])) < 2e-3
    assert all(r.missing == ["p3"] and r.participants == ["p0", "p1", "p2"] for r in results.values())


def test_a_member_that_gave_up_on_an_owner_combines_its_part_as_the_owner_did():
    """p0's wait for p2's combined part runs out (a slow link), while the others get it from p2: p0 combines
    that part from the same pieces and codes it as p2 did, so the members still end bit-identical."""
    engines = swarm(codec="int8", deadline=2.0, patient=True)  # (p0 waits out the deadline for p2's part)
    reduced = engines["p0"]._fetcher.reduced
    owners_but_p2 = lambda round_, unit, asks, parts, deadline, rows=0: {  # noqa: E731
        **{j: NotYet("too slow") for j, (owner, _) in asks.items() if owner == "p2"},
        **reduced(round_, unit, {j: a for j, a in asks.items() if a[0] != "p2"}, parts, deadline, rows),
    }
    engines["p0"]._fetcher.reduced = owners_but_p2
    results = exchange(engines)
    assert_identical(results)
    assert all(r.participants == sorted(GROUP) for r in results.values())


@pytest.mark.parametrize("attack", ["scale", "signflip"])
def test_an_owner_serving_a_false_combined_part_is_refused_and_the_others_agree(attack):
    engines = swarm(patient=True)  # each honest member must hear the liar, not time out on it first
    liar = engines["p3"]
    post = liar._outbox.post_reduced
    change = {"scale": lambda t: t * 1000, "signflip": lambda t: -t}[attack]
    liar._outbox.post_reduced = lambda r, u, kind, part, parts, payload: post(
        r, u, kind, part, parts, rewrite(payload, change)
    )
    results = exchange(engines)
    honest = {p: r for p, r in results.items() if p != "p3"}
    assert_identical(honest)
    assert gap(honest["p0"].new_weights, mean_of(GROUP)) < 2e-3  # its part combined by each of them
    assert all(engines[p].transport.guard.total() >= 1 for p in honest)


def test_an_owner_that_names_only_itself_is_checked_against_the_pieces():
    """An owner that serves -8 times its combined part and says it combined only its own piece: no member
    may hold the part against its own piece, so each holds it against the part it combines from the pieces.
    (Before, such a part was not checked for direction at all.)"""
    engines = swarm(patient=True)
    post = engines["p3"]._outbox.post_reduced
    engines["p3"]._outbox.post_reduced = lambda r, u, kind, part, parts, payload: post(
        r, u, kind, part, parts, rewrite(payload, lambda t: t * -8, peers="p3")
    )
    honest = {p: r for p, r in exchange(engines).items() if p != "p3"}
    assert_identical(honest)
    assert gap(honest["p0"].new_weights, mean_of(GROUP)) < 2e-3
    assert all(engines[p].transport.guard.total() >= 1 for p in honest)


def test_a_lying_owner_s_own_piece_is_not_the_yardstick_of_its_part_combined_elsewhere():
    """p3 sends a piece 1000 times too large and serves its part 1000 times too large; p0 fetches no piece
    of p1 or p2 in time, so it combines p3's part from p3's piece and its own. The yardstick of those two
    norms is p0's own piece, never the lying owner's (with p3's, its piece passed, and p0's weights moved
    hundreds of times the mean's)."""
    engines = swarm(patient=True, deadline=1.0)
    lie_with_scale(engines["p3"])
    liar_end = {n: START[n] + 1000 * (ENDS["p3"][n] - START[n]) for n in START}
    member = engines["p0"].transport
    ask = member.request

    def no_pieces_of_p1_or_p2(peer, name, payload, **kwargs):
        if peer in ("p1", "p2") and name == RPC_UPDATE and UpdateRequest.decode(payload).kind == "piece":
            raise TransportError("piece lost")
        return ask(peer, name, payload, **kwargs)

    member.request = no_pieces_of_p1_or_p2
    original, ENDS["p3"] = ENDS["p3"], liar_end
    try:
        results = exchange(engines)
    finally:
        ENDS["p3"] = original
    # (any mix of honest pieces lies within 0.1 of their mean, here 0.042; p3's piece moved it 48)
    assert gap(results["p0"].new_weights, mean_of(["p0", "p1", "p2"])) < 0.2
    assert_identical({p: r for p, r in results.items() if p in ("p1", "p2")})


def lie_with_scale(engine):
    post = engine._outbox.post_reduced
    engine._outbox.post_reduced = lambda r, u, kind, part, parts, payload: post(
        r, u, kind, part, parts, rewrite(payload, lambda t: t * 1000)
    )


def test_a_newcomer_checks_an_owner_against_the_parts_it_combines_from_the_pieces():
    """A newcomer's update does not count in its first round, so it has no piece to check an owner's part
    against: it combines the part from the members' pieces itself and refuses an owner far from that."""
    engines = swarm(patient=True, peers=[*GROUP, "p4"])
    lie_with_scale(engines["p3"])
    honest = {p: r for p, r in exchange_with_newcomer(engines).items() if p != "p3"}
    assert set(honest) == {"p0", "p1", "p2", "p4"}
    assert_identical(honest)
    assert gap(honest["p4"].new_weights, mean_of(GROUP)) < 2e-3
    assert all(engines[p].transport.guard.total() >= 1 for p in honest)


def test_a_newcomer_that_gets_no_piece_does_not_take_an_owners_part_unchecked():
    """A newcomer that fetches none of the members' pieces has nothing to hold an owner's part against: it
    uses no part it cannot check (p3's, 1000 times too large, poisoned such a peer under load) and does not
    hold that against the owner; the parts it can check it takes (here: none, so it keeps its start
    weights, and the next round's vote puts it back on the row's weights)."""
    engines = swarm(patient=True, deadline=1.0, peers=[*GROUP, "p4"])
    lie_with_scale(engines["p3"])
    newcomer = engines["p4"].transport
    ask = newcomer.request

    def no_pieces(peer, name, payload, **kwargs):
        if name == RPC_UPDATE and UpdateRequest.decode(payload).kind == "piece":
            raise TransportError("piece lost")
        return ask(peer, name, payload, **kwargs)

    newcomer.request = no_pieces
    results = exchange_with_newcomer(engines)
    assert_identical({p: r for p, r in results.items() if p not in ("p3", "p4")})
    assert gap(results["p4"].new_weights, START) == 0.0  # (p3's part would move it 1000 times the mean's)
    assert newcomer.guard.total() == 0


def test_a_member_whose_update_diverged_checks_an_owner_against_the_pieces():
    """A member whose own update is not finite does not count this round: like a newcomer, it checks the
    owners' parts against the parts it combines from the other members' pieces."""
    engines = swarm(patient=True)
    lie_with_scale(engines["p3"])
    diverged = {n: t.clone() for n, t in ENDS["p0"].items()}
    diverged["norm"][0] = float("nan")
    original, ENDS["p0"] = ENDS["p0"], diverged
    try:
        results = exchange(engines)
    finally:
        ENDS["p0"] = original
    honest = {p: r for p, r in results.items() if p != "p3"}
    assert_identical(honest)
    assert all(r.participants == ["p1", "p2", "p3"] for r in honest.values())
    assert honest["p0"].diverged and honest["p1"].missing == ["p0"]
    # p3 trained honestly and only lies as an owner: its update counts, through the pieces
    assert gap(honest["p0"].new_weights, mean_of(["p1", "p2", "p3"])) < 2e-3
    assert all(engines[p].transport.guard.total() >= 1 for p in honest)


def test_members_on_other_start_weights_resynchronize():
    engines = swarm(codec="none")
    other = {n: t + 1.0 for n, t in START.items()}
    results = exchange(engines, start={"p3": other})
    assert results["p3"].resynced and not results["p0"].resynced
    on_base = {p: r for p, r in results.items() if p != "p3"}
    assert_identical(on_base)
    assert gap(on_base["p0"].new_weights, mean_of(["p0", "p1", "p2"])) < 1e-6


def test_a_newcomer_outside_the_group_takes_its_result():
    """A newcomer's first round does not count: it is no member of the group, and adopts its result."""
    results = exchange_with_newcomer(swarm(codec="none", peers=[*GROUP, "p4"]))
    assert_identical(results)
    assert gap(results["p4"].new_weights, mean_of(GROUP)) < 1e-6


# ---------------------------------------------------------------------------------- several rows

GRID_PEERS = [f"g{i}" for i in range(7)]
GRID_TOKENS = {p: 100 * (i + 1) for i, p in enumerate(GRID_PEERS)}
GRID_ENDS = {p: {n: START[n] + d for n, d in weights(20 + i, 0.01).items()} for i, p in enumerate(GRID_PEERS)}
GRID = dense_grid(GRID_PEERS, 0, "t", 3)  # rows of 3, 2 and 2: the parts are 3, a short row's first owns two


def grid_exchange(engines, peers=None, grid=GRID, tokens=GRID_TOKENS):
    """The peers in ``peers`` (default: all) run a round of ``grid`` at once."""

    def job(p):
        return UnitJob(0, UNIT, START, GRID_ENDS[p], tokens[p], dense_group(grid, p), grouped=True, grid=grid)

    return at_once(engines, peers, job)


def grid_mean(peers):
    total = sum(GRID_TOKENS[p] for p in peers)
    return {
        n: START[n] + sum(GRID_TOKENS[p] / total * (GRID_ENDS[p][n] - START[n]) for p in peers) for n in START
    }


@pytest.mark.parametrize("codec, tolerance", [("none", 1e-6), ("int8", 2e-3)])
def test_rows_merge_so_every_holder_ends_identical_on_the_whole_mean(codec, tolerance):
    """More holders than a group holds: each row averages its members' pieces, then the owners of a part
    merge the rows' parts, so every holder of every row ends on the same weights: the mean of all seven (not
    each row's own, which left holders of one block apart, round after round)."""
    assert [len(row) for row in GRID] == [3, 2, 2]
    results = grid_exchange(swarm(codec=codec, peers=GRID_PEERS))
    assert_identical(results)
    assert gap(results["g0"].new_weights, grid_mean(GRID_PEERS)) < tolerance
    assert all(r.participants == GRID_PEERS and not r.missing and not r.resynced for r in results.values())


def test_a_row_owner_that_never_comes_is_combined_from_its_rows_pieces_by_every_row():
    """The owner of a part in the row of three never comes: its row mates combine that part from the
    pieces, and so does each other row's owner of it, which waited in vain: all six agree."""
    absent = GRID[0][1]
    present = [p for p in GRID_PEERS if p != absent]
    results = grid_exchange(swarm(codec="int8", deadline=1.0, peers=GRID_PEERS), peers=present)
    assert_identical(results)
    assert gap(results[present[0]].new_weights, grid_mean(present)) < 2e-3


def test_an_owner_lying_to_the_other_rows_and_its_own_is_refused_and_everyone_agrees():
    """An owner serves its row's part, and the merged part, scaled by 1000: the other rows refuse the
    first and combine its row's part from the pieces, its row mates refuse the second and merge themselves."""
    engines = swarm(codec="int8", patient=True, peers=GRID_PEERS)
    liar = GRID[0][1]
    lie_with_scale(engines[liar])
    honest = {p: r for p, r in grid_exchange(engines).items() if p != liar}
    assert_identical(honest)
    assert gap(honest[GRID[0][0]].new_weights, grid_mean(GRID_PEERS)) < 2e-3  # (the liar's piece is honest)
    assert all(engines[p].transport.guard.total() >= 1 for p in (GRID[0][0], GRID[1][1], GRID[2][1]))


def test_rows_of_very_different_weight_merge_alike_on_every_row():
    """Two rows, one counting 150 times the tokens of the other: the rule's caps measure both rows by the
    same yardstick on every peer (not each merger by its own row's), so both rows end identical."""
    grid = (("g0", "g1", "g2"), ("g3", "g4"))
    tokens = {"g0": 1000, "g1": 1000, "g2": 1000, "g3": 10, "g4": 10}
    engines = {p: e for p, e in swarm(codec="none", peers=list(tokens)).items()}
    for e in engines.values():
        e._reduce_scatter.aggregate = "clipped_mean"
    results = grid_exchange(engines, grid=grid, tokens=tokens)
    assert_identical(results)
