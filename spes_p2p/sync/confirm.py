"""What one holder served (``sync/refresh.py``) is **confirmed** by another holder, asked only for the
SHA-256 of what it would serve for the same request, of the same round (``WeightsRequest.digest``; a
change: with the version it applies to, the one we asked for). Holders of a unit hold the same weights,
bit for bit, and answer alike: the first that agrees confirms the payload; one that two other holders
agree against is refused (not toward a ban: honest holders can differ, one whose version chain split from
the others' for instance), and the next holder asked. With nobody else to ask, or only one that disagrees
(of two holders, nobody can tell which is right), the payload is kept and the disagreement logged. A
holder that is not of that round yet says so, which confirms nothing. Holders are asked to confirm in
turn, the least recently asked first; one that says ``NOT_HELD``, or leaves a whole ``request_timeout``
unanswered, ``UNCONFIRMED_LIMIT`` times in a row (a fake holder, or one that declared more capacity than
it has) is reported by ``failing`` (claims then do not count it), and asked again, last, once every
``UNCONFIRMED_LIMIT`` confirmations of the unit.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from spes_p2p.net.transport import Transport, TransportError
from spes_p2p.net.waiting import MIN_REQUEST_SECONDS, Deadline
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.messages import NOT_HELD, RPC_WEIGHTS, weights_request
from spes_p2p.sync.payload import served_digest
from spes_p2p.sync.versions import Download

logger = logging.getLogger(__name__)

UNCONFIRMED_LIMIT = 3  # asks in a row a holder leaves unanswered before its claim is not believed
MAX_DIGEST_BYTES = 256
OUTVOTED = "two other holders serve other weights"


class Confirmations:
    """Asks holders to confirm what another served, and keeps who failed to, per unit. ``refuse`` counts a
    holder's payload as refused (peer, what, why, toward a ban or not)."""

    def __init__(self, transport: Transport, cfg: SyncConfig, refuse: Callable[..., None]) -> None:
        self.transport, self.cfg, self.refuse = transport, cfg, refuse
        self.unconfirmed: Counter[tuple[str, str]] = Counter()  # (unit, holder) -> asks in a row unanswered
        self._asked: dict[tuple[str, str], int] = {}  # (unit, holder) -> the confirmation it was last asked
        self._confirmations: Counter[str] = Counter()  # unit -> confirmations asked of its holders
        self._lock = threading.Lock()

    def failing(self) -> dict[str, set[str]]:
        """Unit -> its holders that left ``UNCONFIRMED_LIMIT`` asks to confirm it in a row unanswered."""
        with self._lock:
            out: dict[str, set[str]] = {}
            for (unit, peer), misses in self.unconfirmed.items():
                if misses >= UNCONFIRMED_LIMIT:
                    out.setdefault(unit, set()).add(peer)
            return out

    def served(self, unit: str, peer: str) -> None:
        """``peer`` served ``unit``: it counts as its holder again."""
        with self._lock:
            self.unconfirmed.pop((unit, peer), None)

    def forget_gone(self, holders: dict[str, list[str]]) -> None:
        """Drops what we kept of the holders that no longer hold a unit we refresh."""
        with self._lock:
            for key in [k for k in self._asked if k[0] in holders and k[1] not in holders[k[0]]]:
                self._asked.pop(key)
                self.unconfirmed.pop(key, None)

    def confirmed(
        self, unit: str, found: Download, source: str, holders: list[str], deadline: Deadline
    ) -> bool:
        """Whether what ``source`` served stands, asked of the other ``holders`` (the module's docstring)."""
        since = ":".join(map(str, found.want.since)) if found.want.kind == "change" else ""
        ours = served_digest(found.payload, since)
        request = weights_request(unit, found.want, found.round, digest=True)
        against: Counter[str] = Counter()
        for peer in self._confirmers(unit, source, holders):
            if deadline.passed():
                break
            answer = self._digest(peer, unit, request, deadline)
            if answer == ours:
                return True
            if answer and answer.split("/")[0] == since:  # (a change: to the same version)
                against[answer] += 1
                if against[answer] == 2:
                    # (not toward a ban: honest holders may differ, e.g. one whose version chain split)
                    self.refuse(source, f"{found.want.kind} of {unit}", OUTVOTED, ban=False)
                    return False
        if against:
            logger.warning(
                "%s: %s and another holder serve different weights; keeping %s's", unit, source, source
            )
        return True

    def _confirmers(self, unit: str, source: str, holders: list[str]) -> list[str]:
        """The other holders, the least recently asked first; failing ones last, and only once every
        ``UNCONFIRMED_LIMIT`` confirmations of the unit."""
        with self._lock:
            self._confirmations[unit] += 1
            now = self._confirmations[unit]
            others = [p for p in holders if p != source]
            asked = {p: self._asked.get((unit, p), 0) for p in others}
            failing = {p for p in others if self.unconfirmed[(unit, p)] >= UNCONFIRMED_LIMIT}
            due = [p for p in failing if now - asked[p] >= UNCONFIRMED_LIMIT]
            return sorted((p for p in others if p not in failing), key=asked.get) + sorted(due, key=asked.get)

    def _digest(self, peer: str, unit: str, request: bytes, deadline: Deadline) -> str | None:
        """What ``peer`` says it serves for ``request`` (None: no answer; '': it holds the unit, but not of
        that round yet). It misses an ask when it says it does not hold the unit, or does not answer within
        a whole ``request_timeout``."""
        with self._lock:
            self._asked[(unit, peer)] = self._confirmations[unit]
        timeout = min(self.cfg.request_timeout, max(deadline.remaining(), MIN_REQUEST_SECONDS))
        try:
            answer = self.transport.request(
                peer, RPC_WEIGHTS, request, timeout=timeout, max_response_bytes=MAX_DIGEST_BYTES
            ).decode("ascii", "replace")
        except TransportError as exc:
            logger.debug("confirming %s with %s: %s", unit, peer, exc)
            answer = NOT_HELD if timeout >= self.cfg.request_timeout else None
        with self._lock:
            if answer == NOT_HELD:
                self.unconfirmed[(unit, peer)] += 1
            elif answer:
                self.unconfirmed.pop((unit, peer), None)
        return None if answer == NOT_HELD else answer
