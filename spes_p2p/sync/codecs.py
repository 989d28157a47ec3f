"""Codecs: how a unit's tensors travel between peers, as a contract both sides can check before decoding.

This module is the registry (names, and the buffers each codec puts on the wire, as plain numbers; no torch).
``spes_p2p.sync.payload`` does the arithmetic and packs the buffers into a safetensors container.

For a tensor ``N`` of ``n`` float32 elements, each codec sends these buffers (safetensors dtype, shape):

    none   N                                F32, the tensor's shape
    fp16   N                                F16, the tensor's shape
    int8   N#codes  U8 [n]       N#absmax   F32 [ceil(n / 4096)]   (bitsandbytes' signed dynamic map)
    nf4    N#codes  U8 [n/2]     N#absmax   F32 [ceil(n / 64)]     (4-bit NormalFloat, two codes a byte)
    topk   N#indices I32 [k]     N#values   F16 [k]                (k = ceil(n * topk_fraction), sorted)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

from spes_p2p.blockwise import int8_sizes, nf4_sizes
from spes_p2p.swarm.records import MAX_PARTS

CODECS = {
    "none": "float32 as it is (exact)",
    "fp16": "half precision",
    "int8": "blockwise 8-bit, blocks of 4096 (about 1% error)",
    "nf4": "blockwise 4-bit NormalFloat, blocks of 64 (about 9% error)",
    "topk": "the largest fraction of entries, with error feedback at the sender",
}
TOPK_FRACTION = 0.02
HEADER_ALLOWANCE = 4096  # safetensors' length prefix, its metadata, and slack
ENTRY_ALLOWANCE = 256  # header bytes one buffer's entry may take (name, dtype, shape, offsets)
_BYTES = {"F32": 4, "F16": 2, "U8": 1, "I32": 4}


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects of one tensor of a unit."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout(
    codec: str, spec: TensorSpec, topk_fraction: float = TOPK_FRACTION
) -> dict[str, tuple[str, tuple]]:
    """Buffer suffix ('' for the tensor itself) -> (safetensors dtype, shape) of a tensor under ``codec``."""
    n = spec.numel
    if codec == "none":
        return {"": ("F32", spec.shape)}
    if codec == "fp16":
        return {"": ("F16", spec.shape)}
    if codec in ("int8", "nf4"):
        codes, scales = int8_sizes(n) if codec == "int8" else nf4_sizes(n)
        return {"codes": ("U8", (codes,)), "absmax": ("F32", (scales,))}
    if codec == "topk":
        k = topk_count(n, topk_fraction)
        return {"indices": ("I32", (k,)), "values": ("F16", (k,))}
    raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def topk_count(numel: int, fraction: float) -> int:
    return max(1, math.ceil(numel * fraction)) if numel else 0


def buffer_name(tensor: str, suffix: str) -> str:
    return f"{tensor}#{suffix}" if suffix else tensor


def max_payload_bytes(specs: dict[str, TensorSpec], codec: str, topk_fraction: float = TOPK_FRACTION) -> int:
    """An upper bound on an honest payload's size: anything larger is refused before it is read."""
    total = HEADER_ALLOWANCE
    for spec in specs.values():
        for dtype, shape in layout(codec, spec, topk_fraction).values():
            total += _BYTES[dtype] * math.prod(shape) + ENTRY_ALLOWANCE
    return total


def part_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """The ranges [start, stop) of a flattened unit's ``parts`` contiguous parts, sizes within one of each
    other (a reduce-scatter's split; ``numel >= parts``, so none is empty)."""
    if not 1 <= parts <= min(numel, MAX_PARTS):
        raise ValueError(f"cannot split {numel} elements into {parts} parts")
    cuts = [numel * i // parts for i in range(parts + 1)]
    return list(pairwise(cuts))


def piece_spec(specs: dict[str, TensorSpec], part: int, parts: int) -> dict[str, TensorSpec]:
    """What one part of a unit (flattened in name order) travels as: one flat tensor named ``piece``."""
    start, stop = part_bounds(sum(s.numel for s in specs.values()), parts)[part]
    return {"piece": TensorSpec((stop - start,))}
