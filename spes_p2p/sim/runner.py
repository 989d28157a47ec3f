"""Runs a simulated swarm: starts the peers, fires kills, joins and faults as the swarm's round advances, and
waits (bounded) until every live peer has reached the last round.

Every peer lives through the library's one life cycle (``spes_p2p.peer.life.live``): in its own process
(``python -m spes_p2p.peer peerI.toml``, hivemind backend) or on a thread of this process (memory backend).

Layout of the output folder::

    OUT/peers/peerI/    each peer's run folder (metrics.jsonl, state.json, model.safetensors, checkpoints/)
    OUT/logs/peerI.log  each process's output (hivemind backend)
    OUT/keys/           each process's settings, identity key and address file (hivemind backend)
    OUT/summary.json    OUT/loss.png
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from spes_p2p.errors import SpesError
from spes_p2p.files import writable_folder
from spes_p2p.settings import Settings, key_of, load_settings
from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS, SOLE, Event, Partition
from spes_p2p.sim.summary import plot_losses, read_rows, summarize

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
# many peers share a few cores: one math thread each leaves CPU for their p2p daemons and DHT processes
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STARTUP_SECONDS = 120.0  # a process's start, its model and its data
ROUND_BUDGET_SECONDS = 120.0  # a generous bound on one round, for the overall deadline


def name_of(index: int) -> str:
    return f"peer{index}"


class Fleet(ABC):
    """The simulated peers, whatever runs them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.out = Path(settings.run.out)
        self.peers_dir = self.out / "peers"
        self.peers_dir.mkdir(parents=True, exist_ok=True)
        self.killed: set[int] = set()
        self.started: list[int] = []
        self.join_rounds: dict[int, int] = {}  # peer -> the swarm round it joins at

    def peer_settings(self, index: int, join_round: int | None, **changes) -> Settings:
        """Peer ``index``'s own settings: its run folder, and when it joins (None: with the first peers)."""
        self.join_rounds[index] = join_round or 0
        return self.settings.override(
            run__out=str(self.peers_dir / name_of(index)),
            run__min_peers=self.settings.sim.peers if join_round is None else 1,
            run__join_round=join_round or 0,
            run__new_swarm=not self.started,
            run__resume=False,
            **changes,
        )

    @abstractmethod
    def start(self, index: int, join_round: int | None = None) -> None:
        """Starts peer ``index``: one of the first peers, or a newcomer that joins at ``join_round``."""

    @abstractmethod
    def alive(self, index: int) -> bool: ...

    @abstractmethod
    def kill(self, index: int) -> None: ...

    @abstractmethod
    def failures(self) -> list[str]: ...

    def rounds(self) -> dict[int, int]:
        """Live peers' current rounds (the number of rounds they have completed)."""
        return {i: _round_of(self.peers_dir / name_of(i)) for i in self.started if self.alive(i)}

    def partition(self, groups: tuple[tuple[int, ...], ...] | None) -> None:
        raise SpesError("network faults need --backend memory")

    def faults(self) -> dict[str, int]:
        return {}

    def finished(self) -> bool:
        return not any(self.alive(i) for i in self.started)

    def close(self) -> None:  # noqa: B027 - most fleets have nothing to close
        pass


def _round_of(folder: Path) -> int:
    rows = read_rows(folder)
    return rows[-1]["round"] + 1 if rows else 0


# ------------------------------------------------------------------------------------------ memory backend


class MemoryFleet(Fleet):
    """Every peer on a thread of this process, on one MemoryNetwork; a kill makes a peer vanish mid-round."""

    def __init__(self, settings: Settings) -> None:
        from spes_p2p.swarm.memory import MemoryNetwork

        super().__init__(settings)
        sim = settings.sim
        self.net = MemoryNetwork(seed=settings.train.seed)
        self.net.drop, self.net.delay, self.net.corrupt = sim.drop, sim.delay_ms / 1000, sim.corrupt
        self.peers: dict[int, object] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.stops: dict[int, threading.Event] = {}
        self.errors: list[str] = []

    def start(self, index: int, join_round: int | None = None) -> None:
        settings = self.peer_settings(index, join_round)
        self.stops[index] = threading.Event()
        thread = threading.Thread(target=self._life, args=(index, settings), name=name_of(index), daemon=True)
        self.threads[index] = thread
        self.started.append(index)
        thread.start()

    def _life(self, index: int, settings: Settings) -> None:
        from spes_p2p.peer.life import Frontend, live

        fleet = self

        class Tracked(Frontend):
            def started(self, peer) -> None:
                fleet.peers[index] = peer

        transport = self.net.join(name_of(index))
        mode = self.settings.sim.byzantine_peers.get(index)
        if mode:
            from spes_p2p.sim.byzantine import ByzantineTransport

            transport = ByzantineTransport(transport, mode, self.settings.model.layout().units)
        try:
            live(settings, self.stops[index], Tracked(), transport=transport)
        except Exception as exc:  # a killed peer may fail in any way; a live one must not
            if index not in self.killed:
                logger.exception("%s failed", name_of(index))
                self.errors.append(f"{name_of(index)}: {exc}")

    def alive(self, index: int) -> bool:
        return index not in self.killed and self.threads[index].is_alive()

    def rounds(self) -> dict[int, int]:
        return {i: p.round for i, p in self.peers.items() if self.alive(i)}

    def kill(self, index: int) -> None:
        self.killed.add(index)
        peer = self.peers.get(index)
        if peer is not None:
            peer.crash()
        self.stops[index].set()

    def partition(self, groups: tuple[tuple[int, ...], ...] | None) -> None:
        if groups is None:
            self.net.heal()
        else:
            self.net.partition(*[[name_of(i) for i in g] for g in groups])

    def faults(self) -> dict[str, int]:
        return dict(self.net.faults)

    def failures(self) -> list[str]:
        return list(self.errors)

    def close(self) -> None:
        for stop in self.stops.values():
            stop.set()
        for thread in self.threads.values():
            thread.join(timeout=30)


# --------------------------------------------------------------------------------------- hivemind backend


class ProcessFleet(Fleet):
    """Real peer processes on 127.0.0.1 (``python -m spes_p2p.peer``), the first founding the swarm; a kill
    is a SIGKILL of the peer's whole process group."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.keys = self.out / "keys"
        for folder in (self.out / "logs", self.keys):
            folder.mkdir(parents=True, exist_ok=True)
        for stale in self.keys.glob("*.addr"):  # an earlier run's: peers would dial dead addresses
            stale.unlink()
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, index: int, join_round: int | None = None) -> None:
        name = name_of(index)
        settings = self.peer_settings(
            index,
            join_round,
            network__identity=str(self.keys / f"{name}.key"),
            run__addr_file=str(self.keys / f"{name}.addr"),
            run__log_level="info",
            swarm__initial_peers=(self._address_of_a_live_peer(),) if self.started else (),
        )
        config = self.keys / f"{name}.toml"
        config.write_text(settings.to_toml())
        mode = self.settings.sim.byzantine_peers.get(index)
        command = ["spes_p2p.sim.byzantine", str(config), mode] if mode else ["spes_p2p.peer", str(config)]
        with open(self.out / "logs" / f"{name}.log", "w") as log:
            self.procs[index] = subprocess.Popen(
                [sys.executable, "-m", *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **SINGLE_THREADED, "PYTHONUNBUFFERED": "1"},
            )
        self.started.append(index)
        if len(self.started) == 1:
            self._wait_for_address(index)

    def _wait_for_address(self, index: int) -> str:
        path = self.keys / f"{name_of(index)}.addr"
        deadline = time.monotonic() + STARTUP_SECONDS
        while not path.exists():
            if self.procs[index].poll() is not None or time.monotonic() > deadline:
                log = (self.out / "logs" / f"{name_of(index)}.log").read_text()[-2000:]
                raise SpesError(f"{name_of(index)} did not start:\n{log}")
            time.sleep(0.2)
        return path.read_text().split()[0]

    def _address_of_a_live_peer(self) -> str:
        for i in self.started:
            if self.alive(i) and (self.keys / f"{name_of(i)}.addr").exists():
                return self._wait_for_address(i)
        raise SpesError("no live peer to join through")

    def alive(self, index: int) -> bool:
        return self.procs[index].poll() is None

    def kill(self, index: int) -> None:
        self.killed.add(index)
        if self.alive(index):
            os.killpg(self.procs[index].pid, signal.SIGKILL)  # the peer, its DHT process and its p2pd
            self.procs[index].wait(timeout=10)

    def close(self) -> None:
        stop_process_groups(self.procs.values())

    def failures(self) -> list[str]:
        return [
            f"{name_of(i)} exited with {p.returncode}"
            for i, p in self.procs.items()
            if i not in self.killed and p.returncode not in (0, None)
        ]


def stop_process_groups(procs, grace: float = 20.0) -> None:
    """SIGTERM to each still-running process group (a peer leaves in order), SIGKILL after ``grace`` s."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


# ---------------------------------------------------------------------------------------------- the run


class Director:
    """Starts the peers, and fires the scenario's kills and partitions as the swarm's round advances;
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

    def start(self) -> None:
        for index in range(self.first):
            self.fleet.start(index)
        index = self.first
        for join in self.joins:
            for _ in range(join.count):
                self.fleet.start(index, join_round=join.round)
                self.events.append({"type": "join", "peer": name_of(index), "round": join.round})
                index += 1

    def tick(self, swarm_round: int) -> None:
        self._kill(swarm_round)
        self._partition(swarm_round)

    def _kill(self, swarm_round: int) -> None:
        while self.kills and self.kills[0].round <= swarm_round:
            at = self.kills[0].round
            index = (
                _sole_holder(self.fleet, swarm_round) if self.kills[0].count == SOLE else self.kills[0].count
            )
            if index is None and swarm_round <= at + 2:
                return  # no sole holder right now (claims are settling): try again at the next tick
            self.kills.pop(0)
            if index is None:
                self.events.append({"type": "kill skipped", "reason": "no sole holder", "round": at})
                continue
            self.fleet.kill(index)
            self.events.append({"type": "kill", "peer": name_of(index), "round": swarm_round})

    def _partition(self, swarm_round: int) -> None:
        if self.active and swarm_round > self.active.end:
            self.fleet.partition(None)
            self.events.append({"type": "heal", "round": swarm_round})
            self.active = None
        if not self.active and self.partitions and self.partitions[0].start <= swarm_round:
            self.active = self.partitions.pop(0)
            self.fleet.partition(self.active.groups)
            groups = [list(g) for g in self.active.groups]
            self.events.append({"type": "partition", "groups": groups, "round": swarm_round})


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


def simulation(**changes) -> Settings:
    """A simulation's settings: ``spes simulate``'s defaults with ``section__field`` changes."""
    return load_settings(
        None, {key_of(name): v for name, v in changes.items()}, defaults=LOCAL_SWARM_DEFAULTS
    )


def run(settings: Settings, on_tick: Callable[[dict], None] | None = None) -> dict:
    """Runs the simulation to its last round (``[run] rounds``); returns the summary (also written to
    OUT/summary.json)."""
    out = writable_folder(Path(settings.run.out), "--out")
    shutil.rmtree(out / "peers", ignore_errors=True)  # a fresh simulation: no rows of an earlier one
    fleet: Fleet = MemoryFleet(settings) if settings.sim.backend == "memory" else ProcessFleet(settings)
    director = Director(settings, fleet)
    started = time.monotonic()
    deadline = started + STARTUP_SECONDS + settings.run.rounds * ROUND_BUDGET_SECONDS
    try:
        director.start()
        while not fleet.finished():
            rounds = fleet.rounds()
            director.tick(max(rounds.values(), default=0))
            if on_tick:
                on_tick(_tick(fleet, rounds, director.events, time.monotonic() - started))
            if time.monotonic() > deadline:
                raise SpesError(f"the simulation did not finish within {deadline - started:.0f}s; see {out}")
            if fleet.failures():
                break  # the run has failed: stop now, rather than let the others wait for the peer gone
            time.sleep(POLL_SECONDS)
    finally:
        fleet.close()
    events = director.events + [
        {"type": "fault", "kind": k, "count": n} for k, n in fleet.faults().items() if n
    ]
    names = [name_of(i) for i in fleet.started]
    killed = {name_of(i) for i in fleet.killed}
    summary = summarize(
        settings, fleet.peers_dir, events, names, killed, time.monotonic() - started, fleet.failures()
    )
    plot_losses(fleet.peers_dir, events, out / "loss.png")
    return summary


def _tick(fleet: Fleet, rounds: dict[int, int], events: list[dict], elapsed: float) -> dict:
    return {
        "rounds": {name_of(i): r for i, r in rounds.items()},
        "events": list(events),
        "elapsed": elapsed,
        "killed": [name_of(i) for i in fleet.killed],
    }
