"""Aggregation of a unit's updates and the outer step, as pure functions of tensors.

Every holder of a unit runs these on the same decoded contributions in the same order (sorted by peer id), so
holders that aggregated the same set of updates end with bit-identical weights.

Updates come from strangers, so a round's combination is robust (docs/security.md):

- an update whose norm is beyond ``REJECT_FACTOR`` times the round's reference norm is rejected, whatever the
  rule; the reference is the median norm of the round's updates or, when there are fewer than three (two
  cannot outvote each other), this peer's own, or the smaller norm when ours is not among them; token
  counts are capped alike, at ``TOKEN_FACTOR`` times the median (or own, or smaller) count;
- the rule (``method.aggregate``): ``mean`` (token-weighted), ``clipped_mean`` (each update's norm clipped
  to ``CLIP_FACTOR`` times the reference, then the token-weighted mean; the default), ``trimmed_mean`` (per
  coordinate, the mean of what is left when the largest and smallest quarter are dropped) or ``median`` (per
  coordinate); the last two ignore token counts;
- the result must be finite and no longer than the root-sum-square of the updates' norms, which any of the
  rules guarantees: a result that is not is a bug, raised as ``AggregationError``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from spes_p2p.errors import SpesError
from spes_p2p.sync.config import AGGREGATES, OUTER_RULES

REJECT_FACTOR = 10.0
CLIP_FACTOR = 2.0
TOKEN_FACTOR = 4.0  # no update weighs more than this many times the round's median token count
TRIM_FRACTION = 0.25
RESYNC_FACTOR = 10.0  # re-sync moves toward end weights at most this many own-update norms away

Tensors = dict[str, torch.Tensor]


class AggregationError(SpesError):
    """A round's result that is not finite or not bounded by its inputs."""


@dataclass(frozen=True)
class Contribution:
    peer_id: str
    tokens: int  # weight in the mean: the tokens this peer trained on in the round
    tensors: Tensors
    round: int = 0


def norm_of(tensors: Tensors) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors.values()))


def weighted_mean(contributions: list[Contribution]) -> Tensors:
    """Token-weighted mean of the contributions' tensors, summed in peer-id order."""
    if not contributions:
        raise ValueError("nothing to aggregate")
    ordered = sorted(contributions, key=lambda c: (c.peer_id, c.round))
    total = sum(max(c.tokens, 0) for c in ordered)
    weights = [c.tokens / total if total > 0 else 1 / len(ordered) for c in ordered]
    mean = {}
    for name in ordered[0].tensors:
        acc = torch.zeros_like(ordered[0].tensors[name], dtype=torch.float32)
        for w, c in zip(weights, ordered, strict=True):
            acc.add_(c.tensors[name].float(), alpha=w)
        mean[name] = acc
    return mean


@dataclass(frozen=True)
class Combined:
    """A round's combined update, and the peers whose updates were rejected as outliers."""

    update: Tensors
    used: list[Contribution]
    rejected: list[str]


def combine(contributions: list[Contribution], method: str, own: str | None = None) -> Combined:
    """The contributions combined by ``method``; ``own`` is this peer's id when its update is among them."""
    if method not in AGGREGATES:
        raise ValueError(f"unknown aggregate {method!r}; choose one of {', '.join(AGGREGATES)}")
    ordered = _capped_tokens(sorted(contributions, key=lambda c: (c.peer_id, c.round)), own)
    norms = [norm_of(c.tensors) for c in ordered]
    reference = _reference(ordered, norms, own)
    bound = REJECT_FACTOR * reference if reference > 0 else math.inf
    kept = [(c, n) for c, n in zip(ordered, norms, strict=True) if n <= bound]
    rejected = [c.peer_id for c, n in zip(ordered, norms, strict=True) if not n <= bound]  # NaN too
    if not kept:
        return Combined({}, [], rejected)
    limit = CLIP_FACTOR * reference if method == "clipped_mean" and reference > 0 else math.inf
    used = [_scaled(c, limit / n) if n > limit else c for c, n in kept]
    update = _RULES[method](used)
    _check_bounded(update, [norm_of(c.tensors) for c in used])
    return Combined(update, used, rejected)


def _capped_tokens(ordered: list[Contribution], own: str | None) -> list[Contribution]:
    cap = TOKEN_FACTOR * max(_reference(ordered, [float(c.tokens) for c in ordered], own), 1.0)
    return [replace(c, tokens=int(min(c.tokens, cap))) for c in ordered]


def _reference(ordered: list[Contribution], norms: list[float], own: str | None) -> float:
    """The median of ``norms``; with fewer than three, which cannot outvote each other, our own when it is
    among them, else the smallest (a stranger's large value is never the yardstick of the others)."""
    mine = [n for c, n in zip(ordered, norms, strict=True) if c.peer_id == own]
    if len(ordered) < 3 and mine:
        return mine[0]
    finite = sorted(n for n in norms if math.isfinite(n))
    if not finite:
        return 0.0
    return _middle(finite) if len(ordered) >= 3 else finite[0]


def _middle(values):
    """The median of sorted ``values`` (floats, or tensors stacked on dim 0): the mean of the middle two when
    their count is even."""
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def _scaled(c: Contribution, factor: float) -> Contribution:
    return Contribution(c.peer_id, c.tokens, {n: t * factor for n, t in c.tensors.items()}, c.round)


def _coordinatewise(reduce):
    def rule(contributions: list[Contribution]) -> Tensors:
        names = contributions[0].tensors
        return {
            n: reduce(torch.stack([c.tensors[n].float() for c in contributions]).sort(0).values)
            for n in names
        }

    return rule


def _trimmed(stacked: torch.Tensor) -> torch.Tensor:
    n = stacked.shape[0]
    cut = max(1, int(n * TRIM_FRACTION)) if n >= 3 else 0
    return stacked[cut : n - cut].mean(0)


_RULES = {
    "mean": weighted_mean,
    "clipped_mean": weighted_mean,
    "trimmed_mean": _coordinatewise(_trimmed),
    "median": _coordinatewise(_middle),
}


def _check_bounded(update: Tensors, norms: list[float]) -> None:
    bound, norm = math.sqrt(sum(n * n for n in norms)), norm_of(update)
    if not math.isfinite(norm):  # (a NaN or an infinity anywhere makes the norm one)
        raise AggregationError("the combined update is not finite")
    if norm > bound * (1 + 1e-4) + 1e-6:
        raise AggregationError(f"the combined update's norm {norm:.3g} exceeds its inputs' {bound:.3g}")


@dataclass
class OuterStep:
    """The outer rule applied to a unit: FedAvg (SPES: lr 1, no momentum) or Nesterov momentum (DiLoCo)."""

    rule: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9
    buffers: Tensors = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rule not in OUTER_RULES:
            raise ValueError(f"unknown outer rule {self.rule!r}; choose one of {', '.join(OUTER_RULES)}")

    def apply(self, base: Tensors, mean_update: Tensors) -> Tensors:
        """New weights from the round's start weights and the mean update (end minus start weights)."""
        if self.rule == "fedavg":
            return {n: base[n] + self.lr * mean_update[n] for n in base}
        out = {}
        for name, b in base.items():
            grad = -mean_update[name]  # DiLoCo's outer gradient: start minus end weights
            buf = self.buffers.get(name)
            buf = grad.clone() if buf is None else buf.mul_(self.momentum).add_(grad)
            self.buffers[name] = buf
            out[name] = b - self.lr * (grad + self.momentum * buf)
        return out


# ------------------------------------------------------------------------------------ a round's decision


@dataclass(frozen=True)
class Received:
    """Another participant's update, and the hash of the start weights it was measured from."""

    contribution: Contribution
    base: str


@dataclass(frozen=True)
class Decision:
    """How a unit's round ends. The participants' start weights (``base``) are counted, ours included: when
    ours alone is the most common, the updates measured from it are averaged on our start weights. Otherwise
    (ours is outnumbered, or tied) we re-synchronize: the end weights of the participants on the leading
    bases are averaged (ours too when our base is among them), which puts everyone on one base again."""

    resync: bool
    contributions: list[Contribution]  # average: every update that counts, ours first
    resync_from: list[Contribution]  # resync: the other participants whose end weights to average
    ours_leads: bool = True  # our base is among the leading ones (resync: our end weights are averaged too)
    differ: list[str] = field(default_factory=list)  # participants on another base, not averaged in


def decide(
    our_base: str, own: Contribution | None, received: list[Received], late: list[Contribution]
) -> Decision:
    """Which contributions a round combines, and how. ``own`` is None when this peer's update does not count
    (a newcomer's first round, or a diverged update): it then adopts the others' result."""
    counts = Counter([our_base] + [r.base for r in received])
    top = max(counts.values())
    leading = {b for b, n in counts.items() if n == top}
    if leading == {our_base}:
        same = [r.contribution for r in received if r.base == our_base]
        differ = sorted(r.contribution.peer_id for r in received if r.base != our_base)
        return Decision(False, ([own] if own else []) + same + late, [], differ=differ)
    return Decision(
        True,
        [],
        [r.contribution for r in received if r.base in leading],
        ours_leads=our_base in leading,
        differ=sorted(r.contribution.peer_id for r in received if r.base not in leading),
    )


def averaged(
    start: Tensors,
    fallback: Tensors,
    contributions: list[Contribution],
    outer: OuterStep,
    method: str = "mean",
    own: str | None = None,
) -> tuple[Tensors, list[str]]:
    """The new weights from the combined updates, and who was rejected; ``fallback`` when none is left."""
    combined = combine(contributions, method, own) if contributions else Combined({}, [], [])
    if not combined.used:
        return {n: t.clone() for n, t in fallback.items()}, combined.rejected
    return outer.apply(start, combined.update), combined.rejected


def resynchronized(
    end: Tensors, ends: list[Contribution], reach: float = math.inf
) -> tuple[Tensors, list[str]]:
    """The token-weighted mean of the participants' end weights that lie within ``reach`` of ours (a peer
    cannot drag the others arbitrarily far), and who was too far; ours when none is within reach."""
    distances = [norm_of({n: c.tensors[n] - end[n] for n in end}) for c in ends]
    near = [c for c, d in zip(ends, distances, strict=True) if d <= reach]
    far = sorted(c.peer_id for c, d in zip(ends, distances, strict=True) if d > reach)
    if not near:
        return {n: t.clone() for n, t in end.items()}, far
    return weighted_mean(near), far
