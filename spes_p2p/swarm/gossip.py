"""Update announcements by gossip: a unit's holders hear of each other's updates as soon as they are posted.

Every unit has a topic, ``<run_id>/units/<unit>``. A peer follows the topics of the units it exchanges (and
leaves those it gave up); a holder that posts an update gossips its ``Announcement`` there, besides writing it
to the DHT. Gossip is lossy (gossipsub drops what it cannot place, and a peer that subscribed late misses
what came before), so the DHT stays the fallback: with gossip, a round's announcements are read from the
DHT every ``FALLBACK_READ_SECONDS`` (``gather.Gatherer``) instead of at every poll, and a lost
message delays the round by at most that. A backend without gossip (hivemind) reads the DHT at every poll.

What is heard is as hostile as any record: decoded strictly, for the unit of its topic, from a peer the
transport's guard allows (the transport drops the rest), at most ``MAX_HEARD_PER_PEER`` kept per peer.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from spes_p2p.net.transport import MAX_GOSSIP_BYTES, Transport
from spes_p2p.net.wire import RecordError, Strict
from spes_p2p.swarm.records import Announcement, Unit

logger = logging.getLogger(__name__)

MAX_HEARD_PER_PEER = 64  # an honest peer has a few units' announcements of the last few rounds


class Told(Strict):
    """A gossiped announcement: which unit, and the announcement the DHT has too."""

    MAX_BYTES = MAX_GOSSIP_BYTES
    ERROR = RecordError

    unit: Unit
    announcement: Announcement


def topic_of(run_id: str, unit: str) -> str:
    return f"{run_id}/units/{unit}"


class Gossip:
    """The announcements heard, by (round, unit) and peer; thread-safe (the transport delivers on its
    thread, the sync thread follows and reads, the training thread forgets)."""

    def __init__(self, transport: Transport, run_id: str) -> None:
        self.transport, self.run_id = transport, run_id
        self.works = False  # whether the transport has gossip (set by the first follow)
        self.following: set[str] = set()
        self._heard: dict[tuple[int, str], dict[str, Announcement]] = {}
        self._count: Counter[str] = Counter()  # peer -> announcements of it kept
        self._lock = threading.Lock()

    def follow(self, unit: str) -> None:
        """Hears the announcements of ``unit`` from now on."""
        with self._lock:
            new = unit not in self.following
            self.following.add(unit)
        if new:
            on_message = lambda sender, data: self._heard_from(unit, sender, data)  # noqa: E731
            self.works = self.transport.subscribe(topic_of(self.run_id, unit), on_message)

    def follow_only(self, units) -> None:
        """Stops hearing of the units not in ``units``."""
        with self._lock:
            left = self.following - set(units)
            self.following -= left
        for unit in left:
            self.transport.unsubscribe(topic_of(self.run_id, unit))

    def tell(self, unit: str, announcement: Announcement) -> None:
        """Gossips our announcement to the unit's other holders (best effort)."""
        if self.works:
            self.transport.gossip(topic_of(self.run_id, unit), Told(unit, announcement).encode())

    def heard(self, round_: int, unit: str) -> dict[str, Announcement]:
        with self._lock:
            return dict(self._heard.get((round_, unit), {}))

    def forget_before(self, round_: int) -> None:
        with self._lock:
            for key in [k for k in self._heard if k[0] < round_]:
                for peer in self._heard.pop(key):
                    self._count[peer] -= 1
            self._count = +self._count  # (drops the zeros)

    def _heard_from(self, unit: str, sender: str, data: bytes) -> None:
        try:
            told = Told.decode(data)
            if told.unit != unit:
                raise RecordError(f"an announcement of {told.unit} on {unit}'s topic")
        except RecordError as exc:
            self.transport.guard.reject(sender, "gossip", str(exc), counts_toward_ban=False)
            return
        key = (told.announcement.round, unit)
        with self._lock:
            known = sender in self._heard.get(key, {})
            if not known and self._count[sender] >= MAX_HEARD_PER_PEER:
                return  # (dropped quietly: the DHT still has what an honest peer announced)
            self._heard.setdefault(key, {})[sender] = told.announcement
            self._count[sender] += not known
