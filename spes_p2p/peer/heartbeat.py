"""A background thread that refreshes this peer's DHT records every heartbeat, so long rounds never let
them expire."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from spes_p2p.swarm.member import SwarmMember

logger = logging.getLogger(__name__)


class Heartbeat:
    """Refreshes the records every ``seconds``: first runs ``before`` (checks that may change them), then
    the peer record (first: its lapse reads as the peer leaving), then ``after`` (other records)."""

    def __init__(
        self,
        member: SwarmMember,
        seconds: float,
        before: Sequence[Callable[[], None]] = (),
        after: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.member, self.seconds, self.before, self.after = member, seconds, before, after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="spes-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.seconds):
            for beat in (*self.before, self.member.heartbeat, *self.after):
                try:
                    beat()
                except Exception:  # a network hiccup must not kill the peer; the next heartbeat retries
                    logger.exception("heartbeat failed")
