"""A peer's membership in a swarm: the swarm-identity check, its records, its claims, and leaving.

``SwarmMember`` keeps this peer's records alive (``heartbeat``), re-evaluates its claims (``rebalance``, at
sync boundaries) and reads the swarm (``view``). It never blocks for longer than the transport's timeouts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from spes_p2p.errors import ConfigError
from spes_p2p.swarm.claims import choose_units
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


class SwarmMismatch(ConfigError):
    """This peer's model/shards/method settings differ from the swarm's."""


@dataclass(frozen=True, kw_only=True)
class MemberConfig:
    run_id: str
    claimable: list[str]  # units assigned by the claim policy (the expert shards)
    always_held: list[str] = field(default_factory=list)  # units every peer trains (the dense part)
    capacity: int = 1
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

    def uncovered(self) -> list[str]:
        return [u for u, h in self.holders.items() if not h]

    def participants(self, unit: str, round_: int) -> set[str]:
        """The holders of ``unit`` that trained it in ``round_`` (later claimants send nothing yet)."""
        since = self.since.get(unit, {})
        return {p for p in self.holders.get(unit, set()) if since.get(p, 0) <= round_}


def read_view(transport: Transport, run_id: str, units: list[str]) -> SwarmView:
    """Live peers and, for every unit, its live holders; invalid records are logged and skipped."""
    peers = parse_peers(transport.read(peers_key(run_id)))
    holders, since = {}, {}
    for unit in units:
        entries = transport.read(holders_key(run_id, unit))
        live = {
            p: e.value
            for p, e in entries.items()
            if p in peers and isinstance(e.value, dict) and e.value.get("held") is True
        }
        holders[unit] = set(live)
        since[unit] = {p: v["since"] for p, v in live.items() if isinstance(v.get("since"), int)}
    return SwarmView(peers, holders, since)


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
        self.round = 0
        self.tokens_per_s = 0.0
        self.loss: float | None = None
        self.last_view = SwarmView({}, {u: set() for u in self.units})

    @property
    def units(self) -> list[str]:
        return [*self.cfg.always_held, *self.cfg.claimable]

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
        self.held = self._choose(view)
        self.since = {u: self.round if first_round is None else first_round for u in self.units}
        self.heartbeat()
        return self.view()

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

    def rebalance(self, first_round: int | None = None) -> set[str]:
        """Re-runs the claim policy (call at sync boundaries); returns the units given up. Newly claimed units
        are trained from ``first_round`` on (default: the current round)."""
        view = self.view()
        new = self._choose(view)
        dropped = self.held - new
        if new != self.held:
            logger.info("claims: %s -> %s", sorted(self.held), sorted(new))
        for unit in new - self.held:
            self.since[unit] = self.round if first_round is None else first_round
        self.held = new
        self._publish_holders(dropped, held=False)
        self.heartbeat()
        return dropped

    def _choose(self, view: SwarmView) -> set[str]:
        if self.cfg.client_mode:
            return set()  # nobody can fetch a client's updates, so it holds nothing on its own
        return choose_units(
            me=self.transport.peer_id,
            held=self.held,
            units=self.cfg.claimable,
            holders=view.holders,
            capacity=self.cfg.capacity,
            target=self.cfg.target_replication,
            hysteresis=self.cfg.hysteresis,
        )

    def heartbeat(self) -> None:
        """Refreshes this peer's records."""
        expires = self.transport.now() + self.cfg.record_ttl
        self.transport.publish(config_key(self.cfg.run_id), self.identity.to_record(), expires)
        self.transport.publish(peers_key(self.cfg.run_id), self.record().to_record(), expires)
        self._publish_holders(set(self.units_held), held=True)

    def _publish_holders(self, units: set[str], held: bool, ttl: float | None = None) -> None:
        expires = self.transport.now() + (ttl or self.cfg.record_ttl)
        for unit in sorted(units):
            entry = {"held": held, "round": self.round, "since": self.since.get(unit, 0)}
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
        self._publish_holders(set(self.units_held), held=False, ttl=ttl)
        self.held = set()
