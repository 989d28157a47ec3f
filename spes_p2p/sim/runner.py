"""Runs a simulated swarm: starts the peers, fires kills, joins and faults as the swarm's round advances, and
waits (bounded) until every live peer has reached the last round.

Layout of the output folder::

    OUT/peers/peerI/    each peer's run folder (metrics.jsonl, state.json, model.safetensors, checkpoints/)
    OUT/logs/peerI.log  each process's output (hivemind backend)
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
from spes_p2p.settings import to_toml
from spes_p2p.sim.config import SOLE, SimConfig
from spes_p2p.sim.summary import plot_losses, read_rows, summarize

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
# many peers share a few cores: one math thread each leaves CPU for their p2p daemons and DHT processes
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STARTUP_SECONDS = 120.0  # a process's start, its model and its data
ROUND_BUDGET_SECONDS = 120.0  # a generous bound on one round, for the overall deadline


def name_of(index: int) -> str:
    return f"peer{index}"


class Fleet(ABC):
    """The simulated peers, whatever runs them."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.peers_dir = cfg.out / "peers"
        self.peers_dir.mkdir(parents=True, exist_ok=True)
        self.killed: set[int] = set()
        self.started: list[int] = []

    @abstractmethod
    def start(self, index: int, initial: bool) -> None: ...

    @abstractmethod
    def alive(self, index: int) -> bool: ...

    @abstractmethod
    def kill(self, index: int) -> None: ...

    def rounds(self) -> dict[int, int]:
        """Live peers' current rounds (the number of rounds they have completed)."""
        return {i: _round_of(self.peers_dir / name_of(i)) for i in self.started if self.alive(i)}

    def partition(self, groups: tuple[tuple[int, ...], ...] | None) -> None:
        raise SpesError("network faults need --backend memory")

    def finished(self) -> bool:
        return not any(self.alive(i) for i in self.started)

    def close(self) -> None:  # noqa: B027 - most fleets have nothing to close
        pass


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


def _sole_holder(fleet: Fleet) -> int | None:
    """The first live peer that alone trained some expert shard in its latest round."""
    live = fleet.rounds()
    units = {i: set(rows[-1]["units"]) for i in live if (rows := read_rows(fleet.peers_dir / name_of(i)))}
    if len(units) < len(live):
        return None  # some peer has not reported a round yet: we cannot tell
    for index, held in sorted(units.items()):
        others = set().union(*(u for j, u in units.items() if j != index))
        if any(u.startswith("experts/") and u not in others for u in held):
            return index
    return None


def _round_of(folder: Path) -> int:
    rows = read_rows(folder)
    return rows[-1]["round"] + 1 if rows else 0


# ------------------------------------------------------------------------------------------ memory backend


class MemoryFleet(Fleet):
    """Every peer in this process, on one MemoryNetwork; a kill makes the peer vanish mid-round."""

    def __init__(self, cfg: SimConfig) -> None:
        from spes_p2p.swarm.memory import MemoryNetwork

        super().__init__(cfg)
        self.net = MemoryNetwork(seed=cfg.seed)
        self.net.drop, self.net.delay, self.net.corrupt = cfg.drop, cfg.delay_ms / 1000, cfg.corrupt
        self.settings = cfg.settings()
        self.peers: dict[int, object] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.stops: dict[int, threading.Event] = {}
        self.errors: list[str] = []
        self._all_joined = threading.Barrier(cfg.peers, timeout=STARTUP_SECONDS)

    def start(self, index: int, initial: bool) -> None:
        self.stops[index] = threading.Event()
        thread = threading.Thread(target=self._life, args=(index, initial), name=name_of(index), daemon=True)
        self.threads[index] = thread
        self.started.append(index)
        thread.start()

    def _life(self, index: int, initial: bool) -> None:
        from spes_p2p.peer import Peer

        try:
            peer = Peer(self.settings, self.net.join(name_of(index)), out_dir=self.peers_dir / name_of(index))
            self.peers[index] = peer
            peer.join()
            if initial:
                self._all_joined.wait()  # like --min-peers: the first peers start their rounds together
            peer.run(self.stops[index], until_round=self.cfg.rounds)
            if index not in self.killed:
                peer.drain(self.settings.swarm.sync_deadline_max)
                peer.close()
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
        self.stops[index].set()
        peer = self.peers.get(index)
        if peer is not None:
            peer.crash()

    def partition(self, groups: tuple[tuple[int, ...], ...] | None) -> None:
        if groups is None:
            self.net.heal()
        else:
            self.net.partition(*[[name_of(i) for i in g] for g in groups])

    def close(self) -> None:
        for stop in self.stops.values():
            stop.set()
        for thread in self.threads.values():
            thread.join(timeout=30)


# --------------------------------------------------------------------------------------- hivemind backend


class ProcessFleet(Fleet):
    """Real `spes-join` processes on 127.0.0.1, the first with --new-swarm; a kill is a SIGKILL."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        (cfg.out / "logs").mkdir(parents=True, exist_ok=True)
        (cfg.out / "keys").mkdir(parents=True, exist_ok=True)
        for stale in (cfg.out / "keys").glob("*.addr"):  # an earlier run's: peers would dial dead addresses
            stale.unlink()
        (cfg.out / "peers.toml").write_text(to_toml(cfg.settings()))
        self.procs: dict[int, subprocess.Popen] = {}
        self.binary = str(Path(sys.executable).parent / "spes-join")

    def start(self, index: int, initial: bool) -> None:
        name = name_of(index)
        args = [
            self.binary,
            "--config",
            str(self.cfg.out / "peers.toml"),
            "--identity",
            str(self.cfg.out / "keys" / f"{name}.key"),
            "--out",
            str(self.peers_dir / name),
            "--addr-file",
            str(self.cfg.out / "keys" / f"{name}.addr"),
            "--until-round",
            str(self.cfg.rounds),
            "--min-peers",
            str(self.cfg.peers if initial else 1),
            "--log-level",
            "info",
        ]
        if not self.started:
            args.append("--new-swarm")
        else:
            args += ["--peers", self._address_of_a_live_peer()]
        with open(self.cfg.out / "logs" / f"{name}.log", "w") as log:
            self.procs[index] = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **SINGLE_THREADED, "PYTHONUNBUFFERED": "1"},
            )
        self.started.append(index)
        if len(self.started) == 1:
            self._wait_for_address(index)

    def _wait_for_address(self, index: int) -> str:
        path = self.cfg.out / "keys" / f"{name_of(index)}.addr"
        deadline = time.monotonic() + STARTUP_SECONDS
        while not path.exists():
            if self.procs[index].poll() is not None or time.monotonic() > deadline:
                log = (self.cfg.out / "logs" / f"{name_of(index)}.log").read_text()[-2000:]
                raise SpesError(f"{name_of(index)} did not start:\n{log}")
            time.sleep(0.2)
        return path.read_text().split()[0]

    def _address_of_a_live_peer(self) -> str:
        for i in self.started:
            if self.alive(i) and (self.cfg.out / "keys" / f"{name_of(i)}.addr").exists():
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


# ---------------------------------------------------------------------------------------------- the run


def run(cfg: SimConfig, on_tick: Callable[[dict], None] | None = None) -> dict:
    """Runs the simulation to its last round; returns the summary (also written to OUT/summary.json)."""
    shutil.rmtree(cfg.out / "peers", ignore_errors=True)  # a fresh simulation: no rows of an earlier one
    cfg.out.mkdir(parents=True, exist_ok=True)
    fleet: Fleet = MemoryFleet(cfg) if cfg.backend == "memory" else ProcessFleet(cfg)
    events: list[dict] = []
    kills, joins = sorted(cfg.kills, key=lambda k: k[1]), sorted(cfg.joins, key=lambda j: j[1])
    partitions = sorted(cfg.partitions, key=lambda p: p.start)
    active_partition = None
    started = time.monotonic()
    deadline = started + STARTUP_SECONDS + cfg.rounds * ROUND_BUDGET_SECONDS
    try:
        for index in range(cfg.peers):
            fleet.start(index, initial=True)
        next_index = cfg.peers
        while not fleet.finished():
            rounds = fleet.rounds()
            swarm_round = max(rounds.values(), default=0)
            while kills and kills[0][1] <= swarm_round:
                index, at = kills[0]
                index = _sole_holder(fleet) if index == SOLE else index
                if index is None and swarm_round <= at + 2:
                    break  # no sole holder right now (claims are settling): try again at the next tick
                kills.pop(0)
                if index is None:
                    events.append({"type": "kill skipped", "reason": "no sole holder", "round": at})
                    continue
                fleet.kill(index)
                events.append({"type": "kill", "peer": name_of(index), "round": swarm_round})
            while joins and joins[0][1] <= swarm_round:
                count, at = joins.pop(0)
                for _ in range(count):
                    fleet.start(next_index, initial=False)
                    events.append({"type": "join", "peer": name_of(next_index), "round": at})
                    next_index += 1
            if active_partition and swarm_round > active_partition.end:
                fleet.partition(None)
                events.append({"type": "heal", "round": swarm_round})
                active_partition = None
            if not active_partition and partitions and partitions[0].start <= swarm_round:
                active_partition = partitions.pop(0)
                fleet.partition(active_partition.groups)
                events.append(
                    {
                        "type": "partition",
                        "groups": [list(g) for g in active_partition.groups],
                        "round": swarm_round,
                    }
                )
            if on_tick:
                on_tick(
                    {
                        "rounds": {name_of(i): r for i, r in rounds.items()},
                        "events": list(events),
                        "elapsed": time.monotonic() - started,
                        "killed": [name_of(i) for i in fleet.killed],
                    }
                )
            if time.monotonic() > deadline:
                raise SpesError(
                    f"the simulation did not finish within {deadline - started:.0f}s; see {cfg.out}"
                )
            time.sleep(POLL_SECONDS)
    finally:
        fleet.close()
    if cfg.backend == "memory":
        for name, count in fleet.net.faults.items():
            if count:
                events.append({"type": "fault", "kind": name, "count": count})
    failures = fleet.errors if isinstance(fleet, MemoryFleet) else fleet.failures()
    summary = summarize(
        cfg,
        fleet.peers_dir,
        events,
        [name_of(i) for i in fleet.started],
        {name_of(i) for i in fleet.killed},
        time.monotonic() - started,
        failures,
    )
    plot_losses(fleet.peers_dir, events, cfg.out / "loss.png")
    return summary
