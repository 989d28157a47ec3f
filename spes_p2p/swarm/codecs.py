"""Codecs: how a dict of named tensors travels between peers.

Wire format (never pickle, never ``torch.load``)::

    b"SPES" | version u8 | header length u32 (big-endian) | header (UTF-8 JSON) | body (raw buffers)

The header holds the codec name, the body's SHA-256 and length, and for every tensor its name, shape, dtype
and the byte ranges of its buffers inside the body. ``decode`` checks everything against the tensor specs the
receiver expects (names, shapes, dtypes), the size limits (before allocating anything), the checksum, and
that every decoded value is finite, and raises ``PayloadError`` otherwise.

Codecs:
    none   the tensors' own bytes (float32)
    fp16   half precision
    int8   blockwise 8-bit (bitsandbytes' dynamic map, blocks of 4096, one float32 absmax per block)
    nf4    blockwise 4-bit NormalFloat (blocks of 64, one float32 absmax per block): how peers that hold
           their frozen experts in 4 bits ask for them
    topk   the largest ``fraction`` of entries by magnitude: int32 indices + float16 values; the sender keeps
           what was not sent as error feedback (``TopKFeedback``) and adds it to the next update
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch

from spes_p2p.blockwise import (
    INT8_BLOCK,
    NF4_BLOCK,
    dequantize_int8,
    dequantize_nf4,
    int8_sizes,
    nf4_sizes,
    quantize_int8,
    quantize_nf4,
)
from spes_p2p.errors import SpesError

MAGIC, VERSION = b"SPES", 1
MAX_HEADER_BYTES = 1 << 20
CODECS = ("none", "fp16", "int8", "nf4", "topk")
TOPK_FRACTION = 0.02


class PayloadError(SpesError):
    """A payload that is corrupt, oversized, or does not match what was expected."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def specs_of(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in tensors.items()}


def encode(tensors: dict[str, torch.Tensor], codec: str, topk_fraction: float = TOPK_FRACTION) -> bytes:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    entries, buffers, offset = [], [], 0
    for name, tensor in tensors.items():
        parts = _ENCODERS[codec](tensor.detach().float().contiguous().flatten(), topk_fraction)
        ranges = []
        for part in parts:
            raw = part.contiguous().numpy().tobytes()
            ranges.append([offset, len(raw)])
            buffers.append(raw)
            offset += len(raw)
        entries.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "parts": ranges,
            }
        )
    body = b"".join(buffers)
    header = json.dumps(
        {
            "codec": codec,
            "tensors": entries,
            "body_bytes": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }
    ).encode()
    return MAGIC + bytes([VERSION]) + len(header).to_bytes(4, "big") + header + body


def decode(
    payload: bytes, expected: dict[str, TensorSpec], codec: str | None = None
) -> dict[str, torch.Tensor]:
    """Checks and decodes a payload; ``expected`` names every tensor it must hold and nothing else."""
    header, body = _split(payload, expected)
    if codec is not None and header.get("codec") != codec:
        raise PayloadError(f"payload codec {header.get('codec')!r}, expected {codec!r}")
    if header["codec"] not in CODECS:
        raise PayloadError(f"unknown codec {header['codec']!r}")
    entries = header["tensors"]
    if not isinstance(entries, list) or [e.get("name") for e in entries] != list(expected):
        raise PayloadError("payload tensors do not match the expected names")
    out = {}
    for entry in entries:
        spec = expected[entry["name"]]
        if entry.get("shape") != list(spec.shape) or entry.get("dtype") != str(spec.dtype).removeprefix(
            "torch."
        ):
            raise PayloadError(
                f"{entry['name']}: shape/dtype {entry.get('shape')} {entry.get('dtype')} "
                f"differ from {list(spec.shape)} {spec.dtype}"
            )
        parts = [_slice(body, r) for r in entry.get("parts", [])]
        flat = _DECODERS[header["codec"]](parts, spec.numel)
        if flat.numel() != spec.numel or not torch.isfinite(flat).all():
            raise PayloadError(f"{entry['name']}: decoded values are malformed or not finite")
        out[entry["name"]] = flat.view(spec.shape).to(spec.dtype)
    return out


def max_payload_bytes(expected: dict[str, TensorSpec], codec: str) -> int:
    """An upper bound on an honest payload's size: anything larger is refused before it is read."""
    per_element = {"none": 4, "fp16": 2, "int8": 1, "nf4": 0.5, "topk": 6}[codec]
    block = NF4_BLOCK if codec == "nf4" else INT8_BLOCK
    body = sum(math.ceil(s.numel * per_element) + 4 * (s.numel // block + 1) for s in expected.values())
    return body + 512 * len(expected) + 1024


def _split(payload: bytes, expected: dict[str, TensorSpec]) -> tuple[dict, bytes]:
    if len(payload) < 9 or payload[:4] != MAGIC:
        raise PayloadError("not a spes payload (bad magic)")
    if payload[4] != VERSION:
        raise PayloadError(f"payload version {payload[4]}, this peer reads version {VERSION}")
    size = int.from_bytes(payload[5:9], "big")
    if size > MAX_HEADER_BYTES or 9 + size > len(payload):
        raise PayloadError("payload header is truncated or too large")
    try:
        header = json.loads(payload[9 : 9 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PayloadError("payload header is not valid JSON") from None
    if not isinstance(header, dict):
        raise PayloadError("payload header is not an object")
    body = payload[9 + size :]
    if header.get("body_bytes") != len(body):
        raise PayloadError(f"payload body has {len(body)} bytes, header says {header.get('body_bytes')}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise PayloadError("payload checksum mismatch")
    return header, body


def _slice(body: bytes, byte_range) -> bytes:
    if not (
        isinstance(byte_range, list) and len(byte_range) == 2 and all(isinstance(x, int) for x in byte_range)
    ):
        raise PayloadError("malformed buffer range")
    start, length = byte_range
    if start < 0 or length < 0 or start + length > len(body):
        raise PayloadError("buffer range outside the body")
    return body[start : start + length]


def _frombuffer(raw: bytes, dtype: torch.dtype, count: int) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != count * itemsize:
        raise PayloadError(f"buffer of {len(raw)} bytes, expected {count * itemsize}")
    return torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)


# ---------------------------------------------------------------------------------------- per codec


def _enc_none(flat, _):
    return [flat]


def _dec_none(parts, numel):
    (raw,) = _expect_parts(parts, 1)
    return _frombuffer(raw, torch.float32, numel)


def _enc_fp16(flat, _):
    return [flat.half()]


def _dec_fp16(parts, numel):
    (raw,) = _expect_parts(parts, 1)
    return _frombuffer(raw, torch.float16, numel).float()


def _enc_int8(flat, _):
    return list(quantize_int8(flat))


def _dec_int8(parts, numel):
    codes, absmax = _quantized_parts(parts, int8_sizes(numel))
    return dequantize_int8(codes, absmax)


def _enc_nf4(flat, _):
    return list(quantize_nf4(flat))


def _dec_nf4(parts, numel):
    codes, absmax = _quantized_parts(parts, nf4_sizes(numel))
    return dequantize_nf4(codes, absmax, numel)


def _quantized_parts(parts, sizes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    raw_codes, raw_absmax = _expect_parts(parts, 2)
    codes = _frombuffer(raw_codes, torch.uint8, sizes[0])
    absmax = _frombuffer(raw_absmax, torch.float32, sizes[1])
    if not torch.isfinite(absmax).all():
        raise PayloadError("block scales are not finite")
    return codes, absmax


def _enc_topk(flat, fraction):
    k = max(1, math.ceil(flat.numel() * fraction)) if flat.numel() else 0
    indices = (
        flat.abs().topk(k, sorted=False).indices.sort().values if k else torch.empty(0, dtype=torch.long)
    )
    return [indices.int(), flat[indices].half()]


def _dec_topk(parts, numel):
    raw_idx, raw_val = _expect_parts(parts, 2)
    k = len(raw_idx) // 4
    indices = _frombuffer(raw_idx, torch.int32, k).long()
    values = _frombuffer(raw_val, torch.float16, k).float()
    if k and (indices.min() < 0 or indices.max() >= numel):
        raise PayloadError("top-k index out of range")
    return torch.zeros(numel).index_put_((indices,), values)


def _expect_parts(parts, n):
    if len(parts) != n:
        raise PayloadError(f"expected {n} buffers per tensor, got {len(parts)}")
    return parts


_ENCODERS = {"none": _enc_none, "fp16": _enc_fp16, "int8": _enc_int8, "nf4": _enc_nf4, "topk": _enc_topk}
_DECODERS = {"none": _dec_none, "fp16": _dec_fp16, "int8": _dec_int8, "nf4": _dec_nf4, "topk": _dec_topk}


class TopKFeedback:
    """Error feedback for top-k: what a round did not send is added to the next round's update."""

    def __init__(self) -> None:
        self.residual: dict[str, torch.Tensor] = {}

    def encode(self, update: dict[str, torch.Tensor], fraction: float = TOPK_FRACTION) -> bytes:
        full = {n: t + self.residual[n] if n in self.residual else t.clone() for n, t in update.items()}
        payload = encode(full, "topk", fraction)
        sent = decode(payload, specs_of(full), "topk")
        self.residual = {n: full[n] - sent[n] for n in full}
        return payload
