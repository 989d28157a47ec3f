"""Blockwise 8-bit and 4-bit quantization of flat float32 tensors, shared by the codecs that move tensors
between peers and the frozen copies (experts, dense blocks) a peer holds quantized. The layouts (block sizes,
buffer sizes) are in ``spes_p2p.blockwise``; the tables are bitsandbytes' (its signed dynamic map, and NF4),
computed without importing it.

A value is divided by its block's absmax and takes the code of the nearest table entry (ties to the lower
one, as bitsandbytes rounds); NF4 packs two codes per byte, the first in the high nibble.

The arithmetic is plain torch rather than bitsandbytes' CPU kernels: with several threads quantizing at once
(a peer serves, fetches and trains concurrently), those kernels now and then left a whole block of the output
unwritten, so two peers coding the same weights could send different bytes. These ops are deterministic and
safe to run from any thread, on any device.
"""

from __future__ import annotations

import functools

import torch

from spes_p2p.blockwise import INT8_BLOCK, NF4_BLOCK


def quantize_int8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n], absmax float32 [ceil(n / 4096)])."""
    normed, absmax = _normalized(flat, INT8_BLOCK)
    return _nearest(normed, _dynamic_map(flat.device)).to(torch.uint8), absmax


def dequantize_int8(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    return _scaled(_dynamic_map(codes.device)[codes.long()], absmax, INT8_BLOCK)


def quantize_nf4(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [ceil(n / 2)], absmax float32 [ceil(n / 64)])."""
    normed, absmax = _normalized(flat, NF4_BLOCK)
    codes = _nearest(normed, _nf4_table(flat.device))
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8), absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
    pairs = torch.stack([codes.long() >> 4, codes.long() & 0x0F], dim=1).flatten()[:numel]
    return _scaled(_nf4_table(codes.device)[pairs], absmax, NF4_BLOCK)


def dequantize_int8_at(codes: torch.Tensor, absmax: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``dequantize_int8(codes, absmax)[at]`` for flat positions ``at`` (any shape), decoding only those."""
    return _dynamic_map(codes.device)[codes[at].long()] * absmax[at // INT8_BLOCK]


def dequantize_nf4_at(codes: torch.Tensor, absmax: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``dequantize_nf4(codes, absmax, n)[at]`` for flat positions ``at`` (any shape), decoding only those."""
    pairs = codes[at // 2].long()
    nibbles = torch.where(at % 2 == 0, pairs >> 4, pairs & 0x0F)
    return _nf4_table(codes.device)[nibbles] * absmax[at // NF4_BLOCK]


def _normalized(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each value divided by its block's absmax (a block of zeros stays zero), and the absmax per block."""
    flat = flat.detach().float().flatten()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    return normed.flatten()[:n], absmax


def _nearest(normed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index of the nearest entry of an ascending ``table`` (ties: the lower entry)."""
    midpoints = (table[1:] + table[:-1]) / 2
    return torch.bucketize(normed, midpoints)


def _scaled(values: torch.Tensor, absmax: torch.Tensor, block: int) -> torch.Tensor:
    return values * absmax.repeat_interleave(block)[: values.numel()]


# bitsandbytes' tables, computed here as it computes them (``tests/test_quant.py`` checks they are the same):
# importing bitsandbytes imports torch's compiler stack, about 115 MB a process, which a peer that only codes
# (virtual compute, docs/simulate.md) need not pay.
NF4 = (  # bitsandbytes.functional.get_4bit_type("nf4")
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@functools.cache
def _dynamic_map(device: torch.device) -> torch.Tensor:
    """bitsandbytes.functional.create_dynamic_map(signed=True): for each of 7 decades 10^-6 .. 10^0, 2^i
    evenly spaced magnitudes of each sign (the midpoints of a linspace over [0.1, 1]), with 0 and 1."""
    data = [0.0, 1.0]
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist() + (-(10 ** (i - 6)) * means).tolist()
    table = torch.tensor(sorted(data), dtype=torch.float32)
    table[0] = -1.0  # (bitsandbytes' own kernel sets this too: the map then spans [-1, 1])
    return table.to(device)


@functools.cache
def _nf4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4, dtype=torch.float32).to(device)
