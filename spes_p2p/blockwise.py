"""The layouts of blockwise 8-bit and 4-bit quantization: block sizes and buffer sizes (plain integers, no
torch; the arithmetic is in ``spes_p2p.quantize``).

int8: bitsandbytes' signed dynamic map, blocks of 4096, one float32 absmax per block (about 1% error).
nf4:  4-bit NormalFloat, blocks of 64, one float32 absmax per block, two codes per byte (about 9% error).
"""

from __future__ import annotations

import math

INT8_BLOCK = 4096
NF4_BLOCK = 64


def int8_sizes(numel: int) -> tuple[int, int]:
    """Elements of (codes, absmax) for a tensor of ``numel`` elements."""
    return numel, math.ceil(numel / INT8_BLOCK)


def nf4_sizes(numel: int) -> tuple[int, int]:
    return math.ceil(numel / 2), math.ceil(numel / NF4_BLOCK)
