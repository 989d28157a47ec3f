"""Fetching what the other participants of a round announced: their updates (or a part of one), a
reduce-scatter's combined parts, and (to re-synchronize) their end weights.

Fetches run several at a time on the sync engine's pool, each against a **cutoff**: the round's deadline, or
``MIN_REQUEST_SECONDS`` from the start of the batch when less is left. A fetch that would start after its
cutoff is not sent, so a batch never outlives the deadline by more than that, however many participants are
slow. A fetch has one typed outcome: ``Got`` (a checked update, or a part of it), ``Refused`` (a bad payload:
counted, not waited for again), ``Gone`` (the peer no longer has it) or ``NotYet`` (unreachable right now:
asked again); a reduce-scatter's combined part comes as ``Reduced``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from spes_p2p.net.transport import RemoteError, RequestTimeout, Transport, TransportError
from spes_p2p.net.waiting import MIN_REQUEST_SECONDS, Deadline
from spes_p2p.swarm.records import Announcement
from spes_p2p.sync.aggregate import Contribution, Received
from spes_p2p.sync.codecs import EXACT, HEADER_ALLOWANCE, Codec, PayloadError, TensorSpec, piece_spec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.messages import RPC_UPDATE, UpdateRequest
from spes_p2p.sync.payload import decode, metadata_of, payload_meta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Got:
    received: Received


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Gone:
    reason: str


@dataclass(frozen=True)
class NotYet:
    reason: str


@dataclass(frozen=True)
class Reduced:
    """A row's combined update of one part, and what its owner says of it: who contributed to it, the tokens
    they count for, the start weights it was combined on, and (a part merged across the rows) the other
    rows merged into it."""

    piece: torch.Tensor
    contributors: list[str]
    tokens: int = 0
    base: str = ""
    rows: tuple[int, ...] = ()


FetchOutcome = Got | Refused | Gone | NotYet


class UpdateFetcher:
    """Fetches on the pool and checks what comes; ``rejected`` counts refused payloads (read by others)."""

    def __init__(
        self,
        transport: Transport,
        cfg: SyncConfig,
        codec: Codec,
        specs: dict[str, dict[str, TensorSpec]],
        pool: ThreadPoolExecutor,
        abort: threading.Event,
    ) -> None:
        self.transport, self.cfg, self.codec, self.specs = transport, cfg, codec, specs
        self.pool, self.abort = pool, abort
        self.rejected = 0
        self._lock = threading.Lock()

    def updates(
        self,
        unit: str,
        todo: list[tuple[int, str, Announcement]],
        deadline: Deadline,
        part: tuple[int, int] | None = None,
    ) -> list[FetchOutcome]:
        """The outcome of fetching each (round, peer, announcement) in ``todo``, in parallel: the whole
        update, or with ``part`` = (part, parts) that part of it (a reduce-scatter's piece)."""
        cutoff = self._cutoff(deadline)
        return list(self.pool.map(lambda item: self._update(unit, *item, cutoff, part), todo))

    def reduced(
        self, round_: int, unit: str, asks: dict, parts: int, deadline: Deadline, rows: int = 0
    ) -> dict:
        """Key -> a combined part from its owner, for each key's (owner, part) in ``asks``, in parallel: a
        row's ("reduced"), or with ``rows`` all that many rows' ("merged"); ``Reduced``, ``Refused`` (a bad
        payload), or ``NotYet`` (not served yet, or unreachable)."""
        cutoff = self._cutoff(deadline)
        ask = lambda key: self._reduced(round_, unit, *asks[key], parts, rows, cutoff)  # noqa: E731
        return dict(zip(asks, self.pool.map(ask, asks), strict=True))

    def ends(self, round_: int, unit: str, of: list[Contribution], deadline: Deadline) -> list[Contribution]:
        """The end weights behind the given participants' updates (in parallel); those that came in time.
        Each may take a whole request's time (``sync.request_timeout``), even past the round's deadline: the
        deadline is sized for compressed updates, and end weights are whole, uncompressed units; cut off by
        it, holders that parted ways would never come back together."""
        cutoff = Deadline(max(deadline.remaining(), self.cfg.request_timeout), self.abort)
        ends = self.pool.map(lambda c: self._end(round_, unit, c, cutoff), of)
        return [e for e in ends if e is not None]

    def clamped(self, tokens: int) -> int:
        """A round's token count, at most what a round can hold (so no peer outweighs the others at will)."""
        return min(tokens, self.cfg.max_round_tokens)

    def rate(self, peer: str, share: float) -> None:
        """A contribution of ``peer`` counted for ``share`` of its weight (``Guard.score``)."""
        self.transport.guard.score(peer, share)

    def refuse(self, peer: str, unit: str, reason: str) -> Refused:
        self.transport.guard.reject(peer, f"{unit} update", reason)
        with self._lock:
            self.rejected += 1
        return Refused(reason)

    # ------------------------------------------------------------------------------------------ one

    def _cutoff(self, deadline: Deadline) -> Deadline:
        return Deadline(max(deadline.remaining(), MIN_REQUEST_SECONDS), self.abort)

    def _update(
        self,
        unit: str,
        round_: int,
        peer: str,
        announced: Announcement,
        cutoff: Deadline,
        part: tuple[int, int] | None,
    ):
        full = self.specs[unit]
        limit = self.codec.max_bytes(full)
        if (
            announced.codec != self.codec.name
            or announced.bytes > limit + len(announced.pieces) * HEADER_ALLOWANCE
        ):
            return self.refuse(peer, unit, f"announced {announced.bytes} bytes of {announced.codec!r}")
        if (part is None and announced.pieces) or (part is not None and len(announced.pieces) != part[1]):
            # split otherwise than we asked: it saw another group (a disagreement, not an attack)
            return Gone(f"{peer} split its {unit} update of round {round_} in {len(announced.pieces)} parts")
        spec = full if part is None else piece_spec(full, *part)
        kind, where = ("delta", {}) if part is None else ("piece", {"part": part[0], "parts": part[1]})
        request = UpdateRequest(round=round_, unit=unit, kind=kind, **where).encode()
        try:
            bound = self.codec.max_bytes(spec)
            payload = self._request(peer, request, bound, cutoff)
        except RemoteError as exc:  # it announced the update, so it will not come back
            return Gone(f"{peer} no longer has its {unit} update of round {round_}: {exc}")
        except TransportError as exc:
            return NotYet(f"could not fetch {peer}'s {unit} update of round {round_}: {exc}")
        try:
            digest = announced.sha256 if part is None else announced.pieces[part[0]]
            if hashlib.sha256(payload).hexdigest() != digest:
                raise PayloadError("payload does not match its announced checksum")
            meta = payload_meta(unit, round_, kind, *(part or (0, 0)))
            tensors = decode(payload, spec, self.codec, meta=meta)
        except PayloadError as exc:
            return self.refuse(peer, unit, str(exc))
        self.transport.guard.accept(peer)
        contribution = Contribution(peer, self.clamped(announced.tokens), tensors, round_)
        return Got(Received(contribution, announced.base))

    def _reduced(
        self, round_: int, unit: str, owner: str, part: int, parts: int, rows: int, cutoff: Deadline
    ):
        kind, codec = combined_codec(self.codec, parts, rows)
        spec = piece_spec(self.specs[unit], part, parts)
        request = UpdateRequest(round=round_, unit=unit, kind=kind, part=part, parts=parts).encode()
        try:
            payload = self._request(owner, request, codec.max_bytes(spec), cutoff)
        except TransportError as exc:  # (a refusal too: the owner may still be combining)
            return NotYet(f"{owner}'s combined part {part} of {unit}: {exc}")
        try:
            tensors = decode(payload, spec, codec, meta=payload_meta(unit, round_, kind, part, parts))
            return reduced_of(tensors["piece"], metadata_of(payload))
        except PayloadError as exc:
            return self.refuse(owner, unit, str(exc))

    def _end(self, round_: int, unit: str, c: Contribution, cutoff: Deadline) -> Contribution | None:
        request = UpdateRequest(round=round_, unit=unit, kind="end").encode()
        limit = EXACT.max_bytes(self.specs[unit])
        try:
            payload = self._request(c.peer_id, request, limit, cutoff)
            tensors = decode(payload, self.specs[unit], EXACT, meta=payload_meta(unit, round_, "end"))
        except TransportError as exc:
            logger.info("could not fetch %s's %s end weights: %s", c.peer_id, unit, exc)
            return None
        except PayloadError as exc:
            self.refuse(c.peer_id, f"{unit} end weights", str(exc))
            return None
        self.transport.guard.accept(c.peer_id)
        return Contribution(c.peer_id, c.tokens, tensors, round_)

    def _request(self, peer: str, request: bytes, limit: int, cutoff: Deadline) -> bytes:
        if cutoff.passed():
            raise RequestTimeout("the round's deadline passed before this request could start")
        timeout = min(self.cfg.request_timeout, cutoff.remaining())
        return self.transport.request(peer, RPC_UPDATE, request, timeout=timeout, max_response_bytes=limit)


def combined_codec(codec: Codec, parts: int, rows: int = 0) -> tuple[str, Codec]:
    """The kind and codec of a combined part: a row's ("reduced", as wide as its ``parts`` pieces), or
    ``rows`` rows' merged ("merged", as wide as all their pieces)."""
    return ("merged", codec.combined(parts * rows)) if rows else ("reduced", codec.combined(parts))


def reduced_of(piece: torch.Tensor, meta: dict[str, str]) -> Reduced:
    """A combined part as its payload's metadata describes it (``reduce_scatter``'s ``reduced_meta``)."""
    try:
        peers, rows = meta.get("peers", ""), meta.get("rows", "")
        tokens = int(meta.get("tokens", "0"))
        return Reduced(
            piece,
            peers.split(",") if peers else [],
            tokens,
            meta.get("base", ""),
            tuple(int(r) for r in rows.split(",")) if rows else (),
        )
    except ValueError:
        raise PayloadError("a combined part's metadata does not parse") from None
