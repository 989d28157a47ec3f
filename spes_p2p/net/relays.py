"""How the swarm reaches the peers that nobody can dial, and how such a peer reaches the swarm (both
network backends).

A peer behind NAT (``--use-relay``) or in client mode is "relayed": its initial peers are its relays, and
it announces only ``<relay>/p2p-circuit/p2p/<own id>`` addresses, never its own (nobody can dial them).
It dials every directly reachable peer it learns of itself (at most every ``REDIAL_SECONDS``): that
connection is the way back to it, and it carries whole tensors. Other peers learn its circuit addresses
from its peer record (``learn``). Two relayed peers have no connection of their own, nor has a reachable
peer that the relayed one has not dialed yet: their requests are forwarded whole by the target's relay
(``net/forwarding.py``). How a backend uses the circuit addresses beyond that is its own: hivemind's
p2pd also reserves a circuit on each relay, py-libp2p needs nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

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

    def learn(self, me: str, peer_id: str, addresses: list[str]) -> list[str]:
        """Keeps ``peer_id``'s circuit addresses, if it is relayed; returns the addresses to dial it at now
        (we are relayed, it is not, and we have not dialed it for ``REDIAL_SECONDS``)."""
        own = [a for a in addresses if a.endswith(f"/p2p/{peer_id}")][:MAX_CIRCUITS]
        if peer_id == me or not own:
            return []
        circuits = [a for a in own if CIRCUIT in a]
        if circuits:
            self.circuits[peer_id] = circuits
            return []
        self.circuits.pop(peer_id, None)  # (it came back reachable)
        if self.relayed and time.monotonic() - self._dialed.get(peer_id, -REDIAL_SECONDS) >= REDIAL_SECONDS:
            self._dialed[peer_id] = time.monotonic()
            return own
        return []

    def is_relayed(self, peer_id: str) -> bool:
        """Whether ``peer_id``'s record gave circuit addresses (it keeps no records, nobody dials it)."""
        return peer_id in self.circuits

    def circuit(self, peer_id: str) -> list[str]:
        """Where a relayed peer is reached (empty: it is not relayed, or we do not know it)."""
        return list(self.circuits.get(peer_id, []))

    def forwarder(self, peer_id: str, me: str) -> str | None:
        """The relay that can forward our requests to a relayed ``peer_id`` (its first one), unless that
        is us; None when ``peer_id`` is not relayed. (Needed only while it has not dialed us itself.)"""
        if peer_id not in self.circuits:
            return None
        relay = self.circuits[peer_id][0].split(CIRCUIT)[0].rsplit("/p2p/", 1)[-1]
        return None if relay == me else relay
