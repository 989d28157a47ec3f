"""Each contribution screened by its co-holders before a round combines it (docs/security.md, "Screening").

The norm bounds of ``aggregate.combine`` catch updates far off in size; what stays inside them is screened
here. Every rule is a function of what every holder of the unit has alike (the updates, and the loss they
give on a batch every peer picks alike), never of whose update is ours, so that holders keep the same
updates and stay bit-identical. An update that fails a rule is either **refused** (evidence against its
peer, toward a ban: ``Guard``) or **left out** of the round only (no evidence either way):

1. **free-riders** (refused): an update of zeros that claims tokens; of updates that are copies of each
   other (cosine above ``COPY_COSINE``) the first by peer id counts, the others are refused;
2. **agreement**: honest updates of one unit from one start point the same way early in a run (cosines of
   0.24 to 0.65; for sparse updates, the cosine over the entries both sent: ``agreement``). When some agree
   (cosine above ``AGREE_MIN``), an update that agrees with none is left out, unless the probe finds it
   taking loss off (``TIE``: beyond what holders' measurements differ by). When none agree (updates of so
   few steps that their noise hides their common direction, or a run's later rounds on data that differs
   between peers: honest co-holders' cosines measured -0.03 to 0.02 there), with a probe the updates that
   take loss off are kept (all when none does: the probe cannot tell them apart); without one, only those
   pointing against every other are left out. Only an update that points clearly against every other
   (cosine below ``-AGAINST``: a sign flip of an honest update) while others are kept is refused; one that
   merely agrees with none may be an honest peer's on other data (two such refusals in a row banned
   honest peers) or noise, and is only left out;
3. **the loss** (refused; ``Probe``: each update applied alone to the unit's start weights, the other units
   at their start weights too, on the round's probe batch of held-out data): where the best update takes
   more than the probe's noise off (``NOISE`` of the loss), one that adds ``HARM_FACTOR`` times more than
   the best takes off, and more than ``HARM_FLOOR`` of the loss, is refused (gross harm only). Kept
   updates keep their token weights: a weight from the probe, which each holder measures on a model whose
   frozen copies differ slightly, would part the holders' weights every round.

Peers whose frozen copies of other units differ slightly measure slightly different losses: a decision at
the very edge can then differ between holders, and their weights part; the start-weights vote of the next
round puts them back on one base (``aggregate.decide``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spes_p2p.sync.aggregate import Contribution, norm_of

COPY_COSINE = 0.99  # copies: honest updates of one unit, trained on different data, lie far below
NOISE = 2e-4  # of the probe loss: what an honest update of a round's end may add or take off on one batch
# of the probe loss: what holders' measurements of one update may differ by early in a run (their frozen
# copies of other units differ slightly); an update that agrees with none is kept only when it takes more
# than this off, so that every holder keeps the same (noise takes ~0 off, and honest updates of a round
# 2e-5 to 4e-4 of the loss: a margin of NOISE kept noise beside them). Later in a run, on data that
# differs between peers, holders' measurements of one update differed by up to 1% of the loss, each
# favouring its own update: there holders part, and re-synchronize (docs/benchmarks.md)
TIE = 2e-5
HARM_FACTOR = 10.0  # honest updates of a tiny model added up to 8 times what the best of their round took off
# ... and at least this much of the loss: later in a run, on data that differs between peers, an honest
# update added up to 1.0% of the loss on one probe batch while the best took 0.1% off (10.1 times: refused)
HARM_FLOOR = 0.05
AGREE_MIN = 0.02  # honest co-holders' updates measured 0.24 to 0.65; noise of a million entries ~0.001
AGAINST = 0.1  # a flip of an honest update: -0.24 to -0.65; honest updates on differing data: -0.03 or more

Tensors = dict[str, torch.Tensor]
Probe = Callable[[list[Tensors]], list[float]]
"""The probe batch's loss with the unit at its start weights, then with it at each of the given weights."""


@dataclass
class Screened:
    """What screening kept, refused and left out (peer -> why), and scored (peer -> the probe loss its
    update took off, negative when it added some)."""

    kept: list[Contribution]
    refused: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)


def screen(contributions: list[Contribution], start: Tensors, probe: Probe | None) -> Screened:
    """The contributions a round may combine; without a probe (pieces, virtual compute), rules 1 and 2
    only, and of two updates that point against each other neither is kept."""
    out = Screened([])
    rest = _without_free_riders(sorted(contributions, key=lambda c: (c.peer_id, c.round)), out)
    if len(rest) < 2:  # one update has nothing to agree with, nor a better one to be measured against
        out.kept = rest
        return out
    if probe is None:
        out.kept = _agreeing(rest, out, None)
        return out
    base, *losses = probe([{n: start[n] + c.tensors[n] for n in start} for c in rest])
    out.scores = {c.peer_id: base - loss for c, loss in zip(rest, losses, strict=True)}
    rest = _agreeing(rest, out, TIE * abs(base))
    noise = NOISE * abs(base)
    best = max(out.scores[c.peer_id] for c in rest)
    if not best > noise:  # (NaN too) the probe sees no update help: it cannot judge
        out.kept = rest
        return out
    harm = max(HARM_FACTOR * best, HARM_FLOOR * abs(base))
    for c in rest:
        gain = out.scores[c.peer_id]
        if gain >= -harm:
            out.kept.append(c)
        else:  # (NaN too)
            out.refused[c.peer_id] = f"it adds {-gain:.5f} to the validation loss (the best: -{best:.5f})"
    return out


def _without_free_riders(ordered: list[Contribution], out: Screened) -> list[Contribution]:
    kept: list[Contribution] = []
    for c in ordered:
        twin = next((k for k in kept if cosine(k.tensors, c.tensors) > COPY_COSINE), None)
        if c.tokens > 0 and norm_of(c.tensors) == 0:
            out.refused[c.peer_id] = "its update is all zeros"
        elif twin is not None:
            out.refused[c.peer_id] = f"its update is a copy of {twin.peer_id}'s"
        else:
            kept.append(c)
    return kept


def _agreeing(ordered: list[Contribution], out: Screened, margin: float | None) -> list[Contribution]:
    """Rule 2. ``margin``: how much loss an update must take off for the probe to tell that it helps (None:
    there is no probe). ``ordered`` holds two updates or more."""
    closest = {id(c): max(agreement(c.tensors, o.tensors) for o in ordered if o is not c) for c in ordered}
    helping = {id(c) for c in ordered if margin is not None and out.scores[c.peer_id] > margin}
    if any(a > AGREE_MIN for a in closest.values()):
        keep = [c for c in ordered if closest[id(c)] > AGREE_MIN or id(c) in helping]
    elif margin is not None:  # none agree: the probe tells them apart, when it can
        keep = [c for c in ordered if id(c) in helping] or ordered
    else:  # none agree, and nothing tells them apart: only what points against all the others goes
        keep = [c for c in ordered if closest[id(c)] >= -AGREE_MIN]
    for c in ordered:
        if any(k is c for k in keep):
            continue
        if closest[id(c)] < -AGAINST and keep:  # (it points against what was kept: the evidence is on it)
            out.refused[c.peer_id] = (
                f"its update points against every other (cosine {closest[id(c)]:.3f} at most)"
            )
        else:
            out.left_out[c.peer_id] = f"its update agrees with no other (cosine {closest[id(c)]:.3f} at most)"
    return keep


def agreement(a: Tensors, b: Tensors) -> float:
    """The cosine of two updates over the entries both carry: for dense updates their cosine; for sparse
    ones (a sparse codec's) it leaves out the entries only one of them sent, which would pull two honest
    updates' cosine toward zero the sparser they are (0 when they share no entry: no evidence either way)."""
    both = {n: (a[n] != 0) & (b[n] != 0) for n in a}
    return cosine({n: a[n] * both[n] for n in a}, {n: b[n] * both[n] for n in b})


def cosine(a: Tensors, b: Tensors) -> float:
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in a)
    norms = norm_of(a) * norm_of(b)
    return dot / norms if norms > 0 and math.isfinite(norms) else 0.0
