"""A background thread that refreshes this peer's DHT records every heartbeat, so long rounds never let
them expire."""

from __future__ import annotations

import logging
import threading

from spes_p2p.swarm.member import SwarmMember

logger = logging.getLogger(__name__)


class Heartbeat:
    """Refreshes the records every ``seconds``, after running ``also`` (a check that may change them)."""

    def __init__(self, member: SwarmMember, seconds: float, also=lambda: None) -> None:
        self.member, self.seconds, self.also = member, seconds, also
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="spes-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                self.also()
                self.member.heartbeat()
            except Exception:  # a network hiccup must not kill the peer; the next heartbeat retries
                logger.exception("heartbeat failed")
