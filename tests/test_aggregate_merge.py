import pytest
import torch

from spes_p2p.sync.aggregate import (
    Contribution,
    OuterStep,
    Received,
    averaged,
    combine,
    decide,
    resynchronized,
    weighted_mean,
)
from spes_p2p.sync.config import AGGREGATES
from spes_p2p.train.config import MergeConfig
from spes_p2p.train.merge import merge_layer


def test_weighted_mean_weights_by_tokens_and_ignores_order():
    a = Contribution("a", 100, {"w": torch.tensor([1.0, 0.0])})
    b = Contribution("b", 300, {"w": torch.tensor([5.0, 4.0])})
    c = Contribution("c", 600, {"w": torch.tensor([0.1, 0.3])})
    mean = weighted_mean([a, b, c])
    torch.testing.assert_close(mean["w"], torch.tensor([0.1 * 1 + 0.3 * 5 + 0.6 * 0.1, 0.3 * 4 + 0.6 * 0.3]))
    assert torch.equal(mean["w"], weighted_mean([c, a, b])["w"])  # bit-identical whatever the arrival order


def test_fedavg_and_nesterov_outer_steps():
    base = {"w": torch.tensor([1.0, 1.0])}
    mean_update = {"w": torch.tensor([0.5, -0.5])}
    assert torch.equal(OuterStep("fedavg").apply(base, mean_update)["w"], torch.tensor([1.5, 0.5]))
    nesterov = OuterStep("nesterov", lr=0.7, momentum=0.9)
    first = nesterov.apply(base, mean_update)["w"]
    g = -mean_update["w"]  # buffer = g after the first step
    torch.testing.assert_close(first, base["w"] - 0.7 * (g + 0.9 * g))
    second = nesterov.apply(base, mean_update)["w"]
    buf = 0.9 * g + g
    torch.testing.assert_close(second, base["w"] - 0.7 * (g + 0.9 * buf))
    with pytest.raises(ValueError, match="unknown outer rule"):
        OuterStep("adam")


def test_merge_schedule():
    cfg = MergeConfig(interval=200, alpha=0.1, horizon=2000)
    assert (
        cfg.alpha_at(0) == pytest.approx(0.1)
        and cfg.alpha_at(1000) == pytest.approx(0.05)
        and cfg.alpha_at(2000) == 0
    )
    assert cfg.due(200) and cfg.due(1800) and not cfg.due(2000) and not cfg.due(300) and not cfg.due(0)
    assert not MergeConfig(enabled=False).due(200)


def test_merge_pulls_each_expert_toward_its_nearest_neighbours():
    # experts 0 and 1 point the same way, 2 and 3 the other way; K = 1
    directions = [
        torch.tensor([1.0, 0.0]),
        torch.tensor([0.9, 0.1]),
        torch.tensor([0.0, 1.0]),
        torch.tensor([0.1, 1.0]),
    ]
    experts = [{"w1": d.clone(), "w2": torch.full((2,), float(i))} for i, d in enumerate(directions)]
    merged = merge_layer(experts, alpha=0.5, k=1)
    torch.testing.assert_close(merged[0]["w2"], torch.tensor([0.5, 0.5]))  # 0.5 * 0 + 0.5 * expert 1
    torch.testing.assert_close(
        merged[1]["w2"], torch.tensor([0.5, 0.5])
    )  # from pre-merge weights, not merged[0]
    torch.testing.assert_close(merged[2]["w2"], torch.tensor([2.5, 2.5]))
    torch.testing.assert_close(merged[3]["w1"], 0.5 * directions[3] + 0.5 * directions[2])
    assert torch.equal(experts[0]["w2"], torch.zeros(2))  # inputs untouched
    unchanged = merge_layer(experts, alpha=0.0, k=1)
    assert all(torch.equal(u["w1"], e["w1"]) for u, e in zip(unchanged, experts, strict=True))


# ------------------------------------------------------------------------ a round's decision, on values


def contribution(peer, tokens, value, round_=0):
    return Contribution(peer, tokens, {"w": torch.full((3,), float(value))}, round_)


def test_a_round_averages_updates_on_one_base_and_counts_late_ones():
    own = contribution("a", 100, 1.0)
    fetched = [Received(contribution("b", 300, 3.0), base="s0")]
    late = [contribution("c", 100, -2.0, round_=4)]
    decision = decide("s0", own, fetched, late)
    assert not decision.resync
    assert [c.peer_id for c in decision.contributions] == ["a", "b", "c"]
    start, end = {"w": torch.zeros(3)}, {"w": torch.full((3,), 9.0)}
    new, rejected = averaged(start, end, decision.contributions, OuterStep())
    assert torch.equal(new["w"], torch.full((3,), (100 * 1 + 300 * 3 - 100 * 2) / 500)) and rejected == []


def test_a_newcomer_adopts_the_others_result_and_alone_a_peer_keeps_its_own():
    fetched = [Received(contribution("b", 300, 3.0), base="s0")]
    decision = decide("s0", None, fetched, [])
    assert [c.peer_id for c in decision.contributions] == ["b"]
    start, end = {"w": torch.zeros(3)}, {"w": torch.full((3,), 9.0)}
    assert torch.equal(
        averaged(start, end, decision.contributions, OuterStep())[0]["w"], torch.full((3,), 3.0)
    )
    nobody = decide("s0", None, [], [])
    assert torch.equal(averaged(start, end, nobody.contributions, OuterStep())[0]["w"], end["w"])


def test_the_base_most_participants_share_wins_and_others_are_left_out():
    own = contribution("a", 100, 1.0)
    fetched = [
        Received(contribution("b", 300, 3.0), base="s0"),
        Received(contribution("c", 100, 5.0), base="s9"),
    ]
    outnumbered = decide("s0", own, fetched, [contribution("d", 50, 7.0)])
    assert not outnumbered.resync and outnumbered.differ == ["c"]
    assert [c.peer_id for c in outnumbered.contributions] == ["a", "b", "d"]
    # on the other side, c re-synchronizes toward the two on s0, without its own end weights
    other = decide(
        "s9", contribution("c", 100, 5.0), [Received(own, "s0"), Received(fetched[0].contribution, "s0")], []
    )
    assert other.resync and not other.ours_leads and [c.peer_id for c in other.resync_from] == ["a", "b"]
    # a tie: everyone's end weights, ours included (honest holders that missed a round meet halfway)
    tie = decide("s0", own, [fetched[1]], [contribution("d", 50, 7.0)])
    assert tie.resync and tie.ours_leads and [c.peer_id for c in tie.resync_from] == ["c"]
    ends = [contribution("a", 100, 10.0), contribution("c", 300, 30.0)]
    new, far = resynchronized({"w": torch.zeros(3)}, ends)
    assert torch.equal(new["w"], torch.full((3,), 25.0)) and far == []


def test_resynchronizing_ignores_end_weights_beyond_reach():
    end = {"w": torch.full((3,), 10.0)}
    ends = [contribution("a", 100, 10.0), contribution("b", 100, 12.0), contribution("x", 100, 1e6)]
    new, far = resynchronized(end, ends, reach=5.0)
    assert far == ["x"] and torch.equal(new["w"], torch.full((3,), 11.0))
    alone, far = resynchronized(end, ends[2:], reach=5.0)
    assert far == ["x"] and torch.equal(alone["w"], end["w"])


# ------------------------------------------------------------------------------ robust aggregation


def update(peer, values, tokens=100):
    return Contribution(peer, tokens, {"w": torch.tensor(values, dtype=torch.float32)})


HONEST = [update("a", [1.0, 2.0, 0.0]), update("b", [1.2, 1.8, 0.2]), update("c", [0.8, 2.2, -0.2])]


@pytest.mark.parametrize("method", AGGREGATES)
def test_an_update_scaled_a_thousandfold_is_rejected_under_every_rule(method):
    attacker = update("x", [1000.0, 2000.0, 0.0])
    combined = combine([*HONEST, attacker], method, own="a")
    assert combined.rejected == ["x"] and [c.peer_id for c in combined.used] == ["a", "b", "c"]
    torch.testing.assert_close(combined.update["w"], torch.tensor([1.0, 2.0, 0.0]))
    # two holders: the receiver measures against its own update
    pair = combine([HONEST[0], attacker], method, own="a")
    assert pair.rejected == ["x"] and torch.equal(pair.update["w"], HONEST[0].tensors["w"])
    # two strangers' updates, ours not among them (a part combined from its pieces, a newcomer's round):
    # the smaller one is the yardstick, in any order
    for pair in ([HONEST[1], attacker], [attacker, HONEST[1]]):
        combined = combine(pair, method)
        assert combined.rejected == ["x"] and torch.equal(combined.update["w"], HONEST[1].tensors["w"])


def test_no_update_weighs_more_than_four_times_the_median_token_count():
    ups = [
        update("a", [1.0], 100),
        update("b", [1.0], 100),
        update("c", [1.0], 120),
        update("x", [5.0], 10**15),
    ]
    # x weighs 4 x 110 (the median count) = 440 tokens: (100 + 100 + 120 + 440 * 5) / 760
    torch.testing.assert_close(combine(ups, "mean").update["w"], torch.tensor([2520 / 760]))
    pair = combine([update("a", [1.0], 100), update("x", [3.0], 10**15)], "mean", own="a")
    torch.testing.assert_close(pair.update["w"], torch.tensor([(100 + 400 * 3) / 500]))  # against its own
    pair = combine([update("b", [1.0], 100), update("x", [3.0], 10**15)], "mean")
    torch.testing.assert_close(pair.update["w"], torch.tensor([(100 + 400 * 3) / 500]))  # the smaller count


def test_each_rule_on_values():
    ups = [update("a", [1.0, 0.0]), update("b", [2.0, 0.0]), update("c", [3.0, 0.0]), update("d", [5.9, 0.0])]
    torch.testing.assert_close(combine(ups, "mean").update["w"], torch.tensor([11.9 / 4, 0.0]))
    torch.testing.assert_close(combine(ups, "median").update["w"], torch.tensor([2.5, 0.0]))
    torch.testing.assert_close(combine(ups, "trimmed_mean").update["w"], torch.tensor([2.5, 0.0]))
    # reference = median norm 2.5: d is clipped to norm 5 (2 x 2.5)
    torch.testing.assert_close(combine(ups, "clipped_mean").update["w"], torch.tensor([11.0 / 4, 0.0]))
    five = [*ups, update("e", [4.0, 0.0])]
    torch.testing.assert_close(combine(five, "trimmed_mean").update["w"], torch.tensor([3.0, 0.0]))


@pytest.mark.parametrize("method", ["median", "trimmed_mean"])
def test_a_sign_flip_barely_moves_the_coordinatewise_rules(method):
    flipped = update("x", [-1.0, -2.0, 0.0])
    result = combine([*HONEST, flipped], method).update["w"]
    assert (result - torch.tensor([1.0, 2.0, 0.0])).abs().max() <= 0.25


@pytest.mark.parametrize("method", AGGREGATES)
def test_robust_rules_give_bit_identical_results_in_any_order(method):
    ups = [
        update(p, torch.randn(50, generator=torch.Generator().manual_seed(i)).tolist())
        for i, p in enumerate("abcde")
    ]
    first = combine(ups, method).update["w"]
    assert torch.equal(first, combine(list(reversed(ups)), method).update["w"])


@pytest.mark.parametrize("method", AGGREGATES)
def test_a_non_finite_or_overflowing_update_is_rejected_never_combined(method):
    for bad in (float("inf"), float("nan"), 3e38):  # 3e38 is finite, but its squared norm is not
        combined = combine([update("a", [1.0]), update("b", [bad]), update("c", [3.0])], method)
        assert combined.rejected == ["b"] and torch.isfinite(combined.update["w"]).all()
