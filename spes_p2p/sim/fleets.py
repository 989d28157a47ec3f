"""Fleets: the peers of a simulation and their lives. ``MemoryFleet`` runs every peer on a thread of this
process, on one in-memory network; ``ProcessFleet`` starts each as its own process (what
``python -m spes_p2p.peer peerI.toml`` runs, forked from the run's ``launcher``); ``netfleet.NetnsFleet`` puts
each process in a network namespace.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from spes_p2p.errors import SpesError
from spes_p2p.settings import Settings
from spes_p2p.sim.config import name_of
from spes_p2p.sim.launcher import Launched, Launcher
from spes_p2p.sim.processes import kill_all, still_running, stop_process_groups, tree_of
from spes_p2p.sim.summary import read_rows
from spes_p2p.train.checkpoint import list_checkpoints

logger = logging.getLogger(__name__)

# many peers share a few cores: one math thread each leaves CPU for their p2p daemons and DHT processes
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STARTUP_SECONDS = 120.0  # a process's start, its model and its data
ROUND_BUDGET_SECONDS = 120.0  # a generous bound on one round, for a simulation's overall deadline
# the memory backend runs every peer in one process, whose sync work (coding, hashing, quantized copies:
# 0.3 to 3.6 CPU-seconds a peer and round for a model of 100k parameters, more as the peers grow) the
# interpreter's lock serializes: past this many peers, a round's budget grows with them
MEMORY_PEERS_PER_BUDGET = 32
GONE_SECONDS = 10.0  # after the run, how long the processes of killed and stopped peers may take to vanish


class Fleet(ABC):
    """The simulated peers, whatever runs them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.out = Path(settings.run.out)
        self.peers_dir = self.out / "peers"
        self.peers_dir.mkdir(parents=True, exist_ok=True)
        self.killed: set[int] = set()  # peers down now (killed, not restarted)
        self.started: list[int] = []
        self.join_rounds: dict[int, int] = {}  # peer -> the swarm round it joins at
        # peer -> its rows and its newest checkpoint when its life began
        self.at_start: dict[int, tuple[int, str]] = {}

    def peer_settings(self, index: int, join_round: int | None, changes: dict | None = None) -> Settings:
        """Peer ``index``'s own settings: its run folder, and when it joins (None: with the first peers, who
        wait for each other; newcomers and restarts do not). Under churn every peer checkpoints every round:
        a restart resumes from its newest checkpoint."""
        self.join_rounds[index] = join_round or 0
        settings = self.settings
        every = settings.train.checkpoint_every
        if settings.sim.churn:
            every = min(every, settings.method.steps_per_round)
        changes = changes or {}
        first = join_round is None and not changes.get("run.resume")
        own = {
            "run.out": str(self.peers_dir / name_of(index)),
            "run.min_peers": settings.sim.peers if first else 1,
            "run.join_round": join_round or 0,
            "run.new_swarm": not self.started,
            "run.resume": False,
            "train.checkpoint_every": every,
        }
        return settings.override({**own, **changes, **settings.sim.overrides.get(index, {})})

    def begin_life(self, index: int) -> None:
        """Bookkeeping of a peer's (re)start."""
        self.at_start[index] = self._progress(index)
        if index not in self.started:
            self.started.append(index)

    @abstractmethod
    def start(self, index: int, join_round: int | None = None, resume: bool = False) -> None:
        """Starts peer ``index``: one of the first peers, a newcomer that joins at ``join_round``, or (with
        ``resume``) a killed peer again, from its newest checkpoint."""

    def restart(self, index: int) -> None:
        """A killed peer's new life, with ``--resume``: the same run folder and identity, so the same id."""
        _end_torn_row(self.peers_dir / name_of(index))
        self.killed.discard(index)
        self.start(index, resume=True)

    def in_swarm(self, index: int) -> bool:
        """Whether the peer has written a round's row and a checkpoint since its (re)start."""
        rows, checkpoint = self._progress(index)
        rows_then, checkpoint_then = self.at_start[index]
        return rows > rows_then and checkpoint not in ("", checkpoint_then)

    def _progress(self, index: int) -> tuple[int, str]:
        folder = self.peers_dir / name_of(index)
        checkpoints = list_checkpoints(folder)
        return len(read_rows(folder)), checkpoints[-1].name if checkpoints else ""

    @abstractmethod
    def alive(self, index: int) -> bool: ...

    @abstractmethod
    def kill(self, index: int) -> None: ...

    @abstractmethod
    def failures(self) -> list[str]: ...

    @abstractmethod
    def leftovers(self) -> list[str]:
        """After ``close``: what of the run still runs (it should be nothing)."""

    def rounds(self) -> dict[int, int]:
        """Live peers' current rounds (the number of rounds they have completed)."""
        return {i: _round_of(self.peers_dir / name_of(i)) for i in self.started if self.alive(i)}

    def partition(self, groups: tuple[tuple[int, ...], ...] | None) -> None:
        raise SpesError("network faults need --backend memory")

    def faults(self) -> dict[str, int]:
        return {}

    def served(self) -> dict[str, int] | None:
        """The value bytes each DHT key's reads returned, counted at the store (the memory backend); None
        where the store is out of reach (a real backend's keepers: its readers count instead)."""
        return None

    def finished(self) -> bool:
        return not any(self.alive(i) for i in self.started)

    def close(self) -> None:  # noqa: B027 - most fleets have nothing to close
        pass

    @staticmethod
    def check_machine(settings: Settings) -> None:
        """Raises a SpesError naming what this machine lacks to run the fleet."""
        return

    @staticmethod
    def budget_seconds(settings: Settings) -> float:
        """A bound on the whole simulation, past which it counts as hung."""
        return STARTUP_SECONDS + settings.run.rounds * ROUND_BUDGET_SECONDS


def _round_of(folder: Path) -> int:
    rows = read_rows(folder)
    return rows[-1]["round"] + 1 if rows else 0


def _end_torn_row(folder: Path) -> None:
    """Ends a metrics row that a kill cut short, so the restarted peer's first row starts on a line of its
    own (the torn one is then skipped, as ``read_rows`` skips it)."""
    path = folder / "metrics.jsonl"
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


# ------------------------------------------------------------------------------------------ memory backend


@dataclass
class Life:
    """One life of a peer on the memory backend: its thread, its stop, and the peer once built."""

    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    peer: object = None
    killed: bool = False


class MemoryFleet(Fleet):
    """Every peer on a thread of this process, on one MemoryNetwork; a kill makes a peer vanish mid-round,
    a restart is a new thread whose transport has the peer's name (its id)."""

    def __init__(self, settings: Settings) -> None:
        from spes_p2p.net.memory import MemoryNetwork

        super().__init__(settings)
        sim = settings.sim
        self.net = MemoryNetwork(seed=settings.train.seed)
        self.net.drop, self.net.delay, self.net.corrupt = sim.drop, sim.delay_ms / 1000, sim.corrupt
        self.net.gossip_drop = sim.gossip_drop
        self.lives: dict[int, Life] = {}  # peer -> its current life
        self.history: list[tuple[int, Life]] = []  # every life, killed ones too
        self.errors: list[str] = []

    @staticmethod
    def budget_seconds(settings: Settings) -> float:
        return Fleet.budget_seconds(settings) * max(1.0, settings.sim.total_peers / MEMORY_PEERS_PER_BUDGET)

    def start(self, index: int, join_round: int | None = None, resume: bool = False) -> None:
        settings = self.peer_settings(index, join_round, {"run.resume": resume})
        life = self.lives[index] = Life()
        self.history.append((index, life))
        life.thread = threading.Thread(
            target=self._live, args=(index, settings, life), name=name_of(index), daemon=True
        )
        self.begin_life(index)
        life.thread.start()

    def restart(self, index: int) -> None:
        old = self.lives[index]
        old.thread.join(timeout=30)  # (a crashed peer's thread ends at once; it writes nothing more)
        super().restart(index)

    def _live(self, index: int, settings: Settings, life: Life) -> None:
        from spes_p2p.peer.life import Frontend, live

        class Tracked(Frontend):
            def started(self, peer) -> None:
                life.peer = peer

        transport = self.net.join(name_of(index))
        mode = self.settings.sim.byzantine_peers.get(index)
        if mode:
            from spes_p2p.sim.byzantine import ByzantineTransport

            transport = ByzantineTransport(transport, mode, self.settings)
        try:
            live(settings, life.stop, Tracked(), transport=transport)
        except Exception as exc:  # a killed peer may fail in any way; a live one must not
            if not life.killed:
                logger.exception("%s failed", name_of(index))
                self.errors.append(f"{name_of(index)}: {exc}")

    def alive(self, index: int) -> bool:
        life = self.lives[index]
        return not life.killed and life.thread.is_alive()

    def rounds(self) -> dict[int, int]:
        return {
            i: life.peer.round for i, life in self.lives.items() if life.peer is not None and self.alive(i)
        }

    def kill(self, index: int) -> None:
        self.killed.add(index)
        life = self.lives[index]
        life.killed = True
        if life.peer is not None:
            life.peer.crash()
            life.peer.outputs = None  # a killed process writes nothing more: no row, no checkpoint
        life.stop.set()

    def partition(self, groups: tuple[tuple[int, ...], ...] | None) -> None:
        if groups is None:
            self.net.heal()
        else:
            self.net.partition(*[[name_of(i) for i in g] for g in groups])

    def faults(self) -> dict[str, int]:
        return dict(self.net.faults)

    def served(self) -> dict[str, int]:
        return dict(self.net.served)

    def failures(self) -> list[str]:
        return list(self.errors)

    def close(self) -> None:
        for _, life in self.history:
            life.stop.set()
        for _, life in self.history:
            life.thread.join(timeout=30)

    def leftovers(self) -> list[str]:
        return [f"thread of {name_of(i)}" for i, life in self.history if life.thread.is_alive()]


# --------------------------------------------------------------------------------------- hivemind backend


class ProcessFleet(Fleet):
    """Real peer processes on 127.0.0.1 (``python -m spes_p2p.peer``, forked from the run's launcher), the
    first founding the swarm, each in a session of its own; a kill is a SIGKILL of the peer, its DHT process
    and its p2pd."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.keys = self.out / "keys"
        for folder in (self.out / "logs", self.keys):
            folder.mkdir(parents=True, exist_ok=True)
        for stale in self.keys.glob("*.addr"):  # an earlier run's: peers would dial dead addresses
            stale.unlink()
        env = {**os.environ, **SINGLE_THREADED, "PYTHONUNBUFFERED": "1"}
        self.launcher = Launcher(settings.swarm.backend, env, str(self.out))
        self.procs: dict[int, Launched] = {}  # peer -> the process of its current life
        self.sessions: list[int] = []  # the session of every life (its first pid), killed ones too
        self.seen: list = []  # their processes (psutil), as last seen before a kill or the close

    def start(self, index: int, join_round: int | None = None, resume: bool = False) -> None:
        name = name_of(index)
        settings = self.peer_settings(
            index,
            join_round,
            {
                "run.resume": resume,
                "network.identity": str(self.keys / f"{name}.key"),
                "run.addr_file": str(self.keys / f"{name}.addr"),
                "run.log_level": "info",
                **self._network(index),
            },
        )
        config = self.keys / f"{name}.toml"
        config.write_text(settings.to_toml())
        self.procs[index] = self._launch(index, config, append=resume)
        self.sessions.append(self.procs[index].pid)
        self.begin_life(index)
        if len(self.started) == 1 and not resume:
            self._wait_for_address(index)

    def _network(self, index: int) -> dict:
        """Peer ``index``'s network settings: on 127.0.0.1 (the defaults), joining through the live peers."""
        return {"swarm.initial_peers": self._live_addresses() if self.started else ()}

    def _netns(self, index: int) -> str | None:
        """The network namespace peer ``index`` runs in (None: this machine's)."""
        return None

    def _launch(self, index: int, config: Path, append: bool = False) -> Launched:
        """Peer ``index``'s process, in a session of its own, its output in OUT/logs/NAME.log."""
        log = self.out / "logs" / f"{name_of(index)}.log"
        if append:
            with open(log, "a") as f:
                f.write("\n--- restarted with --resume ---\n")
        mode = self.settings.sim.byzantine_peers.get(index)
        if mode:
            module, argv = "spes_p2p.sim.byzantine", [str(config), mode]
        else:
            module, argv = "spes_p2p.peer.__main__", [str(config)]
        return self.launcher.spawn(module, argv, log, append, self._netns(index))

    def _wait_for_address(self, index: int) -> str:
        path = self.keys / f"{name_of(index)}.addr"
        deadline = time.monotonic() + STARTUP_SECONDS
        while not path.exists():
            if self.procs[index].poll() is not None or time.monotonic() > deadline:
                log = (self.out / "logs" / f"{name_of(index)}.log").read_text()[-2000:]
                raise SpesError(f"{name_of(index)} did not start:\n{log}")
            time.sleep(0.2)
        return self._read_address(index)

    def _live_addresses(self) -> tuple[str, ...]:
        """An address of every live peer that has written one (at least one: the first peer's), so that a
        peer joins even when the one it would have dialed dies meanwhile."""
        live = [i for i in self.started if self.alive(i)]
        found = tuple(self._read_address(i) for i in live if (self.keys / f"{name_of(i)}.addr").exists())
        if found:
            return found
        if not live:
            raise SpesError("no live peer to join through")
        return (self._wait_for_address(live[0]),)

    def _read_address(self, index: int) -> str:
        return (self.keys / f"{name_of(index)}.addr").read_text().split()[0]

    def alive(self, index: int) -> bool:
        return self.procs[index].poll() is None

    def kill(self, index: int) -> None:
        """SIGKILL to the peer and every process of its tree (its DHT process and p2pd have a process group
        of their own), all at once."""
        self.killed.add(index)
        proc = self.procs[index]
        if self.alive(index):
            tree = tree_of(proc.pid)
            self.seen += tree
            kill_all(tree)
            proc.wait(timeout=10)
        (self.keys / f"{name_of(index)}.addr").unlink(missing_ok=True)  # nobody should dial it now

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                self.seen += tree_of(proc.pid)
        try:
            stop_process_groups(self.procs.values())
        finally:
            self.launcher.close()

    def leftovers(self) -> list[str]:
        """Processes of the run still running after ``close``: any in a peer's session, or any seen in a
        peer's tree (zombies do not count, they are gone); given ``GONE_SECONDS`` to vanish."""
        deadline = time.monotonic() + GONE_SECONDS
        while (left := still_running(self.seen, set(self.sessions))) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def failures(self) -> list[str]:
        """A peer's current life that exited with an error (a killed life is not one; its restart is)."""
        return [
            f"{name_of(i)} exited with {p.returncode}"
            for i, p in self.procs.items()
            if i not in self.killed and p.poll() not in (0, None)
        ]
