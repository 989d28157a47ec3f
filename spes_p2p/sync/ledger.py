"""What the sync carries from one round to the next, kept in one place.

- the hash of our start weights of each (round, unit), and who took part in it, so that late updates of the
  last ``staleness`` rounds count only when measured from our base and sent by that round's participants;
- which (peer, round, unit) updates were settled already (applied, or refused), so that none counts twice
  and none refused comes back as a late update;
- per unit: what our last update's coding lost (error feedback), the outer rule's state (Nesterov
  momentum), and how many rounds in a row we were outnumbered on our own base;
- per peer: its attendance, which decides whom a round still waits for.

Sync thread only; ``held`` is read by the peer's memory sampling (a copy of the lists, never the tensors'
owners).
"""

from __future__ import annotations

from dataclasses import dataclass

from spes_p2p.sync.aggregate import OuterStep
from spes_p2p.sync.codecs import Codec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.payload import ErrorFeedback

MISS_LIMIT = 3  # rounds in a row a participant may miss before the rounds stop waiting for it
RESYNC_LIMIT = 3  # rounds in a row a unit may stay off the swarm's base before it is downloaded


@dataclass
class Attendance:
    """How one peer kept to the rounds, each counted at most once a round: ``misses``, rounds in a row it
    announced its update and did not deliver it; ``behind``, rounds in a row the deadline passed before it
    announced at all (it was still training: this peer ran ahead)."""

    misses: int = 0
    missed_in: int = -1
    behind: int = 0
    behind_in: int = -1

    def answered(self) -> None:
        self.misses = self.behind = 0

    def missed(self, round_: int) -> None:
        if self.missed_in < round_:
            self.misses, self.missed_in = self.misses + 1, round_
        self.behind = 0  # (it announced: it is not behind)

    def lagged(self, round_: int) -> None:
        if self.behind_in < round_:
            self.behind, self.behind_in = self.behind + 1, round_


class Ledger:
    def __init__(self, cfg: SyncConfig, codec: Codec) -> None:
        self.cfg, self.codec = cfg, codec
        self._bases: dict[tuple[int, str], str] = {}  # (round, unit) -> our start-weights hash
        self._participants: dict[tuple[int, str], set[str]] = {}  # (round, unit) -> who took part
        self._settled: set[tuple[str, int, str]] = set()  # (peer, round, unit) applied or refused
        self._feedback: dict[str, ErrorFeedback] = {}  # unit -> what our last update's coding lost
        self._outer: dict[str, OuterStep] = {}
        self._off_base: dict[str, int] = {}  # unit -> rounds in a row we were outnumbered on our base
        self._attendance: dict[str, Attendance] = {}

    # ------------------------------------------------------------------------------------ rounds

    def opened(self, round_: int, unit: str, participants: tuple[str, ...]) -> None:
        self._participants[(round_, unit)] = set(participants)

    def participants(self, round_: int, unit: str) -> set[str]:
        return set(self._participants.get((round_, unit), ()))

    def posted(self, round_: int, unit: str, base: str) -> None:
        """We posted an update of the round, measured from ``base``."""
        self._bases[(round_, unit)] = base

    def base(self, round_: int, unit: str) -> str | None:
        return self._bases.get((round_, unit))

    def settled(self, peer: str, round_: int, unit: str) -> bool:
        return (peer, round_, unit) in self._settled

    def settle(self, peers: set[str], round_: int, unit: str) -> None:
        self._settled |= {(p, round_, unit) for p in peers}

    # ---------------------------------------------------------------------------------- per unit

    def feedback(self, unit: str) -> ErrorFeedback:
        return self._feedback.setdefault(unit, ErrorFeedback(self.codec))

    def replaced(self, unit: str) -> None:
        """Our weights of ``unit`` were replaced (re-synchronized, or our update diverged): what our coding
        lost is moot."""
        self._feedback.pop(unit, None)

    def outer(self, unit: str) -> OuterStep:
        return self._outer.setdefault(
            unit, OuterStep(self.cfg.outer, self.cfg.outer_lr, self.cfg.outer_momentum)
        )

    def restart_outer(self, unit: str) -> None:
        self._outer.pop(unit, None)

    def on_base(self, unit: str) -> None:
        self._off_base[unit] = 0

    def kept_off_base(self, unit: str) -> bool:
        """One more round outnumbered with nobody in reach; True (and the count starts over) once that has
        happened ``RESYNC_LIMIT`` times in a row: the unit should be downloaded."""
        self._off_base[unit] = self._off_base.get(unit, 0) + 1
        if self._off_base[unit] < RESYNC_LIMIT:
            return False
        self._off_base[unit] = 0
        return True

    # ---------------------------------------------------------------------------------- per peer

    def waited_for(self, peer: str) -> bool:
        """Whether a round still waits for ``peer`` (and, when the deadline cuts it off still training,
        waits longer the next round): it neither missed nor was behind ``MISS_LIMIT`` rounds in a row. A
        holder that never announces costs its co-holders a deadline for that many rounds, not every round;
        an update of its that comes later counts as a late one, and one delivered in time makes it waited
        for again."""
        record = self._attendance.get(peer, Attendance())
        return record.misses < MISS_LIMIT and record.behind < MISS_LIMIT

    def attend(self, round_: int, others: list[str], got: set[str], missing: set[str], announcing: set[str]):
        """Once a round per peer: one that announced its update and did not deliver it (silent, or slow)
        counts a miss; an answer resets the count. A peer merely behind (not announced yet) counts no miss
        (honest peers held up by someone else do not stop waiting for each other), only a round behind."""
        for peer in others:
            record = self._attendance.setdefault(peer, Attendance())
            if peer in got:
                record.answered()
            elif peer in missing and peer in announcing:
                record.missed(round_)
            elif peer in missing:
                record.lagged(round_)

    # ---------------------------------------------------------------------------------- upkeep

    def forget_before(self, oldest: int, round_: int) -> None:
        """Drops what rounds before ``oldest`` left, and residuals older than the round before ``round_``."""
        self._bases = {k: v for k, v in self._bases.items() if k[0] >= oldest}
        self._settled = {k for k in self._settled if k[1] >= oldest}
        self._participants = {k: v for k, v in self._participants.items() if k[0] >= oldest}
        # a residual carries only into the next round: one older than the round just landed is of a unit
        # given up (and would be dropped on its return anyway)
        self._feedback = {u: f for u, f in self._feedback.items() if f.round is None or f.round >= round_ - 1}

    def held(self) -> dict[str, list]:
        """The tensors kept across rounds (``peer.footprint``)."""
        return {
            "residuals": [f.residual for f in list(self._feedback.values())],
            "momenta": [o.buffers for o in list(self._outer.values())],
        }
