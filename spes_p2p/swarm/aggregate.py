"""Aggregation of a unit's updates and the outer step, as pure functions of tensors.

Every holder of a unit runs these on the same decoded contributions in the same order (sorted by peer id), so
holders that aggregated the same set of updates end with bit-identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spes_p2p.swarm.config import OUTER_RULES


@dataclass(frozen=True)
class Contribution:
    peer_id: str
    tokens: int  # weight in the mean: the tokens this peer trained on in the round
    tensors: dict[str, torch.Tensor]
    round: int = 0


def weighted_mean(contributions: list[Contribution]) -> dict[str, torch.Tensor]:
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


@dataclass
class OuterStep:
    """The outer rule applied to a unit: FedAvg (SPES: lr 1, no momentum) or Nesterov momentum (DiLoCo)."""

    rule: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rule not in OUTER_RULES:
            raise ValueError(f"unknown outer rule {self.rule!r}; choose one of {', '.join(OUTER_RULES)}")

    def apply(
        self, base: dict[str, torch.Tensor], mean_update: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
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
class Fetched:
    """Another participant's update, and the hash of the start weights it was measured from."""

    contribution: Contribution
    base: str


@dataclass(frozen=True)
class Decision:
    """How a unit's round ends: the updates to average on our start weights, or (when a participant started
    from other weights, so deltas cannot be mixed) the participants whose end weights to average instead."""

    resync: bool
    contributions: list[Contribution]  # average: every update that counts, ours first
    resync_from: list[Contribution]  # resync: the participants (their tokens; end weights fetched later)


def decide(
    our_base: str, own: Contribution | None, fetched: list[Fetched], late: list[Contribution]
) -> Decision:
    """Which contributions a round combines, and how. ``own`` is None when this peer's update does not count
    (a newcomer's first round): it then adopts the others' result, exactly as they compute it."""
    if all(f.base == our_base for f in fetched):
        contributions = ([own] if own else []) + [f.contribution for f in fetched] + late
        return Decision(False, contributions, [])
    return Decision(True, [], [f.contribution for f in fetched])


def averaged(
    start: dict[str, torch.Tensor],
    end: dict[str, torch.Tensor],
    contributions: list[Contribution],
    outer: OuterStep,
) -> dict[str, torch.Tensor]:
    """The new weights from averaged updates; our own end weights when nobody contributed."""
    if not contributions:
        return {n: t.clone() for n, t in end.items()}
    return outer.apply(start, weighted_mean(contributions))


def resynchronized(end: dict[str, torch.Tensor], ends: list[Contribution]) -> dict[str, torch.Tensor]:
    """The new weights when re-synchronizing: the token-weighted mean of the participants' end weights."""
    return weighted_mean(ends) if ends else {n: t.clone() for n, t in end.items()}
