"""Gathering a round's updates: the announcements (ours out; the others' in, by gossip and from the DHT),
the fetches of what they announce, and the adaptive deadline that bounds the wait.

A round waits for the participants still waited for (``Ledger.waited_for``) until all have answered, left
or been refused, or the deadline passed; a participant that announced and was not heard from in time counts
a miss, one that had not even announced (it is behind: this peer ran ahead) makes the next round wait
longer, so the peers fall back into step (``Ledger.attend``); after ``MISS_LIMIT`` rounds in a row of
either, it is not waited for until it delivers in time again. Late updates of the last ``staleness`` rounds
count too, from those rounds' participants only, measured from our base of then.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from spes_p2p.net.transport import Transport
from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.swarm.gossip import Gossip
from spes_p2p.swarm.records import Announcement, decode_entries, updates_key
from spes_p2p.sync.aggregate import Contribution, Received
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.fetching import Gone, Got, Refused, UpdateFetcher
from spes_p2p.sync.jobs import UnitJob
from spes_p2p.sync.ledger import Ledger

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # between reads of a round's announcements
LIVENESS_CHECK_SECONDS = 1.0  # between checks that the participants we wait for are still in the swarm
FALLBACK_READ_SECONDS = 1.0  # between DHT reads of a round's announcements, when gossip brings them
ANNOUNCE_TTL = 120.0  # seconds an announcement lives in the DHT


class AdaptiveDeadline:
    """How long a round waits for the last participant: ``factor`` x a running mean of observed waits, within
    [low, high]; the first round waits up to ``high``."""

    def __init__(self, low: float, high: float, factor: float = 2.0) -> None:
        self.low, self.high, self.factor = low, high, factor
        self.mean_wait: float | None = None

    def seconds(self) -> float:
        if self.mean_wait is None:
            return self.high
        return min(self.high, max(self.low, self.factor * self.mean_wait))

    def observe(self, wait: float) -> None:
        self.mean_wait = wait if self.mean_wait is None else 0.7 * self.mean_wait + 0.3 * wait


class Roster(Protocol):
    """Who is in the swarm now, as its records say (``swarm.member.SwarmMember``)."""

    def live_peers(self) -> set[str]: ...

    def participants(self, unit: str, round_: int) -> set[str]:
        """Who takes part in a unit's round now: not a peer that left, nor one back only for later rounds."""
        ...


@dataclass(frozen=True)
class Gathered:
    """What came of a round's wait: the updates received (by peer id), and who did not deliver."""

    received: list[Received]
    missing: list[str]  # expected, and not heard from in time
    refused: list[str]  # sent something that failed its checks


class Gatherer:
    """Sync thread (and the fetch pool); ``held`` is called by the peer's memory sampler."""

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        cfg: SyncConfig,
        fetcher: UpdateFetcher,
        ledger: Ledger,
        abort: threading.Event,
        roster: Roster | None = None,
    ) -> None:
        """``abort``: set when the peer stops, it ends every wait at once, with what has arrived;
        ``roster``: who still takes part in a round (without one, everyone named does)."""
        self.transport, self.run_id, self.cfg = transport, run_id, cfg
        self.fetcher, self.ledger, self.abort = fetcher, ledger, abort
        self.roster = roster  # no round waits for peers that left, or that came back for later rounds only
        self.gossip = Gossip(transport, run_id)
        # one per unit: units differ in size and in who exchanges them (a dense block's reduce-scatter pieces
        # come in a fraction of an expert shard's whole updates' time)
        self._deadlines: dict[str, AdaptiveDeadline] = {}
        self._last_round = False  # (set: every wait runs to deadline_max)
        self._received: list = []  # the decoded updates (or pieces) of the unit's round in progress
        # (round, unit) -> when the DHT's announcements were last read, and what they were
        self._read: dict[tuple[int, str], tuple[float, dict[str, Announcement]]] = {}
        self._lock = threading.Lock()

    def round_deadline(self, unit: str) -> Deadline:
        """A deadline for one wait of a round of ``unit``, as long as its adaptive deadline says now."""
        return Deadline(self.deadline_seconds(unit), self.abort)

    def last_round(self) -> None:
        """The run's last round is next: its waits run to ``deadline_max``, as no later round makes up for
        an update they cut off (peers that left still end them early)."""
        self._last_round = True

    def deadline_seconds(self, unit: str | None = None) -> float:
        """``unit``'s adaptive deadline now; without one, the longest of the units' (for refreshes);
        ``deadline_max`` in the run's last round."""
        if self._last_round:
            return self.cfg.deadline_max
        if unit is not None:
            return self._deadline(unit).seconds()
        with self._lock:
            known = list(self._deadlines.values())
        return max((d.seconds() for d in known), default=self.cfg.deadline_max)

    def _deadline(self, unit: str) -> AdaptiveDeadline:
        with self._lock:
            return self._deadlines.setdefault(
                unit, AdaptiveDeadline(self.cfg.deadline_min, self.cfg.deadline_max)
            )

    def held(self) -> list:
        """The updates received for the unit's round in progress (``peer.footprint``)."""
        return [list(self._received)]

    def unit_done(self) -> None:
        """The unit's round is over: what it received is not kept."""
        self._received = []

    def taking_part(self, round_: int, unit: str, peers) -> set[str]:
        """Those of ``peers`` that still take part in the unit's round (all of them, without a roster)."""
        return set(peers) & self.roster.participants(unit, round_) if self.roster is not None else set(peers)

    # ------------------------------------------------------------------------------------ announcements

    def follow(self, unit: str) -> None:
        """Hears announcements of ``unit`` by gossip from now on."""
        self.gossip.follow(unit)

    def follow_only(self, units) -> None:
        """Hears announcements of these units only (the ones this peer still holds)."""
        self.gossip.follow_only(units)

    def announce(self, round_: int, unit: str, announcement: Announcement) -> None:
        key = updates_key(self.run_id, round_, unit)
        self.transport.publish(key, announcement.encode(), self.transport.now() + ANNOUNCE_TTL)
        self.gossip.tell(unit, announcement)

    def announcements(self, round_: int, unit: str) -> dict[str, Announcement]:
        """The round's announcements of ``unit``: those heard by gossip, and those in the DHT, read at every
        call without gossip, and with it at most every ``FALLBACK_READ_SECONDS`` (at least four times in
        the shortest round deadline); the DHT's win."""
        key, now = (round_, unit), time.monotonic()
        every = min(FALLBACK_READ_SECONDS, self.cfg.deadline_min / 4)
        with self._lock:
            read_at, announced = self._read.get(key, (-math.inf, {}))
        if not self.gossip.works or now >= read_at + every:
            entries = self.transport.read(updates_key(self.run_id, round_, unit))
            decoded = decode_entries(entries, Announcement, "update announcement", self.transport.guard)
            announced = {p: a for p, a in decoded.items() if a.round == round_}
            with self._lock:
                self._read[key] = (now, announced)
        return {**self.gossip.heard(round_, unit), **announced}

    # ------------------------------------------------------------------------------------ the wait

    def gather(
        self,
        round_: int,
        unit: str,
        others: list[str],
        deadline: Deadline,
        part: tuple[int, int] | None = None,
    ) -> Gathered:
        """Fetches the others' updates of this round (with ``part`` = (part, parts), that part of them) until
        all that are waited for answered, left, or the deadline passed. The deadline adapts to when the last
        answer came, whoever is still missing."""
        started = last_answer = time.monotonic()
        # (a peer we banned is in a grouped exchange's grid, as the others count it: refused, not waited for)
        refused = {p for p in others if not self.transport.guard.allows(p)}
        wanted, got, announcing = set(others) - refused, {}, set()
        waiting = {p for p in wanted if self.ledger.waited_for(p)}
        next_liveness_check = started + LIVENESS_CHECK_SECONDS

        def one_pass() -> bool | None:
            nonlocal last_answer, next_liveness_check
            announced = self.announcements(round_, unit)
            announcing.update(announced)
            todo = [(round_, p, announced[p]) for p in sorted(wanted) if p in announced]
            for (_, peer, _), outcome in zip(
                todo, self.fetcher.updates(unit, todo, deadline, part), strict=True
            ):
                if isinstance(outcome, Got | Refused | Gone):
                    wanted.discard(peer)
                    waiting.discard(peer)
                if isinstance(outcome, Got):
                    got[peer], last_answer = outcome.received, time.monotonic()
                elif isinstance(outcome, Refused):
                    refused.add(peer)
            if waiting and time.monotonic() >= next_liveness_check:
                waiting.intersection_update(self.taking_part(round_, unit, waiting))  # (left, or restarted)
                next_liveness_check = time.monotonic() + LIVENESS_CHECK_SECONDS
            return True if not waiting else None

        if not poll(one_pass, deadline, POLL_SECONDS):
            logger.info("round %d %s: deadline passed without %s", round_, unit, sorted(waiting))
        self._received.extend(r.contribution.tensors for r in got.values())
        if waiting - announcing:  # cut off while still training: this peer ran ahead, and waits longer next
            self._deadline(unit).observe(time.monotonic() - started)  # round to fall back into step
        elif got:
            self._deadline(unit).observe(last_answer - started)
        missing = set(others) - set(got) - refused
        self.ledger.attend(round_, others, set(got), missing, announcing)
        return Gathered([got[p] for p in sorted(got)], sorted(missing), sorted(refused))

    def late_updates(self, job: UnitJob, deadline: Deadline) -> list[Contribution]:
        """Updates of the last ``staleness`` rounds that came after those rounds closed, on our base of then,
        from peers that took part in those rounds (nobody else may slip an update in); not one that came in
        time and was refused."""
        me, todo = self.transport.peer_id, []
        for past in range(max(0, job.round - self.cfg.staleness), job.round):
            our_base = self.ledger.base(past, job.unit)
            took_part = self.ledger.participants(past, job.unit) - {me}
            for peer, announced in sorted(self.announcements(past, job.unit).items()):
                fresh = peer in took_part and not self.ledger.settled(peer, past, job.unit)
                if fresh and our_base is not None and announced.base == our_base:
                    todo.append((past, peer, announced))
        outcomes = self.fetcher.updates(job.unit, todo, deadline)
        return [o.received.contribution for o in outcomes if isinstance(o, Got)]

    def pieces(
        self, round_: int, unit: str, peers: list[str], base: str, part, deadline
    ) -> list[Contribution]:
        """Part ``part`` = (part, parts) of the updates that ``peers`` announced on ``base`` (a reduce-
        scatter's fallback, when a part's owner failed us)."""
        announced = self.announcements(round_, unit)
        todo = [(round_, p, a) for p, a in sorted(announced.items()) if p in peers and a.base == base]
        outcomes = self.fetcher.updates(unit, todo, deadline, part)
        return [o.received.contribution for o in outcomes if isinstance(o, Got)]

    # ------------------------------------------------------------------------------------ upkeep

    def forget_before(self, round_: int) -> None:
        with self._lock:
            self._read = {k: v for k, v in self._read.items() if k[0] >= round_}
        self.gossip.forget_before(round_)
