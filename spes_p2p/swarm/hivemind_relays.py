"""How a hivemind peer reaches the peers that nobody can dial, and is reached when it is one of them.

A peer behind NAT (or in client mode) is "relayed": its p2pd reserves a slot on each of its relays (its
initial peers; libp2p circuit relay v2, which every reachable p2pd serves) and it announces only
``<relay>/p2p-circuit/p2p/<own id>`` addresses, never its own (nobody can dial them). It dials every
directly reachable peer it learns of itself (at most every ``REDIAL_SECONDS``): that connection is the way
back to it, and, unlike a relayed one, it carries whole tensors. Other peers learn its circuit addresses
from its peer record (``learn``) and connect through them before a request. Two relayed peers have no
connection of their own, nor has a reachable peer that the relayed one has not dialed yet: their requests
are forwarded whole by the target's relay (``swarm/forwarding.py``), because p2pd's circuits end after
128 KiB.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from hivemind.p2p import P2P
from multiaddr import Multiaddr

MAX_CIRCUITS = 4  # addresses kept (circuits) or dialed per peer
REDIAL_SECONDS = 30.0  # a relayed peer dials each directly reachable peer at most this often
CIRCUIT = "/p2p-circuit/"


class Relays:
    """A peer's relays (none: it is reachable itself) and the circuit addresses of the relayed peers it
    has learned of."""

    def __init__(self, relays: Sequence[str]) -> None:
        self.relays = list(relays)
        self.circuits: dict[str, list[str]] = {}  # relayed peer -> its circuit addresses
        self._dialed: dict[str, float] = {}  # (a relayed peer) peer -> when it last dialed it

    @property
    def relayed(self) -> bool:
        return bool(self.relays)

    def addresses(self, peer_id: str) -> list[str]:
        """A relayed peer's own addresses: its circuits."""
        return [f"{relay}{CIRCUIT}p2p/{peer_id}" for relay in self.relays]

    def learn(self, me: str, peer_id: str, addresses: list[str]) -> list[Multiaddr]:
        """Keeps ``peer_id``'s circuit addresses, if it is relayed; returns the addresses to dial it at now
        (we are relayed, it is not, and we have not dialed it for ``REDIAL_SECONDS``)."""
        own = [a for a in addresses if a.endswith(f"/p2p/{peer_id}")][:MAX_CIRCUITS]
        if peer_id == me or not own:
            return []
        circuits = [a for a in own if CIRCUIT in a]
        if circuits:
            self.circuits[peer_id] = circuits
            return []
        if self.relayed and time.monotonic() - self._dialed.get(peer_id, -REDIAL_SECONDS) >= REDIAL_SECONDS:
            self._dialed[peer_id] = time.monotonic()
            return [Multiaddr(a) for a in own]
        return []

    def circuit(self, peer_id: str) -> list[Multiaddr]:
        """Where a relayed peer is reached (empty: it is not relayed, or we do not know it)."""
        return [Multiaddr(a) for a in self.circuits.get(peer_id, [])]

    def forwarder(self, peer_id: str, me: str) -> str | None:
        """The relay that can forward our requests to a relayed ``peer_id`` (its first one), unless that
        is us; None when ``peer_id`` is not relayed. (Whether we need it: ``HivemindTransport.request``.)"""
        if peer_id not in self.circuits:
            return None
        relay = self.circuits[peer_id][0].split(CIRCUIT)[0].rsplit("/p2p/", 1)[-1]
        return None if relay == me else relay


def relays_without_discovery() -> None:
    """p2pd reserves on the given relays at once only with ``-relayDiscovery=0``, which hivemind does not
    pass: with discovery on, go-libp2p's autorelay waits minutes for more candidates before it reserves.
    (Called in the DHT's process, before it starts p2pd.)"""
    make_args = P2P._make_process_args

    def with_static_relays(*args, **kwargs):
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        return make_args(*args, **kwargs)

    P2P._make_process_args = staticmethod(with_static_relays)
