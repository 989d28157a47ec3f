"""Runs a simulated swarm: starts the peers (a fleet: ``fleets.py``, or ``netfleet.py`` with a network
namespace per peer), fires kills, churn, joins and faults as the swarm's round advances (``director``), and
waits (bounded) until every live peer has reached the last round.

Every peer lives through the library's one life cycle (``spes_p2p.peer.life.live``): in its own process
(``python -m spes_p2p.peer peerI.toml``, hivemind backend) or on a thread of this process (memory backend).
A restart (churn) is a new life of the same peer: the same run folder and identity, with ``--resume``.

Layout of the output folder::

    OUT/peers/peerI/    each peer's run folder (metrics.jsonl, state.json, model.safetensors, checkpoints/)
    OUT/logs/peerI.log  each process's output (hivemind backend; a restart appends to it)
    OUT/keys/           each process's settings, identity key and address file (hivemind backend)
    OUT/summary.json    OUT/loss.png
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from spes_p2p.errors import SpesError
from spes_p2p.files import writable_folder
from spes_p2p.settings import Settings, load_settings
from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS, name_of
from spes_p2p.sim.director import Director
from spes_p2p.sim.fleets import Fleet, MemoryFleet, ProcessFleet
from spes_p2p.sim.netfleet import NetnsFleet
from spes_p2p.sim.summary import plot_losses, summarize

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2


# ---------------------------------------------------------------------------------------------- the run


def simulation(changes: dict | None = None) -> Settings:
    """A simulation's settings: ``spes simulate``'s defaults with ``{'section.field': value}`` changes."""
    return load_settings(None, changes, defaults=LOCAL_SWARM_DEFAULTS)


def run(settings: Settings, on_tick: Callable[[dict], None] | None = None) -> dict:
    """Runs the simulation to its last round (``run.rounds``); returns the summary (also written to
    OUT/summary.json)."""
    with _terminate_as_interrupt():
        return _run(settings, on_tick)


def _run(settings: Settings, on_tick: Callable[[dict], None] | None) -> dict:
    out = writable_folder(Path(settings.run.out), "--out")
    fleet_class = _fleet_class(settings)
    fleet_class.check_machine(settings)  # before an earlier run's results are removed
    shutil.rmtree(out / "peers", ignore_errors=True)  # a fresh simulation: no rows of an earlier one
    fleet = fleet_class(settings)
    director = Director(settings, fleet)
    started = time.monotonic()
    deadline = started + fleet_class.budget_seconds(settings)
    try:
        director.start()
        while not fleet.finished():
            rounds = fleet.rounds()
            director.tick(max(rounds.values(), default=0), min(rounds.values(), default=0))
            if on_tick:
                on_tick(_tick(fleet, rounds, director.events, time.monotonic() - started))
            if time.monotonic() > deadline:
                raise SpesError(f"the simulation did not finish within {deadline - started:.0f}s; see {out}")
            if fleet.failures():
                break  # the run has failed: stop now, rather than let the others wait for the peer gone
            time.sleep(POLL_SECONDS)
    finally:
        failures = fleet.failures()  # (taken before the close: a peer the close stops has not failed)
        fleet.close()
    leftovers = fleet.leftovers()
    events = director.events + [
        {"type": "fault", "kind": k, "count": n} for k, n in fleet.faults().items() if n
    ]
    names = [name_of(i) for i in fleet.started]
    killed = {name_of(i) for i in fleet.killed}
    seconds = time.monotonic() - started
    summary = summarize(
        settings, fleet.peers_dir, events, names, killed, seconds, failures, leftovers, fleet.served()
    )
    plot_losses(fleet.peers_dir, events, out / "loss.png")
    return summary


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM stops a simulation as Ctrl-C does: its peers are stopped and what it created is removed (the
    default would end this process at once, leaving its peers running)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _fleet_class(settings: Settings) -> type[Fleet]:
    if settings.swarm.backend == "memory":
        return MemoryFleet
    if settings.sim.netns:
        return NetnsFleet
    return ProcessFleet


def _tick(fleet: Fleet, rounds: dict[int, int], events: list[dict], elapsed: float) -> dict:
    return {
        "rounds": {name_of(i): r for i, r in rounds.items()},
        "events": list(events),
        "elapsed": elapsed,
        "killed": [name_of(i) for i in fleet.killed],
    }
