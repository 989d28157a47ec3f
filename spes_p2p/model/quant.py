"""Frozen experts held quantized: 8-bit blockwise (bitsandbytes' dynamic map) or 4-bit NF4.

Another peer holds the real copy of an expert this peer does not train, so the local copy may be lossy. A
quantized weight is dequantized per matmul when it is used, and its backward dequantizes it again instead of
keeping it, so no full-precision copy of a frozen expert outlives the op that used it. Gradients still flow
through it to the inputs (the router and attention get theirs); the weight itself gets none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model.config import FROZEN_FORMATS
from spes_p2p.quantize import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4


def check_format(kind: str) -> str:
    if kind not in FROZEN_FORMATS:
        raise ConfigError(f"frozen experts must be one of {', '.join(FROZEN_FORMATS)}, got {kind!r}")
    return kind


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

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.absmax.numel()

    def numel(self) -> int:
        return self.shape.numel()


class _FrozenMatmul(torch.autograd.Function):
    """``x @ W`` for a quantized W: the gradient reaches x, never W; W is dequantized again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
        ctx.weight = weight
        return x @ weight.dequantize().to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.weight.dequantize().to(grad.dtype).t(), None


def frozen_matmul(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    return _FrozenMatmul.apply(x, weight)
