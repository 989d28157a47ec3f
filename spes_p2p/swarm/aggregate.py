"""Aggregation of a unit's updates and the outer step, as pure functions of tensors.

Every holder of a unit runs these on the same decoded contributions in the same order (sorted by peer id), so
holders that aggregated the same set of updates end with bit-identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

OUTER_RULES = ("fedavg", "nesterov")


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
