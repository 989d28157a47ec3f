"""Memory accounting: the bytes a peer allocates for weights, gradients and optimizer state, and the outer
state its sync keeps. (What a peer holds while it trains is measured in ``sim/running_memory.py``.)

Measured, not estimated: the model and optimizer are built for the given ownership and take one real step,
then every allocated tensor is counted. Parameters below 4096 elements keep 32-bit state even with the 8-bit
optimizer (a bitsandbytes default); that is counted too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model import ModelConfig, MoETransformer, UnitLayout
from spes_p2p.model.config import ModelSettings
from spes_p2p.model.quant import quantized_bytes
from spes_p2p.model.units import layout_of
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.optim import optimizer_step, tensor_bytes
from spes_p2p.train.trainer import Trainer

KEYS = (
    "total_params",
    "trainable_params",
    "weights_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "outer_bytes",
    "total_bytes",
)


def measure(
    model_cfg: ModelConfig,
    layout: UnitLayout,
    units: list[str],
    train: TrainConfig,
    outer: Callable[[str], int] = lambda unit: 0,
) -> dict[str, int]:
    """Allocated bytes after one real step of a trainer that owns ``units`` and holds the other units as
    ``train.frozen_experts`` and ``train.frozen_dense`` (full, int8 or nf4), plus ``outer(unit)`` float32
    copies of each unit it trains (``outer_bytes``): what the sync keeps from one round to the next.

    The step's batch routes enough tokens that every expert gets some, as in real training; an expert that
    got none would have no gradient buffer in this step.
    """
    _check_fits(model_cfg)
    torch.manual_seed(0)
    model = MoETransformer(model_cfg)
    trainer = Trainer(model, layout, units, train)
    tokens = torch.randint(0, model_cfg.vocab_size, (train.batch_size, train.seq_len + 1))
    out = model(tokens[:, :-1], tokens[:, 1:])
    out.loss.backward()
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer_step(trainer.optimizer)  # creates the optimizer state
    report = {
        "total_params": model.num_params(),
        "trainable_params": sum(p.numel() for p in trainer.trainable),
        "weights_bytes": weights_bytes(model),
        "grads_bytes": grads,
        "optimizer_bytes": tensor_bytes(list(trainer.optimizer.state.values())),
        "outer_bytes": sum(
            outer(layout.unit_of(n)) * tensor_bytes(p) for n, p in model.named_parameters() if p.requires_grad
        ),
    }
    report["total_bytes"] = sum(report[k] for k in KEYS if k.endswith("_bytes") and k != "total_bytes")
    return report


def weights_bytes(model: MoETransformer) -> int:
    """Parameters plus the codes and scales of every weight held quantized (frozen experts, dense blocks)."""
    return sum(tensor_bytes(p) for p in model.parameters()) + quantized_bytes(model)


# fp32 copies of each trained weight the sync keeps across a round: the start weights the round's update is
# measured from, DiLoCo's Nesterov momentum, and a SPES holder's last version of a unit others keep frozen
# copies of (``sync/versions.py``)
START, MOMENTUM, VERSION = 1, 1, 1


def outer_copies(method: str, layout: UnitLayout) -> Callable[[str], int]:
    """Float32 copies of each trained unit the sync of ``method`` (spes, diloco or centralized: none)
    keeps across a round."""
    if method == "centralized":
        return lambda unit: 0
    if method == "diloco":
        return lambda unit: START + MOMENTUM
    versioned = layout.n_dense_blocks > 1  # (with one dense block, every peer trains it: no versions)
    return lambda unit: START + VERSION * (versioned or unit.startswith("experts/"))


def compare(model: ModelSettings, capacity: int, active_blocks: int, train: TrainConfig) -> dict:
    """A SPES peer that trains ``capacity`` expert shards and ``active_blocks`` of the dense blocks (the
    largest ones: the worst case), holding the other units as ``train`` says, next to a DiLoCo peer and a
    centralized trainer (``full``: no outer state), both training every unit."""
    model_cfg, layout = model.architecture(), layout_of(model)
    if not 1 <= capacity <= layout.n_shards:
        raise ConfigError(f"capacity must be between 1 and the shards ({layout.n_shards})")
    units = [*_largest_blocks(model_cfg, layout, active_blocks), *layout.expert_units[:capacity]]
    report = measure(model_cfg, layout, units, train, outer_copies("spes", layout))
    everything = dataclasses.replace(train, frozen_experts="full", frozen_dense="full")
    report["full"] = measure(model_cfg, layout, layout.units, everything)
    report["diloco"] = measure(model_cfg, layout, layout.units, everything, outer_copies("diloco", layout))
    report["ratio_vs_full"] = report["total_bytes"] / report["full"]["total_bytes"]
    report["ratio_vs_diloco"] = report["total_bytes"] / report["diloco"]["total_bytes"]
    report.update(
        preset=model.preset,
        shards=model.shards,
        owned_units=units,
        optimizer=train.optimizer,
        dense_blocks=model.dense_blocks,
        active_blocks=active_blocks,
        frozen_experts=train.frozen_experts,
        frozen_dense=train.frozen_dense,
    )
    return report


def _largest_blocks(model_cfg: ModelConfig, layout: UnitLayout, count: int) -> list[str]:
    sizes = dict.fromkeys(layout.dense_units, 0)
    with torch.device("meta"):
        for name, p in MoETransformer(model_cfg).named_parameters():
            unit = layout.unit_of(name)
            if unit in sizes:
                sizes[unit] += p.numel()
    return sorted(sorted(sizes, key=lambda u: -sizes[u])[:count])


def _check_fits(model_cfg: ModelConfig) -> None:
    import psutil

    with torch.device("meta"):
        n = MoETransformer(model_cfg).num_params()
    need = n * 4 * 3  # fp32 weights, gradients and (at worst) one more copy of state
    available = psutil.virtual_memory().available
    if need > available:
        raise ConfigError(
            f"this preset has {n / 1e9:.2f}B parameters and needs about {need / 2**30:.0f} GiB to measure, "
            f"but only {available / 2**30:.0f} GiB is free; measure a smaller preset or use a larger machine"
        )
