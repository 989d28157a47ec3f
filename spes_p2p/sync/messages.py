"""The RPC requests peers send each other, as typed msgpack messages decoded strictly.

Answers are payloads (``spes_p2p.sync.payload``): safetensors whose metadata names the unit and round.

    spes/update   UpdateRequest  -> our coded update of that round ("delta"), its end weights ("end"), part
                                  ``part`` of ``parts`` of it ("piece"), or, of a part we own, our row's
                                  combined update ("reduced") or all rows' ("merged"; see
                                  ``sync/reduce_scatter.py``)
    spes/weights  WeightsRequest -> our weights of a unit, as of ``round`` when we still have it; or its
                                  current version, or the change that made version ``round``, of the
                                  exact chain or a quantized one; or only the SHA-256 of that, or its
                                  index or one of its chunks (``sync/chunks.py``)

A request that is too large, not msgpack, of the wrong schema (a missing or unknown field, a wrong type, an
unknown unit or codec) is a ``BadRequest``: the server answers with a failure, never an exception of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from spes_p2p.net.wire import BadRequest, Strict
from spes_p2p.swarm.records import MAX_PARTS, Round, Unit
from spes_p2p.sync.chunks import MAX_CHUNKS
from spes_p2p.sync.codecs import CODECS
from spes_p2p.sync.versions import QUANTIZED

if TYPE_CHECKING:
    from spes_p2p.sync.versions import Want

RPC_UPDATE = "spes/update"
RPC_WEIGHTS = "spes/weights"
MAX_REQUEST_BYTES = 1024
NOT_HELD = "-"  # the answer to a digest request (WeightsRequest.digest) for a unit the peer does not hold

CodecName = Literal[tuple(CODECS)]  # type: ignore[valid-type]


class Message(Strict):
    MAX_BYTES = MAX_REQUEST_BYTES
    ERROR = BadRequest


class UpdateRequest(Message):
    round: Round
    unit: Unit
    kind: Literal["delta", "end", "piece", "reduced", "merged"] = "delta"
    part: Annotated[int, msgspec.Meta(ge=0, lt=MAX_PARTS)] = 0  # piece, reduced, merged: which part...
    parts: Annotated[int, msgspec.Meta(ge=0, le=MAX_PARTS)] = 0  # ...of how many

    def __post_init__(self) -> None:
        split = self.kind in ("piece", "reduced", "merged")
        if split != (self.part < self.parts) or (not split and self.parts):
            raise ValueError("part and parts go with kinds piece, reduced and merged, with part < parts")


class WeightsRequest(Message):
    unit: Unit
    codec: CodecName
    round: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: the newest
    any_copy: bool = False  # newcomers: a unit we do not hold is answered from our own copy
    kind: Literal["weights", "version", "change"] = "weights"  # see sync/versions.py
    # only the SHA-256 of what would be served, of exactly that round (another holder's download confirmed)
    digest: bool = False
    # versions and changes: of the exact chain, or of a quantized format's (a version in that format or exact)
    chain: Literal[("full", *QUANTIZED)] = "full"  # type: ignore[valid-type]
    # only the index of what would be served (sync/chunks.py), or one chunk of it, of exactly that round
    index: bool = False
    chunk: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_CHUNKS)] = -1

    def __post_init__(self) -> None:
        if self.digest + self.index + (self.chunk >= 0) > 1 or (
            self.any_copy and (self.index or self.chunk >= 0)
        ):
            raise ValueError("ask for one of digest, index or chunk, and not of a peer's own copy")
        whole = self.kind == "version" and self.codec in (self.chain, "none")
        if self.chain != "full" and not (whole or self.kind == "change"):
            raise ValueError(
                "a quantized chain has versions (in its format or exact) and changes, no weights"
            )


def weights_request(unit: str, want: Want, round_: int, **flags: bool) -> bytes:
    """The request for ``want`` of ``unit`` as of ``round_`` (with ``digest``, ``index``, ``chunk``...)."""
    return WeightsRequest(
        unit=unit, codec=want.codec, round=round_, kind=want.kind, chain=want.chain, **flags
    ).encode()
