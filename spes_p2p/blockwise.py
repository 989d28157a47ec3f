"""The layouts of blockwise 8-bit and 4-bit quantization and of chunked top-k: block sizes and buffer sizes
(plain integers, no torch; the arithmetic is in ``spes_p2p.quantize`` and ``spes_p2p.sparsify``).

int8: bitsandbytes' signed dynamic map, blocks of 4096, one float32 absmax per block (about 1% error).
nf4:  4-bit NormalFloat, blocks of 64, one float32 absmax per block, two codes per byte (about 9% error).
sparse: chunks of up to 4096, a few slots each, a position of ``index_bits`` bits per slot.
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


def index_bits(chunk: int) -> int:
    """Bits to write a position in a chunk of ``chunk`` values."""
    return max(1, (chunk - 1).bit_length())


def chunking(numel: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(chunk size, chunks, slots per chunk) for a tensor of ``numel`` values: a tensor smaller than a chunk
    is one chunk of its own size."""
    size = max(1, min(chunk, numel))
    return size, math.ceil(numel / size), min(k, size)
