"""Frozen copies: a peer fetches the units it does not train from their holders, units in parallel.

For each unit it asks the holders (in an order shuffled per peer, to spread the load, those that failed to
serve lately last) for their weights of round ``min_round`` or later, until one answers or the deadline
passes; holders whose records vanished are skipped. A unit that no holder can serve may come from a
``fallback`` peer's own copy (newcomers). Every answer is a checked payload; a bad one is counted and the
next holder is asked.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from spes_p2p.swarm.codecs import TensorSpec, max_payload_bytes
from spes_p2p.swarm.config import SyncConfig
from spes_p2p.swarm.messages import RPC_WEIGHTS, WeightsRequest
from spes_p2p.swarm.payload import PayloadError, decode, metadata_of
from spes_p2p.swarm.transport import Transport, TransportError
from spes_p2p.swarm.waiting import Deadline, poll

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1
MIN_REQUEST_SECONDS = 0.5

Tensors = dict[str, torch.Tensor]
Found = tuple[int, Tensors]  # (the round of the weights, the weights)
NOBODY: Found = (-2, {})  # every holder left and there is no fallback: stop asking


class Refresh:
    """Runs on the sync thread (frozen copies) or the training thread (catch-up); fetches on the pool."""

    def __init__(
        self,
        transport: Transport,
        cfg: SyncConfig,
        specs: dict[str, dict[str, TensorSpec]],
        pool: ThreadPoolExecutor,
        abort: threading.Event,
        live_peers=None,
    ) -> None:
        self.transport, self.cfg, self.specs, self.pool, self.abort = transport, cfg, specs, pool, abort
        self.live_peers = live_peers
        self.rejected = 0
        self.failed: Counter[str] = Counter()  # holder -> fetches in a row it did not serve
        self._lock = threading.Lock()

    def run(
        self,
        min_round: int,
        holders: dict[str, list[str]],
        seconds: float,
        codec: str | dict[str, str] | None = None,
        on_unit: Callable[[str, int, Tensors], None] | None = None,
        fallback: list[str] = (),
    ) -> dict[str, int]:
        """Fetches each unit in ``holders`` (unit -> live holders) from one of them; returns unit -> round
        fetched, for the units obtained. ``codec``: one for every unit, or unit -> codec (default: the
        refresh codec)."""
        codecs = codec if isinstance(codec, dict) else {u: codec or self.cfg.refresh_codec for u in holders}
        deadline = Deadline(seconds, self.abort)
        futures = {
            u: self.pool.submit(self._unit, u, h, list(fallback), min_round, codecs[u], deadline)
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
                got[unit] = found[0]
                if on_unit:
                    on_unit(unit, *found)
        return got

    def _unit(
        self,
        unit: str,
        holders: list[str],
        fallback: list[str],
        min_round: int,
        codec: str,
        deadline: Deadline,
    ) -> Found | None:
        order = list(holders)
        random.Random(f"{self.transport.peer_id}:{unit}:{min_round}").shuffle(order)
        order.sort(key=lambda p: self.failed[p])  # (stable) holders that served lately first

        def one_pass() -> Found | None:
            nonlocal order
            if self.live_peers is not None:
                order = [p for p in order if p in self.live_peers()]
                if not order and not fallback:
                    return NOBODY
            for peer in order:
                found = self._fetch(peer, unit, codec, min_round, False, deadline)
                if found is not None:
                    return found
            if order and not deadline.passed():
                return None  # holders first, while they may still catch up
            for peer in fallback:
                found = self._fetch(peer, unit, codec, -1, True, deadline)
                if found is not None:
                    return found
            return None

        found = poll(one_pass, deadline, POLL_SECONDS)
        if found is NOBODY:
            logger.info("every holder of %s left; keeping the old copy", unit)
        elif found is None:
            logger.info("no holder had %s of round >= %d in time; keeping the old copy", unit, min_round)
        return None if found is NOBODY else found

    def _fetch(
        self, peer: str, unit: str, codec: str, min_round: int, any_copy: bool, deadline: Deadline
    ) -> Found | None:
        """(round, weights) from ``peer``, or None when it cannot serve them (yet)."""
        # the round to match (refreshes: every peer then gets the same version), or the newest (catch-up)
        request = WeightsRequest(unit=unit, codec=codec, round=max(min_round, -1), any_copy=any_copy).encode()
        timeout = min(self.cfg.request_timeout, max(deadline.remaining(), MIN_REQUEST_SECONDS))
        limit = max_payload_bytes(self.specs[unit], codec, self.cfg.topk_fraction)
        try:
            payload = self.transport.request(
                peer, RPC_WEIGHTS, request, timeout=timeout, max_response_bytes=limit
            )
        except TransportError as exc:
            logger.debug("weights of %s from %s: %s", unit, peer, exc)
            with self._lock:
                self.failed[peer] += 1
            return None
        try:
            tensors = decode(
                payload,
                self.specs[unit],
                codec,
                meta={"unit": unit, "kind": "weights"},
                topk_fraction=self.cfg.topk_fraction,
            )
            round_ = _round_of(payload)
        except PayloadError as exc:
            self.transport.guard.reject(peer, f"weights of {unit}", str(exc))
            with self._lock:
                self.rejected += 1
            return None
        self.transport.guard.accept(peer)
        with self._lock:
            self.failed.pop(peer, None)
        return (round_, tensors) if round_ >= min_round else None


def _round_of(payload: bytes) -> int:
    text = metadata_of(payload).get("round", "")
    if not text.lstrip("-").isdigit() or int(text) < -1:
        raise PayloadError(f"payload round {text!r} is not a round")
    return int(text)
