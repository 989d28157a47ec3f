"""What a peer serves to the others, and for how long.

- its coded update of each unit it trained, per round (``spes/update``, kind "delta"; or in parts, kind
  "piece", for a reduce-scatter), the end weights behind it (kind "end", uncompressed, for
  re-synchronization), and its row's combined update of each part it owns (kind "reduced"), and all rows'
  (kind "merged");
- its weights of each unit it holds, per round (``spes/weights``), so that every peer that starts training
  a unit gets the same weights of a round; newcomers may ask for its own copy of any unit;
- the current version of each unit it holds, and the change that made it (``sync/versions.py``), for the
  peers that keep frozen copies.

Everything is kept for ``KEEP_ROUNDS`` rounds (end weights for ``END_KEEP_ROUNDS``), and kept as it is
served: as payloads (the weights and end weights in the exact ``none`` codec), never as tensors beside them.
What is asked for in another codec is coded from them once and kept too. Threads: the sync and training
threads post and forget; the transport's handler threads read; one lock guards the maps, and payloads are
encoded outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from spes_p2p.net.transport import Transport, Unavailable
from spes_p2p.net.wire import BadRequest
from spes_p2p.sync.chunks import ChunkIndex, chunk_of
from spes_p2p.sync.codecs import EXACT, Codecs, TensorSpec
from spes_p2p.sync.messages import (
    MAX_REQUEST_BYTES,
    NOT_HELD,
    RPC_UPDATE,
    RPC_WEIGHTS,
    Message,
    UpdateRequest,
    WeightsRequest,
)
from spes_p2p.sync.payload import encode, metadata_of, payload_meta, served_digest, tensors_of
from spes_p2p.sync.versions import Versions

KEEP_ROUNDS = 3
END_KEEP_ROUNDS = 2  # end weights are asked for by co-holders that re-synchronize in the same round
M = TypeVar("M", bound=Message)

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Posted:
    """One of our updates: its payload (or its parts' payloads), the end weights behind it (a ``none``
    payload), and what its announcement said."""

    payload: bytes
    end: bytes
    tokens: int
    base: str
    pieces: tuple[bytes, ...] = ()


class Outbox:
    def __init__(
        self,
        transport: Transport,
        specs: dict[str, dict[str, TensorSpec]],
        codecs: Codecs,
        versions: Versions,
        local_copy: Callable[[str], Tensors] | None = None,
    ) -> None:
        self.specs, self.codecs = specs, codecs
        self.versions = versions  # of the units we hold
        self.local_copy = local_copy  # our copy of any unit, for newcomers that find no holder ready
        self.guard = transport.guard
        self._lock = threading.Lock()
        self._updates: dict[tuple[int, str], Posted] = {}  # (round, unit) -> our update
        self._weights: dict[str, dict[int, bytes]] = {}  # unit -> round -> weights served (none codec)
        self._encoded: dict[tuple[int, str, str, str], bytes] = {}  # (round, unit, kind, codec) -> payload
        self._reduced: dict[tuple, bytes] = {}  # (round, unit, kind, part, parts) -> payload
        self._indexes: dict[tuple, bytes] = {}  # (round, unit, kind, codec, chain, digest) -> ChunkIndex
        transport.serve(RPC_UPDATE, self.rpc_update, max_request_bytes=MAX_REQUEST_BYTES)
        transport.serve(RPC_WEIGHTS, self.rpc_weights, max_request_bytes=MAX_REQUEST_BYTES)

    # ------------------------------------------------------------------------------------- posting

    def post_update(self, round_: int, unit: str, posted: Posted) -> None:
        with self._lock:
            self._updates[(round_, unit)] = posted

    def post_reduced(self, round_: int, unit: str, kind: str, part: int, parts: int, payload: bytes) -> None:
        """Serves a combined part of ours (``kind`` "reduced" or "merged")."""
        with self._lock:
            self._reduced[(round_, unit, kind, part, parts)] = payload

    def update(self, round_: int, unit: str) -> Posted | None:
        with self._lock:
            return self._updates.get((round_, unit))

    def serve_weights(self, round_: int, unit: str, weights: Tensors) -> None:
        """From now on, those who ask for ``unit`` get these weights (as of round ``round_``)."""
        payload = encode(weights, EXACT, meta=payload_meta(unit, round_, "weights"))
        with self._lock:
            versions = self._weights.setdefault(unit, {})
            versions[round_] = payload
            for old in sorted(versions)[:-KEEP_ROUNDS]:  # so slower peers get the version they ask for
                del versions[old]
            self._encoded = {k: v for k, v in self._encoded.items() if k[:3] != (round_, unit, "weights")}

    def forget_before(self, round_: int) -> None:
        """Drops updates, served weights (so a unit given up stops being served) and encodings older than
        ``KEEP_ROUNDS`` rounds before ``round_``, and end weights older than ``END_KEEP_ROUNDS``."""
        horizon, end_horizon = round_ - KEEP_ROUNDS, round_ - END_KEEP_ROUNDS
        with self._lock:
            kept = {u: {r: w for r, w in v.items() if r > horizon} for u, v in self._weights.items()}
            self._weights = {u: v for u, v in kept.items() if v}
            self._updates = {
                k: v if k[0] > end_horizon else replace(v, end=b"")
                for k, v in self._updates.items()
                if k[0] > horizon
            }
            self._encoded = {k: v for k, v in self._encoded.items() if k[0] > horizon}
            self._indexes = {k: v for k, v in self._indexes.items() if k[0] > horizon}
            self._reduced = {k: v for k, v in self._reduced.items() if k[0] > horizon}

    # ------------------------------------------------------------------------------------- serving

    def rpc_update(self, caller: str, request: bytes) -> bytes:
        req = self._parse(UpdateRequest, caller, request)
        if req.kind in ("reduced", "merged"):
            with self._lock:
                reduced = self._reduced.get((req.round, req.unit, req.kind, req.part, req.parts))
            if reduced is None:
                raise Unavailable(
                    f"no combined part {req.part}/{req.parts} of {req.unit} in round {req.round}"
                )
            return reduced
        posted = self.update(req.round, req.unit)
        if posted is None:
            raise Unavailable(f"no update for {req.unit} in round {req.round}")
        if req.kind == "end" and posted.end:
            return posted.end
        if req.kind == "piece" and req.parts == len(posted.pieces):
            return posted.pieces[req.part]
        if req.kind == "delta" and posted.payload:
            return posted.payload
        raise Unavailable(f"our {req.unit} update of round {req.round} is not served as asked")

    def rpc_weights(self, caller: str, request: bytes) -> bytes:
        req = self._parse(WeightsRequest, caller, request)
        if req.digest:
            return self._digest(req)
        if req.index:
            return self._index(req)
        if req.chunk >= 0:
            return self._chunk(req)
        return self._weights_payload(req)

    def _digest(self, req: WeightsRequest) -> bytes:
        """``payload.served_digest`` of what we serve for ``req``, of exactly its round; empty when we hold
        the unit, but not of that round (yet); ``NOT_HELD`` when we do not hold it."""
        with self._lock:
            held = req.unit in self._weights
        if not held and self.versions.current(req.unit) is None:
            return NOT_HELD.encode()
        try:
            payload = self._weights_payload(req)
        except Unavailable:
            return b""
        return served_digest(payload).encode() if int(metadata_of(payload)["round"]) == req.round else b""

    def _index(self, req: WeightsRequest) -> bytes:
        """The index of what we serve for ``req`` (of its round, or a later one), computed once and kept."""
        payload = self._weights_payload(req)
        round_ = int(metadata_of(payload)["round"])
        key = (round_, req.unit, req.kind, req.codec, req.chain, served_digest(payload))
        with self._lock:
            index = self._indexes.get(key)
        if index is None:
            index = ChunkIndex.of(payload, round_).encode()
            with self._lock:
                self._indexes[key] = index
        return index

    def _chunk(self, req: WeightsRequest) -> bytes:
        """A chunk of what we serve for ``req``, of exactly its round (as another holder's index has it)."""
        payload = self._weights_payload(req)
        if int(metadata_of(payload)["round"]) != req.round:
            raise Unavailable(f"{req.unit} of round {req.round} is not served here (any more)")
        return chunk_of(payload, req.chunk)

    def _weights_payload(self, req: WeightsRequest) -> bytes:
        if req.kind == "change":
            change = self.versions.change(req.unit, req.round, req.chain)
            if change is None:
                raise Unavailable(f"no change of {req.unit} ({req.chain}) to version {req.round} here")
            return change
        if req.kind == "version":
            version = self.versions.current(req.unit)
            if version is None or version.round < req.round or req.chain not in ("full", *version.chains):
                raise Unavailable(f"no version {req.round} of {req.unit} ({req.chain}) here")
            if req.chain == "full":
                return self._coded((version.round, req.unit, "version", req.codec), version.payload)
            held = version.chains[req.chain]
            if req.codec == "none":  # (a keeper of a dense block: its norms are float32)
                meta = payload_meta(req.unit, version.round, "version")
                key = (version.round, req.unit, f"version of {req.chain}", "none")
                return self._cached(key, lambda: encode(version.held(req.chain), EXACT, meta=meta))
            if held.rest:
                raise Unavailable(f"{req.unit}'s {req.chain} chain has float32 tensors: ask for it exactly")
            return held.payload
        with self._lock:
            versions = dict(self._weights.get(req.unit, {}))
        if versions:
            round_ = req.round if req.round in versions else max(versions)
            return self._coded((round_, req.unit, "weights", req.codec), versions[round_])
        if req.any_copy and self.local_copy is not None and req.unit in self.specs:
            copy = self.local_copy(req.unit)
            return encode(copy, self.codecs[req.codec], meta=payload_meta(req.unit, -1, "weights"))
        raise Unavailable(f"this peer does not hold {req.unit}")

    def _parse(self, message: type[M], caller: str, request: bytes) -> M:
        """The request, checked; a malformed one counts against its sender (and its answer is a failure)."""
        try:
            return message.decode(request)
        except BadRequest as exc:
            self.guard.reject(caller, "request", str(exc))
            raise

    def _coded(self, key: tuple[int, str, str, str], exact: bytes) -> bytes:
        """``exact`` (a ``none`` payload of ours), in the codec ``key`` names: coded once, then kept."""
        round_, unit, kind, codec = key
        if codec == "none":
            return exact
        meta = payload_meta(unit, round_, kind)
        return self._cached(key, lambda: encode(tensors_of(exact), self.codecs[codec], meta=meta))

    def _cached(self, key: tuple[int, str, str, str], make: Callable[[], bytes]) -> bytes:
        with self._lock:
            cached = self._encoded.get(key)
        if cached is None:
            cached = make()
            with self._lock:
                self._encoded[key] = cached
        return cached

    def held(self) -> list:
        """Every payload kept (``peer.footprint``)."""
        with self._lock:
            updates = [[p.payload, p.end, *p.pieces] for p in self._updates.values()]
            weights = [list(v.values()) for v in self._weights.values()]
            return [updates, weights, list(self._encoded.values()), list(self._reduced.values())]
