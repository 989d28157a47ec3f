"""Landing a round: its synced weights go into the model.

Without overlap the model simply takes them. With overlap, the next round has been training since the
round ended, so a unit becomes its synced weights plus the local progress made since (``under_progress``),
and the next update of a trained unit is measured from its synced weights, not from where the round began.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from spes_p2p.peer.job import RoundJob
from spes_p2p.sync.versions import Download

Tensors = dict[str, torch.Tensor]


def under_progress(synced: Tensors, now: Tensors, since: Tensors) -> Tensors:
    """``synced`` plus the progress from ``since`` to ``now``."""
    return {n: synced[n] + (now[n] - since[n]) for n in now}


class Landing:
    """Where each unit's next update is measured from. Training thread only."""

    def __init__(
        self,
        read: Callable[[str], Tensors],
        write: Callable[[str, Tensors], None],
        overlap: bool,
        reset_state: Callable[[str], None] = lambda unit: None,
        on_copy: Callable[[str, Download, Tensors | None], None] = lambda unit, download, weights: None,
    ) -> None:
        """``on_copy`` hears of every refreshed copy as it is written, with the copy as the model holds it
        when what came makes a version (None otherwise, and for a unit trained now: no frozen copy)."""
        self.read, self.write, self.overlap, self.reset_state = read, write, overlap, reset_state
        self.on_copy = on_copy
        self.training: set[str] = set()  # the units training now
        self.round_start: dict[str, Tensors] = {}  # units training now, as their round began (if needed)
        self.synced_start: dict[str, Tensors] = {}  # overlap: synced weights the next update starts from

    def begin_round(self, units: list[str], in_flight: RoundJob | None = None) -> None:
        """Snapshots the units training now, but those the round ``in_flight`` trained: its landing gives
        them the synced weights their next update starts from."""
        self.training = set(units)
        landing = set(in_flight.units) if in_flight is not None else set()
        self.round_start = {u: self.read(u) for u in units if u not in landing}

    def update_start(self, units: list[str]) -> dict[str, Tensors]:
        """Where this round's updates are measured from (after the previous round landed)."""
        return {u: self.synced_start.pop(u) if u in self.synced_start else self.round_start[u] for u in units}

    def land(self, job: RoundJob) -> None:
        """Writes the job's results and refreshed copies (decoding them now) into the model; training waits
        for it, so it counts in the job's ``sync_wait_seconds``."""
        started = time.perf_counter()
        self._land(job)
        job.metrics["sync_wait_seconds"] = job.metrics.get("sync_wait_seconds", 0.0) + (
            time.perf_counter() - started
        )

    def _land(self, job: RoundJob) -> None:
        for unit, result in job.results.items():  # units trained in the job's round
            if result.diverged:  # its progress is as broken as its update: restart from the result
                self.reset_state(unit)
                self.write(unit, result.new_weights)
                if self.overlap:
                    self.synced_start[unit] = result.new_weights
            else:
                self._write(unit, result.new_weights, since=job.end[unit])
        for unit, download in job.refreshed.items():  # frozen in that round; maybe trained now
            trained_now = unit in self.training  # (a unit claimed now: it has a snapshot)
            weights = download.onto(partial(self._copy, unit))  # (a change: added to our copy)
            self._write(unit, weights, since=self.round_start.get(unit))
            version = download.want.makes_version and not trained_now
            self.on_copy(unit, download, self.read(unit) if version else None)

    def _copy(self, unit: str) -> Tensors:
        """Our copy of ``unit``, the version a change applies to (a unit trained now: as its round began)."""
        return self.round_start[unit] if unit in self.training else self.read(unit)

    def held(self) -> dict[str, list]:
        return {"snapshots": [self.round_start, self.synced_start]}

    def restart(self, units: list[str]) -> None:
        """After a download of the swarm's model: this round's updates are measured from it."""
        self.synced_start = {u: self.read(u) for u in units}

    def _write(self, unit: str, synced: Tensors, since: Tensors | None) -> None:
        if not self.overlap or since is None:
            self.write(unit, synced)
            return
        self.synced_start[unit] = synced
        self.write(unit, under_progress(synced, self.read(unit), since))
