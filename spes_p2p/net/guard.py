"""Whom a peer listens to: an optional allowlist of peer ids, and a ban list that grows from rejections.

Every transport has a ``Guard``. The transport itself drops what the guard does not allow: DHT entries
written by other peers are not read, and their requests are refused. The layers above report what they
reject (``reject``): malformed records, requests and payloads, and updates far beyond the others. Each kind
is logged once per peer (then at debug level) and counted; a peer whose payloads or requests are rejected
``BAN_AFTER`` times in a row (an accepted one resets the count: a bit flipped in transit is not a ban) is
banned for the rest of the run. A malformed record only hides that record: records are re-read at every
poll, so each kind counts once per peer and never toward a ban.

A peer's contributions also get a **score** (``score``): a moving average of how each of its updates fared
in its co-holders' screening, 1 kept, 0 refused; a peer whose score falls below ``BAN_SCORE`` after
``MIN_SCORED`` outcomes is banned too. This catches what passes every payload
check and is refused only later, by its co-holders' screening, round after round (a free-rider).
A plain moving average, not a rating system such as OpenSkill: outcomes here are a peer's pass or fail
against checks every holder runs alike, not matches between peers to rank, and the average says in one
number, readable on the dashboard, what share of a peer's recent updates counted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger(__name__)

BAN_AFTER = 5
SCORE_RATE = 0.5  # the weight of each new outcome in a peer's score
BAN_SCORE = 0.3  # two refusals in a row from a full score: 0.25
MIN_SCORED = 2


class Guard:
    """Thread-safe: transports, the sync thread and the fetch pool all report to it."""

    def __init__(self, allowlist: tuple[str, ...] = (), ban_after: int = BAN_AFTER) -> None:
        self.allowlist = frozenset(allowlist)
        self.ban_after = ban_after
        self.rejections: Counter[str] = Counter()  # peer -> everything of it rejected
        self._streak: Counter[str] = Counter()  # peer -> payloads and requests rejected in a row
        self._banned: set[str] = set()
        self._scores: dict[str, float] = {}  # peer -> the moving average of its contributions' outcomes
        self._scored: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def allow_only(self, peers: tuple[str, ...]) -> None:
        """From now on, only ``peers`` (none given: everyone not banned)."""
        with self._lock:
            self.allowlist = frozenset(peers)

    def allows(self, peer: str) -> bool:
        with self._lock:
            return peer not in self._banned and (not self.allowlist or peer in self.allowlist)

    def listed(self, peer: str) -> bool:
        """Whether the allowlist, if any, names ``peer`` (banned or not)."""
        return not self.allowlist or peer in self.allowlist

    def banned(self) -> list[str]:
        with self._lock:
            return sorted(self._banned)

    def total(self) -> int:
        with self._lock:
            return sum(self.rejections.values())

    def reject(self, peer: str, kind: str, reason: str, *, counts_toward_ban: bool = True) -> None:
        """``peer`` sent a ``kind`` (a record, a request, a payload...) that was refused for ``reason``."""
        with self._lock:
            first = (peer, kind) not in self._logged
            if first or counts_toward_ban:  # (a record re-read at every poll counts once)
                self.rejections[peer] += 1
            self._logged.add((peer, kind))
            ban = False
            if counts_toward_ban:
                self._streak[peer] += 1
                ban = self._streak[peer] >= self.ban_after and peer not in self._banned
                if ban:
                    self._banned.add(peer)
        log = logger.warning if first else logger.debug
        log("rejecting %s's %s: %s", peer, kind, reason)
        if ban:
            logger.warning("banning %s for the rest of the run: %d rejections in a row", peer, self.ban_after)

    def score(self, peer: str, outcome: float) -> None:
        """How one contribution of ``peer`` fared: 1 it counted fully, 0 it was refused (or between)."""
        with self._lock:
            old = self._scores.get(peer, 1.0)
            new = self._scores[peer] = old + SCORE_RATE * (min(max(outcome, 0.0), 1.0) - old)
            self._scored[peer] += 1
            ban = new < BAN_SCORE and self._scored[peer] >= MIN_SCORED and peer not in self._banned
            if ban:
                self._banned.add(peer)
        if ban:
            logger.warning("banning %s for the rest of the run: its contributions score %.2f", peer, new)

    def scores(self) -> dict[str, float]:
        with self._lock:
            return dict(self._scores)

    def accept(self, peer: str) -> None:
        """``peer`` sent something that passed every check."""
        with self._lock:
            self._streak.pop(peer, None)
