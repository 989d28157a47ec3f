"""Chunked top-k with few-bit values: the arithmetic of the ``sparseloco`` codec (``spes_p2p.sync.codecs``,
which holds the layout and the reasons for each choice).

A flat tensor of ``n`` values is cut into ``m`` chunks of ``c`` (the last padded with zeros). In each chunk
the ``k`` entries of largest magnitude are kept; of those, the nonzero ones are the chunk's **entries** (a
chunk with fewer than ``k`` nonzero values keeps exactly its nonzero values: a sparse input keeps its
support). Each entry travels as:

- its position in the chunk, ``index_bits(c)`` bits (12 for chunks of 4096);
- a code of ``bits`` bits: the sign in the high bit, and in the others its magnitude group: the chunk's
  entries ranked by magnitude are cut into ``2 ** (bits - 1)`` groups of (nearly) equal count, and every
  entry of a group decodes to the group's mean magnitude, the chunk's **levels** (float32, largest first).

A chunk's ``k`` slots are ordered by position, strictly increasing; a slot that repeats the position before
it is empty (a chunk with fewer entries than slots fills the rest so; one with none puts them all at
position 0, with its levels 0). Decoding refuses positions out of the chunk or going backwards, and levels
that are negative or not finite.
"""

from __future__ import annotations

import math

import torch

from spes_p2p.blockwise import chunking, index_bits


def sparsify(flat: torch.Tensor, chunk: int, k: int, bits: int) -> tuple[torch.Tensor, ...]:
    """(positions uint8, codes uint8, levels float32 [chunks, 2 ** (bits - 1)]) of a flat float32 tensor."""
    size, chunks, slots = chunking(flat.numel(), chunk, k)
    groups = 2 ** (bits - 1)
    rows = flat.float()
    if chunks * size > flat.numel():  # (a copy of the whole tensor: only when its last chunk is short)
        rows = torch.nn.functional.pad(rows, (0, chunks * size - flat.numel()))
    rows = rows.view(chunks, size)
    top = rows.abs().topk(slots, dim=1, sorted=True)  # by magnitude, largest first
    magnitude, position = top.values, top.indices
    entries = (magnitude > 0).sum(dim=1, keepdim=True)  # (chunks, 1)
    rank = torch.arange(slots, device=flat.device).expand(chunks, slots)
    real = rank < entries
    group = torch.where(real, rank * groups // entries.clamp_min(1), 0)
    total = magnitude.new_zeros(chunks, groups).scatter_add_(1, group, magnitude * real)
    count = magnitude.new_zeros(chunks, groups).scatter_add_(1, group, real.float())
    levels = total / count.clamp_min(1)
    negative = rows.gather(1, position) < 0
    codes = torch.where(real, group + groups * negative, 0)
    # by position, the empty slots last, each repeating the last entry's position (0 in an empty chunk)
    order = torch.where(real, position, size).sort(dim=1)
    position, codes = order.values, codes.gather(1, order.indices)
    last = position.gather(1, (entries - 1).clamp_min(0)) * (entries > 0)
    position = torch.where(real, position, last)
    return pack_bits(position.flatten(), index_bits(size)), pack_bits(codes.flatten(), bits), levels


def densify(
    positions: torch.Tensor,
    codes: torch.Tensor,
    levels: torch.Tensor,
    numel: int,
    chunk: int,
    k: int,
    bits: int,
) -> torch.Tensor:
    """The flat float32 tensor of ``numel`` values that ``sparsify``'s buffers stand for; ``ValueError`` for
    buffers no honest sender makes."""
    size, chunks, slots = chunking(numel, chunk, k)
    groups = 2 ** (bits - 1)
    if not (levels.isfinite().all() and (levels >= 0).all()):
        raise ValueError("chunk levels are negative or not finite")
    position = unpack_bits(positions, index_bits(size), chunks * slots).view(chunks, slots)
    code = unpack_bits(codes, bits, chunks * slots).view(chunks, slots)
    if (position >= size).any() or (position[:, 1:] < position[:, :-1]).any():
        raise ValueError("positions out of their chunk or not in order")
    real = torch.ones_like(position, dtype=torch.bool)
    real[:, 1:] = position[:, 1:] != position[:, :-1]
    sign = 1.0 - 2.0 * (code >= groups).float()
    values = sign * levels.gather(1, code % groups) * real
    at = position + torch.arange(chunks, device=position.device).unsqueeze(1) * size
    out = values.new_zeros(chunks * size).index_add_(0, at.flatten(), values.flatten())
    return out[:numel]


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below ``2 ** width``, ``width`` bits each, least significant first, as bytes."""
    size, (per, group) = math.ceil(values.numel() * width / 8), _grouping(width)
    if per == 0:  # (a width whose group would not fit 56 bits: one bit at a time)
        shifts = torch.arange(width, device=values.device, dtype=torch.int32)
        bits = ((values.int().unsqueeze(1) >> shifts) & 1).to(torch.uint8).flatten()
        bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], device=values.device, dtype=torch.uint8)
        return (bits * weights).sum(dim=1, dtype=torch.uint8)
    # ``per`` values fill ``group`` bytes exactly: add them up shifted into one int64, then cut it in bytes
    values = torch.nn.functional.pad(values.long(), (0, -values.numel() % per)).view(-1, per)
    shifts = torch.arange(per, device=values.device, dtype=torch.int64) * width
    packed = (values << shifts).sum(dim=1, keepdim=True)
    cuts = torch.arange(group, device=values.device, dtype=torch.int64) * 8
    return ((packed >> cuts) & 0xFF).to(torch.uint8).flatten()[:size]


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers (int64) that ``pack_bits`` wrote into ``packed``."""
    per, group = _grouping(width)
    if per == 0:
        shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
        bits = ((packed.unsqueeze(1) >> shifts) & 1).flatten()[: count * width].view(count, width)
        weights = 2 ** torch.arange(width, device=packed.device, dtype=torch.int64)
        return (bits.long() * weights).sum(dim=1)
    needed = -(-count // per) * group
    packed = torch.nn.functional.pad(packed[:needed].long(), (0, needed - min(needed, packed.numel())))
    cuts = torch.arange(group, device=packed.device, dtype=torch.int64) * 8
    whole = (packed.view(-1, group) << cuts).sum(dim=1, keepdim=True)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * width
    return ((whole >> shifts) & ((1 << width) - 1)).flatten()[:count]


def _grouping(width: int) -> tuple[int, int]:
    """(values that fill a whole number of bytes, those bytes), or (0, 0) where that group is wider than 56
    bits (widths 9, 11, 13 and 15)."""
    bits = math.lcm(width, 8)
    return (bits // width, bits // 8) if bits <= 56 else (0, 0)
