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

What one holder served is then confirmed by another (``sync/confirm.py``).
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
from spes_p2p.sync.confirm import Confirmations
from spes_p2p.sync.messages import RPC_WEIGHTS, weights_request
from spes_p2p.sync.payload import decode, metadata_of
from spes_p2p.sync.versions import ELSEWHERE, NOBODY, Chains, Download, Want

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1
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
        self._lock = threading.Lock()
        self.confirmations = Confirmations(transport, cfg, self._refuse)

    def failing(self) -> dict[str, set[str]]:
        return self.confirmations.failing()

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
        self.confirmations.forget_gone(holders)
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
        newest = max(min_round, 0) + ROUNDS_AHEAD  # (what anyone serves us: not of round 10^9)

        def one_pass() -> Download | None:
            nonlocal order, want
            if self.live_peers is not None:
                live = self.live_peers()
                order = [p for p in order if p in live]
                if not order and not fallback:
                    return NOBODY
            elsewhere = False
            if want.kind != "change" and self._limit(unit, want) > CHUNK_BYTES:
                found = self._chunked(unit, order, want, min_round, newest, deadline, verify)
                if found is not None:
                    return found
            for peer in order:
                found = self._fetch(peer, unit, want, min_round, newest, False, deadline, verify)
                elsewhere |= found is ELSEWHERE
                if (
                    found is not None
                    and found is not ELSEWHERE
                    and self.confirmations.confirmed(unit, found, peer, order, deadline)
                ):
                    return found
            if want.kind == "change" and (elsewhere or patience.passed()):  # the whole version instead
                want = self.chains.whole(unit, want.chain)
            if order and not deadline.passed():
                return None  # holders first, while they may still catch up
            for peer in fallback:  # (a peer's own copy, of any round, but none far past the swarm's)
                found = self._fetch(peer, unit, want, -1, newest, True, deadline, verify)
                if found is not None:
                    return found
            return None

        found = poll(one_pass, deadline, POLL_SECONDS)
        if found is NOBODY:
            logger.info("every holder of %s left; keeping the old copy", unit)
        elif found is None:
            logger.info("no holder had %s of round >= %d in time; keeping the old copy", unit, min_round)
        return None if found is NOBODY else found

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
        newest: int,
        any_copy: bool,
        deadline: Deadline,
        verify: Verify | None,
    ) -> Download | None:
        """What we want of ``unit`` from ``peer``, of a round from ``min_round`` to ``newest``, or None when
        it cannot serve it (yet)."""
        # the round to match (refreshes: every peer then gets the same version), or the newest (catch-up)
        request = weights_request(unit, want, max(min_round, -1), any_copy=any_copy)
        try:
            payload = self._ask(peer, request, self._limit(unit, want), deadline)
        except TransportError as exc:
            logger.debug("%s of %s from %s: %s", want.kind, unit, peer, exc)
            with self._lock:
                self.failed[peer] += 1
            return None
        return self._check(peer, unit, want, min_round, newest, payload, verify)

    def _chunked(
        self,
        unit: str,
        order: list[str],
        want: Want,
        min_round: int,
        newest: int,
        deadline: Deadline,
        verify: Verify | None,
    ) -> Download | None:
        """What we want of ``unit``, in chunks from every holder in ``order`` at once (``sync/chunks.py``);
        None when that cannot be (it is then asked of one holder at a time)."""
        asking = Asking(
            ask=lambda peer, request, limit: self._ask(peer, request, limit, deadline),
            request=functools.partial(weights_request, unit, want),
            refuse=lambda peer, what, why: self._refuse(peer, f"{what} of {unit}", why),
            limit=self._limit(unit, want),
            deadline=deadline,
        )
        got = download(asking, order, max(min_round, -1), newest)
        return None if got is None else self._check(got[0], unit, want, min_round, newest, got[1], verify)

    def _ask(self, peer: str, request: bytes, limit: int, deadline: Deadline) -> bytes:
        timeout = min(self.cfg.request_timeout, max(deadline.remaining(), MIN_REQUEST_SECONDS))
        return self.transport.request(peer, RPC_WEIGHTS, request, timeout=timeout, max_response_bytes=limit)

    def _limit(self, unit: str, want: Want) -> int:
        return self.codecs[want.codec].max_bytes(self.specs[unit])

    def _check(
        self,
        peer: str,
        unit: str,
        want: Want,
        min_round: int,
        newest: int,
        payload: bytes,
        verify: Verify | None,
    ) -> Download | None:
        """``payload`` of ``unit`` from ``peer``, checked (of round ``newest`` at most); None when refused or
        not of a round wanted."""
        decoder = functools.partial(
            decode,
            expected=self.specs[unit],
            codec=self.codecs[want.codec],
            meta={"unit": unit, "kind": want.kind},
        )
        try:
            tensors = decoder(payload)  # checked now; decoded again when used
            round_ = _round_of(payload)
            if round_ > newest:
                raise PayloadError(f"it is of round {round_}, far past round {newest - ROUNDS_AHEAD}")
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
        self.confirmations.served(unit, peer)
        if want.kind == "change" and (since != ":".join(map(str, want.since)) or round_ != min_round):
            return ELSEWHERE
        return Download(round_, want, payload, decoder) if round_ >= min_round else None


def _round_of(payload: bytes) -> int:
    text = metadata_of(payload).get("round", "")
    if not text.lstrip("-").isdigit() or int(text) < -1:
        raise PayloadError(f"payload round {text!r} is not a round")
    return int(text)
