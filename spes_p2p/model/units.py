"""Units: the pieces of the model that peers own, train and exchange.

``experts/<s>`` is expert shard s: experts ``[s*n, (s+1)*n)`` of every MoE layer, n = experts per shard.
``dense/<b>`` is block b of every parameter that is not an expert. The dense part is cut into B contiguous
blocks of "atoms" (the embedding; each transformer layer's attention, norms and router; the final norm with
the lm_head), balanced by parameter count. B = 1 (``dense/0`` is the whole dense part) is SPES as published.

A unit's tensors are a flat ``name -> tensor`` dict keyed by parameter names; this is what the swarm moves.
Frozen copies held quantized (``hold_frozen``) keep their names: ``read_unit`` dequantizes them,
``write_unit`` re-quantizes; ``quantized_when_frozen`` says which tensors of each unit that is (the sync's
quantized version chains quantize the same ones).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from spes_p2p.errors import ConfigError
from spes_p2p.model.config import ModelConfig, ModelSettings
from spes_p2p.model.quant import QuantizedWeights

_EXPERT_PARAM = re.compile(r"^layers\.\d+\.moe\.experts\.(\d+)\.")
_LAYER_PARAM = re.compile(r"^layers\.(\d+)\.")
_UNIT = re.compile(r"^(experts|dense)/(\d+)$")
MIN_QUANTIZED = 4096  # elements: smaller dense weights (a small router) stay fp32, as norms do


@dataclass(frozen=True)
class UnitLayout:
    """How a model with ``n_experts`` experts per layer splits into ``n_shards`` expert shards, and its dense
    part into blocks: block b starts at atom ``dense_starts[b - 1]`` (atom 0 is the embedding, atom i + 1 is
    layer i, the last atom is the final norm with the lm_head). Build it with ``for_model``."""

    n_experts: int
    n_shards: int
    dense_starts: tuple[int, ...] = ()

    @classmethod
    def for_model(cls, cfg: ModelConfig, n_shards: int, dense_blocks: int = 1) -> UnitLayout:
        return cls(cfg.n_experts, n_shards, dense_partition(cfg, dense_blocks))

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
    def n_dense_blocks(self) -> int:
        return len(self.dense_starts) + 1

    @property
    def dense_units(self) -> list[str]:
        return [f"dense/{b}" for b in range(self.n_dense_blocks)]

    @property
    def expert_units(self) -> list[str]:
        return [f"experts/{s}" for s in range(self.n_shards)]

    @property
    def units(self) -> list[str]:
        return self.dense_units + self.expert_units

    def check_unit(self, unit: str) -> str:
        match = _UNIT.match(unit)
        if not match:
            raise ConfigError(f"bad unit name {unit!r}: expected 'experts/<shard>' or 'dense/<block>'")
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
            return f"dense/{bisect.bisect_right(self.dense_starts, _atom_of(param_name))}"
        return f"experts/{int(match.group(1)) // self.experts_per_shard}"


def _atom_of(param_name: str) -> float:
    """The dense atom a parameter belongs to: 0 embedding, i + 1 layer i, infinity for the model's head."""
    if param_name.startswith("embed."):
        return 0
    match = _LAYER_PARAM.match(param_name)
    return int(match.group(1)) + 1 if match else float("inf")


def dense_partition(cfg: ModelConfig, blocks: int) -> tuple[int, ...]:
    """Where each dense block after the first starts (atom indices): contiguous blocks whose largest parameter
    count is as small as possible."""
    atoms = cfg.n_layers + 2
    if not 1 <= blocks <= atoms:
        raise ConfigError(
            f"dense blocks must be between 1 and {atoms} for this model (embedding, {cfg.n_layers} layers, "
            f"head), got {blocks}"
        )
    from spes_p2p.model.transformer import MoETransformer

    sizes = [0] * atoms
    with torch.device("meta"):
        for name, p in MoETransformer(cfg).named_parameters():
            if not _EXPERT_PARAM.match(name):
                sizes[min(_atom_of(name), atoms - 1)] += p.numel()
    return balanced_starts(sizes, blocks)


def balanced_starts(sizes: list[int], blocks: int) -> tuple[int, ...]:
    """Splits ``sizes`` into ``blocks`` non-empty contiguous runs as evenly as possible (the smallest sum of
    squared run sums); returns the start index of every run after the first (an exact dynamic programme:
    the lists are short)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the best cost when the first i atoms form k runs; cut[k][i]: where the last run starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(blocks + 1)]
    cut = [[0] * (n + 1) for _ in range(blocks + 1)]
    best[0][0] = 0
    for k in range(1, blocks + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = best[k - 1][j] + (prefix[i] - prefix[j]) ** 2
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(blocks, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return tuple(sorted(starts)[1:])


def named_weights(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(name, module, attribute) of every weight in parameter order, quantized ones included."""
    for prefix, module in model.named_modules():
        if isinstance(module, QuantizedWeights):
            attrs = list(module.WEIGHTS)
        else:
            attrs = [name for name, _ in module.named_parameters(recurse=False)]
        for attr in attrs:
            yield (f"{prefix}.{attr}" if prefix else attr), module, attr


def unit_parameters(model: nn.Module, layout: UnitLayout, unit: str) -> dict[str, nn.Parameter]:
    """The parameters that make up ``unit``, by name, in the model's order (quantized weights are none)."""
    layout.check_unit(unit)
    return {name: p for name, p in model.named_parameters() if layout.unit_of(name) == unit}


def _unit_weights(model: nn.Module, layout: UnitLayout, unit: str) -> dict[str, tuple[nn.Module, str]]:
    layout.check_unit(unit)
    return {name: (m, attr) for name, m, attr in named_weights(model) if layout.unit_of(name) == unit}


def read_unit(model: nn.Module, layout: UnitLayout, unit: str) -> dict[str, torch.Tensor]:
    """A detached full-precision copy of the unit's tensors."""
    return {name: _get(m, attr).clone() for name, (m, attr) in _unit_weights(model, layout, unit).items()}


@torch.no_grad()
def write_unit(model: nn.Module, layout: UnitLayout, unit: str, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrites the unit's weights in place (re-quantizing quantized ones); names, shapes and dtypes must
    match exactly."""
    weights = _unit_weights(model, layout, unit)
    if set(tensors) != set(weights):
        missing, extra = sorted(set(weights) - set(tensors)), sorted(set(tensors) - set(weights))
        raise ValueError(
            f"tensors for {unit} do not match its parameters: missing {missing[:3]}, extra {extra[:3]}"
        )
    for name, (m, attr) in weights.items():
        t, shape = tensors[name], _shape(m, attr)
        if t.shape != shape or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected float32 {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    for name, (m, attr) in weights.items():
        if isinstance(m, QuantizedWeights):
            m.set_weight(attr, tensors[name])
        else:
            getattr(m, attr).copy_(tensors[name])


def _get(module: nn.Module, attr: str) -> torch.Tensor:
    return module.get_weight(attr) if isinstance(module, QuantizedWeights) else getattr(module, attr).detach()


def _shape(module: nn.Module, attr: str) -> torch.Size:
    return module.weight_shape(attr) if isinstance(module, QuantizedWeights) else getattr(module, attr).shape


def hold_frozen(
    model: nn.Module, layout: UnitLayout, trained: list[str], *, experts: str = "full", dense: str = "full"
) -> None:
    """Units outside ``trained`` are held as ``experts`` (expert shards) or ``dense`` (dense blocks): full,
    int8 or nf4; trained units as full-precision parameters. Of a dense block only the weights of 2 or more
    dims and at least ``MIN_QUANTIZED`` elements are quantized (embedding, attention, lm_head, a large
    router); norms and small routers stay fp32 parameters, frozen."""
    trained_set = set(trained)
    for unit, _, module in _quantizable(model, layout):
        kind = experts if unit.startswith("experts/") else dense
        if kind == "full" or unit in trained_set or not _quantized_when_frozen(unit, module):
            module.dequantize_()
        else:
            module.quantize_(kind)


def quantized_when_frozen(model: nn.Module, layout: UnitLayout) -> dict[str, frozenset[str]]:
    """For each unit, the weights that ``hold_frozen`` quantizes when the unit is held int8 or nf4 (what a
    quantized copy's keepers hold quantized, ``sync.versions.Chains``)."""
    out: dict[str, set[str]] = {u: set() for u in layout.units}
    for unit, prefix, module in _quantizable(model, layout):
        if _quantized_when_frozen(unit, module):
            out[unit] |= {f"{prefix}.{w}" for w in module.WEIGHTS}
    return {u: frozenset(names) for u, names in out.items()}


def _quantizable(model: nn.Module, layout: UnitLayout) -> Iterator[tuple[str, str, QuantizedWeights]]:
    """(unit, name, module) of every module whose weights may be held quantized."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeights):
            yield layout.unit_of(f"{name}.{module.WEIGHTS[0]}"), name, module


def _quantized_when_frozen(unit: str, module: QuantizedWeights) -> bool:
    """Experts always; a dense weight of 2 or more dims and at least ``MIN_QUANTIZED`` elements."""
    shapes = [module.weight_shape(w) for w in module.WEIGHTS]
    worth = all(len(shape) >= 2 and shape.numel() >= MIN_QUANTIZED for shape in shapes)
    return unit.startswith("experts/") or worth


def set_trainable(model: nn.Module, layout: UnitLayout, units: list[str]) -> list[nn.Parameter]:
    """Freezes every parameter outside ``units``; returns the trainable parameters in model order."""
    owned = {layout.check_unit(u) for u in units}
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(layout.unit_of(name) in owned)
        if p.requires_grad:
            trainable.append(p)
    return trainable


def layout_of(model: ModelSettings) -> UnitLayout:
    """The units of the model that ``[model]`` settings describe."""
    return UnitLayout.for_model(model.architecture(), model.shards, model.dense_blocks)
