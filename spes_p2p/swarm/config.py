"""The swarm layer's settings sections: ``[swarm]`` (membership and records), ``[sync]`` (the exchange of
updates) and ``[network]`` (how this peer is reached). Plain values; no torch and no networking here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spes_p2p.fields import PEER, SWARM, FieldError, Section, check, setting
from spes_p2p.swarm.codecs import CODECS, MAX_PARTS, TOPK_FRACTION
from spes_p2p.swarm.transport import MAX_EXPIRY_AHEAD

OUTER_RULES = ("fedavg", "nesterov")
AGGREGATES = ("mean", "clipped_mean", "trimmed_mean", "median")
DENSE_EXCHANGES = ("reduce_scatter", "all_to_all")
FROZEN_REFRESHES = ("changes", "weights")
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
class SyncConfig(Section):
    """[sync]: how a round's updates are coded, combined and waited for (docs/protocol.md)."""

    SCOPE = SWARM

    codec: str = setting("int8", "How updates travel.", choices=tuple(CODECS))
    refresh_codec: str = setting(
        "int8", "How frozen copies of other units travel (their changes, or weights).", choices=tuple(CODECS)
    )
    frozen_refresh: str = setting(
        "changes",
        "How frozen copies are brought up to date: changes (what changed since the copy's version, in "
        "refresh_codec) or weights (the holders' weights in full, every time).",
        choices=FROZEN_REFRESHES,
    )
    topk_fraction: float = setting(TOPK_FRACTION, "topk codec: the share of entries sent.")
    outer: str = setting("fedavg", "Outer rule: fedavg (SPES) or nesterov (DiLoCo).", choices=OUTER_RULES)
    outer_lr: float = setting(1.0, "Outer learning rate.")
    outer_momentum: float = setting(0.9, "Outer momentum (nesterov only).")
    dense_group_size: int = setting(16, "G: the dense part is averaged in random groups of at most G peers.")
    dense_exchange: str = setting(
        "reduce_scatter",
        "How a group averages the dense part: reduce_scatter (each member combines 1/G of it: about two "
        "dense-sized messages each way per peer) or all_to_all (each pulls every other member's update).",
        choices=DENSE_EXCHANGES,
    )
    staleness: int = setting(1, "Rounds a late update still counts.")
    max_round_tokens: int = setting(
        1 << 24, "The most tokens one update may count for; a larger count is clamped to this."
    )
    deadline_min: float = setting(
        2.0,
        "A round waits for late participants at least this long...",
        flag="--sync-deadline-min",
        scope=PEER,
    )
    deadline_max: float = setting(
        60.0, "...and at most this long, adapting in between.", flag="--sync-deadline-max", scope=PEER
    )
    request_timeout: float = setting(30.0, "Seconds one request to a peer may take.", scope=PEER)

    def validate(self) -> None:
        check(0 < self.topk_fraction <= 1, "topk_fraction", "must be in (0, 1]")
        check(self.outer_lr > 0, "outer_lr", "must be positive")
        check(0 <= self.outer_momentum < 1, "outer_momentum", "must be in [0, 1)")
        check(2 <= self.dense_group_size <= MAX_PARTS, "dense_group_size", f"must be in [2, {MAX_PARTS}]")
        check(self.staleness >= 0, "staleness", "must be at least 0")
        check(self.max_round_tokens >= 1, "max_round_tokens", "must be at least 1")
        check(
            0 < self.deadline_min <= self.deadline_max,
            "deadline_min",
            "must be positive and at most deadline_max",
        )
        check(self.request_timeout > 0, "request_timeout", "must be positive")


@dataclass(frozen=True, kw_only=True)
class NetworkConfig(Section):
    """[network]: where this peer listens, what it announces, and its identity."""

    listen: tuple[str, ...] = setting(
        ("/ip4/0.0.0.0/tcp/0",),
        "Where to accept connections (tcp/0: any free port; repeatable).",
        metavar="MULTIADDR",
    )
    announce: tuple[str, ...] = setting(
        (), "A public multiaddr to advertise after port forwarding (repeatable).", metavar="MULTIADDR"
    )
    identity: str = setting(
        "~/.spes/identity.key", "Private key file (created if missing): a restarted peer keeps its peer id."
    )
    client_mode: bool = setting(
        False, "Dial out only (a DHT client); the swarm reaches this peer through relays: its initial peers."
    )
    use_relay: bool = setting(
        False, "Behind NAT: the swarm reaches this peer through relays (its initial peers), not its address."
    )

    def validate(self) -> None:
        check(bool(self.listen), "listen", "needs at least one multiaddr")
        for addr in self.listen:
            check_multiaddr(addr, "listen")
        for addr in self.announce:
            check_multiaddr(addr, "announce")


def check_multiaddr(addr: str, field: str, need_peer_id: bool = False) -> None:
    from multiaddr import Multiaddr

    try:
        parsed = Multiaddr(addr)
    except Exception:  # multiaddr raises several ValueError and ParseError kinds
        raise FieldError(
            field,
            f"has a malformed multiaddr {addr!r} (expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/<peer id>)",
        ) from None
    if need_peer_id and "p2p" not in [p.name for p in parsed.protocols()]:
        raise FieldError(field, f"multiaddr {addr!r} lacks its /p2p/<peer id> part")
