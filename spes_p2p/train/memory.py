"""Memory accounting: the bytes a peer allocates for weights, gradients and optimizer state.

Measured, not estimated: the model and optimizer are built for the given ownership and take one real step,
then every allocated tensor is counted. Parameters below 4096 elements keep 32-bit state even with the 8-bit
optimizer (a bitsandbytes default); that is counted too.
"""

from __future__ import annotations

import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model import ModelConfig, MoETransformer, UnitLayout, get_preset
from spes_p2p.model.moe import SwiGLUExpert
from spes_p2p.train.optim import tensor_bytes
from spes_p2p.train.trainer import TrainConfig, Trainer

KEYS = ("total_params", "trainable_params", "weights_bytes", "grads_bytes", "optimizer_bytes", "total_bytes")


def measure(
    model_cfg: ModelConfig,
    layout: UnitLayout,
    units: list[str],
    optimizer: str,
    frozen_experts: str = "full",
    batch_size: int = 4,
    seq_len: int = 128,
) -> dict[str, int]:
    """Allocated bytes after one real step of a trainer that owns ``units`` and holds the other experts as
    ``frozen_experts`` (full, int8 or nf4).

    The step's batch routes enough tokens that every expert gets some, as in real training; an expert that
    got none would have no gradient buffer in this step.
    """
    _check_fits(model_cfg)
    torch.manual_seed(0)
    model = MoETransformer(model_cfg)
    trainer = Trainer(
        model, layout, units, TrainConfig(optimizer=optimizer, warmup_steps=0, frozen_experts=frozen_experts)
    )
    tokens = torch.randint(0, model_cfg.vocab_size, (batch_size, seq_len + 1))
    out = model(tokens[:, :-1], tokens[:, 1:])
    out.loss.backward()
    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    trainer.optimizer.step()  # creates the optimizer state
    report = {
        "total_params": model.num_params(),
        "trainable_params": sum(p.numel() for p in trainer.trainable),
        "weights_bytes": weights_bytes(model),
        "grads_bytes": grads,
        "optimizer_bytes": tensor_bytes(list(trainer.optimizer.state.values())),
    }
    report["total_bytes"] = report["weights_bytes"] + report["grads_bytes"] + report["optimizer_bytes"]
    return report


def weights_bytes(model: MoETransformer) -> int:
    """Parameters plus the codes and scales of experts held quantized."""
    quantized = sum(
        q.nbytes for m in model.modules() if isinstance(m, SwiGLUExpert) for q in m.quantized.values()
    )
    return sum(tensor_bytes(p) for p in model.parameters()) + quantized


def compare(
    preset: str,
    n_shards: int,
    owned_shards: list[int],
    optimizer: str,
    dense_blocks: int = 1,
    active_blocks: int = 1,
    frozen_experts: str = "full",
) -> dict:
    """A peer owning ``owned_shards`` and ``active_blocks`` of the ``dense_blocks`` dense blocks (the largest
    ones: the worst case), holding other experts as ``frozen_experts``, next to a trainer that owns every unit
    in full precision."""
    model_cfg = get_preset(preset)
    layout = UnitLayout.for_model(model_cfg, n_shards, dense_blocks)
    if not 1 <= active_blocks <= dense_blocks:
        raise ConfigError(f"active blocks must be between 1 and the dense blocks ({dense_blocks})")
    units = [*_largest_blocks(model_cfg, layout, active_blocks), *layout.shard_units(owned_shards)]
    report = measure(model_cfg, layout, units, optimizer, frozen_experts)
    report["full"] = measure(model_cfg, layout, layout.units, optimizer)
    report["ratio_vs_full"] = report["total_bytes"] / report["full"]["total_bytes"]
    report.update(
        preset=preset,
        shards=n_shards,
        owned_units=units,
        optimizer=optimizer,
        dense_blocks=dense_blocks,
        active_blocks=active_blocks,
        frozen_experts=frozen_experts,
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
