"""Units: the pieces of the model that peers own, train and exchange.

``experts/<s>`` is expert shard s: experts ``[s*n, (s+1)*n)`` of every MoE layer, n = experts per shard.
``dense/0`` is every parameter that is not an expert (embeddings, attention, norms, routers, lm_head).

A unit's tensors are a flat ``name -> tensor`` dict keyed by parameter names; this is what the swarm moves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from spes_p2p.errors import ConfigError

_EXPERT_PARAM = re.compile(r"^layers\.\d+\.moe\.experts\.(\d+)\.")
_UNIT = re.compile(r"^(experts|dense)/(\d+)$")


@dataclass(frozen=True)
class UnitLayout:
    """How a model with ``n_experts`` experts per layer splits into ``n_shards`` expert shards."""

    n_experts: int
    n_shards: int

    def __post_init__(self) -> None:
        if self.n_shards < 1:
            raise ConfigError(f"shards must be at least 1, got {self.n_shards}")
        if self.n_experts % self.n_shards:
            raise ConfigError(
                f"shards ({self.n_shards}) must divide the number of experts ({self.n_experts}); "
                f"try one of {[d for d in range(1, self.n_experts + 1) if self.n_experts % d == 0]}"
            )

    @property
    def experts_per_shard(self) -> int:
        return self.n_experts // self.n_shards

    @property
    def units(self) -> list[str]:
        return ["dense/0"] + [f"experts/{s}" for s in range(self.n_shards)]

    def check_unit(self, unit: str) -> str:
        match = _UNIT.match(unit)
        if not match:
            raise ConfigError(f"bad unit name {unit!r}: expected 'experts/<shard>' or 'dense/0'")
        if unit not in self.units:
            raise ConfigError(f"unit {unit!r} is out of range: this model has units {', '.join(self.units)}")
        return unit

    def shard_units(self, shards: list[int]) -> list[str]:
        """The units of the given expert shards (``--owned-shards``), checked against the layout."""
        for s in shards:
            if not 0 <= s < self.n_shards:
                raise ConfigError(f"owned shard {s} is out of range: shards are 0..{self.n_shards - 1}")
        return [f"experts/{s}" for s in sorted(set(shards))]

    def unit_of(self, param_name: str) -> str:
        match = _EXPERT_PARAM.match(param_name)
        if match is None:
            return "dense/0"
        return f"experts/{int(match.group(1)) // self.experts_per_shard}"


def unit_parameters(model: nn.Module, layout: UnitLayout, unit: str) -> dict[str, nn.Parameter]:
    """The parameters that make up ``unit``, by name, in the model's order."""
    layout.check_unit(unit)
    return {name: p for name, p in model.named_parameters() if layout.unit_of(name) == unit}


def read_unit(model: nn.Module, layout: UnitLayout, unit: str) -> dict[str, torch.Tensor]:
    """A detached copy of the unit's tensors."""
    return {name: p.detach().clone() for name, p in unit_parameters(model, layout, unit).items()}


@torch.no_grad()
def write_unit(model: nn.Module, layout: UnitLayout, unit: str, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrites the unit's parameters in place; names, shapes and dtypes must match exactly."""
    params = unit_parameters(model, layout, unit)
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(
            f"tensors for {unit} do not match its parameters: missing {missing[:3]}, extra {extra[:3]}"
        )
    for name, p in params.items():
        t = tensors[name]
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ValueError(f"{name}: expected {p.dtype} {tuple(p.shape)}, got {t.dtype} {tuple(t.shape)}")
    for name, p in params.items():
        p.copy_(tensors[name])


def set_trainable(model: nn.Module, layout: UnitLayout, units: list[str]) -> list[nn.Parameter]:
    """Freezes every parameter outside ``units``; returns the trainable parameters in model order."""
    owned = {layout.check_unit(u) for u in units}
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(layout.unit_of(name) in owned)
        if p.requires_grad:
            trainable.append(p)
    return trainable
