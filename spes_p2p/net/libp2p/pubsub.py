"""Gossip for the libp2p backend: gossipsub topics whose messages go to a handler (on its trio loop).

Pubsub signs every message and checks each one's signature against its sender's key (strict signing). A
handler gets only what another peer sent, that peer allowed by the guard, at most ``MAX_GOSSIP_BYTES``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub

from spes_p2p.net.guard import Guard
from spes_p2p.net.transport import MAX_GOSSIP_BYTES, GossipHandler

logger = logging.getLogger(__name__)

DEGREE, DEGREE_LOW, DEGREE_HIGH = 6, 4, 12  # gossipsub's mesh size per topic, as in go-libp2p
HEARTBEAT_SECONDS = 1  # mesh upkeep (py-libp2p's default of 120 s leaves new subscribers out for long)


class Topics:
    def __init__(self, host, guard: Guard, spawn: Callable[..., None]) -> None:
        self.me, self.guard, self.spawn = str(host.get_id()), guard, spawn
        self.router = GossipSub(
            [PROTOCOL_ID_V11], DEGREE, DEGREE_LOW, DEGREE_HIGH, heartbeat_interval=HEARTBEAT_SECONDS
        )
        self.pubsub = Pubsub(host, self.router)

    async def subscribe(self, topic: str, on_message: GossipHandler) -> None:
        if topic not in self.pubsub.topic_ids:
            self.spawn(self._deliver, await self.pubsub.subscribe(topic), on_message)

    async def _deliver(self, subscription, on_message: GossipHandler) -> None:
        """Hands ``on_message`` what others gossip on the subscription's topic, until it is unsubscribed."""
        async for message in subscription:
            try:
                sender = str(ID(message.from_id))
            except Exception:  # (not a peer id: nobody to blame)
                continue
            if sender == self.me or not self.guard.allows(sender):
                continue
            if len(message.data) > MAX_GOSSIP_BYTES:
                self.guard.reject(sender, "gossip", f"{len(message.data)} bytes", counts_toward_ban=False)
                continue
            try:
                on_message(sender, bytes(message.data))
            except Exception:  # the handler's bug must not end the subscription
                logger.exception("a gossip handler failed")

    def unsubscribe(self, topic: str) -> Awaitable[None]:
        return self.pubsub.unsubscribe(topic)

    def publish(self, topic: str, data: bytes) -> Awaitable[None]:
        return self.pubsub.publish(topic, data)
