"""The swarm layer's settings sections: ``[swarm]`` (which swarm, membership, records and claims) and
``[peer]`` (what this volunteer claims at once). Plain values; no torch and no networking here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spes_p2p.fields import SWARM, Section, check, setting
from spes_p2p.net.config import check_multiaddr
from spes_p2p.net.transport import MAX_EXPIRY_AHEAD

BACKENDS = ("hivemind", "libp2p", "memory")


@dataclass(frozen=True, kw_only=True)
class SwarmConfig(Section):
    """[swarm]: which swarm, how to reach it, and how peers keep their records and claims."""

    run_id: str = setting("spes-demo", "The swarm's name; peers with another run_id never meet.")
    initial_peers: tuple[str, ...] = setting(
        (),
        "A running peer's multiaddr, ending in /p2p/<peer id> (repeatable).",
        flag="--peers",
        metavar="MULTIADDR",
    )
    backend: str = setting(
        "hivemind",
        "The swarm's network stack: hivemind (its Go daemon, p2pd), libp2p (py-libp2p, pure Python), or "
        "memory (spes simulate only: every peer in one process).",
        choices=BACKENDS,
        scope=SWARM,
    )
    manifest: str = setting(
        "", "The swarm's manifest hash (an invite carries it): join only the swarm whose manifest has it."
    )
    target_replication: int = setting(
        2, "Holders wanted per expert shard.", flag="--replication", scope=SWARM
    )
    hysteresis: int = setting(
        1, "Extra holders a unit needs before a peer leaves it for a less-covered one.", scope=SWARM
    )
    heartbeat_seconds: float = setting(
        5.0, "Seconds between refreshes of this peer's records.", flag="--heartbeat"
    )
    record_ttl_seconds: float = setting(
        20.0, "Seconds before a silent peer's records vanish.", flag="--record-ttl"
    )
    join_timeout_seconds: float = setting(20.0, "Bound on reaching the initial peers.", flag="--join-timeout")
    allowlist: tuple[str, ...] = setting(
        (),
        "Listen only to these peer ids (repeatable; give every peer the same list); empty: to everyone.",
        flag="--allow",
        metavar="PEER_ID",
    )

    def validate(self) -> None:
        check(
            bool(re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.run_id)),
            "run_id",
            "must be 1-64 letters, digits, '.', '_' or '-'",
        )
        for addr in self.initial_peers:
            check_multiaddr(addr, "initial_peers", need_peer_id=True)
        check(
            not self.manifest or bool(re.fullmatch(r"[0-9a-f]{64}", self.manifest)),
            "manifest",
            "must be a manifest's SHA-256 (64 hex digits), as an invite writes it",
        )
        check(self.target_replication >= 1, "target_replication", "must be at least 1")
        check(self.hysteresis >= 0, "hysteresis", "must be at least 0")
        check(self.heartbeat_seconds > 0, "heartbeat_seconds", "must be positive")
        check(
            2 * self.heartbeat_seconds < self.record_ttl_seconds < MAX_EXPIRY_AHEAD - 1,
            "record_ttl_seconds",
            "must exceed twice heartbeat_seconds (or records expire between heartbeats), and stay under "
            f"{MAX_EXPIRY_AHEAD - 1:.0f} (entries set to live longer are not read)",
        )
        check(self.join_timeout_seconds > 0, "join_timeout_seconds", "must be positive")
        for peer in self.allowlist:
            check(
                bool(re.fullmatch(r"[A-Za-z0-9]{1,128}", peer)),
                "allowlist",
                f"has {peer!r}, which is not a peer id (the part after /p2p/ in a peer's address)",
            )


@dataclass(frozen=True, kw_only=True)
class PeerConfig(Section):
    """[peer]: how much this volunteer trains at once."""

    capacity: int = setting(1, "Expert shards this peer trains at once (0: only the dense part).")
    active_blocks: int = setting(1, "Dense blocks this peer trains at once (with model.dense_blocks > 1).")

    def validate(self) -> None:
        check(self.capacity >= 0, "capacity", "must be at least 0")
        check(self.active_blocks >= 1, "active_blocks", "must be at least 1")
