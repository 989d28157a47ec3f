"""Blockwise 8-bit and 4-bit quantization of flat float32 tensors (bitsandbytes, CPU or GPU), shared by the
codecs that move tensors between peers and the frozen experts a peer holds quantized.

int8: bitsandbytes' signed dynamic map, blocks of 4096, one float32 absmax per block (about 1% error).
nf4:  4-bit NormalFloat, blocks of 64, one float32 absmax per block, two codes per byte (about 9% error).
"""

from __future__ import annotations

import math

import torch

from spes_p2p.compat import bitsandbytes

INT8_BLOCK = 4096
NF4_BLOCK = 64


def quantize_int8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n], absmax float32 [ceil(n / 4096)])."""
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0)
    codes, state = bitsandbytes().functional.quantize_blockwise(flat.float(), blocksize=INT8_BLOCK)
    return codes, state.absmax.float()


def dequantize_int8(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    if codes.numel() == 0:
        return torch.empty(0)
    functional = bitsandbytes().functional
    return functional.dequantize_blockwise(codes, absmax=absmax, code=_dynamic_map(), blocksize=INT8_BLOCK)


def quantize_nf4(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [ceil(n / 2)], absmax float32 [ceil(n / 64)])."""
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0)
    functional = bitsandbytes().functional
    codes, state = functional.quantize_4bit(flat.float(), blocksize=NF4_BLOCK, quant_type="nf4")
    return codes.flatten(), state.absmax.float()


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0)
    functional = bitsandbytes().functional
    state = functional.QuantState(
        absmax=absmax,
        shape=torch.Size([numel]),
        code=functional.get_4bit_type("nf4", device=codes.device),
        blocksize=NF4_BLOCK,
        quant_type="nf4",
        dtype=torch.float32,
    )
    return functional.dequantize_4bit(codes.view(-1, 1), state)


def int8_sizes(numel: int) -> tuple[int, int]:
    """Elements of (codes, absmax) for a tensor of ``numel`` elements."""
    return numel, math.ceil(numel / INT8_BLOCK)


def nf4_sizes(numel: int) -> tuple[int, int]:
    return math.ceil(numel / 2), math.ceil(numel / NF4_BLOCK)


def _dynamic_map() -> torch.Tensor:
    global _MAP
    if _MAP is None:
        _MAP = bitsandbytes().functional.create_dynamic_map(signed=True)
    return _MAP


_MAP = None
