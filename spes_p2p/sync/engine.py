"""The sync's one facade: the exchange of each trained unit's update with its other holders (all-to-all, or
by reduce-scatter in a group), serving what others ask for, the versions of the units we hold and the
frozen copies of the others. It moves tensors; it knows nothing of optimizers or data. See
docs/protocol.md, and docs/architecture.md for its parts:

    Outbox        (serving.py)         what we serve: updates, weights, combined parts, versions
    Ledger        (ledger.py)          what carries across rounds
    Gatherer      (gather.py)          announcements, fetches of updates, the adaptive deadline
    AllToAll, ReduceScatter            the two strategies of a unit's round (exchange.py: what they share)
    Refresh       (refresh.py)         units fetched from their holders: frozen copies, catch-up downloads
    Versions, Copies (versions.py)     the versions of the units we hold; which of our copies are versions

No wait is unbounded: every request has a timeout, and every round and refresh a deadline that adapts to
observed arrival times within [deadline_min, deadline_max]; ``stop_waiting`` ends every wait at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from spes_p2p.net.transport import Transport
from spes_p2p.sync.all_to_all import AllToAll
from spes_p2p.sync.codecs import Codecs, TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.exchange import Exchange, Grid, dense_grid
from spes_p2p.sync.fetching import UpdateFetcher
from spes_p2p.sync.gather import Gatherer, Roster
from spes_p2p.sync.jobs import UnitJob, UnitResult
from spes_p2p.sync.ledger import Ledger
from spes_p2p.sync.payload import tensors_hash
from spes_p2p.sync.reduce_scatter import ReduceScatter
from spes_p2p.sync.refresh import Refresh, Verify
from spes_p2p.sync.serving import KEEP_ROUNDS, Outbox
from spes_p2p.sync.versions import EXACT_WEIGHTS, Chains, Copies, Download, Version, Versions, Want

PARALLEL_FETCHES = 4

Tensors = dict[str, torch.Tensor]


class SyncEngine:
    def __init__(
        self,
        transport: Transport,
        run_id: str,
        cfg: SyncConfig,
        specs: dict[str, dict[str, TensorSpec]],
        local_copy: Callable[[str], Tensors] | None = None,
        roster: Roster | None = None,
        aggregate: str = "mean",
        quantized: dict[str, frozenset[str]] | None = None,
    ) -> None:
        """``specs``: every unit's tensors; ``local_copy``: our copy of any unit (for newcomers that find no
        holder ready); ``roster``: who is in the swarm and takes part in a round now; ``aggregate``: the rule
        that combines a round's updates (``aggregate.combine``); ``quantized``: the tensors of each unit that
        a peer holding it quantized keeps quantized (``Chains``; default: every tensor of an expert shard)."""
        self.transport, self.cfg, self._specs, self._run_id = transport, cfg, specs, run_id
        codecs = Codecs.of(cfg)
        self.chains = Chains.experts_only(specs) if quantized is None else Chains(specs, quantized)
        self._abort = threading.Event()  # set when the peer stops: waits end at once, with what has arrived
        self._pool = ThreadPoolExecutor(PARALLEL_FETCHES, thread_name_prefix="spes-fetch")
        self._versions = Versions(codecs.refresh, self.chains)  # of the units we hold
        self._copies = Copies()  # which of our frozen copies are versions
        self._outbox = Outbox(transport, specs, codecs, self._versions, local_copy)
        self._ledger = Ledger(cfg, codecs.update)
        fetcher = UpdateFetcher(transport, cfg, codecs.update, specs, self._pool, self._abort)
        self._gatherer = Gatherer(transport, run_id, cfg, fetcher, self._ledger, self._abort, roster)
        parts = (transport.peer_id, codecs.update, specs, aggregate, self._outbox, self._ledger)
        self._all_to_all = AllToAll(*parts, self._gatherer, fetcher)
        self._reduce_scatter = ReduceScatter(*parts, self._gatherer, fetcher)
        live_peers = roster.live_peers if roster is not None else None
        self._refresh = Refresh(
            transport, cfg, codecs, specs, self._pool, self._abort, live_peers, self.chains
        )
        self._fetcher = fetcher
        self._sample: Callable[[], None] = lambda: None

    # ---------------------------------------------------------------------------------- a round

    def exchange(self, job: UnitJob) -> UnitResult:
        """One unit's round with its other participants: its new weights, and who took part. A peer left off
        the swarm's weights takes a leader's result of the round."""
        self._gatherer.follow(job.unit)
        try:
            result = self._strategy(job).run(job)
            self._sample()  # (the round holds the most now: every update received is decoded)
        finally:
            self._gatherer.unit_done()
        if result.download_from:
            self.refresh(
                job.round,
                {job.unit: result.download_from},
                self.deadline_seconds(),
                want=EXACT_WEIGHTS,
                on_unit=lambda _, download: result.new_weights.update(download.tensors),
            )
        return result

    def grid(self, members: list[str], round_: int) -> Grid:
        """This round's random rows of a grouped unit's ``members`` (``exchange.dense_grid``): rows of at
        most ``sync.dense_group_size`` that merge, by reduce-scatter; one row of all, all-to-all."""
        scatter = self.cfg.dense_exchange == "reduce_scatter"
        size = self.cfg.dense_group_size if scatter else max(1, len(members))
        return dense_grid(members, round_, self._run_id, size)

    def _strategy(self, job: UnitJob) -> Exchange:
        """A grouped unit (the dense part) goes by reduce-scatter when the swarm says so and its row has three
        members or more, or there are several rows; anything else all-to-all."""
        scatter = self.cfg.dense_exchange == "reduce_scatter"
        grouped = job.grouped and scatter and (len(job.participants) >= 3 or len(job.grid) > 1)
        return self._reduce_scatter if grouped else self._all_to_all

    def deadline_seconds(self) -> float:
        """How long a round waits for its last participant now (adapting to how long they took)."""
        return self._gatherer.deadline_seconds()

    def last_round(self) -> None:
        """The next round is the run's last: it waits for every participant up to ``deadline_max``."""
        self._gatherer.last_round()

    def longest_wait(self) -> float:
        """The longest one wait may take (``sync.deadline_max``): a round's, a download's, a catch-up's."""
        return self.cfg.deadline_max

    def worst_case(self, waits: int) -> float:
        """Seconds ``waits`` waits take when every one runs to its limit, its last requests included."""
        return waits * (self.cfg.deadline_max + 2 * self.cfg.request_timeout)

    def refresh(
        self,
        min_round: int,
        holders: dict[str, list[str]],
        seconds: float,
        want: Want | dict[str, Want] | None = None,
        on_unit: Callable[[str, Download], None] | None = None,
        fallback: list[str] = (),
        verify: Verify | None = None,
    ) -> dict[str, int]:
        """Fetches each unit in ``holders`` from one of them (``refresh.Refresh.run``); unit -> round got."""
        return self._refresh.run(min_round, holders, seconds, want, on_unit, fallback, verify)

    def failing(self) -> dict[str, set[str]]:
        """Unit -> its holders that neither serve nor confirm it (``refresh.Refresh.failing``)."""
        return self._refresh.failing()

    @property
    def rejected_payloads(self) -> int:
        return self._fetcher.rejected + self._refresh.rejected

    # ---------------------------------------------------------------------------------- serving

    def serve_weights(self, round_: int, unit: str, weights: Tensors) -> None:
        """Serves our weights of a unit we hold (so our copy of it is no frozen copy any more)."""
        self._outbox.serve_weights(round_, unit, weights)
        self._copies.forget(unit)

    def serve_initial(self, unit: str, weights: Tensors) -> None:
        """Serves the swarm's initial weights of ``unit`` exactly, as round -1 (a founder from ``--init``)."""
        self._outbox.serve_weights(-1, unit, weights)

    # ---------------------------------------------------------------------------------- versions

    def start_versions(
        self, round_: int, read: Callable[[str], Tensors], held: list[str], versioned: Callable[[str], bool]
    ) -> None:
        """From the swarm's initial model (version ``round_``): every unit we hold that has versions starts
        its chain, and every frozen copy is that version."""
        for unit in self._specs:
            if unit not in held:
                self._copies.set(unit, round_, tensors_hash(read(unit)))
            elif versioned(unit):
                self._versions.start(unit, round_, read(unit))

    def version(self, unit: str) -> Version | None:
        """Our current version of a unit we hold."""
        return self._versions.current(unit)

    def start_version(
        self, unit: str, round_: int, weights: Tensors, chains: dict[str, Tensors] | None = None
    ) -> None:
        """Our version chains of ``unit`` start at ``round_`` (a co-holder's exact version, and what its
        quantized chains hold)."""
        self._versions.start(unit, round_, weights, chains)

    def advance_version(self, unit: str, round_: int, since: int, weights: Tensors) -> Version:
        return self._versions.advance(unit, round_, since, weights)

    def copy_version(self, unit: str) -> tuple[int, str] | None:
        """The version (round and hash) our frozen copy of ``unit`` is exactly, if it is one."""
        return self._copies.get(unit)

    def copy_landed(self, unit: str, download: Download, held: Tensors | None, stored: str) -> None:
        """A refreshed copy was written (``held``: as our model holds it; None: the unit is trained now,
        and moves on): it is a version exactly when what came makes one of the chain of how we store it
        (``stored``: full, int8 or nf4)."""
        if held is not None and download.want.makes_version and download.want.chain == stored:
            self._copies.set(unit, download.round, tensors_hash(held))
        else:
            self._copies.forget(unit)

    def forget_copies(self) -> None:
        """After a download of the whole model: no copy is a version (the next refresh fetches those)."""
        self._copies.forget()

    # ---------------------------------------------------------------------------------- upkeep

    def measure_with(self, sample: Callable[[], None]) -> None:
        """Calls ``sample`` (the peer's memory sampling) when a round holds the most."""
        self._sample = sample

    def sample(self) -> None:
        self._sample()

    def held(self) -> dict[str, list]:
        """What the sync keeps, by kind (``peer.footprint``)."""
        kept, versions = self._ledger.held(), self._versions.held()
        return {
            "outer": [kept["residuals"], kept["momenta"]],
            "versions": versions["versions"],
            "served": [self._outbox.held(), versions["served"]],
            "received": self._gatherer.held(),
        }

    def forget_before(self, round_: int, held: list[str] = ()) -> None:
        """Drops what was kept for rounds older than ``KEEP_ROUNDS`` before ``round_`` (versions of units
        not ``held`` too, and their gossip)."""
        self._outbox.forget_before(round_)
        self._gatherer.follow_only(held)
        self._versions.forget(set(held), round_ - KEEP_ROUNDS)
        oldest = round_ - KEEP_ROUNDS - self.cfg.staleness + 1  # the oldest round a late update may be of
        self._ledger.forget_before(oldest, round_)
        self._gatherer.forget_before(oldest)

    def stop_waiting(self) -> None:
        """The peer stops: every wait ends at once, with what has arrived."""
        self._abort.set()

    def close(self) -> None:
        self._abort.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
