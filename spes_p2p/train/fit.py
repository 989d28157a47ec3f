"""Pre-flight: does a peer's model fit the memory of the device it trains on, before anything is allocated?

``estimate_bytes`` counts from the parameter shapes alone (a model on the meta device), per element:

    trained weight     4 (fp32) + 4 (gradient) + optimizer state: 2 for 8-bit AdamW (8 for a tensor under
                       4096 elements, which bitsandbytes keeps in 32 bits), 8 for torch's AdamW
    frozen expert      full 4, int8 about 1.0, nf4 about 0.5625 (codes plus one fp32 scale a block)
    frozen dense       as a frozen expert, with ``frozen_dense`` (weights of 2 or more dims and at least
                       4096 elements; norms and small routers stay fp32)

plus a quarter on top for activations and the runtime. ``check_fits`` compares it with the free memory of
the device (``torch.cuda.mem_get_info`` on CUDA, the machine's available memory on the CPU) and refuses a
model that does not fit, in one line: the bytes needed, the bytes free, and the nearest configuration that
fits by the same estimate (``suggest``), or that none does.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from spes_p2p.blockwise import int8_sizes, nf4_sizes
from spes_p2p.errors import ConfigError
from spes_p2p.model import ModelConfig, MoETransformer, UnitLayout
from spes_p2p.model.config import PRESETS
from spes_p2p.model.units import MIN_QUANTIZED, balanced_starts

MARGIN = 1.25  # activations, the allocator's slack, the runtime
SMALL_STATE = 4096  # elements: bitsandbytes keeps the state of smaller tensors in 32 bits
KNOBS = ("frozen_experts", "dense_blocks", "shards")  # what ``suggest`` may turn, in this order
GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a peer trains and how it holds the rest: everything the estimate depends on but the model."""

    shards: int
    dense_blocks: int = 1
    active_blocks: int = 1  # dense blocks trained: the largest ones (the worst case)
    capacity: int = 1  # expert shards trained
    frozen_experts: str = "full"
    frozen_dense: str = "full"
    optimizer: str = "adamw8bit"
    everything: bool = False  # trains every unit (DiLoCo, the centralized baseline): nothing is frozen

    def describe(self) -> str:
        if self.everything:
            return "every unit"
        blocks = min(self.active_blocks, self.dense_blocks)
        return (
            f"{min(self.capacity, self.shards)} of {self.shards} expert shards and {blocks} of "
            f"{self.dense_blocks} dense blocks, frozen experts {self.frozen_experts}"
        )


def peer_plan(settings) -> Plan:
    """What a swarm peer of ``settings`` (``spes_p2p.settings.Settings``) trains at most: ``capacity`` expert
    shards and ``active_blocks`` dense blocks, or every unit in DiLoCo mode."""
    model, train, peer = settings.model, settings.train, settings.peer
    return Plan(
        shards=model.shards,
        dense_blocks=model.dense_blocks,
        active_blocks=peer.active_blocks,
        capacity=peer.capacity,
        frozen_experts=train.frozen_experts,
        frozen_dense=train.frozen_dense,
        optimizer=train.optimizer,
        everything=settings.method.mode == "diloco",
    )


def estimate_bytes(cfg: ModelConfig, plan: Plan) -> int:
    """What a trainer of ``plan`` needs at least: weights as held, gradients and optimizer state of what it
    trains, plus ``MARGIN``."""
    parts = held_bytes(cfg, plan)
    return int(MARGIN * (parts["trained"] + parts["frozen"] + parts["gradients"] + parts["optimizer"]))


def held_bytes(cfg: ModelConfig, plan: Plan) -> dict[str, int]:
    """The bytes of a trainer of ``plan`` after a step, by kind: the trained weights (float32), the others as
    held, the gradients, the optimizer state."""
    layout = _layout(cfg, plan.shards, plan.dense_blocks)
    trained = set(layout.units) if plan.everything else _trained_units(cfg, layout, plan)
    out = dict.fromkeys(("trained", "frozen", "gradients", "optimizer"), 0)
    for name, numel, ndim in _parameters(cfg):
        unit = layout.unit_of(name)
        if unit in trained:
            out["trained"] += 4 * numel
            out["gradients"] += 4 * numel
            out["optimizer"] += _state_bytes(numel, plan.optimizer) * numel
        elif unit.startswith("experts/"):
            out["frozen"] += _held_bytes(numel, plan.frozen_experts)
        elif ndim >= 2 and numel >= MIN_QUANTIZED:
            out["frozen"] += _held_bytes(numel, plan.frozen_dense)
        else:
            out["frozen"] += 4 * numel
    return out


def free_bytes(device: torch.device) -> int:
    """Bytes free on ``device`` now: the GPU's free memory, or this machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_fits(preset: str, cfg: ModelConfig, plan: Plan, device: torch.device, **options) -> None:
    """Refuses, before allocating, a ``plan`` that does not fit: ``fit_problem``'s line as a ConfigError
    (``options``: its keyword arguments)."""
    problem = fit_problem(preset, cfg, plan, device, **options)
    if problem:
        raise ConfigError(problem)


def fit_problem(
    preset: str,
    cfg: ModelConfig,
    plan: Plan,
    device: torch.device,
    *,
    free: int | None = None,
    knobs: tuple[str, ...] = KNOBS,
    capacity_flag: str = "--capacity 1",
) -> str | None:
    """Why ``plan`` does not fit ``free`` bytes (default: what ``device`` has free now), in one line naming a
    configuration that fits (turning only ``knobs``; ``capacity_flag`` is how the command says "train one
    expert shard"), or the presets that fit when none does; None when it fits."""
    free = free_bytes(device) if free is None else free
    need = estimate_bytes(cfg, plan)
    if need <= free:
        return None
    line = (
        f"{preset} needs about {need / GiB:.1f} GiB ({need:,} bytes) on {device.type} to train "
        f"{plan.describe()}, but {device.type} has {free / GiB:.1f} GiB free ({free:,} bytes)"
    )
    fitting = suggest(cfg, plan, free, knobs)
    if fitting is not None:
        advice = " ".join(flags(plan, fitting, capacity_flag))
        return f"{line}; try {advice} (about {estimate_bytes(cfg, fitting) / GiB:.1f} GiB)"
    presets = [name for name, other in PRESETS.items() if _fits_somehow(other, plan, free, knobs)]
    return f"{line}; no configuration of {preset} fits. Presets that fit: {', '.join(presets) or 'none'}"


def suggest(cfg: ModelConfig, plan: Plan, free: int, knobs: tuple[str, ...] = KNOBS) -> Plan | None:
    """The plan nearest to ``plan`` that fits ``free`` bytes, or None. In order of least change: frozen
    experts in nf4; then more dense blocks, training one; then more expert shards, training one."""
    if plan.everything:
        return plan if estimate_bytes(cfg, plan) <= free else None
    for candidate in _candidates(cfg, plan, knobs):
        if estimate_bytes(cfg, candidate) <= free:
            return candidate
    return None


def flags(plan: Plan, other: Plan, capacity_flag: str = "--capacity 1") -> list[str]:
    """The command-line flags that turn ``plan`` into ``other``."""
    out = []
    if other.frozen_experts != plan.frozen_experts:
        out.append(f"--frozen-experts {other.frozen_experts}")
    if other.dense_blocks != plan.dense_blocks:
        out.append(f"--dense-blocks {other.dense_blocks}")
        if other.active_blocks != plan.active_blocks:
            out.append(f"--active-blocks {other.active_blocks}")
    if other.shards != plan.shards:
        out.append(f"--shards {other.shards}")
        if other.capacity != plan.capacity:
            out.append(capacity_flag)
    return out


def _candidates(cfg: ModelConfig, plan: Plan, knobs: tuple[str, ...]):
    base = dataclasses.replace(plan, frozen_experts="nf4") if "frozen_experts" in knobs else plan
    more_shards = [s for s in range(plan.shards + 1, cfg.n_experts + 1) if cfg.n_experts % s == 0]
    more_blocks = list(range(plan.dense_blocks + 1, cfg.n_layers + 3))  # atoms: embedding, layers, head
    for shards in [plan.shards, *(more_shards if "shards" in knobs else [])]:
        with_shards = base if shards == plan.shards else dataclasses.replace(base, shards=shards, capacity=1)
        yield with_shards
        if "dense_blocks" in knobs:
            for blocks in more_blocks:
                yield dataclasses.replace(with_shards, dense_blocks=blocks, active_blocks=1)


def _fits_somehow(cfg: ModelConfig, plan: Plan, free: int, knobs: tuple[str, ...]) -> bool:
    """Whether some configuration of another preset fits (``plan``'s, where that preset allows it)."""
    shards = plan.shards if cfg.n_experts % plan.shards == 0 else 1
    blocks = min(plan.dense_blocks, cfg.n_layers + 2)
    nearest = dataclasses.replace(plan, shards=shards, dense_blocks=blocks)
    return suggest(cfg, nearest, free, knobs) is not None


def _trained_units(cfg: ModelConfig, layout: UnitLayout, plan: Plan) -> set[str]:
    sizes = dict.fromkeys(layout.dense_units, 0)
    for name, numel, _ in _parameters(cfg):
        unit = layout.unit_of(name)
        if unit in sizes:
            sizes[unit] += numel
    largest = sorted(sizes, key=lambda u: -sizes[u])[: plan.active_blocks]
    return {*largest, *layout.expert_units[: plan.capacity]}


def _state_bytes(numel: int, optimizer: str) -> int:
    return 2 if optimizer == "adamw8bit" and numel >= SMALL_STATE else 8


def _held_bytes(numel: int, kind: str) -> int:
    if kind == "full":
        return 4 * numel
    codes, scales = int8_sizes(numel) if kind == "int8" else nf4_sizes(numel)
    return codes + 4 * scales


@functools.cache
def _parameters(cfg: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """(name, elements, dims) of every parameter of the model, from a model on the meta device."""
    with torch.device("meta"):
        return tuple((n, p.numel(), p.ndim) for n, p in MoETransformer(cfg).named_parameters())


@functools.cache
def _layout(cfg: ModelConfig, shards: int, blocks: int) -> UnitLayout:
    """``UnitLayout.for_model`` from the cached shapes (it builds a model of its own each time)."""
    atoms = cfg.n_layers + 2
    per_atom = UnitLayout(cfg.n_experts, 1, tuple(range(1, atoms)))  # dense/<i> is atom i
    sizes = [0] * atoms
    for name, numel, _ in _parameters(cfg):
        unit = per_atom.unit_of(name)
        if unit.startswith("dense/"):
            sizes[int(unit.removeprefix("dense/"))] += numel
    return UnitLayout(cfg.n_experts, shards, balanced_starts(sizes, blocks))


def preflight(settings) -> dict:
    """Whether a peer of ``settings`` fits its device now: the bytes it needs, the bytes free, and (when it
    does not fit) the refusal a peer would print."""
    from spes_p2p.train.device import resolve_device

    device = resolve_device(settings.train.device)
    cfg, plan, free = settings.model.architecture(), peer_plan(settings), free_bytes(device)
    problem = fit_problem(settings.model.preset, cfg, plan, device, free=free)
    return {
        "device": device.type,
        "needs_bytes": estimate_bytes(cfg, plan),
        "free_bytes": free,
        "fits": problem is None,
        "problem": problem,
    }
