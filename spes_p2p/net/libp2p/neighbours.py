"""The peers a libp2p peer dials and knows of, on the backend's trio loop: dialing them, and keeping them in
Kademlia's routing table (which the records' lookups start from)."""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

logger = logging.getLogger(__name__)

PEERSTORE_TTL = 3600.0  # how long a learned address is kept


class Neighbours:
    def __init__(self, host, dht, dial_timeout: float) -> None:
        self.host, self.dht, self.dial_timeout = host, dht, dial_timeout

    async def dial(self, infos: list[PeerInfo]) -> list[str]:
        """Dials each peer (at once, each within the dial timeout); the ones reached, added to the table."""
        reached: list[str] = []

        async def dial_one(info: PeerInfo) -> None:
            try:  # (outside the timeout's scope, as in ``kad_records``: a cut-off dial fails as a group)
                with trio.move_on_after(self.dial_timeout):
                    await self.host.connect(info)
                    reached.append(str(info.peer_id))
                    await self.add(info)
            except Exception as exc:
                logger.debug("cannot dial %s: %s", info.peer_id, exc)

        async with trio.open_nursery() as nursery:
            for info in infos:
                nursery.start_soon(dial_one, info)
        return reached

    async def populate(self) -> None:
        """A lookup of this peer's own id fills the routing table with the peers near it."""
        for peer in await self.dht.peer_routing.find_closest_peers_network(self.host.get_id().to_bytes()):
            await self.add(peer)

    async def learn(self, info: PeerInfo) -> None:
        """A peer's addresses, from its record: to the peerstore and the routing table."""
        self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, PEERSTORE_TTL)
        await self.add(info)

    async def add(self, peer: PeerInfo | ID) -> None:
        try:
            await self.dht.routing_table.add_peer(peer)
        except Exception as exc:  # the table decides; a peer it cannot check is simply not added
            logger.debug("not added to the routing table: %s", exc)
