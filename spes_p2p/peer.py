"""The volunteer's life cycle, wiring the swarm layer to the model's units.

Today: open the transport, check the swarm identity, claim expert shards, heartbeat and rebalance until
stopped, then release the claims. (Training between sync boundaries joins this loop with the sync protocol;
until then, every heartbeat counts as a sync boundary.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spes_p2p import __version__
from spes_p2p.errors import ConfigError
from spes_p2p.model.config import get_preset
from spes_p2p.model.units import UnitLayout
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import MemberConfig, SwarmMember, SwarmView, read_identities, read_view
from spes_p2p.swarm.reachability import Reachability, assess
from spes_p2p.swarm.records import SwarmIdentity
from spes_p2p.swarm.transport import Transport

logger = logging.getLogger(__name__)

PROTOCOL = 1  # bumped when peers of different versions can no longer work together


def swarm_identity(settings: Settings) -> SwarmIdentity:
    """The settings that must match across the swarm: model, shards, method, protocol."""
    model = get_preset(settings.model.preset)
    layout = UnitLayout(model.n_experts, settings.model.shards)
    fields = {f"model.{k}": v for k, v in model.to_dict().items()}
    fields.update(
        {
            "model.preset": settings.model.preset,
            "model.shards": settings.model.shards,
            "method.steps_per_round": settings.method.steps_per_round,
            "method.codec": settings.method.codec,
            "protocol": PROTOCOL,
            "units": layout.units,
        }
    )
    return SwarmIdentity(fields)


def member_config(settings: Settings, identity: SwarmIdentity) -> MemberConfig:
    units = identity.fields["units"]
    return MemberConfig(
        run_id=settings.swarm.run_id,
        claimable=[u for u in units if u.startswith("experts/")],
        always_held=[u for u in units if u.startswith("dense/")],  # SPES: every peer trains the dense part
        capacity=settings.peer.capacity,
        target_replication=settings.swarm.target_replication,
        hysteresis=settings.swarm.hysteresis,
        record_ttl=settings.swarm.record_ttl_seconds,
        version=__version__,
        client_mode=settings.network.client_mode,
    )


def open_transport(settings: Settings, *, new_swarm: bool, client: bool = False) -> Transport:
    """The hivemind transport; a new swarm dials nobody, a joining peer needs initial peers."""
    initial = [] if new_swarm else list(settings.swarm.initial_peers)
    if not new_swarm and not initial:
        raise ConfigError(
            "no initial peers: pass --peers ADDR (a running peer's multiaddr), set initial_peers "
            "in peers.toml, or start a new swarm with --new-swarm"
        )
    from spes_p2p.swarm.hivemind_backend import HivemindTransport  # heavy: imported only when used

    net = settings.network
    return HivemindTransport(
        initial_peers=initial,
        listen=net.listen,
        announce=net.announce,
        identity_path=None if client else Path(net.identity).expanduser(),
        client_mode=client or net.client_mode,
        use_relay=net.use_relay,
        startup_timeout=settings.swarm.join_timeout_seconds,
    )


@dataclass
class PeerStatus:
    peer_id: str
    addresses: list[str]
    units: list[str]
    view: SwarmView
    heartbeats: int


class Peer:
    def __init__(self, settings: Settings, transport: Transport) -> None:
        self.settings, self.transport = settings, transport
        self.identity = swarm_identity(settings)
        self.member = SwarmMember(transport, self.identity, member_config(settings, self.identity))
        self.heartbeats = 0
        self.joined = False

    def reachability(self) -> Reachability:
        net = self.settings.network
        return assess(
            self.transport.addresses(),
            client_mode=net.client_mode,
            announced=bool(net.announce),
            relay=net.use_relay,
        )

    def join(self) -> PeerStatus:
        self.member.join()
        self.joined = True
        return self.status()

    def run(self, stop: threading.Event, on_update: Callable[[PeerStatus], None] | None = None) -> None:
        """Heartbeats (and rebalances) until ``stop`` is set; a failed heartbeat is logged and retried."""
        while not stop.wait(self.settings.swarm.heartbeat_seconds):
            try:
                self.member.rebalance()
                self.heartbeats += 1
            except Exception:  # a network hiccup must not kill the peer; the next heartbeat retries
                logger.exception("heartbeat failed; retrying in %.1fs", self.settings.swarm.heartbeat_seconds)
            if on_update:
                on_update(self.status())

    def status(self) -> PeerStatus:
        return PeerStatus(
            self.transport.peer_id,
            self.transport.addresses(),
            self.member.units_held,
            self.member.last_view,
            self.heartbeats,
        )

    def close(self, timeout: float = 5.0) -> None:
        """Releases claims (if it joined), then leaves the network; returns within about 2 x ``timeout``."""
        if self.joined:
            releasing = threading.Thread(target=self._release, name="release-claims", daemon=True)
            releasing.start()
            releasing.join(timeout)
            if releasing.is_alive():
                logger.warning("releasing claims took over %.0fs; they will expire by themselves", timeout)
        self.transport.shutdown(timeout)

    def _release(self) -> None:
        try:
            self.member.leave()
        except Exception:  # leaving must not fail: the records expire on their own anyway
            logger.exception("could not release claims; they expire by themselves")


def swarm_summary(transport: Transport, run_id: str) -> dict:
    """The swarm as `spes status --json` prints it."""
    identities = read_identities(transport, run_id)
    hashes = sorted({i.hash for i in identities.values()})
    units = next(iter(identities.values())).fields.get("units", []) if identities else []
    view = read_view(transport, run_id, units)
    return {
        "run_id": run_id,
        "config_hashes": hashes,
        "peers": [
            {
                "peer_id": p.peer_id,
                "units": p.units,
                "round": p.round,
                "tokens_per_s": p.tokens_per_s,
                "loss": p.loss,
                "version": p.version,
                "addresses": p.addresses,
                "client_mode": p.client_mode,
            }
            for p in sorted(view.peers.values(), key=lambda p: p.peer_id)
        ],
        "units": {u: sorted(h) for u, h in view.holders.items()},
        "uncovered": view.uncovered(),
    }


def share_snippet(settings: Settings, addresses: list[str]) -> str:
    """A peers.toml fragment that lets others join this swarm."""
    peers = ", ".join(f'"{a}"' for a in addresses)
    s = settings
    return (
        f'[swarm]\nrun_id = "{s.swarm.run_id}"\ninitial_peers = [{peers}]\n\n'
        f'[model]\npreset = "{s.model.preset}"\nshards = {s.model.shards}\n\n'
        f'[method]\nsteps_per_round = {s.method.steps_per_round}\ncodec = "{s.method.codec}"\n'
    )
