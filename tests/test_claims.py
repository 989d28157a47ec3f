"""The claim policy, on plain values: many peers, simultaneous joins, departures, uneven capacities."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from spes_p2p.swarm.claims import choose_units, plan_moves
from spes_p2p.swarm.member import Delivery

UNITS = [f"experts/{i}" for i in range(4)]


def holders_of(choices: dict[str, set[str]], units=UNITS) -> dict[str, set[str]]:
    return {u: {p for p, held in choices.items() if u in held} for u in units}


def evaluate_all(choices, capacity, target=2, hysteresis=1, units=UNITS):
    """Every peer re-evaluates from the same view (a sync boundary)."""
    view = holders_of(choices, units)
    return {
        p: choose_units(
            me=p,
            held=held,
            units=units,
            holders=view,
            capacity=capacity.get(p, 1) if isinstance(capacity, dict) else capacity,
            target=target,
            hysteresis=hysteresis,
        )
        for p, held in choices.items()
    }


def settle(choices, capacity=1, rounds=10, **kw):
    for _ in range(rounds):
        new = evaluate_all(choices, capacity, **kw)
        if new == choices:
            return choices
        choices = new
    raise AssertionError(f"claims did not settle in {rounds} rounds: {choices}")


def test_sequential_joins_spread_evenly():
    choices: dict[str, set[str]] = {}
    for i in range(12):
        me = f"peer-{i}"
        choices[me] = choose_units(
            me=me, held=(), units=UNITS, holders=holders_of(choices), capacity=1, target=3
        )
    counts = sorted(len(h) for h in holders_of(choices).values())
    assert counts == [3, 3, 3, 3]


def test_first_peer_takes_an_uncovered_unit_and_late_joiner_fills_the_gap():
    choices = {"a": {"experts/0"}, "b": {"experts/1"}, "c": {"experts/2"}, "d": {"experts/0"}}
    got = choose_units(me="e", held=(), units=UNITS, holders=holders_of(choices), capacity=1, target=2)
    assert got == {"experts/3"}


def test_simultaneous_joins_cover_everything_after_one_boundary_and_stay_put():
    peers = [f"p{i}" for i in range(6)]
    empty = holders_of({})
    choices = {
        p: choose_units(me=p, held=(), units=UNITS, holders=empty, capacity=1, target=2) for p in peers
    }
    settled = settle(choices)
    assert all(len(h) >= 1 for h in holders_of(settled).values())
    assert evaluate_all(settled, 1) == settled  # no flapping


def test_everyone_but_one_leaving():
    choices = settle({f"p{i}": set() for i in range(8)}, capacity=1)
    survivor = {"p3": choices["p3"]}
    # a peer with room for every unit takes the uncovered ones at its next boundary
    after = evaluate_all(survivor, capacity=4)
    assert after["p3"] == set(UNITS)
    # a peer with room for one keeps its unit: moving would only uncover it
    assert evaluate_all(survivor, capacity=1) == survivor


def test_uncovered_unit_is_taken_over_by_a_holder_of_an_over_covered_one():
    choices = {"a": {"experts/0"}, "b": {"experts/0"}, "c": {"experts/1"}, "d": {"experts/2"}}
    after = evaluate_all(choices, capacity=1)
    assert holders_of(after)["experts/3"], after
    assert sum(after[p] != choices[p] for p in choices) == 1  # exactly one peer moved
    assert holders_of(after)["experts/0"]  # and it did not uncover what it left


def test_hysteresis_prevents_small_rebalances():
    # 3 vs 1 holders: a gap of 2 is not worth a move with hysteresis 1, but is with hysteresis 0
    choices = {"a": {"experts/0"}, "b": {"experts/0"}, "c": {"experts/0"}, "d": {"experts/1"}}
    two_units = UNITS[:2]
    assert evaluate_all(choices, 1, target=3, hysteresis=1, units=two_units) == choices
    moved = evaluate_all(choices, 1, target=3, hysteresis=0, units=two_units)
    assert sorted(len(h) for h in holders_of(moved, two_units).values()) == [2, 2]


def test_uneven_capacities():
    capacity = {"big": 3, "s1": 1, "s2": 1}
    choices = {p: set() for p in capacity}
    choices["big"] = choose_units(
        me="big", held=(), units=UNITS, holders=holders_of({}), capacity=3, target=1
    )
    for p in ("s1", "s2"):
        choices[p] = choose_units(
            me=p, held=(), units=UNITS, holders=holders_of(choices), capacity=1, target=1
        )
    assert len(choices["big"]) == 3
    assert all(holders_of(choices).values())
    settled = settle(choices, capacity=capacity, target=1)
    assert all(holders_of(settled).values())  # every unit keeps a holder
    assert {p: len(u) for p, u in settled.items()} == capacity  # and every peer fills its capacity
    # the big peer shrinks: it drops what others also hold first
    shrunk = choose_units(
        me="big", held=choices["big"], units=UNITS, holders=holders_of(choices), capacity=1, target=1
    )
    assert len(shrunk) == 1


def test_plan_is_deterministic_and_moves_each_peer_at_most_once():
    holders = {
        "experts/0": {"a", "b", "c", "d", "e"},
        "experts/1": set(),
        "experts/2": set(),
        "experts/3": {"f"},
    }
    moves = plan_moves(holders, target=2, hysteresis=1)
    assert moves == plan_moves(
        {u: set(reversed(sorted(h))) for u, h in holders.items()}, target=2, hysteresis=1
    )
    assert len({p for p, _, _ in moves}) == len(moves)
    assert {dst for _, _, dst in moves} >= {"experts/1", "experts/2"}


@settings(max_examples=60, deadline=None)
@given(n_peers=st.integers(1, 10), n_units=st.integers(1, 6), seed=st.integers(0, 1000))
def test_random_joins_and_departures_keep_every_unit_covered_when_possible(n_peers, n_units, seed):
    rng = random.Random(seed)
    units = [f"experts/{i}" for i in range(n_units)]
    choices: dict[str, set[str]] = {}
    next_id = 0
    for _ in range(12):
        if choices and rng.random() < 0.4:
            del choices[rng.choice(sorted(choices))]
        while len(choices) < n_peers and rng.random() < 0.7:
            me, next_id = f"p{next_id}", next_id + 1
            choices[me] = choose_units(
                me=me, held=(), units=units, holders=holders_of(choices, units), capacity=1, target=2
            )
        choices = settle(choices, units=units)
        covered = sum(1 for h in holders_of(choices, units).values() if h)
        assert covered == min(len(choices), n_units)


def one_boundary_in_turn(choices: dict[str, set[str]], capacity: int) -> dict[str, set[str]]:
    """Every peer re-evaluates once, one after another, each seeing the claims made before it."""
    moved: set[str] = set()
    for peer in sorted(choices):
        new = choose_units(
            me=peer,
            held=choices[peer],
            units=UNITS,
            holders=holders_of(choices),
            capacity=capacity,
            target=2,
            settled=moved,
        )
        if new != choices[peer]:
            moved.add(peer)
        choices = {**choices, peer: new}
    return choices


@settings(max_examples=40, deadline=None)
@given(names=st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=2, max_size=2, unique=True))
def test_peers_that_evaluate_in_turn_still_cover_everything(names):
    """Two peers holding the same two units, two units uncovered: one boundary later, all are covered, also
    when each peer sees the other's new claims (a peer that moved is not planned to move again)."""
    choices = {p: {"experts/0", "experts/1"} for p in names}
    assert all(holders_of(one_boundary_in_turn(choices, 2)).values())


def test_a_peer_of_capacity_zero_holds_no_shard_and_is_never_moved():
    holders = {"experts/0": {"a"}, "experts/1": set()}
    assert (
        choose_units(me="z", held=(), units=sorted(holders), holders=holders, capacity=0, target=2) == set()
    )


def test_a_holder_that_claims_more_than_it_serves_is_not_counted_once_it_is_failing():
    """A peer that declares capacity for every shard and claims them all passes the records' checks; it
    inflates every shard's coverage, so that a shard with one honest holder looks replicated. Once
    refreshes report it failing (``sync.refresh``), claims count the shards' other holders alone."""
    holders = {"experts/0": {"fake", "p0", "p1", "p2", "p4"}, "experts/1": {"fake", "p3"}}
    delivery = Delivery()

    def choices() -> dict[str, set[str]]:
        held = {p: {u for u, h in holders.items() if p in h} for p in ("p0", "p1", "p2", "p3", "p4")}
        view = delivery.delivering(holders, set())
        return {
            p: choose_units(me=p, held=h, units=sorted(holders), holders=view, capacity=1, target=2)
            for p, h in held.items()
        }

    assert choices() == {p: {u for u, h in holders.items() if p in h} for p in choices()}  # nobody moves
    delivery.failing = {u: {"fake"} for u in holders}
    after = choices()
    assert sorted(len([p for p, h in after.items() if u in h]) for u in holders) == [2, 3], after
