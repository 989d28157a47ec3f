"""A round's sync, from the end of its training until it lands.

``RoundJob`` (``job.py``) is what the training thread hands over. ``RoundSync`` does the sync's work on it:
exchange each trained unit's update and serve the new weights, then (``frozen``) publish their versions,
refresh the frozen copies and merge when due. It reads the swarm view and the job; it never touches the
model. ``Pipeline`` runs it in the background while the next round trains (overlap), or at once, and hands
finished jobs back for landing.

Threads: a job belongs to the sync thread from ``submit`` until ``take`` returns it to the training thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from spes_p2p.errors import SpesError
from spes_p2p.model.units import UnitLayout
from spes_p2p.peer.frozen import FrozenCopies
from spes_p2p.peer.job import RoundJob
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import SwarmMember, SwarmView
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.exchange import dense_group
from spes_p2p.sync.jobs import UnitJob, UnitResult

logger = logging.getLogger(__name__)

SYNC_MARGIN_SECONDS = 60.0

Tensors = dict[str, torch.Tensor]


class RoundSync:
    def __init__(
        self,
        settings: Settings,
        member: SwarmMember,
        sync: SyncEngine,
        layout: UnitLayout,
        read: Callable[[str], Tensors] | None = None,
        probe: Callable[..., list[float]] | None = None,
    ) -> None:
        """``read``: our weights of a unit; ``probe``: ``LocalTraining.probe``, which measures the validation
        loss of candidate weights (None with virtual compute: updates are then screened without it)."""
        self.settings, self.member, self.sync, self.layout = settings, member, sync, layout
        self.me, self.probe = member.me, probe
        self.frozen = FrozenCopies(settings, member, sync, layout, read, probe)

    def __call__(self, job: RoundJob) -> None:
        try:
            view = self.member.view()
            starts = dict(job.start)  # (the probes measure every unit at its start weights)
            for unit in job.units:
                job.results[unit] = self._exchange(job, unit, view, starts)
                del job.start[unit]  # (snapshots go as soon as their arithmetic is done)
                self.sync.serve_weights(job.round, unit, job.results[unit].new_weights)
            self.frozen.publish(job, view)
            self.frozen.refresh(job, view)
            self.sync.sample()  # the refreshed copies are decoded, not landed yet
            if job.experts is not None:
                self.frozen.merge(job)
                job.experts = None
                for unit, result in job.results.items():
                    self.sync.serve_weights(job.round, unit, result.new_weights)
        except BaseException as exc:  # re-raised on the training thread when the job lands
            job.error = exc

    def _exchange(self, job: RoundJob, unit: str, view: SwarmView, starts: dict[str, Tensors]) -> UnitResult:
        """The unit's round: its participants are its holders in that round, or (the dense part, and every
        unit in DiLoCo) our row of the round's random grid of them; a unit we started to hold since then does
        not count."""
        counted = self.member.since_of(unit) <= job.round
        participants = sorted(view.participants(unit, job.round) | {self.me})
        grouped = unit.startswith("dense/") or self.settings.method.mode == "diloco"
        grid = ()
        if grouped:  # a newcomer that does not count yet follows a row it is not a member of
            members = view.members(unit, job.round) | {self.me}
            grid = self.sync.grid([p for p in members if counted or p != self.me], job.round)
            participants = dense_group(grid, self.me)
        start, end = job.start[unit], job.end[unit]
        probe = self.probe and partial(self.probe, job.round, unit, starts)
        return self.sync.exchange(
            UnitJob(job.round, unit, start, end, job.tokens, participants, counted, grouped, probe, grid)
        )

    def bound(self, job: RoundJob) -> float:
        """Seconds a job's sync can take when every wait runs to its limit (each unit's exchange, a download,
        a version, the refresh), with a margin: past it, the sync is broken, not slow."""
        waits = 8 * len(job.units) + 1  # a reduce-scatter: pieces, its second part, merging, parts, fallbacks
        return self.sync.worst_case(waits) + SYNC_MARGIN_SECONDS


class Pipeline:
    """Runs each round's sync: on a background thread with overlap, on the caller's without."""

    def __init__(self, work: RoundSync, overlap: bool) -> None:
        self.work, self.overlap = work, overlap
        self.in_flight: RoundJob | None = None

    def submit(self, job: RoundJob) -> RoundJob | None:
        """Starts the job's sync; returns it when it is already done (without overlap)."""
        if not self.overlap:
            waited = time.perf_counter()
            self.work(job)
            job.metrics["sync_wait_seconds"] = time.perf_counter() - waited
            return job
        job.thread = threading.Thread(target=self.work, args=(job,), name="spes-sync", daemon=True)
        self.in_flight = job
        job.thread.start()
        return None

    def held(self) -> dict[str, list]:
        job = self.in_flight
        return job.held() if job is not None else {}

    def finished(self) -> bool:
        return self.in_flight is not None and not self.in_flight.thread.is_alive()

    def take(self) -> RoundJob | None:
        """The job in flight, once its sync is done (waiting for it); None when there is none."""
        job, self.in_flight = self.in_flight, None
        if job is not None:
            waited = time.perf_counter()
            job.thread.join(self.work.bound(job))
            if job.thread.is_alive():
                raise SpesError(f"the sync of round {job.round} did not end within its bound; it is stuck")
            job.metrics["sync_wait_seconds"] = time.perf_counter() - waited  # training was blocked this long
        return job
