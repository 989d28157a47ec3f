"""A round's sync, from the end of its training until it lands.

``RoundJob`` is what the training thread hands over: snapshots of the trained units at the round's start
and end (and of the frozen experts, when a merge is due), its tokens and metrics. ``RoundSync`` does the
sync's work on it: exchange each trained unit's update, merge when due, serve the new weights, refresh the
frozen copies. It reads the swarm view and the job; it never touches the model. ``Pipeline`` runs it in the
background while the next round trains (overlap), or at once, and hands finished jobs back for landing.

Threads: a job belongs to the sync thread from ``submit`` until ``take`` returns it to the training thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from spes_p2p.errors import SpesError
from spes_p2p.model.units import UnitLayout
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import SwarmMember, SwarmView
from spes_p2p.swarm.outcome import tensors_hash
from spes_p2p.swarm.refresh import Fetched, Want
from spes_p2p.swarm.sync import SyncEngine, UnitRound, dense_group
from spes_p2p.swarm.versions import is_version_round
from spes_p2p.train.merge import merge_experts

logger = logging.getLogger(__name__)

SYNC_MARGIN_SECONDS = 60.0

Tensors = dict[str, torch.Tensor]


@dataclass
class RoundJob:
    round: int
    units: list[str]  # the units trained this round
    start: dict[str, Tensors]  # where each unit's update is measured from
    end: dict[str, Tensors]  # the local end-of-round weights
    tokens: int
    metrics: dict
    experts: Tensors | None = None  # when a merge is due: every expert weight this peer did not train
    results: dict[str, UnitRound] = field(default_factory=dict)  # trained units
    refreshed: dict[str, Fetched] = field(default_factory=dict)  # frozen copies, and units trained next
    error: BaseException | None = None
    thread: threading.Thread | None = None


class RoundSync:
    def __init__(self, settings: Settings, member: SwarmMember, sync: SyncEngine, layout: UnitLayout) -> None:
        self.settings, self.member, self.sync, self.layout = settings, member, sync, layout
        self.me = member.transport.peer_id
        self.every = settings.method.refresh_every_rounds

    def __call__(self, job: RoundJob) -> None:
        try:
            view = self.member.view()
            for unit in job.units:
                job.results[unit] = self._exchange(job, unit, view)
                self.sync.serve_weights(job.round, unit, job.results[unit].new_weights)
            versions = is_version_round(job.round, self.every)
            if versions and self.settings.sync.frozen_refresh == "changes":
                self._publish_versions(job, view)
            self._refresh(job, view, versions)
            if job.experts is not None:
                self._merge(job)
                for unit, result in job.results.items():
                    self.sync.serve_weights(job.round, unit, result.new_weights)
        except BaseException as exc:  # re-raised on the training thread when the job lands
            job.error = exc

    def _exchange(self, job: RoundJob, unit: str, view: SwarmView) -> UnitRound:
        counted = self.member.since_of(unit) <= job.round
        participants = sorted(view.participants(unit, job.round) | {self.me})
        grouped = unit.startswith("dense/") or self.settings.method.mode == "diloco"
        if grouped:  # a newcomer that does not count yet follows a group it is not a member of
            members = participants if counted else [p for p in participants if p != self.me]
            size = self.settings.sync.dense_group_size
            participants = dense_group(members, self.me, job.round, self.settings.swarm.run_id, size)
        result = self.sync.exchange(
            job.round, unit, job.start[unit], job.end[unit], job.tokens, participants, counted, grouped
        )
        if result.download:  # kept off the swarm's weights: take a participant's result of this round
            self.sync.refresh(
                job.round,
                {unit: [p for p in participants if p != self.me]},
                self.sync.deadline.seconds(),
                want=Want("weights", "none"),
                on_unit=lambda _, fetched: result.new_weights.update(fetched.tensors),
            )
        return result

    def _publish_versions(self, job: RoundJob, view: SwarmView) -> None:
        """The next version of each unit we trained that others keep frozen copies of; a unit whose version
        chain we lack (we just took it over) joins a co-holder's first."""
        since = job.round - self.every
        for unit, result in job.results.items():
            if not self._versioned(unit):
                continue
            current = self.sync.versions.current(unit)
            if current is None or current.round < since:
                self.sync.refresh(
                    since,
                    {unit: sorted(view.participants(unit, job.round) - {self.me})},
                    self.sync.deadline.seconds(),
                    want=Want("version", "none"),
                    on_unit=lambda u, fetched: self.sync.versions.start(u, fetched.round, fetched.tensors),
                )
                current = self.sync.versions.current(unit)
            if current is None or current.round < job.round:
                self.sync.versions.advance(unit, job.round, since, result.new_weights)

    def _versioned(self, unit: str) -> bool:
        """Whether some peers keep a frozen copy of ``unit``: an expert shard, or a dense block of several."""
        if self.settings.method.mode == "diloco":
            return False
        return unit.startswith("experts/") or len(self.layout.dense_units) > 1

    def _refresh(self, job: RoundJob, view: SwarmView, versions: bool) -> None:
        """The units we start training next (their weights, exactly), and at a version round our frozen
        copies of every other unit."""
        frozen = {
            u: sorted(view.participants(u, job.round) - {self.me})
            for u in self.layout.units
            if u not in job.units and (versions or u in self.member.units_held)
        }
        got = self.sync.refresh(
            job.round,
            frozen,
            self.sync.deadline.seconds(),
            want={u: self._want(u, job) for u in frozen},
            on_unit=lambda unit, fetched: job.refreshed.__setitem__(unit, fetched),
        )
        for unit, holders in frozen.items():
            if holders:
                self.member.served(unit, unit in got)

    def _want(self, unit: str, job: RoundJob) -> Want:
        """Exact weights of a unit we are about to train. For a frozen copy: the change since its version
        (or, when it is not one, the exact version); held quantized, the version in its own format. At a
        merge, every peer needs this round's version of every expert alike: exact ones."""
        if unit in self.member.units_held:
            return Want("weights", "none")
        sync, stored = self.settings.sync, self.settings.train.frozen_experts
        quantized = unit.startswith("experts/") and stored != "full"
        if sync.frozen_refresh == "weights":  # (a merge: every peer in the same codec)
            return Want("weights", stored if quantized and job.experts is None else sync.refresh_codec)
        if quantized:
            return Want("version", "none" if job.experts is not None else stored)
        copy = self.sync.copies.get(unit)
        if copy is not None and copy[0] == job.round - self.every:
            return Want("change", sync.refresh_codec, copy)
        return Want("version", "none")

    def landed(self, unit: str, fetched: Fetched, weights: Tensors) -> None:
        """A refreshed copy was written: it is a version exactly when it was one (or a change to ours) and
        it is kept in full precision."""
        exact = fetched.want.kind == "change" or fetched.want == Want("version", "none")
        stored_exactly = not unit.startswith("experts/") or self.settings.train.frozen_experts == "full"
        if exact and stored_exactly:
            self.sync.copies.set(unit, fetched.round, tensors_hash(weights))
        else:
            self.sync.copies.forget(unit)

    def _merge(self, job: RoundJob) -> None:
        """The expert-merging warm-up, on every expert's version of this round (ours as we published it,
        the others' as our refreshed copies have it): every peer computes the same correction, whatever
        it stores its frozen experts as, and adds it to the experts it trained."""
        versions: Tensors = {}
        for unit in self.layout.expert_units:
            weights = self._version_of(unit, job)
            if weights is None:
                logger.info("round %d: no version of %s this round; no merge", job.round, unit)
                return
            versions.update(weights)
        step = (job.round + 1) * self.settings.method.steps_per_round
        n = self.layout.experts_per_shard
        owned = {
            int(u.split("/")[1]) * n + i for u in job.results if u.startswith("experts/") for i in range(n)
        }
        merged = merge_experts(
            versions, self.settings.merge.alpha_at(step), self.settings.merge.neighbours, owned
        )
        for result in job.results.values():
            for name in set(merged) & set(result.new_weights):
                result.new_weights[name] = result.new_weights[name] + (merged[name] - versions[name])

    def _version_of(self, unit: str, job: RoundJob) -> Tensors | None:
        """``unit`` as every peer has it this round: its version (refreshed by weights: the weights as its
        holders served them, and ours as we trained them)."""
        by_weights = self.settings.sync.frozen_refresh == "weights"
        if unit in job.results:
            current = self.sync.versions.current(unit)
            if by_weights:
                return job.results[unit].new_weights
            return current.weights if current is not None and current.round == job.round else None
        fetched = job.refreshed.get(unit)
        if fetched is None or fetched.round != job.round:
            return None
        if fetched.want.kind == "change":  # added to our copy, which was the version before
            return {n: job.experts[n] + t for n, t in fetched.tensors.items()}
        exact = fetched.want == Want("version", "none") or fetched.want.kind == "weights"
        return fetched.tensors if exact else None

    def bound(self, job: RoundJob) -> float:
        """Seconds a job's sync can take when every wait runs to its limit (each unit's exchange, a download,
        a version, the refresh), with a margin: past it, the sync is broken, not slow."""
        c = self.settings.sync
        waits = 4 * len(job.units) + 1  # a reduce-scatter waits for pieces, combined parts and a fallback
        return waits * (c.deadline_max + 2 * c.request_timeout) + SYNC_MARGIN_SECONDS


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
