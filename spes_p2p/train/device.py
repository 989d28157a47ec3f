"""Where a model trains (``--device auto|cpu|cuda``), and the precision it computes in there.

The setting is resolved once, here. The model is built on the CPU (so a seed gives the same initial weights
on every peer, whatever its device) and then placed on the device with ``place``, weights held quantized
included; batches follow the model. On CUDA the forward pass and the loss run under bf16 autocast: matmuls
in bf16, the loss in fp32 (``cross_entropy`` and ``logsumexp`` autocast to fp32), while the weights stay fp32
and the optimizer state fp32 or 8-bit. On the CPU nothing changes: no autocast.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from spes_p2p.errors import ConfigError
from spes_p2p.train.config import DEVICES


def resolve_device(name: str) -> torch.device:
    """The device of ``--device name``: auto is cuda when torch sees a CUDA device, else cpu."""
    if name not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"--device cuda: torch {torch.__version__} ({build}) finds no CUDA device on this machine; pass "
            "--device cpu (or auto), or install the torch build that matches this machine's CUDA driver"
        )
    return torch.device(name)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; nothing on the CPU (where bf16 matmuls are slower, not faster)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def place(model: nn.Module, device: torch.device) -> nn.Module:
    """Moves ``model`` to ``device``: its parameters and buffers, and the codes and scales of every weight it
    holds quantized (``nn.Module.to`` does not see those). Moving to where it already is costs nothing."""
    model.to(device)
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if quantized:
            for name, q in quantized.items():
                quantized[name] = q.to(device)
    return model


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` lives (its first parameter's device; a model always keeps some fp32 parameters)."""
    return next(model.parameters()).device
