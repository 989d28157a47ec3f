"""The scenario of a simulation, fired as the swarm's round advances: the first peers and the newcomers,
kills (``--kill``), churn (``--churn``: random kills, each followed a round later by a restart with
``--resume``) and network partitions. Every event is recorded for the summary."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from spes_p2p.settings import Settings
from spes_p2p.sim.config import SOLE, Event, Partition, name_of
from spes_p2p.sim.summary import read_rows

if TYPE_CHECKING:
    from spes_p2p.sim.fleets import Fleet

# no churn kill in the last rounds, so that a restarted peer has rounds to come back in: a round passes
# before its restart, then on 2 shared cores its process takes 60-100 s to import, start its DHT, wait out
# the round in progress and download the model. In the soak (docs/simulate.md) a restarted peer wrote its
# first row 2 to 5 rounds (of 20 steps) after its restart
CHURN_TAIL_ROUNDS = 6


class Director:
    """Starts the peers, and fires the scenario's kills, churn and partitions as the swarm's round advances;
    records events. Newcomers start with the first peers and wait, ready, until the swarm reaches their
    round, so that they join then whatever their start-up takes."""

    def __init__(self, settings: Settings, fleet: Fleet) -> None:
        sim = settings.sim
        self.fleet, self.first = fleet, sim.peers
        self.kills: list[Event] = sim.kill_events
        self.joins: list[Event] = sim.join_events
        self.partitions: list[Partition] = sim.partition_events
        self.active: Partition | None = None
        self.events: list[dict] = []
        self.churn = Churn(fleet, self.events, sim.churn, settings.train.seed, settings.run.rounds)

    def start(self) -> None:
        for index in range(self.first):
            self.fleet.start(index)
        index = self.first
        for join in self.joins:
            for _ in range(join.count):
                self.fleet.start(index, join_round=join.round)
                self.events.append({"type": "join", "peer": name_of(index), "round": join.round})
                index += 1

    def tick(self, swarm_round: int, slowest: int | None = None) -> None:
        """``swarm_round``: the most rounds a live peer has completed (kills, churn and heals go by it);
        ``slowest``: the fewest (a partition starts once every peer has completed the rounds before it, so
        that it cuts no exchange of an earlier round short; None: ``swarm_round``)."""
        self._kill(swarm_round)
        self.churn.tick(swarm_round)
        self._partition(swarm_round, swarm_round if slowest is None else slowest)

    def _kill(self, swarm_round: int) -> None:
        """Fires every kill whose round has come, each on its own: a ``sole`` kill that finds no sole holder
        (claims are settling) tries again at the next tick, for up to 2 rounds past its own, and holds up
        none of the kills after it."""
        waiting = []
        for kill in self.kills:
            if kill.round > swarm_round:
                waiting.append(kill)
                continue
            index = _sole_holder(self.fleet, swarm_round) if kill.count == SOLE else kill.count
            if index is None and swarm_round <= kill.round + 2:
                waiting.append(kill)  # no sole holder right now: try again at the next tick
            elif index is None or not self.fleet.alive(index):
                reason = "no sole holder" if index is None else f"{name_of(index)} is down already"
                self.events.append({"type": "kill skipped", "reason": reason, "round": kill.round})
            else:
                self.fleet.kill(index)
                self.events.append({"type": "kill", "peer": name_of(index), "round": swarm_round})
        self.kills = waiting

    def _partition(self, swarm_round: int, slowest: int) -> None:
        if self.active and swarm_round > self.active.end:
            self.fleet.partition(None)
            self.events.append({"type": "heal", "round": swarm_round})
            self.active = None
        if not self.active and self.partitions and self.partitions[0].start <= slowest:
            self.active = self.partitions.pop(0)
            self.fleet.partition(self.active.groups)
            groups = [list(g) for g in self.active.groups]
            self.events.append({"type": "partition", "groups": groups, "round": swarm_round})


class Churn:
    """``--churn P``: in each swarm round from 1 on, each peer in the swarm is killed with probability P, and
    restarted with ``--resume`` once the swarm has advanced a round.

    A peer is in the swarm when it is alive, its join round has come, and it has written a round's row and a
    checkpoint since it (re)started (so it has a checkpoint to resume from, and a restart's return is seen
    before the next kill). A peer drawn in a round is killed as soon as it is in the swarm, in that round
    or, when it was not in the swarm yet (it had to land the swarm's first round, or to come back from a
    restart, and a slow machine let the round pass), in a later one, up to the last round with draws.

    The draws come from a generator seeded with ``train.seed``, one per peer and round whether or not the
    peer can be killed then, so a run's kills depend on the seed alone (and on which peers are in the swarm
    at that moment). No kill takes the last peer in the swarm (a restart joins through a live one): a peer
    drawn while it is the last one dies once another is in the swarm too. No kill falls in the last
    ``CHURN_TAIL_ROUNDS`` rounds: a peer drawn and not killable before then is spared (``kill skipped``)."""

    def __init__(self, fleet: Fleet, events: list[dict], probability: float, seed: int, rounds: int) -> None:
        self.fleet, self.events, self.p = fleet, events, probability
        self.rng = random.Random(f"churn:{seed}")
        self.last = rounds - CHURN_TAIL_ROUNDS  # the last swarm round with draws
        self.drawn = 0  # the swarm round drawn for last
        self.doomed: set[int] = set()  # peers drawn and not killed yet
        self.down: dict[int, int] = {}  # killed peer -> the swarm round it was killed at

    def tick(self, swarm_round: int) -> None:
        if not self.p:
            return
        while self.drawn < min(swarm_round, self.last):
            self.drawn += 1
            peers = range(len(self.fleet.join_rounds))
            drawn = {i for i in peers if self.rng.random() < self.p}  # (one draw per peer, always)
            self.doomed |= drawn - set(self.down)  # (a peer that is down is not in the swarm that round)
        if self.doomed and swarm_round <= self.last:
            self._kill(swarm_round)
        elif self.doomed:  # the draws are over: what could not be killed in time is spared
            for index in sorted(self.doomed):
                reason = "never killable while its round lasted"
                self.events.append(
                    {"type": "kill skipped", "peer": name_of(index), "reason": reason, "round": swarm_round}
                )
            self.doomed.clear()
        for index, at in sorted(self.down.items()):  # (after the kills: a restart dials live peers only)
            if swarm_round > at:
                del self.down[index]
                self.fleet.restart(index)
                rows, _ = self.fleet.at_start[index]  # (the summary tells its rows after the restart by them)
                self.events.append(
                    {"type": "restart", "peer": name_of(index), "round": swarm_round, "rows": rows}
                )

    def _kill(self, swarm_round: int) -> None:
        in_swarm = {i for i in range(len(self.fleet.join_rounds)) if self._in_swarm(i, swarm_round)}
        for index in sorted(self.doomed & in_swarm):
            if len(in_swarm) == 1:  # the last peer in the swarm (as a round starts, often the first to land
                continue  # it): it dies once another is in too, a restart joins through a live one
            self.doomed.discard(index)
            in_swarm.remove(index)
            self.fleet.kill(index)
            self.down[index] = swarm_round
            self.events.append({"type": "kill", "peer": name_of(index), "round": swarm_round, "churn": True})

    def _in_swarm(self, index: int, swarm_round: int) -> bool:
        fleet = self.fleet
        return (
            index not in self.down
            and fleet.join_rounds[index] <= swarm_round
            and fleet.alive(index)
            and fleet.in_swarm(index)
        )


def _sole_holder(fleet: Fleet, swarm_round: int) -> int | None:
    """The first live peer that alone trained some expert shard in its latest round."""
    live = [i for i in fleet.rounds() if fleet.join_rounds[i] <= swarm_round]  # (not newcomers still waiting)
    units = {i: set(rows[-1]["units"]) for i in live if (rows := read_rows(fleet.peers_dir / name_of(i)))}
    if len(units) < len(live):
        return None  # some peer has not reported a round yet: we cannot tell
    for index, held in sorted(units.items()):
        others = set().union(*(u for j, u in units.items() if j != index))
        if any(u.startswith("experts/") and u not in others for u in held):
            return index
    return None
