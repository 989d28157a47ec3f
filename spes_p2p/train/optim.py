"""The optimizer over a peer's trainable parameters, and the learning-rate schedule."""

from __future__ import annotations

import math
import threading

import torch
from torch import nn

from spes_p2p.compat import bitsandbytes, optimizers_without_compiler
from spes_p2p.errors import ConfigError
from spes_p2p.train.config import OPTIMIZERS, TrainConfig


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``min_ratio * peak`` at ``total_steps``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(1, total_steps - warmup_steps), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def scheduled_lr(cfg: TrainConfig, step: int) -> float:
    """``[train]``'s schedule at ``step``."""
    warmup, total = cfg.warmup_steps, cfg.total_steps
    return lr_at(step, peak=cfg.lr, warmup_steps=warmup, total_steps=total, min_ratio=cfg.min_lr_ratio)


def build_optimizer(
    named_params: list[tuple[str, nn.Parameter]],
    *,
    kind: str,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """AdamW (8-bit blockwise state from bitsandbytes, or torch's) over the given parameters only.

    Norm weights (1-D) get no weight decay.
    """
    if kind not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {kind!r}; choose one of: {', '.join(OPTIMIZERS)}")
    if not named_params:
        raise ConfigError("nothing to train: the owned units have no parameters")
    groups = [
        {"params": [p for _, p in named_params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named_params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    optimizers_without_compiler()
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    return bitsandbytes().optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps)


_8BIT_STEPS = threading.Lock()


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step. bitsandbytes' 8-bit step on CPU is not thread-safe (peers stepping at once in one
    process, as in a simulation, corrupt each other's updates), so those steps take turns."""
    if type(optimizer).__module__.startswith("bitsandbytes"):
        with _8BIT_STEPS:
            optimizer.step()
    else:
        optimizer.step()


def tensor_bytes(obj) -> int:
    """Bytes held by the distinct tensors inside a (nested) dict/list, e.g. an optimizer's state."""
    return sum(t.numel() * t.element_size() for t in _distinct_tensors(obj, {}).values())


def _distinct_tensors(obj, found: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        found.setdefault(obj.data_ptr(), obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _distinct_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _distinct_tensors(value, found)
    return found
