"""Fetching units from their holders, units in parallel: frozen copies, and the units a peer starts training
or downloads.

For each unit it asks the holders (in an order shuffled per peer, to spread the load, those that failed to
serve lately last) for what it ``Want``s of round ``min_round`` or later: their weights, their current
version, or the change that made that version (``sync/versions.py``), until one answers or the deadline
passes; holders whose records vanished are skipped. When no holder serves the change our copy needs, its
chain's version is asked for whole instead. A unit that no holder can serve may come from a ``fallback``
peer's own copy (newcomers). Every answer is a checked payload; a bad one is counted and the next holder
is asked. Weights and versions larger than a chunk come in chunks from every holder at once instead, once
two holders agree on their index (``sync/chunks.py``: that agreement confirms them), or the one holder
that answers has nobody to confirm it.

What one holder served is then **confirmed** by another, asked only for the SHA-256 of what it would serve
for the same request, of the same round (``WeightsRequest.digest``; a change: with the version it applies
to, the one we asked for). Holders of a unit hold the same weights, bit for bit, and answer alike: the
first that agrees confirms the payload; one that two other holders agree against is refused (not toward a
ban: honest holders can differ, one whose version chain split from the others' for instance), and the next
holder asked. With nobody else to ask, or only one that disagrees (of two holders, nobody can tell which is
right), the payload is kept and the disagreement logged. A holder that is not of that round yet says so,
which confirms nothing. Holders are asked to confirm in turn, the least recently asked first; one that says
``NOT_HELD``, or leaves a whole ``request_timeout`` unanswered, ``UNCONFIRMED_LIMIT`` times in a row (a fake
holder, or one that declared more capacity than it has) is reported by ``failing`` (claims then do not
count it), and asked again, last, once every ``UNCONFIRMED_LIMIT`` confirmations of the unit.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from spes_p2p.net.transport import Transport, TransportError
from spes_p2p.net.waiting import MIN_REQUEST_SECONDS, Deadline, poll
from spes_p2p.sync.chunks import CHUNK_BYTES, Asking, download
from spes_p2p.sync.codecs import Codecs, PayloadError, TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.messages import NOT_HELD, RPC_WEIGHTS, WeightsRequest
from spes_p2p.sync.payload import decode, metadata_of, served_digest
from spes_p2p.sync.versions import ELSEWHERE, NOBODY, Chains, Download, Want

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1
UNCONFIRMED_LIMIT = 3  # asks in a row a holder leaves unanswered before its claim is not believed
MAX_DIGEST_BYTES = 256
OUTVOTED = "two other holders serve other weights"
ROUNDS_AHEAD = 16  # what a holder serves is of the round asked for, or a few later: not of round 10^9

Tensors = dict[str, torch.Tensor]
Verify = Callable[
    [str, Tensors], str
]  # (unit, tensors as they decode) -> why they cannot be used; '' if they can


class Refresh:
    """Runs on the sync thread (frozen copies) or the training thread (catch-up); fetches on the pool."""

    def __init__(
        self,
        transport: Transport,
        cfg: SyncConfig,
        codecs: Codecs,
        specs: dict[str, dict[str, TensorSpec]],
        pool: ThreadPoolExecutor,
        abort: threading.Event,
        live_peers,
        chains: Chains,
    ) -> None:
        self.transport, self.cfg, self.specs, self.pool, self.abort = transport, cfg, specs, pool, abort
        self.codecs, self.chains = codecs, chains
        self.live_peers = live_peers
        self.rejected = 0
        self.failed: Counter[str] = Counter()  # holder -> fetches in a row it did not serve
        self.unconfirmed: Counter[tuple[str, str]] = Counter()  # (unit, holder) -> asks in a row unanswered
        self._asked: dict[tuple[str, str], int] = {}  # (unit, holder) -> the confirmation it was last asked
        self._confirmations: Counter[str] = Counter()  # unit -> confirmations asked of its holders
        self._lock = threading.Lock()

    def failing(self) -> dict[str, set[str]]:
        """Unit -> its holders that left ``UNCONFIRMED_LIMIT`` asks to confirm it in a row unanswered."""
        with self._lock:
            out: dict[str, set[str]] = {}
            for (unit, peer), misses in self.unconfirmed.items():
                if misses >= UNCONFIRMED_LIMIT:
                    out.setdefault(unit, set()).add(peer)
            return out

    def run(
        self,
        min_round: int,
        holders: dict[str, list[str]],
        seconds: float,
        want: Want | dict[str, Want] | None = None,
        on_unit: Callable[[str, Download], None] | None = None,
        fallback: list[str] = (),
        verify: Verify | None = None,
    ) -> dict[str, int]:
        """Fetches each unit in ``holders`` (unit -> live holders) from one of them; returns unit -> round
        fetched, for the units obtained. ``want``: one for every unit, or unit -> what (default: weights in
        the refresh codec). ``verify``: a check of what a peer served beyond its payload's (a peer that
        fails it is refused and counted, and the next one asked)."""
        self._forget_gone(holders)
        default = Want("weights", self.cfg.refresh_codec)
        wants = want if isinstance(want, dict) else {u: want or default for u in holders}
        deadline, patience = Deadline(seconds, self.abort), Deadline(seconds / 2, self.abort)
        futures = {
            u: self.pool.submit(
                self._unit, u, h, list(fallback), min_round, wants[u], deadline, patience, verify
            )
            for u, h in holders.items()
            if h or fallback
        }
        got = {}
        for unit, future in futures.items():
            try:
                found = future.result(timeout=deadline.remaining() + self.cfg.request_timeout)
            except FutureTimeout:
                logger.warning("refreshing %s outlived its deadline; keeping the old copy", unit)
                continue
            if found is not None:
                got[unit] = found.round
                if on_unit:
                    on_unit(unit, found)
        return got

    def _unit(
        self,
        unit: str,
        holders: list[str],
        fallback: list[str],
        min_round: int,
        want: Want,
        deadline: Deadline,
        patience: Deadline,
        verify: Verify | None,
    ) -> Download | None:
        """``patience``: how long to wait for a change before asking for the whole version instead."""
        order = list(holders)
        random.Random(f"{self.transport.peer_id}:{unit}:{min_round}").shuffle(order)
        order.sort(key=lambda p: self.failed[p])  # (stable) holders that served lately first

        def one_pass() -> Download | None:
            nonlocal order, want
            if self.live_peers is not None:
                live = self.live_peers()
                order = [p for p in order if p in live]
                if not order and not fallback:
                    return NOBODY
            elsewhere = False
            if want.kind != "change" and self._limit(unit, want) > CHUNK_BYTES:
                found = self._chunked(unit, order, want, min_round, deadline, verify)
                if found is not None:
                    return found
            for peer in order:
                found = self._fetch(peer, unit, want, min_round, False, deadline, verify)
                elsewhere |= found is ELSEWHERE
                if (
                    found is not None
                    and found is not ELSEWHERE
                    and self._confirmed(unit, found, peer, order, deadline)
                ):
                    return found
            if want.kind == "change" and (elsewhere or patience.passed()):  # the whole version instead
                want = self.chains.whole(unit, want.chain)
            if order and not deadline.passed():
                return None  # holders first, while they may still catch up
            for peer in fallback:
                found = self._fetch(peer, unit, want, -1, True, deadline, verify)
                if found is not None:
                    return found
            return None

        found = poll(one_pass, deadline, POLL_SECONDS)
        if found is NOBODY:
            logger.info("every holder of %s left; keeping the old copy", unit)
        elif found is None:
            logger.info("no holder had %s of round >= %d in time; keeping the old copy", unit, min_round)
        return None if found is NOBODY else found

    def _forget_gone(self, holders: dict[str, list[str]]) -> None:
        """Drops what we kept of the holders that no longer hold a unit we refresh."""
        with self._lock:
            for key in [k for k in self._asked if k[0] in holders and k[1] not in holders[k[0]]]:
                self._asked.pop(key)
                self.unconfirmed.pop(key, None)

    def _confirmed(
        self, unit: str, found: Download, source: str, holders: list[str], deadline: Deadline
    ) -> bool:
        """Whether what ``source`` served stands, asked of the other ``holders`` (the module's docstring)."""
        since = ":".join(map(str, found.want.since)) if found.want.kind == "change" else ""
        ours = served_digest(found.payload, since)
        request = _request(unit, found.want, found.round, digest=True)
        against: Counter[str] = Counter()
        for peer in self._confirmers(unit, source, holders):
            if deadline.passed():
                break
            answer = self._digest(peer, unit, request, deadline)
            if answer == ours:
                return True
            if answer and answer.split("/")[0] == since:  # (a change: to the same version)
                against[answer] += 1
                if against[answer] == 2:
                    # (not toward a ban: honest holders may differ, e.g. one whose version chain split)
                    self._refuse(source, f"{found.want.kind} of {unit}", OUTVOTED, ban=False)
                    return False
        if against:
            logger.warning(
                "%s: %s and another holder serve different weights; keeping %s's", unit, source, source
            )
        return True

    def _confirmers(self, unit: str, source: str, holders: list[str]) -> list[str]:
        """The other holders, the least recently asked first; failing ones last, and only once every
        ``UNCONFIRMED_LIMIT`` confirmations of the unit."""
        with self._lock:
            self._confirmations[unit] += 1
            now = self._confirmations[unit]
            others = [p for p in holders if p != source]
            asked = {p: self._asked.get((unit, p), 0) for p in others}
            failing = {p for p in others if self.unconfirmed[(unit, p)] >= UNCONFIRMED_LIMIT}
            due = [p for p in failing if now - asked[p] >= UNCONFIRMED_LIMIT]
            return sorted((p for p in others if p not in failing), key=asked.get) + sorted(due, key=asked.get)

    def _digest(self, peer: str, unit: str, request: bytes, deadline: Deadline) -> str | None:
        """What ``peer`` says it serves for ``request`` (None: no answer; '': it holds the unit, but not of
        that round yet). It misses an ask when it says it does not hold the unit, or does not answer within
        a whole ``request_timeout``."""
        with self._lock:
            self._asked[(unit, peer)] = self._confirmations[unit]
        timeout = min(self.cfg.request_timeout, max(deadline.remaining(), MIN_REQUEST_SECONDS))
        try:
            answer = self.transport.request(
                peer, RPC_WEIGHTS, request, timeout=timeout, max_response_bytes=MAX_DIGEST_BYTES
            ).decode("ascii", "replace")
        except TransportError as exc:
            logger.debug("confirming %s with %s: %s", unit, peer, exc)
            answer = NOT_HELD if timeout >= self.cfg.request_timeout else None
        with self._lock:
            if answer == NOT_HELD:
                self.unconfirmed[(unit, peer)] += 1
            elif answer:
                self.unconfirmed.pop((unit, peer), None)
        return None if answer == NOT_HELD else answer

    def _refuse(self, peer: str, what: str, why: str, ban: bool = True) -> None:
        self.transport.guard.reject(peer, what, why, counts_toward_ban=ban)
        with self._lock:
            self.rejected += 1
            self.failed[peer] += 1

    def _fetch(
        self,
        peer: str,
        unit: str,
        want: Want,
        min_round: int,
        any_copy: bool,
        deadline: Deadline,
        verify: Verify | None,
    ) -> Download | None:
        """What we want of ``unit`` from ``peer``, or None when it cannot serve it (yet)."""
        # the round to match (refreshes: every peer then gets the same version), or the newest (catch-up)
        request = _request(unit, want, max(min_round, -1), any_copy=any_copy)
        try:
            payload = self._ask(peer, request, self._limit(unit, want), deadline)
        except TransportError as exc:
            logger.debug("%s of %s from %s: %s", want.kind, unit, peer, exc)
            with self._lock:
                self.failed[peer] += 1
            return None
        return self._check(peer, unit, want, min_round, payload, verify)

    def _chunked(
        self,
        unit: str,
        order: list[str],
        want: Want,
        min_round: int,
        deadline: Deadline,
        verify: Verify | None,
    ) -> Download | None:
        """What we want of ``unit``, in chunks from every holder in ``order`` at once (``sync/chunks.py``);
        None when that cannot be (it is then asked of one holder at a time)."""
        asking = Asking(
            ask=lambda peer, request, limit: self._ask(peer, request, limit, deadline),
            request=functools.partial(_request, unit, want),
            refuse=lambda peer, what, why: self._refuse(peer, f"{what} of {unit}", why),
            limit=self._limit(unit, want),
            deadline=deadline,
        )
        got = download(asking, order, max(min_round, -1), max(min_round, 0) + ROUNDS_AHEAD)
        return None if got is None else self._check(got[0], unit, want, min_round, got[1], verify)

    def _ask(self, peer: str, request: bytes, limit: int, deadline: Deadline) -> bytes:
        timeout = min(self.cfg.request_timeout, max(deadline.remaining(), MIN_REQUEST_SECONDS))
        return self.transport.request(peer, RPC_WEIGHTS, request, timeout=timeout, max_response_bytes=limit)

    def _limit(self, unit: str, want: Want) -> int:
        return self.codecs[want.codec].max_bytes(self.specs[unit])

    def _check(
        self, peer: str, unit: str, want: Want, min_round: int, payload: bytes, verify: Verify | None
    ) -> Download | None:
        """``payload`` of ``unit`` from ``peer``, checked; None when refused or not of a round wanted."""
        decoder = functools.partial(
            decode,
            expected=self.specs[unit],
            codec=self.codecs[want.codec],
            meta={"unit": unit, "kind": want.kind},
        )
        try:
            tensors = decoder(payload)  # checked now; decoded again when used
            round_ = _round_of(payload)
            if round_ > max(min_round, 0) + ROUNDS_AHEAD:
                raise PayloadError(f"it is of round {round_}, far past round {min_round} asked for")
            since = metadata_of(payload).get("since") if want.kind == "change" else None
            problem = verify(unit, tensors) if verify is not None else ""
            if problem:
                raise PayloadError(problem)
        except PayloadError as exc:
            self._refuse(peer, f"{want.kind} of {unit}", str(exc))
            return None
        self.transport.guard.accept(peer)
        with self._lock:
            self.failed.pop(peer, None)
            self.unconfirmed.pop((unit, peer), None)
        if want.kind == "change" and (since != ":".join(map(str, want.since)) or round_ != min_round):
            return ELSEWHERE
        return Download(round_, want, payload, decoder) if round_ >= min_round else None


def _request(unit: str, want: Want, round_: int, **flags: bool) -> bytes:
    return WeightsRequest(
        unit=unit, codec=want.codec, round=round_, kind=want.kind, chain=want.chain, **flags
    ).encode()


def _round_of(payload: bytes) -> int:
    text = metadata_of(payload).get("round", "")
    if not text.lstrip("-").isdigit() or int(text) < -1:
        raise PayloadError(f"payload round {text!r} is not a round")
    return int(text)
