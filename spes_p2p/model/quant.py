"""Frozen copies held quantized: 8-bit blockwise (bitsandbytes' dynamic map) or 4-bit NF4.

Another peer holds the real copy of a unit this peer does not train (an expert shard, a dense block), so the
local copy may be lossy. A quantized weight is dequantized where it is used, and a matmul's backward
dequantizes it again instead of keeping it, so no full-precision copy of a frozen weight outlives the op that
used it. Gradients still flow through it to the inputs (the router and attention get theirs); the weight
itself gets none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spes_p2p.errors import ConfigError
from spes_p2p.quantize import (
    dequantize_int8,
    dequantize_int8_at,
    dequantize_nf4,
    dequantize_nf4_at,
    quantize_int8,
    quantize_nf4,
)


@dataclass
class QuantizedTensor:
    """A float32 tensor stored as 8-bit or 4-bit codes plus one float32 scale per block (``blockwise``)."""

    kind: str  # int8 or nf4
    shape: torch.Size
    codes: torch.Tensor  # uint8
    absmax: torch.Tensor  # float32, one per block

    @classmethod
    def quantize(cls, tensor: torch.Tensor, kind: str) -> QuantizedTensor:
        flat = tensor.detach().float().contiguous().flatten()
        if kind == "int8":
            return cls(kind, tensor.shape, *quantize_int8(flat))
        if kind == "nf4":
            return cls(kind, tensor.shape, *quantize_nf4(flat))
        raise ConfigError(f"cannot quantize to {kind!r}: choose int8 or nf4")

    def dequantize(self) -> torch.Tensor:
        if self.kind == "int8":
            return dequantize_int8(self.codes, self.absmax).view(self.shape)
        return dequantize_nf4(self.codes, self.absmax, self.shape.numel()).view(self.shape)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """``dequantize()[index]`` of a 2-d tensor, decoding only those rows (an embedding lookup)."""
        cols = self.shape[1]
        at = index.unsqueeze(-1) * cols + torch.arange(cols, device=index.device)  # (*index, cols)
        if self.kind == "int8":
            return dequantize_int8_at(self.codes, self.absmax, at)
        return dequantize_nf4_at(self.codes, self.absmax, at)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.absmax.numel()

    @property
    def device(self) -> torch.device:
        """Where the codes live, and where ``dequantize`` computes."""
        return self.codes.device

    def to(self, device: torch.device) -> QuantizedTensor:
        return QuantizedTensor(self.kind, self.shape, self.codes.to(device), self.absmax.to(device))

    def numel(self) -> int:
        return self.shape.numel()


class _FrozenMatmul(torch.autograd.Function):
    """``x @ W`` (``x @ W.T`` when transposed) for a quantized W: the gradient reaches x, never W; W is
    dequantized again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: QuantizedTensor, transposed: bool) -> torch.Tensor:
        ctx.weight, ctx.transposed = weight, transposed
        w = weight.dequantize().to(x.dtype)
        return x @ (w.t() if transposed else w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.weight.dequantize().to(grad.dtype)
        return grad @ (w if ctx.transposed else w.t()), None, None


def frozen_matmul(x: torch.Tensor, weight: QuantizedTensor, transposed: bool = False) -> torch.Tensor:
    return _FrozenMatmul.apply(x, weight, transposed)


class QuantizedWeights(nn.Module):
    """A module whose ``WEIGHTS`` (all its parameters) may be held quantized while frozen (``quantize_``).

    They then leave the module's parameters and live in ``self.quantized``, under the same names; forwards
    ask ``self.quantized`` first. ``state_dict`` and ``load_state_dict`` still read and write them in full
    precision, so checkpoints do not depend on how a peer holds its frozen copies.
    """

    WEIGHTS: tuple[str, ...] = ("weight",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quantized: dict[str, QuantizedTensor] = {}

    def quantize_(self, kind: str) -> None:
        """Holds the weights as ``kind`` (int8 or nf4) codes; they stop being parameters."""
        if self.quantized and next(iter(self.quantized.values())).kind == kind:
            return
        weights = {name: self.get_weight(name) for name in self.WEIGHTS}
        for name in self.WEIGHTS:
            if name in self._parameters:
                delattr(self, name)
            self.quantized[name] = QuantizedTensor.quantize(weights[name], kind)

    def dequantize_(self) -> None:
        """Back to full-precision (frozen) parameters, e.g. when this peer starts training the unit."""
        for name, q in list(self.quantized.items()):
            self.register_parameter(name, nn.Parameter(q.dequantize(), requires_grad=False))
        self.quantized.clear()

    def matmul(self, x: torch.Tensor, name: str, transposed: bool = False) -> torch.Tensor:
        """``x @ W`` (``x @ W.T`` when transposed) for the weight ``name``, quantized or not."""
        q = self.quantized.get(name)
        if q is not None:
            return frozen_matmul(x, q, transposed)
        weight = getattr(self, name)
        return x @ (weight.t() if transposed else weight)

    def get_weight(self, name: str) -> torch.Tensor:
        q = self.quantized.get(name)
        return getattr(self, name).detach() if q is None else q.dequantize()

    @torch.no_grad()
    def set_weight(self, name: str, value: torch.Tensor) -> None:
        q = self.quantized.get(name)
        if q is None:
            getattr(self, name).copy_(value)
        else:
            self.quantized[name] = QuantizedTensor.quantize(value.to(q.device), q.kind)

    def weight_shape(self, name: str) -> torch.Size:
        q = self.quantized.get(name)
        return getattr(self, name).shape if q is None else q.shape

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, q in self.quantized.items():
            destination[prefix + name] = q.dequantize()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        for name in self.quantized:
            key = prefix + name
            if key not in state_dict:
                missing.append(key)
                continue
            if key in unexpected:
                unexpected.remove(key)
            if tuple(state_dict[key].shape) != tuple(self.quantized[name].shape):
                errors.append(f"size mismatch for {key}: {tuple(state_dict[key].shape)}")
                continue
            self.set_weight(name, state_dict[key])


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the codes and scales of every weight ``model`` holds quantized."""
    return sum(q.nbytes for q in _quantized(model))


def quantized_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The codes and scales of every weight ``model`` holds quantized."""
    return [t for q in _quantized(model) for t in (q.codes, q.absmax)]


def _quantized(model: nn.Module) -> list[QuantizedTensor]:
    return [q for m in model.modules() if isinstance(m, QuantizedWeights) for q in m.quantized.values()]


def quantized_numel(model: nn.Module) -> int:
    """Elements of every weight ``model`` holds quantized."""
    return sum(q.numel() for q in _quantized(model))
