"""One peer's life from start to exit, as ``spes-join`` and the simulator's peer processes both run it:
open the transport, build the peer, join (or resume), wait for the first peers, train rounds until stopped,
serve the last round until the others have it, then release the claims and leave.

A front end (the terminal view of ``spes-join``, or plain log lines) follows along through ``Frontend``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import psutil

from spes_p2p.errors import SpesError
from spes_p2p.files import writable_folder
from spes_p2p.net.reachability import Reachability
from spes_p2p.net.transport import Transport
from spes_p2p.peer import joining
from spes_p2p.peer.admission import admit
from spes_p2p.peer.node import Peer, PeerStatus
from spes_p2p.peer.setup import founded_from, open_transport
from spes_p2p.peer.status import live_addresses, swarm_summary, write_invite
from spes_p2p.settings import Settings
from spes_p2p.train.device import resolve_device
from spes_p2p.train.fit import KNOBS, check_fits, peer_plan

logger = logging.getLogger(__name__)


class Frontend:
    """What a peer shows while it lives; this default writes log lines."""

    def phase(self, text: str) -> AbstractContextManager:
        logger.info(text)
        return contextlib.nullcontext()

    def started(self, peer: Peer) -> None:
        """The peer exists (it has not joined yet)."""

    def joined(self, status: PeerStatus, reachability: Reachability, resumed: Path | None) -> None:
        if resumed:
            logger.info("resumed from %s; now at the swarm's round %d", resumed, status.round)
        logger.info("peer %s holding %s; dial it at %s", status.peer_id, status.units, status.addresses)
        logger.info("%s", reachability.message)

    def update(self, status: PeerStatus) -> None:
        """After joining, and after every round."""
        logger.info("at round %d: loss %s", status.round, status.loss)

    def left(self, status: PeerStatus) -> None:
        logger.info("left the swarm after round %d", status.round)

    def serving(self, url: str) -> None:
        """The swarm's dashboard is up (``--dashboard PORT``)."""
        logger.info("the swarm's dashboard: %s", url)


def live(
    settings: Settings, stop: threading.Event, ui: Frontend | None = None, transport: Transport | None = None
) -> PeerStatus | None:
    """Runs one peer until ``stop`` is set or ``run.rounds`` are done; returns its final status (None when
    stopped before it was admitted). Without a ``transport``, it opens the one the settings name (and counts
    its start-up from the process's start)."""
    ui = ui or Frontend()
    settings = founded_from(settings)
    preflight(settings, identity=transport is None)
    startup = Startup(since_process_start=transport is None)
    if transport is None:
        with ui.phase("Starting the peer and joining the swarm..."):
            transport = open_transport(settings, new_swarm=settings.run.new_swarm)
    transport.guard.allow_only(settings.swarm.allowlist)
    startup.mark("transport")
    peer = None
    try:
        peer = _prepare(settings, transport, stop, ui, startup)
        if peer is None:
            return None
        with _dashboard(peer, ui):  # (before joining: a port in use stops the peer before it claims)
            _join(peer, stop, ui, startup)
            peer.run(stop, on_update=ui.update, rounds=peer.settings.run.rounds)
            if not stop.is_set():
                with ui.phase("Serving the last round until the others have it..."):
                    peer.drain(peer.sync.longest_wait())
        final = peer.status()
    finally:
        with ui.phase("Releasing claims and leaving..."):
            if peer is not None:
                peer.close()
            else:
                transport.shutdown()
    ui.left(final)
    return final


@contextlib.contextmanager
def _dashboard(peer: Peer, ui: Frontend) -> Iterator[None]:
    """``--dashboard PORT``: the swarm's page, served from this peer while it trains (reading the swarm's
    records on a thread of its own)."""
    cfg = peer.settings.dashboard
    if not cfg.port:
        yield
        return
    from spes_p2p.dashboard.server import Dashboard

    run_id = peer.settings.swarm.run_id
    with Dashboard(lambda: swarm_summary(peer.transport, run_id, peer.manifest), cfg.host, cfg.port) as board:
        ui.serving(board.url)
        yield


class Startup:
    """Seconds from the start (of the process, or of ``live``) to each milestone of a peer's start-up."""

    def __init__(self, since_process_start: bool) -> None:
        self.t0 = psutil.Process().create_time() if since_process_start else time.time()
        self.marks: dict[str, float] = {}

    def mark(self, milestone: str) -> None:
        self.marks[milestone] = round(time.time() - self.t0, 2)


def _prepare(
    settings: Settings, transport: Transport, stop: threading.Event, ui: Frontend, startup: Startup
) -> Peer | None:
    """Admission (a newcomer adopts the swarm's manifest), then the model, the data and the peer; None when
    stopped during admission."""
    admission = None
    if not settings.run.new_swarm:
        with ui.phase("Reading the swarm's manifest..."):
            try:
                admission = admit(settings, transport, stop)
            except SpesError:
                if not stop.is_set():
                    raise
                logger.info("stopped before joining the swarm")  # (the waits it was in gave up)
                return None
        settings = admission.settings
    startup.mark("manifest")
    with ui.phase("Preparing the model and the data..."):
        peer = Peer(settings, transport, Path(settings.run.out) if settings.run.out else None, admission)
    startup.mark("model_and_data")
    ui.started(peer)
    return peer


def _join(peer: Peer, stop: threading.Event, ui: Frontend, startup: Startup) -> None:
    """Joins at the round asked for, writes what others need (addresses, an invite), and waits for the first
    peers; the start-up's milestones go to OUT/startup.json."""
    run = peer.settings.run
    if run.join_round:
        with ui.phase(f"Waiting for the swarm to reach round {run.join_round}..."):
            joining.wait_for_round(peer.member, run.join_round, run.wait_seconds, stop)
    status = peer.join(resume=run.resume, mark=startup.mark)
    startup.mark("joined")
    logger.info("start-up, seconds since launch: %s", startup.marks)
    if run.out:
        (Path(run.out) / "startup.json").write_text(json.dumps(startup.marks))
    if run.addr_file:
        _write_lines(Path(run.addr_file), status.addresses)
    if run.invite:
        addresses = status.addresses + live_addresses(peer.transport, peer.settings.swarm.run_id)
        write_invite(Path(run.invite), peer.settings, peer.manifest, list(dict.fromkeys(addresses)))
    ui.joined(status, peer.reachability.check(), peer.resumed_from)
    if run.min_peers > 1:
        with ui.phase(f"Waiting for {run.min_peers} peers..."):
            joining.wait_for_peers(peer.member, run.min_peers, run.wait_seconds, stop)
        joining.settle_founders(peer.member, peer.round)
    ui.update(peer.status())


def preflight(settings: Settings, identity: bool = True) -> None:
    """What can be checked before anything starts: the run folder and the identity's can be written, and the
    model fits the memory of the device it trains on (with the units this peer may train at most)."""
    if settings.run.out:
        writable_folder(Path(settings.run.out), "--out")
    key = Path(settings.network.identity).expanduser()
    if identity and not key.exists():
        writable_folder(key.parent, "the folder of --identity")
    model = settings.model
    # a newcomer adopts the swarm's shards and dense blocks: only its founder may choose them
    knobs = KNOBS if settings.run.new_swarm else ("frozen_experts",)
    device = resolve_device(settings.train.device)
    check_fits(model.preset, model.architecture(), peer_plan(settings), device, knobs=knobs)


def stop_on_signals() -> threading.Event:
    """SIGINT and SIGTERM ask for a clean stop (the peer leaves in order); a second one stops at once.
    SIGUSR1 writes every thread's stack to stderr (where a peer that does not leave is stuck)."""
    stop = threading.Event()
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)

    def handle(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        logger.warning("%s: leaving the swarm...", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop


def _write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
    logger.info("wrote %d address(es) to %s", len(lines), path)
