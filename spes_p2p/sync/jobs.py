"""One unit's round as the sync takes it, and how it ended.

``UnitJob`` is built once, by the peer, from what its training thread handed over (the unit's start and end
weights, the tokens) and what the swarm says (who exchanges it, whether this peer's update counts); the
sync passes it along unchanged. ``UnitResult`` is what the exchange reports back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from spes_p2p.sync.payload import all_finite, tensors_hash
from spes_p2p.sync.screening import Probe

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class UnitJob:
    """One unit's round. ``participants``: the peers that exchange it, this one included when it counts;
    for a ``grouped`` unit (the dense part) our row of the round's ``grid`` (``exchange.dense_grid``: all
    the unit's participants in random rows, in the order every participant computes alike). ``counted``
    is False in a newcomer's first round: its update is neither announced nor combined, and it adopts the
    others' result."""

    round: int
    unit: str
    start: Tensors  # where our update is measured from (the synced weights of the round before)
    end: Tensors  # our weights at the end of the round's training
    tokens: int  # what our update was trained on
    participants: tuple[str, ...]
    counted: bool = True
    grouped: bool = False
    probe: Probe | None = None  # the validation loss of candidate weights for the unit (screening.Probe)
    grid: tuple[tuple[str, ...], ...] = ()  # a grouped unit's rows (ours is ``participants``); () = ours only

    def __post_init__(self) -> None:
        object.__setattr__(self, "participants", tuple(self.participants))
        object.__setattr__(self, "grid", tuple(map(tuple, self.grid)) or (self.participants,))

    @property
    def row(self) -> int:
        """Our row's place in the grid."""
        return self.grid.index(self.participants)

    @property
    def parts(self) -> int:
        """How many parts a reduce-scatter splits the unit into: one per member of the grid's longest row."""
        return max(map(len, self.grid))

    @cached_property
    def base(self) -> str:
        """The hash of our start weights: participants on the same base can combine their updates."""
        return tensors_hash(self.start)

    @cached_property
    def update(self) -> Tensors:
        return {n: self.end[n] - self.start[n] for n in self.start}

    @cached_property
    def diverged(self) -> bool:
        """Whether our update is not finite: it is not sent, and we take the others' result."""
        return not all_finite(self.update.values())

    def others(self, me: str) -> list[str]:
        return sorted(set(self.participants) - {me})


@dataclass
class UnitResult:
    """What one unit's exchange did in one round."""

    unit: str
    participants: list[str]  # peers whose updates were aggregated (this one included)
    missing: list[str]  # expected participants that did not answer in time
    rejected: list[str]  # peers whose payloads failed validation, or whose updates were outliers
    left_out: list[str] = field(default_factory=list)  # peers whose updates screening left out, not refused
    apart: list[str] = field(default_factory=list)  # peers whose updates started from other weights
    resynced: bool = False  # start weights differed, so end weights were averaged instead
    diverged: bool = False  # our update was not finite: not sent; we took the others' result
    download_from: list[str] = field(default_factory=list)  # take this round's result from one of them
    scores: dict[str, float] = field(default_factory=dict)  # peer -> the validation loss its update took off
    new_weights: Tensors = field(default_factory=dict)
