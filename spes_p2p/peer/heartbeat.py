"""Background threads that refresh this peer's DHT records every heartbeat, so long rounds never let them
expire."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from spes_p2p.swarm.member import SwarmMember

logger = logging.getLogger(__name__)


class Heartbeat:
    """Refreshes the records every ``seconds``. One thread runs ``before`` (checks that may change the peer
    record), then the peer record, whose lapse reads as the peer leaving; another runs ``after`` (the other
    records), so that their DHT calls, seconds each on a busy libp2p peer, never hold the peer record back
    (in one thread, an 8-peer libp2p swarm on 2 cores refreshed its peer records every 5 to 15 s instead
    of every second, and they lapsed: peers read the swarm without themselves)."""

    def __init__(
        self,
        member: SwarmMember,
        seconds: float,
        before: Sequence[Callable[[], None]] = (),
        after: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.seconds = seconds
        self._stop = threading.Event()
        beats = {"spes-heartbeat": (*before, member.heartbeat), "spes-records": tuple(after)}
        self._threads = [
            threading.Thread(target=self._beat, args=(group,), name=name, daemon=True)
            for name, group in beats.items()
            if group
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self, group: tuple[Callable[[], None], ...]) -> None:
        while not self._stop.wait(self.seconds):
            for beat in group:
                try:
                    beat()
                except Exception:  # a network hiccup must not kill the peer; the next heartbeat retries
                    logger.exception("heartbeat failed")
