"""Screening of co-holders' updates (sync/screening.py): free-riders, agreement and the loss probe, decided
alike by every holder, whoever's update is whose."""

import torch

from spes_p2p.sync.aggregate import Contribution
from spes_p2p.sync.screening import NOISE, screen

N = 100_000  # noise's cosine with anything is about 1 / sqrt(N)
START = {"w": torch.zeros(N)}
TARGET = torch.linspace(-1, 1, N)  # the weights that minimize the probe's loss


def probe(candidates):
    """A loss every holder measures alike: the distance to TARGET."""
    return [float((START["w"] - TARGET).pow(2).mean())] + [
        float((c["w"] - TARGET).pow(2).mean()) for c in candidates
    ]


def honest(seed: int, tokens: int = 100) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.1 * TARGET + 0.05 * torch.randn(N, generator=g)  # toward the target, with its own noise


def update(peer: str, t: torch.Tensor, tokens: int = 100) -> Contribution:
    return Contribution(peer, tokens, {"w": t})


def decided(updates, with_probe=True):
    out = screen(updates, START, probe if with_probe else None)
    return sorted(c.peer_id for c in out.kept), out


def test_honest_updates_all_count_and_the_order_they_come_in_does_not_matter():
    updates = [update("a", honest(0)), update("b", honest(1)), update("c", honest(2))]
    kept, out = decided(updates)
    assert kept == ["a", "b", "c"] and not out.refused
    assert all(s > 0 for s in out.scores.values())
    assert decided(updates[::-1])[0] == kept
    weights = {c.peer_id: c.tokens for c in out.kept}
    assert max(weights.values()) == 100 and min(weights.values()) > 50  # all take loss off: over half


def test_a_flipped_a_half_flipped_and_a_zero_update_are_refused_and_noise_left_out_among_two_or_three():
    noise = torch.randn(N) * honest(5).norm() / N**0.5
    for bad in (-honest(5), -0.5 * honest(5), 0 * TARGET, noise):
        for holders in (["a"], ["a", "b"]):
            updates = [update(p, honest(i)) for i, p in enumerate(holders)] + [update("m", bad)]
            for order in (updates, updates[::-1]):  # (each holder's own is a different one of them)
                kept, out = decided(order)
                assert kept == holders, (bad[:3], holders, out)
                # noise is no evidence against its peer: an honest update on other data agrees with none too
                assert ("m" in out.left_out) == (bad is noise) != ("m" in out.refused), (bad[:3], out)


def test_a_copy_counts_once_and_the_copier_is_refused():
    original = honest(0)
    kept, out = decided([update("a", original), update("b", honest(1)), update("c", original + 1e-6)])
    assert kept == ["a", "b"] and out.refused["c"] == "its update is a copy of a's"


def test_without_a_probe_two_updates_that_point_apart_are_both_left_out():
    kept, out = decided([update("a", honest(0)), update("m", -honest(0) * 0.5)], with_probe=False)
    assert kept == [] and set(out.left_out) == {"a", "m"} and not out.refused  # (which is the flip?)
    kept, _ = decided([update("a", honest(0)), update("b", honest(1))], with_probe=False)
    assert kept == ["a", "b"]


def test_an_update_that_agrees_but_adds_more_loss_than_the_best_takes_off_is_refused():
    bent = honest(1) + 6 * (torch.rand(N) - 0.5)  # points along the others, and is mostly harm
    kept, out = decided([update("a", honest(0)), update("b", honest(2)), update("m", bent)])
    assert kept == ["a", "b"] and out.scores["m"] < -10 * max(out.scores["a"], out.scores["b"])
    assert "to the validation loss" in out.refused["m"]


def test_updates_that_pass_keep_their_token_weights():
    _, out = decided([update("a", honest(0), 100), update("b", 0.2 * honest(1), 300)])
    assert {c.peer_id: c.tokens for c in out.kept} == {"a": 100, "b": 300}


STEP = 5e-5


def weak(seed: int) -> torch.Tensor:
    """An honest update of few steps: a sliver toward the target in its own noise, which agrees with no
    other update (cosine about 0.015) and takes off 1e-4 of the probe's loss (between TIE and NOISE)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(N, generator=g)
    noise -= (noise @ TARGET) / (TARGET @ TARGET) * TARGET  # (orthogonal to the target)
    return STEP * (TARGET + 8 * noise / noise.norm() * TARGET.norm())


def test_of_two_holders_noise_goes_even_when_the_honest_update_takes_little_loss_off():
    noise = torch.randn(N) * weak(0).norm() / N**0.5
    kept, out = decided([update("a", weak(0)), update("m", noise)])
    assert 0 < out.scores["a"] - out.scores["m"] < NOISE * probe([])[0]  # rule 3 cannot judge it
    assert kept == ["a"] and "m" in out.left_out  # (no evidence against its peer: see below)


def test_updates_that_agree_with_none_and_take_off_as_much_all_stay():
    a, b = weak(1), weak(2)
    b -= (b @ a - STEP**2 * TARGET @ TARGET) / (a @ a) * a  # (b's noise orthogonal to a's too)
    b *= a.norm() / b.norm()
    kept, out = decided([update("a", a), update("b", b)])
    assert abs(out.scores["a"] - out.scores["b"]) < 1e-6 and kept == ["a", "b"]  # (float32 rounding)


def test_sparse_updates_agree_on_the_entries_they_share_and_a_flipped_one_is_not_kept():
    """A sparse codec's updates (each peer's top 1.5% a chunk) share few entries, so their plain cosine is
    near zero even when they agree; on the entries both carry, honest ones agree and a flip does not."""
    from spes_p2p.sync.codecs import SparseLoCo
    from spes_p2p.sync.payload import decode, encode, specs_of
    from spes_p2p.sync.screening import AGREE_MIN, agreement, cosine

    codec = SparseLoCo()

    def sparse(t: torch.Tensor) -> torch.Tensor:
        return decode(encode({"w": t}, codec), specs_of({"w": t}), codec)["w"]

    a, b, c = (
        sparse(0.02 * TARGET + 0.05 * torch.randn(N, generator=torch.Generator().manual_seed(s)))
        for s in (1, 2, 3)
    )
    assert cosine({"w": a}, {"w": b}) < AGREE_MIN < agreement({"w": a}, {"w": b})
    assert agreement({"w": a}, {"w": -b}) < -AGREE_MIN
    kept, out = decided(
        [update("p0", a), update("p1", b), update("p2", c), update("p3", -sparse(honest(4)))], False
    )
    # (it points against the others by less than a flip of an update that agrees as much as theirs:
    # theirs is mostly noise, so it is left out, not refused)
    assert kept == ["p0", "p1", "p2"] and "p3" in {**out.refused, **out.left_out}


def test_honest_updates_on_differing_data_are_left_out_at_most_never_refused():
    """Later in a run, on data that differs between peers, honest co-holders' updates agree with none
    (cosines of -0.03 to 0.02 measured) and one may add loss on the probe's batch: two such refusals in a
    row banned honest peers. What takes loss off is kept; the rest is left out, on no evidence against its
    peer."""
    a, b = weak(1), -weak(2)  # (b: a sliver away from the target; its cosine with a is about -0.015)
    kept, out = decided([update("a", a), update("b", b)])
    assert kept == ["a"] and "b" in out.left_out and not out.refused
    kept, out = decided([update("a", a), update("b", b)], with_probe=False)
    assert kept == ["a", "b"] and not out.refused  # (no probe: neither points against the other)
    # beside two that agree: one pointing a little against them (cosine about -0.09, a flip of an honest
    # update measures -0.24 or less) is left out, not refused
    kept, out = decided([update("a", honest(0)), update("b", honest(1)), update("c", -weak(3))])
    assert kept == ["a", "b"] and "c" in out.left_out and not out.refused


def test_an_update_that_adds_more_than_ten_times_what_the_best_takes_off_but_little_of_the_loss_stays():
    """Later in a run, an honest update added 1.0% of the probe batch's loss while the best took 0.1% off:
    only gross harm is refused, beyond ``HARM_FLOOR`` of the loss too."""
    from spes_p2p.sync.screening import HARM_FLOOR

    base = probe([])[0]
    small = 0.0005 * TARGET  # takes 0.1% of the loss off
    g = torch.Generator().manual_seed(0)
    noisy = 0.05 * TARGET + 0.194 * torch.randn(N, generator=g)  # agrees, and adds 1.5% of the loss
    kept, out = decided([update("a", small), update("b", noisy)])
    assert -HARM_FLOOR * base < out.scores["b"] < -10 * out.scores["a"] < 0 and kept == ["a", "b"]
