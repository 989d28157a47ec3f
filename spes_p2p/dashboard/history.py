"""What the dashboard remembers of a swarm between reads of its records: per round, the peers' losses and
the bytes they moved; the swarm's rates; and what changed (joins, leaves, re-claims, rejections, bans,
coverage). Each read is one ``spes status --json`` summary; nothing here touches the network.

Everything comes from the peers' own records, so a peer can lie about its figures: the page shows what the
swarm says of itself. A liar cannot stretch it, though: the swarm's pace and loss are the median peer's, a
peer more than ``FAR`` rounds ahead of it is left out of the charts, and a jump of more than ``FAR`` rounds
between two reads spreads its traffic over the last ``FAR`` only. It is bounded: the last ``MAX_ROUNDS``
rounds and ``MAX_EVENTS`` events.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

MAX_ROUNDS = 2000
MAX_EVENTS = 200
FAR = 100  # rounds


@dataclass
class RoundFigures:
    """One round as its peers reported it: the losses of each, and the bytes moved while at that round."""

    loss: dict[str, float] = field(default_factory=dict)
    val_loss: dict[str, float] = field(default_factory=dict)
    sent: int = 0
    received: int = 0


class SwarmHistory:
    """Fed one summary per read (``add``), from one thread; read from others (``view``)."""

    def __init__(self) -> None:
        self.rounds: dict[int, RoundFigures] = {}
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._peers: dict[str, dict] = {}  # peer id -> its entry at the last read
        self._uncovered: set[str] = set()
        self._first: tuple[float, int] | None = None  # (time, median peer's round) of the first read
        self._last: tuple[float, int] = (0.0, 0)
        self._tokens = 0  # tokens the peers trained while watched
        self._lock = threading.Lock()

    def add(self, summary: dict, at: float) -> None:
        """One read of the swarm, made at ``at`` (seconds, any fixed origin)."""
        with self._lock:
            peers = {p["peer_id"]: p for p in summary["peers"]}
            median = statistics.median_low(p["round"] for p in peers.values()) if peers else self._last[1]
            if self._first is None:
                self._first = (at, median)
                self._event(at, summary, "", "watch", f"watching {len(peers)} live peers")
            else:
                self._changes(at, summary, peers)
            for peer_id, entry in peers.items():
                if entry["round"] <= median + FAR:
                    self._record(entry, self._peers.get(peer_id))
            self._peers, self._last = peers, (at, median)
            self._uncovered = set(summary["uncovered"])
            for old in sorted(self.rounds)[: max(0, len(self.rounds) - MAX_ROUNDS)]:
                del self.rounds[old]

    def view(self) -> dict:
        """The losses and traffic by round, the rates, and the events (newest first)."""
        with self._lock:
            rounds = sorted(self.rounds)
            (t0, r0), (t1, r1) = self._first or (0.0, 0), self._last
            hours = (t1 - t0) / 3600
            return {
                "round": r1,  # the median peer's (a liar far ahead does not move it)
                "rounds": rounds,
                "loss": [_median(self.rounds[r].loss) for r in rounds],
                "val_loss": [_median(self.rounds[r].val_loss) for r in rounds],
                "sent": [self.rounds[r].sent for r in rounds],
                "received": [self.rounds[r].received for r in rounds],
                "watched_seconds": t1 - t0,
                "rounds_per_hour": (r1 - r0) / hours if hours > 0 else None,
                "tokens_per_hour": self._tokens / hours if hours > 0 else None,
                "events": list(reversed(self.events)),
            }

    def _record(self, entry: dict, before: dict | None) -> None:
        """A peer's losses at its round, and what it moved and trained since the last read: its traffic
        is shared evenly among the rounds it went through meanwhile."""
        figures = self.rounds.setdefault(entry["round"], RoundFigures())
        if entry["loss"] is not None:
            figures.loss[entry["peer_id"]] = entry["loss"]
        if entry["val_loss"] is not None:
            figures.val_loss[entry["peer_id"]] = entry["val_loss"]
        if before is None:
            return
        # (a peer that restarted counts from zero again: no negative traffic)
        sent = max(0, entry["bytes_sent"] - before["bytes_sent"])
        received = max(0, entry["bytes_received"] - before["bytes_received"])
        self._tokens += max(0, entry["tokens"] - before["tokens"])
        now = entry["round"]
        went = range(max(min(before["round"] + 1, now), now - FAR + 1), now + 1)
        for i, r in enumerate(went):
            share = self.rounds.setdefault(r, RoundFigures())
            share.sent += sent // len(went) + (sent % len(went) if i == len(went) - 1 else 0)
            share.received += received // len(went) + (received % len(went) if i == len(went) - 1 else 0)

    def _changes(self, at: float, summary: dict, peers: dict[str, dict]) -> None:
        for peer_id in sorted(peers.keys() - self._peers.keys()):
            units = ", ".join(peers[peer_id]["units"]) or "nothing yet"
            self._event(at, summary, peer_id, "join", f"joined, holding {units}")
        for peer_id in sorted(self._peers.keys() - peers.keys()):
            self._event(at, summary, peer_id, "leave", "left (or its record expired)")
        for peer_id in sorted(peers.keys() & self._peers.keys()):
            now, before = peers[peer_id], self._peers[peer_id]
            if now["units"] != before["units"]:
                units = ", ".join(now["units"]) or "nothing"
                self._event(at, summary, peer_id, "claim", f"now holds {units}")
            if now["rejected"] > before["rejected"]:
                n = now["rejected"] - before["rejected"]
                self._event(at, summary, peer_id, "rejected", f"rejected {n} message(s) of other peers")
            for banned in sorted(set(now["banned"]) - set(before["banned"])):
                self._event(at, summary, peer_id, "ban", f"banned {banned}")
        uncovered = set(summary["uncovered"])
        for unit in sorted(uncovered - self._uncovered):
            self._event(at, summary, unit, "uncovered", "no live peer trains it")
        for unit in sorted(self._uncovered - uncovered):
            self._event(at, summary, unit, "covered", "trained again")

    def _event(self, at: float, summary: dict, who: str, kind: str, text: str) -> None:
        self.events.append({"at": at, "round": summary["round"], "who": who, "kind": kind, "text": text})


def _median(values: dict[str, float]) -> float | None:
    """The median peer's value (the lower of the middle two: no arithmetic on what peers wrote, which may be
    any finite float, and a few liars move it no further than to an honest peer's value)."""
    return statistics.median_low(values.values()) if values else None
