"""Codecs: how a unit's tensors travel between peers, each an object with its name, its parameters, its
layout on the wire, the bound on an honest payload's size, and its arithmetic (``encode`` / ``decode``).

``CODECS`` is the registry: adding a codec is a class and one line there. ``Codecs.of(sync)`` configures
them with the swarm's ``[sync]`` settings (a codec whose parameters are settings, like top-k's fraction,
reads them in its ``configured``). ``spes_p2p.sync.payload`` packs a codec's buffers into a safetensors
container and checks them against the layout before any codec sees a byte.

For a tensor ``N`` of ``n`` float32 elements, each codec sends these buffers (safetensors dtype, shape):

    none   N                                F32, the tensor's shape
    fp16   N                                F16, the tensor's shape
    int8   N#codes  U8 [n]       N#absmax   F32 [ceil(n / 4096)]   (bitsandbytes' signed dynamic map)
    nf4    N#codes  U8 [n/2]     N#absmax   F32 [ceil(n / 64)]     (4-bit NormalFloat, two codes a byte)
    topk   N#indices I32 [k]     N#values   F16 [k]                (k = ceil(n * fraction), sorted)
    sparseloco  N#positions U8 [ceil(m * s * 12 / 8)]   N#codes U8 [ceil(m * s * bits / 8)]
                N#levels F32 [m, 2 ** (bits - 1)]      (m chunks of 4096, s = k slots each; spes_p2p.sparsify)

The layouts are plain numbers and this module imports no torch (the settings list the codecs, and ``spes
--help`` stays light); the arithmetic takes and returns tensors, and the blockwise codecs import
``spes_p2p.quantize`` (torch) on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING, ClassVar

from spes_p2p.blockwise import chunking, index_bits, int8_sizes, nf4_sizes
from spes_p2p.errors import SpesError
from spes_p2p.fields import Section
from spes_p2p.swarm.records import MAX_PARTS

if TYPE_CHECKING:
    import torch

HEADER_ALLOWANCE = 4096  # safetensors' length prefix, its metadata, and slack
ENTRY_ALLOWANCE = 256  # header bytes one buffer's entry may take (name, dtype, shape, offsets)
_BYTES = {"F32": 4, "F16": 2, "U8": 1, "I32": 4}

Layout = dict[str, tuple[str, tuple[int, ...]]]  # buffer suffix ('' for the tensor itself) -> (dtype, shape)


class PayloadError(SpesError):
    """A payload that is corrupt, oversized, or does not match what was expected."""


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects of one tensor of a unit."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Codec:
    """One way to code a flat float32 tensor as buffers, and back. ``decode`` gets buffers whose dtypes and
    shapes already match ``layout``; it raises ``PayloadError`` for values no honest sender makes."""

    name: ClassVar[str]
    help: ClassVar[str]
    lossless: ClassVar[bool] = False  # whether error feedback has nothing to carry
    feedback_decay: ClassVar[float] = 1.0  # what of the last round's residual error feedback carries

    def layout(self, spec: TensorSpec) -> Layout:
        raise NotImplementedError

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The buffers of ``flat``, in ``layout`` order, on its device."""
        raise NotImplementedError

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        raise NotImplementedError

    def configured(self, sync: Section) -> Codec:
        """This codec with the parameters the swarm's ``[sync]`` settings give it (most have none)."""
        return self

    def combined(self, pieces: int) -> Codec:
        """How a combination of ``pieces`` payloads of this codec travels (a reduce-scatter's combined part):
        a sparse codec widens to carry every entry the pieces carried; the others stay as they are."""
        return self

    def max_bytes(self, specs: dict[str, TensorSpec]) -> int:
        """An upper bound on an honest payload's size: anything larger is refused before it is read."""
        total = HEADER_ALLOWANCE
        for spec in specs.values():
            for dtype, shape in self.layout(spec).values():
                total += _BYTES[dtype] * math.prod(shape) + ENTRY_ALLOWANCE
        return total

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class Exact(Codec):
    name, help, lossless = "none", "float32 as it is (exact)", True

    def layout(self, spec: TensorSpec) -> Layout:
        return {"": ("F32", spec.shape)}

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat]

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        return buffers[0].flatten()


class Half(Codec):
    name, help = "fp16", "half precision"

    def layout(self, spec: TensorSpec) -> Layout:
        return {"": ("F16", spec.shape)}

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat.half()]

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        return buffers[0].flatten().float()


class Int8(Codec):
    name, help = "int8", "blockwise 8-bit, blocks of 4096 (about 1% error)"

    def layout(self, spec: TensorSpec) -> Layout:
        codes, scales = int8_sizes(spec.numel)
        return {"codes": ("U8", (codes,)), "absmax": ("F32", (scales,))}

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        from spes_p2p.quantize import quantize_int8

        return list(quantize_int8(flat))

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        from spes_p2p.quantize import dequantize_int8

        codes, absmax = _finite_scales(buffers)
        return dequantize_int8(codes, absmax)


class NF4(Codec):
    name, help = "nf4", "blockwise 4-bit NormalFloat, blocks of 64 (about 9% error)"

    def layout(self, spec: TensorSpec) -> Layout:
        codes, scales = nf4_sizes(spec.numel)
        return {"codes": ("U8", (codes,)), "absmax": ("F32", (scales,))}

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        from spes_p2p.quantize import quantize_nf4

        return list(quantize_nf4(flat))

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        from spes_p2p.quantize import dequantize_nf4

        codes, absmax = _finite_scales(buffers)
        return dequantize_nf4(codes, absmax, numel)


@dataclass(frozen=True)
class TopK(Codec):
    """The largest ``fraction`` of entries (by magnitude), their indices sorted, values in half precision;
    what it drops is carried to the next round by error feedback at the sender."""

    fraction: float = 0.02
    name, help = "topk", "the largest fraction of entries, with error feedback at the sender"

    def configured(self, sync: Section) -> TopK:
        return TopK(sync.topk_fraction)

    def combined(self, pieces: int) -> TopK:
        return TopK(min(1.0, self.fraction * pieces))

    def count(self, numel: int) -> int:
        return max(1, math.ceil(numel * self.fraction)) if numel else 0

    def layout(self, spec: TensorSpec) -> Layout:
        k = self.count(spec.numel)
        return {"indices": ("I32", (k,)), "values": ("F16", (k,))}

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        indices = flat.abs().topk(self.count(flat.numel()), sorted=False).indices.sort().values
        return [indices.int(), flat[indices].half()]

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        indices, values = buffers[0].long(), buffers[1].float()
        if len(indices) and (
            indices.min() < 0 or indices.max() >= numel or (indices[1:] <= indices[:-1]).any()
        ):
            raise PayloadError("top-k indices out of range or not strictly increasing")
        return values.new_zeros(numel).index_put_((indices,), values)


@dataclass(frozen=True)
class SparseLoCo(Codec):
    """SparseLoCo's compression (arXiv 2508.15706), as docs/protocol.md describes it: in each chunk of
    ``chunk`` values the ``k`` largest by magnitude, each as its position and a ``bits``-bit code (a sign and
    a magnitude group whose mean the chunk sends); error feedback carries what was not sent, its older part
    decayed by ``feedback_decay`` each round, and stands in for an outer momentum."""

    chunk: int = 4096
    k: int = 64
    bits: int = 2
    feedback_decay: float = 0.95  # type: ignore[misc]  (a setting here; a constant of the other codecs)
    name, help = "sparseloco", "per chunk of 4096 the top 64 entries in 2 bits, error feedback with decay"

    def configured(self, sync: Section) -> SparseLoCo:
        return SparseLoCo(sync.sparse_chunk, sync.sparse_k, sync.sparse_bits, sync.sparse_decay)

    def combined(self, pieces: int) -> SparseLoCo:
        return replace(self, k=min(self.chunk, self.k * pieces))

    def layout(self, spec: TensorSpec) -> Layout:
        size, chunks, slots = chunking(spec.numel, self.chunk, self.k)
        entries = chunks * slots
        return {
            "positions": ("U8", (math.ceil(entries * index_bits(size) / 8),)),
            "codes": ("U8", (math.ceil(entries * self.bits / 8),)),
            "levels": ("F32", (chunks, 2 ** (self.bits - 1))),
        }

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        from spes_p2p.sparsify import sparsify

        return list(sparsify(flat, self.chunk, self.k, self.bits))

    def decode(self, buffers: list[torch.Tensor], numel: int) -> torch.Tensor:
        from spes_p2p.sparsify import densify

        try:
            return densify(*buffers, numel, self.chunk, self.k, self.bits)
        except ValueError as exc:
            raise PayloadError(str(exc)) from None


CODECS: dict[str, Codec] = {c.name: c for c in (Exact(), Half(), Int8(), NF4(), TopK(), SparseLoCo())}
EXACT = CODECS["none"]


@dataclass(frozen=True)
class Codecs:
    """The swarm's codecs as its ``[sync]`` settings configure them: ``update`` (how updates travel),
    ``refresh`` (how frozen copies' changes travel), and any by name (``codecs["int8"]``: a frozen copy's
    own format, or what a peer asks for)."""

    by_name: dict[str, Codec]
    update: Codec
    refresh: Codec

    @classmethod
    def of(cls, sync: Section) -> Codecs:
        by_name = {name: codec.configured(sync) for name, codec in CODECS.items()}
        return cls(by_name, by_name[sync.codec], by_name[sync.refresh_codec])

    def __getitem__(self, name: str) -> Codec:
        return self.by_name[name]


def buffer_name(tensor: str, suffix: str) -> str:
    return f"{tensor}#{suffix}" if suffix else tensor


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


def _finite_scales(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    if not buffers[1].isfinite().all():
        raise PayloadError("block scales are not finite")
    return buffers
