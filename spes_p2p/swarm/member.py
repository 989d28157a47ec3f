"""A peer's membership in a swarm: the swarm-identity check, its records, its claims, and leaving.

``SwarmMember`` keeps this peer's records alive (``heartbeat``), re-evaluates its claims (``rebalance``, at
sync boundaries) and reads the swarm (``view``). It never blocks for longer than the transport's timeouts.

A holder record says from which round the peer trains the unit (``since``), in which rotation epoch it was
made (``epoch``, dense blocks), and, for a unit the peer has given up, the last round it trained it
(``until``): for a few rounds more it still serves that round's weights, so the unit's new holders can fetch
them exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from spes_p2p.errors import ConfigError
from spes_p2p.swarm.claims import carry_block, choose_units, holders_at_epoch
from spes_p2p.swarm.records import (
    PeerRecord,
    RecordError,
    SwarmIdentity,
    config_key,
    holders_key,
    parse_peers,
    peers_key,
)
from spes_p2p.swarm.transport import Transport

logger = logging.getLogger(__name__)


ENDING_ROUNDS = 2  # rounds a former holder still announces a unit it gave up


class SwarmMismatch(ConfigError):
    """This peer's model/shards/method settings differ from the swarm's."""


@dataclass(frozen=True, kw_only=True)
class MemberConfig:
    run_id: str
    claimable: list[str]  # units assigned by the claim policy (the expert shards)
    always_held: list[str] = field(default_factory=list)  # units every peer trains (the dense part, B = 1)
    capacity: int = 1
    dense_claimable: list[str] = field(default_factory=list)  # dense blocks, when there are B > 1
    dense_capacity: int = 1  # dense blocks this peer trains at once
    rotate_every: int = 0  # rounds between dense-block rotations; 0: never
    block_order: str = "cyclic"
    target_replication: int = 2
    hysteresis: int = 1
    record_ttl: float = 20.0
    version: str = ""
    client_mode: bool = False


@dataclass
class SwarmView:
    """What a peer sees of the swarm at one moment."""

    peers: dict[str, PeerRecord]  # live, valid, active peers
    holders: dict[str, set[str]]  # unit -> live peers that hold it
    since: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> holder -> first round it trains
    until: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> former holder -> last round
    epochs: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> holder -> its record's epoch

    def uncovered(self) -> list[str]:
        return [u for u, h in self.holders.items() if not h]

    def participants(self, unit: str, round_: int) -> set[str]:
        """The peers that trained ``unit`` in ``round_``: holders since then, former holders until then."""
        since = self.since.get(unit, {})
        current = {p for p in self.holders.get(unit, set()) if since.get(p, 0) <= round_}
        former = {p for p, last in self.until.get(unit, {}).items() if since.get(p, 0) <= round_ <= last}
        return current | former


def read_view(transport: Transport, run_id: str, units: list[str]) -> SwarmView:
    """Live peers and, for every unit, its live holders; invalid records are logged and skipped."""
    peers = parse_peers(transport.read(peers_key(run_id)))
    view = SwarmView(peers, {})
    for unit in units:
        entries = transport.read(holders_key(run_id, unit))
        live = {
            p: e.value
            for p, e in entries.items()
            if p in peers and isinstance(e.value, dict) and e.value.get("held") is True
        }
        view.until[unit] = {p: v["until"] for p, v in live.items() if _is_int(v.get("until"))}
        view.holders[unit] = set(live) - set(view.until[unit])
        view.since[unit] = {p: v["since"] for p, v in live.items() if _is_int(v.get("since"))}
        view.epochs[unit] = {p: v.get("epoch", 0) for p, v in live.items() if _is_int(v.get("epoch", 0))}
    return view


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_identities(transport: Transport, run_id: str) -> dict[str, SwarmIdentity]:
    identities = {}
    for peer, entry in transport.read(config_key(run_id)).items():
        try:
            identities[peer] = SwarmIdentity.from_record(entry.value)
        except RecordError as exc:
            logger.warning("ignoring the config record of %s: %s", peer, exc)
    return identities


class SwarmMember:
    def __init__(self, transport: Transport, identity: SwarmIdentity, cfg: MemberConfig) -> None:
        self.transport, self.identity, self.cfg = transport, identity, cfg
        self.held: set[str] = set()
        self.since: dict[str, int] = {}  # unit -> the first round this peer trains it
        self.ending: dict[str, int] = {}  # unit given up -> the last round this peer trained it
        self.epoch = 0  # the dense-block rotation epoch of this peer's claims
        self.round = 0
        self.tokens_per_s = 0.0
        self.loss: float | None = None
        self.last_view = SwarmView({}, {u: set() for u in self.units})

    @property
    def units(self) -> list[str]:
        return [*self.cfg.always_held, *self.cfg.dense_claimable, *self.cfg.claimable]

    @property
    def units_held(self) -> list[str]:
        return [u for u in self.units if u in self.held or u in self.cfg.always_held]

    def check_identity(self) -> None:
        """Raises SwarmMismatch naming the fields where this peer differs from the swarm's live peers."""
        for peer, theirs in read_identities(self.transport, self.cfg.run_id).items():
            if peer != self.transport.peer_id and theirs.hash != self.identity.hash:
                diffs = "; ".join(self.identity.differences(theirs))
                raise SwarmMismatch(
                    f"this peer's settings differ from swarm {self.cfg.run_id!r} (peer {peer}): {diffs}"
                )

    def join(self, first_round: int | None = None) -> SwarmView:
        """Checks the swarm identity, then claims and publishes. Nothing is written if the check fails. The
        units count this peer's updates from ``first_round`` on (default: the current round)."""
        self.check_identity()
        view = self.view()
        first = self.round if first_round is None else first_round
        self.epoch = self.epoch_of(first)
        self.held = self._choose(view, first)
        self.since = {u: first for u in self.units}
        self.heartbeat()
        return self.view()

    def epoch_of(self, round_: int) -> int:
        return round_ // self.cfg.rotate_every if self.cfg.dense_claimable and self.cfg.rotate_every else 0

    def start_at(self, round_: int) -> None:
        """A newcomer that caught up trains everything it holds from ``round_`` on."""
        self.round = round_
        self.since = {u: round_ for u in self.units}
        self.heartbeat()

    def live_peers(self) -> set[str]:
        """Peer ids with a live, active record (one DHT read)."""
        return set(parse_peers(self.transport.read(peers_key(self.cfg.run_id))))

    def view(self) -> SwarmView:
        self.last_view = read_view(self.transport, self.cfg.run_id, self.units)
        return self.last_view

    def rebalance(self, first_round: int | None = None, count_from: int | None = None) -> set[str]:
        """Re-runs the claim policy (call at sync boundaries); returns the units given up. The claims take
        effect in ``first_round`` (default: the current round); the others count this peer's updates of a new
        unit from ``count_from`` on (default: ``first_round``; later when they may read their participants
        before they see the claim)."""
        view = self.view()
        first = self.round if first_round is None else first_round
        count = first if count_from is None else count_from
        new = self._choose(view, first)
        dropped = self.held - new
        if new != self.held:
            logger.info("claims: %s -> %s", sorted(self.held), sorted(new))
        for unit in new - self.held:
            self.since[unit] = count
            self.ending.pop(unit, None)
        for unit in dropped:
            self.ending[unit] = first - 1  # the last round it trains the unit
        self.held = new
        self.heartbeat()
        return dropped

    def _choose(self, view: SwarmView, first_round: int) -> set[str]:
        if self.cfg.client_mode:
            return set()  # nobody can fetch a client's updates, so it holds nothing on its own
        me = self.transport.peer_id
        experts = choose_units(
            me=me,
            held=self.held,
            units=self.cfg.claimable,
            holders=view.holders,
            capacity=self.cfg.capacity,
            target=self.cfg.target_replication,
            hysteresis=self.cfg.hysteresis,
        )
        if not self.cfg.dense_claimable:
            return experts
        return experts | self._choose_blocks(view, self.epoch_of(first_round))

    def _choose_blocks(self, view: SwarmView, epoch: int) -> set[str]:
        """The dense blocks to train from ``epoch`` on: this peer's carried through the rotations since its
        last claim, then the claim policy over everyone's claims carried to the same epoch."""
        blocks, order, seed = self.cfg.dense_claimable, self.cfg.block_order, self.cfg.run_id
        mine = {
            blocks[carry_block(int(u.split("/")[1]), self.epoch, epoch, len(blocks), order, seed)]
            for u in self.held
            if u in blocks
        }
        if mine != {u for u in self.held if u in blocks}:
            logger.info("rotation to epoch %d: dense blocks %s", epoch, sorted(mine))
        others = {u: {p: view.epochs.get(u, {}).get(p, 0) for p in view.holders.get(u, ())} for u in blocks}
        self.epoch = epoch
        return choose_units(
            me=self.transport.peer_id,
            held=mine,
            units=blocks,
            holders=holders_at_epoch(others, epoch, order, seed),
            capacity=self.cfg.dense_capacity,
            target=len(view.peers) + 1,  # dense blocks: as evenly covered as the peers allow
            hysteresis=self.cfg.hysteresis,
        )

    def heartbeat(self) -> None:
        """Refreshes this peer's records; a unit given up is announced as such until its last round is
        ``ENDING_ROUNDS`` behind, then released."""
        expires = self.transport.now() + self.cfg.record_ttl
        self.transport.publish(config_key(self.cfg.run_id), self.identity.to_record(), expires)
        self.transport.publish(peers_key(self.cfg.run_id), self.record().to_record(), expires)
        self._publish_holders(set(self.units_held), held=True)
        released = {u for u, last in self.ending.items() if self.round > last + ENDING_ROUNDS}
        self._publish_holders(set(self.ending) - released, held=True)
        self._publish_holders(released, held=False)
        for unit in released:
            del self.ending[unit]

    def _publish_holders(self, units: set[str], held: bool, ttl: float | None = None) -> None:
        expires = self.transport.now() + (ttl or self.cfg.record_ttl)
        for unit in sorted(units):
            entry = {"held": held, "round": self.round, "since": self.since.get(unit, 0), "epoch": self.epoch}
            if held and unit in self.ending:
                entry["until"] = self.ending[unit]
            self.transport.publish(holders_key(self.cfg.run_id, unit), entry, expires)

    def record(self, state: str = "active") -> PeerRecord:
        return PeerRecord(
            peer_id=self.transport.peer_id,
            addresses=self.transport.addresses()[:16],
            units=self.units_held if state == "active" else [],
            round=self.round,
            tokens_per_s=self.tokens_per_s,
            loss=self.loss,
            version=self.cfg.version,
            config_hash=self.identity.hash,
            state=state,
            client_mode=self.cfg.client_mode,
        )

    def leave(self) -> None:
        """Releases every claim at once: tombstones replace the records until they expire.

        A DHT keeps the entry with the later expiry, so tombstones outlive the last heartbeat's records.
        """
        ttl = self.cfg.record_ttl + 1.0
        expires = self.transport.now() + ttl
        self.transport.publish(peers_key(self.cfg.run_id), self.record(state="left").to_record(), expires)
        self._publish_holders(set(self.units_held) | set(self.ending), held=False, ttl=ttl)
        self.held = set()
        self.ending = {}
