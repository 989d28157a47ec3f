"""The network layer's settings section: ``[network]`` (where this peer listens, what it announces, its
identity). Plain values; no networking here."""

from __future__ import annotations

from dataclasses import dataclass

from spes_p2p.fields import FieldError, Section, check, setting


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
