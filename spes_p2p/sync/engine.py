"""The sync protocol, in three parts behind one facade: serving (``serving.Outbox``), the exchange of
updates among a unit's holders (``exchange.Exchange``) and the refresh of frozen copies
(``refresh.Refresh``). It moves tensors; it knows nothing of optimizers or data. See docs/protocol.md.

No wait is unbounded: every request has a timeout, and every round and refresh a deadline that adapts to
observed arrival times within [deadline_min, deadline_max]; ``abort`` ends every wait at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from spes_p2p.net.transport import Transport
from spes_p2p.sync.codecs import Codecs, TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.exchange import Exchange, dense_group
from spes_p2p.sync.outcome import UnitRound, tensors_hash
from spes_p2p.sync.refresh import Refresh
from spes_p2p.sync.serving import KEEP_ROUNDS, Outbox
from spes_p2p.sync.versions import Copies, Versions

PARALLEL_FETCHES = 4

Tensors = dict[str, torch.Tensor]
__all__ = ["SyncEngine", "UnitRound", "dense_group"]


class SyncEngine:
    def __init__(
        self,
        transport: Transport,
        run_id: str,
        cfg: SyncConfig,
        specs: dict[str, dict[str, TensorSpec]],
        local_copy: Callable[[str], Tensors] | None = None,
        live_peers: Callable[[], set[str]] | None = None,
        aggregate: str = "mean",
    ) -> None:
        """``aggregate`` is the rule that combines a round's updates (``aggregate.combine``)."""
        self.transport = transport
        self.abort = threading.Event()  # set when the peer stops: waits end at once, with what has arrived
        self._pool = ThreadPoolExecutor(PARALLEL_FETCHES, thread_name_prefix="spes-fetch")
        codecs = Codecs.of(cfg)
        self.versions = Versions(codecs.refresh)  # of the units we hold
        self.copies = Copies()  # which of our frozen copies are versions
        self.outbox = Outbox(transport, specs, codecs, self.versions, local_copy)
        self._exchange = Exchange(
            transport,
            run_id,
            cfg,
            codecs,
            specs,
            self.outbox,
            self._pool,
            self.abort,
            live_peers,
            aggregate,
        )
        self._refresh = Refresh(transport, cfg, codecs, specs, self._pool, self.abort, live_peers)
        self.sample: Callable[[], None] = lambda: None  # measures the peer's memory (``peer.footprint``)
        self._exchange.sample = lambda: self.sample()

    @property
    def deadline(self):
        """The adaptive round deadline (``waiting.AdaptiveDeadline``)."""
        return self._exchange.deadline

    @property
    def rejected_payloads(self) -> int:
        return self._exchange.rejected + self._refresh.rejected

    def exchange(
        self,
        round_: int,
        unit: str,
        start: Tensors,
        end: Tensors,
        tokens: int,
        participants: list[str],
        counted: bool = True,
        grouped: bool = False,
    ) -> UnitRound:
        return self._exchange.run(round_, unit, start, end, tokens, participants, counted, grouped)

    def refresh(
        self, min_round: int, holders: dict[str, list[str]], deadline: float, **kwargs
    ) -> dict[str, int]:
        return self._refresh.run(min_round, holders, deadline, **kwargs)

    def start_versions(
        self, round_: int, read: Callable[[str], Tensors], held: list[str], versioned: Callable[[str], bool]
    ) -> None:
        """From the swarm's initial model (version ``round_``): every unit we hold that has versions starts
        its chain, and every frozen copy is that version."""
        for unit in self.outbox.specs:
            if unit not in held:
                self.copies.set(unit, round_, tensors_hash(read(unit)))
            elif versioned(unit):
                self.versions.start(unit, round_, read(unit))

    def serve_weights(self, round_: int, unit: str, weights: Tensors) -> None:
        """Serves our weights of a unit we hold (so our copy of it is no frozen copy any more)."""
        self.outbox.serve_weights(round_, unit, weights)
        self.copies.forget(unit)

    def held(self) -> dict[str, list]:
        """What the sync keeps, by kind (``peer.footprint``)."""
        x = self._exchange
        residuals = [f.residual for f in list(x.feedback.values())]
        momenta = [o.buffers for o in list(x.outer.values())]
        versions = self.versions.held()
        return {
            "outer": [residuals, momenta],
            "versions": versions["versions"],
            "served": [self.outbox.held(), versions["served"]],
            "received": [list(x.inputs)],
        }

    def forget_before(self, round_: int, held: list[str] = ()) -> None:
        """Drops what was kept for rounds older than ``KEEP_ROUNDS`` before ``round_`` (versions of units
        not ``held`` too, and their gossip)."""
        self.outbox.forget_before(round_)
        self._exchange.gossip.follow_only(held)
        self.versions.forget(set(held), round_ - KEEP_ROUNDS)
        self._exchange.forget_before(round_, KEEP_ROUNDS)

    def close(self) -> None:
        self.abort.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
