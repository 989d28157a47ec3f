import pytest
import torch

from spes_p2p.swarm.aggregate import (
    Contribution,
    Fetched,
    OuterStep,
    averaged,
    decide,
    resynchronized,
    weighted_mean,
)
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
    fetched = [Fetched(contribution("b", 300, 3.0), base="s0")]
    late = [contribution("c", 100, -2.0, round_=4)]
    decision = decide("s0", own, fetched, late)
    assert not decision.resync
    assert [c.peer_id for c in decision.contributions] == ["a", "b", "c"]
    start, end = {"w": torch.zeros(3)}, {"w": torch.full((3,), 9.0)}
    new = averaged(start, end, decision.contributions, OuterStep())
    assert torch.equal(new["w"], torch.full((3,), (100 * 1 + 300 * 3 - 100 * 2) / 500))


def test_a_newcomer_adopts_the_others_result_and_alone_a_peer_keeps_its_own():
    fetched = [Fetched(contribution("b", 300, 3.0), base="s0")]
    decision = decide("s0", None, fetched, [])
    assert [c.peer_id for c in decision.contributions] == ["b"]
    start, end = {"w": torch.zeros(3)}, {"w": torch.full((3,), 9.0)}
    assert torch.equal(averaged(start, end, decision.contributions, OuterStep())["w"], torch.full((3,), 3.0))
    nobody = decide("s0", None, [], [])
    assert torch.equal(averaged(start, end, nobody.contributions, OuterStep())["w"], end["w"])


def test_another_base_means_resynchronizing_from_end_weights():
    own = contribution("a", 100, 1.0)
    fetched = [
        Fetched(contribution("b", 300, 3.0), base="s0"),
        Fetched(contribution("c", 100, 5.0), base="s9"),
    ]
    decision = decide("s0", own, fetched, [contribution("d", 50, 7.0)])
    assert decision.resync and decision.contributions == []
    assert [c.peer_id for c in decision.resync_from] == ["b", "c"]  # late updates do not mix in
    ends = [contribution("a", 100, 10.0), contribution("b", 300, 30.0)]
    assert torch.equal(resynchronized({"w": torch.zeros(3)}, ends)["w"], torch.full((3,), 25.0))
