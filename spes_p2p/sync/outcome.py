"""What one unit's round did, as the exchange (``exchange.py``) and the reduce-scatter (``reduce.py``)
report it, and the limits they share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

MISS_LIMIT = 3  # rounds in a row a participant may miss before the rounds stop waiting for it

Tensors = dict[str, torch.Tensor]


@dataclass
class UnitRound:
    """What one unit's exchange did in one round."""

    unit: str
    participants: list[str]  # peers whose updates were aggregated (this one included)
    missing: list[str]  # expected participants that did not answer in time
    rejected: list[str]  # peers whose payloads failed validation, or whose updates were outliers
    resynced: bool = False  # start weights differed, so end weights were averaged instead
    diverged: bool = False  # our update was not finite: not sent; we took the others' result
    download_from: list[str] = field(default_factory=list)  # take this round's result from one of them
    new_weights: Tensors = field(default_factory=dict)


def tensors_hash(tensors: Tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
