"""What the training thread hands the sync at the end of a round, and gets back when it lands: snapshots of
the trained units at the round's start and end (and of the frozen experts, when a merge is due), its
tokens and metrics; then each unit's result and the refreshed copies of the others.

A job belongs to the sync thread from ``Pipeline.submit`` until ``Pipeline.take`` returns it to the
training thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from spes_p2p.sync.jobs import UnitResult
from spes_p2p.sync.versions import Download

Tensors = dict[str, torch.Tensor]


@dataclass
class RoundJob:
    round: int
    units: list[str]  # the units trained this round
    start: dict[str, Tensors]  # where each unit's update is measured from
    end: dict[str, Tensors]  # the local end-of-round weights
    tokens: int
    metrics: dict
    experts: Tensors | None = None  # when a merge is due: the frozen experts a change adds to (or {})
    results: dict[str, UnitResult] = field(default_factory=dict)  # trained units
    refreshed: dict[str, Download] = field(default_factory=dict)  # frozen copies, and units trained next
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def held(self) -> dict[str, list]:
        results = [r.new_weights for r in list(self.results.values())]
        return {
            "snapshots": [self.start, self.end, self.experts or {}, results],
            "received": [f.payload for f in list(self.refreshed.values())],
        }
