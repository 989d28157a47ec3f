"""A peer's membership in a swarm: the manifest check, its records, its claims, and leaving.

``SwarmMember`` keeps this peer's records alive (``heartbeat``), re-evaluates its claims (``rebalance``, at
sync boundaries) and reads the swarm (``view``). It never blocks for longer than the transport's timeouts.
It is thread-safe: the training thread claims and reports progress, the heartbeat thread refreshes the
records, the sync thread reads views and claims; one lock guards its state, never held across a DHT call.

A peer's record lists the units it holds: from which round it trains each (``since``), and, for a unit it
has given up, the last round it trained it (``until``): for a few rounds more it still serves that round's
weights, so the unit's new holders can fetch them exactly. The record also names the rotation epoch of its
claims (``epoch``, dense blocks).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from spes_p2p.errors import SwarmMismatch
from spes_p2p.net.config import NetworkConfig
from spes_p2p.net.transport import Transport
from spes_p2p.net.waiting import Deadline
from spes_p2p.swarm import manifest as manifests
from spes_p2p.swarm.claims import carry_block, choose_units, holders_at_epoch
from spes_p2p.swarm.config import PeerConfig, SwarmConfig
from spes_p2p.swarm.manifest import Manifest, ManifestError
from spes_p2p.swarm.records import (
    MAX_ADDRESSES,
    MAX_BANNED,
    MAX_SCORES,
    Holding,
    PeerRecord,
    Progress,
    ProgressRecord,
    Record,
    peers_key,
    progress_key,
    read_peers,
)

logger = logging.getLogger(__name__)

UNSERVED_LIMIT = 3


ENDING_ROUNDS = 2  # rounds a former holder still announces a unit it gave up
# The manifest record never changes, and counts only while its peer's record is live: it lives this many
# record TTLs, and is refreshed once half of that has passed (not every heartbeat).
MANIFEST_TTLS = 4


def mismatch(transport: Transport, run_id: str, ours: Manifest, peer: str, theirs: manifests.ManifestRecord):
    """The error for a peer whose manifest differs from ours: the protocols when they differ, else every
    differing field (when its manifest can be fetched)."""
    if theirs.protocol != ours.protocol:
        return SwarmMismatch(manifests.protocol_mismatch(run_id, theirs.protocol, peer))
    try:
        full, _ = manifests.fetch(transport, [peer], theirs.hash, Deadline(10.0))
        detail = "; ".join(manifests.differences(ours, full))
    except ManifestError as exc:
        detail = f"manifest {theirs.hash[:16]} vs {ours.hash[:16]} here ({exc})"
    return SwarmMismatch(f"this peer's settings differ from swarm {run_id!r} (peer {peer}): {detail}")


def check_manifest(transport: Transport, run_id: str, ours: Manifest) -> None:
    """Raises SwarmMismatch when the other live peers share another manifest, naming what differs. A few
    that differ while others share ours are left out of this peer's views (one stranger's record does not
    lock newcomers out)."""
    live = read_peers(transport, run_id)
    records = manifests.read_records(transport, run_id)
    others = {p: r for p, r in records.items() if p != transport.peer_id and p in live}
    differ = {p: r for p, r in sorted(others.items()) if r.hash != ours.hash}
    if differ and len(differ) == len(others):
        peer, theirs = next(iter(differ.items()))
        raise mismatch(transport, run_id, ours, peer, theirs)
    for peer, theirs in differ.items():
        reason = f"manifest {theirs.hash[:16]}, not the swarm's"
        transport.guard.reject(peer, "manifest record", reason, counts_toward_ban=False)


@dataclass(frozen=True, kw_only=True)
class MemberConfig:
    """What membership needs: the ``[swarm]``, ``[peer]`` and ``[network]`` sections, and how the swarm's
    units are claimed (which the peer derives from the model and the method)."""

    swarm: SwarmConfig
    peer: PeerConfig = field(default_factory=PeerConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    claimable: list[str]  # units assigned by the claim policy (the expert shards)
    always_held: list[str] = field(default_factory=list)  # units every peer trains (the dense part, B = 1)
    dense_claimable: list[str] = field(default_factory=list)  # dense blocks, when there are B > 1
    rotate_every: int = 0  # method.rotate_every_rounds: rounds between dense-block rotations; 0: never
    block_order: str = "cyclic"  # method.block_order
    version: str = ""


@dataclass
class SwarmView:
    """What a peer sees of the swarm at one moment."""

    peers: dict[str, PeerRecord]  # live, valid, active peers
    holders: dict[str, set[str]]  # unit -> live peers that hold it
    since: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> holder -> first round it trains
    until: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> former holder -> last round
    epochs: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> holder -> its record's epoch
    # peers whose record was last refreshed over half a record TTL ago: they missed a heartbeat, and may be
    # dead (a killed peer's record outlives it by up to a TTL); claims plan no move for them
    stale: set[str] = field(default_factory=set)
    # the live records of peers this one banned: in none of the above, but a grouped exchange's grid counts
    # them (``members``)
    banned: dict[str, PeerRecord] = field(default_factory=dict)

    def uncovered(self) -> list[str]:
        return [u for u, h in self.holders.items() if not h]

    def participants(self, unit: str, round_: int) -> set[str]:
        """The peers that trained ``unit`` in ``round_``: holders since then, former holders until then."""
        since = self.since.get(unit, {})
        current = {p for p in self.holders.get(unit, set()) if since.get(p, 0) <= round_}
        former = {p for p, last in self.until.get(unit, {}).items() if since.get(p, 0) <= round_ <= last}
        return current | former

    def members(self, unit: str, round_: int) -> set[str]:
        """``participants``, and the peers this one banned that trained ``unit`` in ``round_`` as their
        records say. A ban is this peer's own: the others still count a peer it banned, so the grid of a
        grouped exchange, which every member must compute alike, counts it too (it deals the same rows and
        part owners); the banned peer's update is then refused, not waited for (``sync/gather.py``)."""
        banned = {p for p, r in self.banned.items() if _trained(r.holds.get(unit), round_)}
        return self.participants(unit, round_) | banned


def _trained(holding: Holding | None, round_: int) -> bool:
    """Whether a record's holding of a unit says its peer trained it in ``round_``."""
    if holding is None:
        return False
    return holding.since <= round_ and (holding.until is None or round_ <= holding.until)


def read_view(
    transport: Transport, run_id: str, units: list[str], manifest: str = "", stale_after: float = math.inf
) -> SwarmView:
    """Live peers (those sharing ``manifest``, when given) and, for every unit, its live holders (one DHT
    read); invalid records are skipped and reported to the transport's guard. Records older than
    ``stale_after`` seconds are stale (``SwarmView.stale``)."""
    records = read_peers(transport, run_id, banned=True)
    records = {p: r for p, r in records.items() if not manifest or r.manifest == manifest}
    peers = {p: r for p, r in records.items() if p == transport.peer_id or transport.guard.allows(p)}
    for peer, record in peers.items():
        transport.learn(peer, record.addresses)  # (a signed record: the peer itself says where it is)
    over = over_capacity(records, transport.guard)
    now = transport.now()
    view = SwarmView(peers, {}, stale={p for p, r in peers.items() if now - r.seen > stale_after})
    view.banned = {p: r for p, r in records.items() if p not in peers and p not in over}
    for unit in units:
        live = {p: r.holds[unit] for p, r in peers.items() if unit in r.holds and p not in over}
        view.until[unit] = {p: h.until for p, h in live.items() if h.until is not None}
        view.holders[unit] = set(live) - set(view.until[unit])
        view.since[unit] = {p: h.since for p, h in live.items()}
        view.epochs[unit] = {p: peers[p].epoch for p in live}
    return view


def over_capacity(peers: dict[str, PeerRecord], guard) -> set[str]:
    """Peers that hold more expert shards than their records declare they can: their claims are ignored
    (a client never does this; a peer that claims every shard to starve the others does)."""
    # (a shard given up is still served a few rounds: not a claim)
    held = {p: sum(u.startswith("experts/") for u in r.units) for p, r in peers.items()}
    over = {p for p, n in held.items() if n > peers[p].capacity}
    for p in over:
        guard.reject(
            p,
            "claims",
            f"{held[p]} expert shards, over its capacity {peers[p].capacity}",
            counts_toward_ban=False,
        )
    return over


@dataclass
class Delivery:
    """What this peer saw of the holders of units it does not train: ``unserved``, unit -> refreshes in a
    row that none of its holders served; ``failing``, unit -> holders that left ``UNCONFIRMED_LIMIT`` asks
    to serve or confirm it in a row unanswered (``sync.refresh``)."""

    unserved: Counter[str] = field(default_factory=Counter)
    failing: dict[str, set[str]] = field(default_factory=dict)

    def delivering(self, holders: dict[str, set[str]], held: set[str]) -> dict[str, set[str]]:
        """Each unit's holders that deliver it: none for a unit none of whose holders served
        ``UNSERVED_LIMIT`` refreshes in a row, and never one that is failing (for a unit we hold: all, as
        we no longer refresh it)."""
        return {
            u: set()
            if self.unserved[u] >= UNSERVED_LIMIT
            else h - (set() if u in held else self.failing.get(u, set()))
            for u, h in holders.items()
        }


@dataclass(frozen=True)
class ClaimChoice:
    """Which units a peer holds from a round on: the claim policy (``claims.choose_units``) over a view, for
    the expert shards and, with dense blocks (B > 1), the blocks carried through their rotations."""

    cfg: MemberConfig
    me: str

    def epoch_of(self, round_: int) -> int:
        """The dense-block rotation epoch of ``round_`` (0 without rotations)."""
        return round_ // self.cfg.rotate_every if self.cfg.dense_claimable and self.cfg.rotate_every else 0

    def __call__(
        self,
        view: SwarmView,
        held: set[str],
        delivery: Delivery,
        first_round: int,
        epoch: int,
        founding: bool = False,
    ) -> tuple[set[str], int]:
        """The units to hold from ``first_round`` on, and the rotation epoch of those claims (``epoch``:
        that of ``held``). Expert shards count only the holders that deliver them (``Delivery``). Peers
        that claimed since ``first_round`` are not moved again, but for
        ``founding`` (before the first round, when every claim is that new); nor are stale ones (a plan that
        moves a dead peer moves nobody)."""
        settled = {p for since in view.since.values() for p, s in since.items() if s >= first_round}
        settled = (set() if founding else settled) | view.stale
        delivering = delivery.delivering(view.holders, held)
        experts = choose_units(
            me=self.me,
            held=held,
            units=self.cfg.claimable,
            holders=delivering,
            capacity=self.cfg.peer.capacity,
            target=self.cfg.swarm.target_replication,
            hysteresis=self.cfg.swarm.hysteresis,
            settled=settled,
        )
        if not self.cfg.dense_claimable:
            return experts, epoch
        target = self.epoch_of(first_round)
        return experts | self._blocks(view, held, epoch, target, settled), target

    def _blocks(self, view: SwarmView, held: set[str], epoch: int, target: int, settled: set) -> set[str]:
        """The dense blocks to train from epoch ``target`` on: ours carried through the rotations since
        ``epoch``, then the claim policy over everyone's claims carried to the same epoch."""
        blocks, order, seed = self.cfg.dense_claimable, self.cfg.block_order, self.cfg.swarm.run_id
        mine = {
            blocks[carry_block(int(u.split("/")[1]), epoch, target, len(blocks), order, seed)]
            for u in held
            if u in blocks
        }
        if mine != {u for u in held if u in blocks}:
            logger.info("rotation to epoch %d: dense blocks %s", target, sorted(mine))
        others = {u: {p: view.epochs.get(u, {}).get(p, 0) for p in view.holders.get(u, ())} for u in blocks}
        return choose_units(
            me=self.me,
            held=mine,
            units=blocks,
            holders=holders_at_epoch(others, target, order, seed),
            capacity=self.cfg.peer.active_blocks,
            target=len(view.peers) + 1,  # dense blocks: as evenly covered as the peers allow
            hysteresis=self.cfg.swarm.hysteresis,
            settled=settled,
        )


class SwarmMember:
    """This peer's claims and progress, and its records in the DHT.

    Threads: the training thread joins, claims, rebalances and reports progress; the heartbeat thread
    refreshes the records; the sync thread reads views, ``since`` and ``units_held``. ``_state`` guards the
    fields below and is never held across a DHT call; ``_publishing`` serializes whole publications (a
    snapshot of the state, then its DHT writes), so an older snapshot never overwrites a newer one.
    """

    def __init__(self, transport: Transport, manifest: Manifest, cfg: MemberConfig) -> None:
        self.transport, self.manifest, self.cfg = transport, manifest, cfg
        self._choose = ClaimChoice(cfg, transport.peer_id)
        self._manifest_record = manifest.record()
        self._manifest_due = float("-inf")  # when the manifest record is next refreshed (transport time)
        self._published = False  # whether this peer's active record is out (until it leaves)
        # the progress record, read by people only, is written when more than its traffic counters changed
        # (a round ended, a refusal, a score), else every third of a TTL
        self._progress_due, self._progress_news = float("-inf"), None
        self._left = False  # once it left, a late heartbeat must not bring its record back
        self._viewed_at = float("-inf")  # when last_view was read (time.monotonic)
        self._state = threading.RLock()
        self._publishing = threading.Lock()
        self.held: set[str] = set()
        self.since: dict[str, int] = {}  # unit -> the first round this peer trains it
        self.ending: dict[str, int] = {}  # unit given up -> the last round this peer trained it
        self.epoch = 0  # the dense-block rotation epoch of this peer's claims
        self.round = 0
        self.progress = Progress()  # (its traffic and rejections are filled in when published)
        self.data_epoch = 0
        self.reachable = "unknown"
        self.last_view = SwarmView({}, {u: set() for u in self.units})
        self.delivery = Delivery()  # of the units this peer does not train

    @property
    def me(self) -> str:
        return self.transport.peer_id

    @property
    def units(self) -> list[str]:
        return [*self.cfg.always_held, *self.cfg.dense_claimable, *self.cfg.claimable]

    @property
    def units_held(self) -> list[str]:
        with self._state:
            return [u for u in self.units if u in self.held or u in self.cfg.always_held]

    def since_of(self, unit: str) -> int:
        with self._state:
            return self.since.get(unit, 0)

    def check_manifest(self) -> None:
        check_manifest(self.transport, self.cfg.swarm.run_id, self.manifest)

    def join(self, first_round: int | None = None) -> SwarmView:
        """Checks the manifest, then claims and publishes. Nothing is written if the check fails. The
        units count this peer's updates from ``first_round`` on (default: the current round)."""
        self.check_manifest()
        view = self.view()
        with self._state:
            first = self.round if first_round is None else first_round
            epoch = self._choose.epoch_of(first)
            self.held, self.epoch = self._choose(view, self.held, self.delivery, first, epoch)
            self.since = {u: first for u in self.units}
            self._left = False
        self.heartbeat()
        return self.view()

    def settle(self) -> None:
        """Before the first round, once the founders see each other: founders that claimed at the same
        moment (neither had seen the other's record) may hold the same unit while another has nobody; the
        moves that each of them plans alike from the same view spread them out."""
        view = self.view()
        with self._state:
            new, _ = self._choose(view, self.held, self.delivery, 0, self.epoch, founding=True)
            if new == self.held:
                return
            logger.info("claims, settled among the founders: %s -> %s", sorted(self.held), sorted(new))
            self.held = new
        self.heartbeat()

    def start_at(self, round_: int) -> None:
        """A peer that caught up trains everything it holds from ``round_`` on."""
        with self._state:
            self.round = round_
            self.since = {u: round_ for u in self.units}
        self.heartbeat()

    def report(self, round_: int, progress: Progress, data_epoch: int) -> None:
        """Progress, and the epoch of the dataset this peer trains, for the next heartbeat."""
        with self._state:
            self.round, self.progress, self.data_epoch = round_, progress, data_epoch

    def set_reachable(self, verdict: str) -> None:
        """Whether peers could dial this one back (yes, no or unknown), for the next heartbeat."""
        with self._state:
            self.reachable = verdict

    def live_peers(self) -> set[str]:
        """The peers of ``recent_view`` (waits check liveness often, from several threads: one read a
        heartbeat serves them all; the records change no faster, but for a leave's tombstone)."""
        return set(self.recent_view().peers)

    def participants(self, unit: str, round_: int) -> set[str]:
        """Who takes part in ``unit``'s round ``round_`` as the swarm's records say now (a view as recent as
        ``live_peers``'s): a peer that left does not, nor one that came back holding the unit only from a
        later round (a restart, which will never deliver that round's update)."""
        return self.recent_view().participants(unit, round_)

    def recent_view(self) -> SwarmView:
        """The last view, when it was read within a heartbeat, else a new one: for waits that poll the
        swarm's records (they change no faster than heartbeats; a read each poll, by hundreds of peers
        that wait together, would cost every one of them a read of every record several times a second)."""
        if time.monotonic() - self._viewed_at > self.cfg.swarm.heartbeat_seconds:
            self.view()
        return self.last_view

    def view(self) -> SwarmView:
        """The swarm now (one DHT read). Once this peer's record is out, every read finds it: one that does
        not (a DHT timeout, on a saturated machine) must not read as "everyone left": the last view stands."""
        ttl = self.cfg.swarm.record_ttl_seconds
        view = read_view(self.transport, self.cfg.swarm.run_id, self.units, self.manifest.hash, ttl / 2)
        if self._published and self.me not in view.peers:
            logger.warning("a read of the swarm's records found nobody; using the last view")
            return self.last_view
        self.last_view, self._viewed_at = view, time.monotonic()  # (readers see the old view or this one)
        return view

    def served(self, unit: str, ok: bool) -> None:
        """Whether a refresh of ``unit`` (not trained here) got it from one of its holders. A unit none of
        whose holders serves for ``UNSERVED_LIMIT`` refreshes in a row counts as uncovered in claims: holders
        that never deliver (fake ones too) do not keep it from being trained."""
        with self._state:
            self.delivery.unserved[unit] = 0 if ok else self.delivery.unserved[unit] + 1

    def failing(self, holders: dict[str, set[str]]) -> None:
        """Unit -> its holders that neither serve nor confirm it (``sync.refresh``): claims do not count
        them (a holder that claims more than it serves, whatever capacity it declares)."""
        with self._state:
            self.delivery.failing = holders

    def rebalance(
        self, first_round: int | None = None, count_from: int | None = None, view: SwarmView | None = None
    ) -> set[str]:
        """Re-runs the claim policy (call at sync boundaries); returns the units given up. The claims take
        effect in ``first_round`` (default: the current round); the others count this peer's updates of a new
        unit from ``count_from`` on (default: ``first_round``; later when they may read their participants
        before they see the claim). ``view``: the swarm as the caller read it just before (default: read
        now), so that a round boundary reads the swarm's records once."""
        view = self.view() if view is None else view
        with self._state:
            first_round = self.round if first_round is None else first_round
            count_from = first_round if count_from is None else count_from
            new, self.epoch = self._choose(view, self.held, self.delivery, first_round, self.epoch)
            dropped = self.held - new
            if new != self.held:
                logger.info("claims: %s -> %s", sorted(self.held), sorted(new))
            for unit in new - self.held:
                self.since[unit] = count_from
                self.delivery.unserved.pop(unit, None)  # (held: no longer refreshed, so no longer judged)
                self.ending.pop(unit, None)
            for unit in dropped:
                if first_round > self.since.get(unit, 0):  # (a unit never trained here is just dropped)
                    self.ending[unit] = first_round - 1  # the last round it trains the unit
            self.held = new
        self.heartbeat()
        return dropped

    def heartbeat(self) -> None:
        """Refreshes this peer's records; a unit given up is announced as such until its last round is
        ``ENDING_ROUNDS`` behind, then released."""
        addresses = self.transport.addresses()[:MAX_ADDRESSES]
        with self._publishing:
            if self._left:
                return
            with self._state:
                for unit in [u for u, last in self.ending.items() if self.round > last + ENDING_ROUNDS]:
                    del self.ending[unit]
                record = self._peer_record("active", addresses)
                progress = progress_record(self.transport, self.round, self.progress)
            run_id, ttl, now = self.cfg.swarm.run_id, self.cfg.swarm.record_ttl_seconds, self.transport.now()
            records = [(peers_key(run_id), record)]
            news = without_traffic(progress)
            if now >= self._progress_due or news != self._progress_news:
                records.append((progress_key(run_id), progress))
                self._progress_due, self._progress_news = now + ttl / 3, news
            self._publish(records, ttl)
            self._published = True
            if now >= self._manifest_due:
                self._manifest_due = now + MANIFEST_TTLS * ttl / 2
                self._publish([(manifests.manifest_key(run_id), self._manifest_record)], MANIFEST_TTLS * ttl)

    def leave(self) -> None:
        """Releases every claim at once: a "left" tombstone replaces the peer record until it expires.

        A DHT keeps the entry with the later expiry, so the tombstone outlives the last heartbeat's record.
        """
        addresses = self.transport.addresses()[:MAX_ADDRESSES]
        with self._publishing:
            with self._state:
                self.held, self.ending = set(), {}
                self._published, self._left = False, True
                record = self._peer_record("left", addresses)
            self._publish(
                [(peers_key(self.cfg.swarm.run_id), record)], self.cfg.swarm.record_ttl_seconds + 1.0
            )

    def leave_within(self, seconds: float, first: Callable[[], None] = lambda: None) -> None:
        """``first`` (other records given back), then ``leave``, on a thread given at most ``seconds``; it
        never fails (records expire by themselves)."""

        def release() -> None:
            try:
                first()
                self.leave()
            except Exception:
                logger.exception("could not release claims; they expire by themselves")

        releasing = threading.Thread(target=release, name="release-claims", daemon=True)
        releasing.start()
        releasing.join(seconds)
        if releasing.is_alive():
            logger.warning("releasing claims took over %.0fs; they will expire by themselves", seconds)

    def _publish(self, records: list[tuple[str, Record]], ttl: float) -> None:
        expires = self.transport.now() + ttl
        for key, record in records:
            self.transport.publish(key, record.encode(), expires)

    def _peer_record(self, state: str, addresses: list[str]) -> PeerRecord:
        return PeerRecord(
            peer_id=self.me,
            addresses=addresses,
            holds={
                u: Holding(since=self.since.get(u, 0), until=self.ending.get(u))
                for u in sorted(set(self.units_held) | set(self.ending))
                if state == "active"
            },
            epoch=self.epoch,
            round=self.round,
            trained=self.progress.tokens > 0,
            data_epoch=self.data_epoch,
            version=self.cfg.version,
            manifest=self.manifest.hash,
            state=state,
            client_mode=self.cfg.network.client_mode,
            seen=self.transport.now(),
            capacity=self.cfg.peer.capacity + sum(u.startswith("experts/") for u in self.cfg.always_held),
            banned=self.transport.guard.banned()[:MAX_BANNED],
            reachable=self.reachable,
        )


def without_traffic(record: ProgressRecord) -> ProgressRecord:
    """``record`` with its traffic counters, which change at every request, zeroed: what is news in it."""
    quiet = msgspec.structs.replace(record.progress, sent=0, received=0)
    return msgspec.structs.replace(record, progress=quiet)


def progress_record(transport: Transport, round_: int, progress: Progress) -> ProgressRecord:
    """What a peer shows of itself: ``progress`` with its traffic and refusals, and its scores of others."""
    traffic, guard = transport.stats, transport.guard
    return ProgressRecord(
        peer_id=transport.peer_id,
        round=round_,
        progress=msgspec.structs.replace(
            progress, sent=traffic.bytes_sent, received=traffic.bytes_received, rejected=guard.total()
        ),
        scores={p: round(s, 3) for p, s in sorted(guard.scores().items(), key=lambda kv: kv[1])[:MAX_SCORES]},
    )
