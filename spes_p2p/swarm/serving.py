"""What a peer serves to the others, and for how long.

- its coded update of each unit it trained, per round (``spes/update``, kind "delta"; or in parts, kind
  "piece", for a reduce-scatter), the end weights behind it (kind "end", uncompressed, for
  re-synchronization), and the group's combined update of each part it owns (kind "reduced");
- its weights of each unit it holds, per round (``spes/weights``), so that every peer that starts training
  a unit gets the same weights of a round; newcomers may ask for its own copy of any unit;
- the current version of each unit it holds, and the change that made it (``swarm/versions.py``), for the
  peers that keep frozen copies.

Everything is kept for ``KEEP_ROUNDS`` rounds. Threads: the sync and training threads post and forget;
the transport's handler threads read; one lock guards the maps, and payloads are encoded outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from spes_p2p.swarm.codecs import TensorSpec
from spes_p2p.swarm.messages import (
    MAX_REQUEST_BYTES,
    RPC_UPDATE,
    RPC_WEIGHTS,
    BadRequest,
    Message,
    UpdateRequest,
    WeightsRequest,
)
from spes_p2p.swarm.payload import encode
from spes_p2p.swarm.transport import Transport, Unavailable
from spes_p2p.swarm.versions import Versions

KEEP_ROUNDS = 3
M = TypeVar("M", bound=Message)

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Posted:
    """One of our updates: its payload (or its parts' payloads), the end weights behind it, and what its
    announcement said."""

    payload: bytes
    end: Tensors
    tokens: int
    base: str
    pieces: tuple[bytes, ...] = ()


def payload_meta(unit: str, round_: int, kind: str, part: int = 0, parts: int = 0) -> dict[str, str]:
    """The metadata every payload carries, and that its receiver checks."""
    meta = {"unit": unit, "round": str(round_), "kind": kind}
    return {**meta, "part": f"{part}/{parts}"} if parts else meta


class Outbox:
    def __init__(
        self,
        transport: Transport,
        specs: dict[str, dict[str, TensorSpec]],
        topk_fraction: float,
        versions: Versions,
        local_copy: Callable[[str], Tensors] | None = None,
    ) -> None:
        self.specs, self.topk_fraction = specs, topk_fraction
        self.versions = versions  # of the units we hold
        self.local_copy = local_copy  # our copy of any unit, for newcomers that find no holder ready
        self.guard = transport.guard
        self._lock = threading.Lock()
        self._updates: dict[tuple[int, str], Posted] = {}  # (round, unit) -> our update
        self._weights: dict[str, dict[int, Tensors]] = {}  # unit -> round -> weights served
        self._encoded: dict[tuple[int, str, str, str], bytes] = {}  # (round, unit, kind, codec) -> payload
        self._reduced: dict[tuple[int, str, int, int], bytes] = {}  # (round, unit, part, parts) -> payload
        transport.serve(RPC_UPDATE, self.rpc_update, max_request_bytes=MAX_REQUEST_BYTES)
        transport.serve(RPC_WEIGHTS, self.rpc_weights, max_request_bytes=MAX_REQUEST_BYTES)

    # ------------------------------------------------------------------------------------- posting

    def post_update(self, round_: int, unit: str, posted: Posted) -> None:
        with self._lock:
            self._updates[(round_, unit)] = posted

    def post_reduced(self, round_: int, unit: str, part: int, parts: int, payload: bytes) -> None:
        with self._lock:
            self._reduced[(round_, unit, part, parts)] = payload

    def update(self, round_: int, unit: str) -> Posted | None:
        with self._lock:
            return self._updates.get((round_, unit))

    def serve_weights(self, round_: int, unit: str, weights: Tensors) -> None:
        """From now on, those who ask for ``unit`` get these weights (as of round ``round_``)."""
        copy = {n: t.detach().clone() for n, t in weights.items()}
        with self._lock:
            versions = self._weights.setdefault(unit, {})
            versions[round_] = copy
            for old in sorted(versions)[:-KEEP_ROUNDS]:  # so slower peers get the version they ask for
                del versions[old]
            self._encoded = {k: v for k, v in self._encoded.items() if k[:3] != (round_, unit, "weights")}

    def forget_before(self, round_: int) -> None:
        """Drops updates, served weights (so a unit given up stops being served) and encodings older than
        ``KEEP_ROUNDS`` rounds before ``round_``."""
        horizon = round_ - KEEP_ROUNDS
        with self._lock:
            kept = {u: {r: w for r, w in v.items() if r > horizon} for u, v in self._weights.items()}
            self._weights = {u: v for u, v in kept.items() if v}
            self._updates = {k: v for k, v in self._updates.items() if k[0] > horizon}
            self._encoded = {k: v for k, v in self._encoded.items() if k[0] > horizon}
            self._reduced = {k: v for k, v in self._reduced.items() if k[0] > horizon}

    # ------------------------------------------------------------------------------------- serving

    def rpc_update(self, caller: str, request: bytes) -> bytes:
        req = self._parse(UpdateRequest, caller, request)
        if req.kind == "reduced":
            with self._lock:
                reduced = self._reduced.get((req.round, req.unit, req.part, req.parts))
            if reduced is None:
                raise Unavailable(
                    f"no combined part {req.part}/{req.parts} of {req.unit} in round {req.round}"
                )
            return reduced
        posted = self.update(req.round, req.unit)
        if posted is None:
            raise Unavailable(f"no update for {req.unit} in round {req.round}")
        if req.kind == "end":
            return self._encoded_once((req.round, req.unit, "end", "none"), posted.end)
        if req.kind == "piece" and req.parts == len(posted.pieces):
            return posted.pieces[req.part]
        if req.kind == "delta" and posted.payload:
            return posted.payload
        raise Unavailable(f"our {req.unit} update of round {req.round} is not served as asked")

    def rpc_weights(self, caller: str, request: bytes) -> bytes:
        req = self._parse(WeightsRequest, caller, request)
        if req.kind == "change":
            change = self.versions.change(req.unit, req.round)
            if change is None:
                raise Unavailable(f"no change of {req.unit} to version {req.round} here")
            return change.payload
        if req.kind == "version":
            version = self.versions.current(req.unit)
            if version is None or version.round < req.round:
                raise Unavailable(f"no version {req.round} of {req.unit} here")
            return self._encoded_once((version.round, req.unit, "version", req.codec), version.weights)
        with self._lock:
            versions = dict(self._weights.get(req.unit, {}))
        if versions:
            round_ = req.round if req.round in versions else max(versions)
            return self._encoded_once((round_, req.unit, "weights", req.codec), versions[round_])
        if req.any_copy and self.local_copy is not None and req.unit in self.specs:
            copy = self.local_copy(req.unit)
            return encode(
                copy, req.codec, meta=payload_meta(req.unit, -1, "weights"), topk_fraction=self.topk_fraction
            )
        raise Unavailable(f"this peer does not hold {req.unit}")

    def _parse(self, message: type[M], caller: str, request: bytes) -> M:
        """The request, checked; a malformed one counts against its sender (and its answer is a failure)."""
        try:
            return message.decode(request)
        except BadRequest as exc:
            self.guard.reject(caller, "request", str(exc))
            raise

    def _encoded_once(self, key: tuple[int, str, str, str], tensors: Tensors) -> bytes:
        with self._lock:
            cached = self._encoded.get(key)
        if cached is None:
            round_, unit, kind, codec = key
            cached = encode(
                tensors, codec, meta=payload_meta(unit, round_, kind), topk_fraction=self.topk_fraction
            )
            with self._lock:
                self._encoded[key] = cached
        return cached
