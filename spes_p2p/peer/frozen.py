"""Frozen copies: a peer's copies of the units it does not train, brought up to date by versions
(``sync/versions.py``), and the expert-merging warm-up, which runs on every expert's version of a round.

What a holder serves for a frozen copy is checked before it is kept (docs/security.md): it may move our copy
by at most ``MAX_MOVE`` of the copy's norm, and, for a copy held in full precision, must not raise the
validation loss on the round's probe batch by more than ``PROBE_MARGIN`` of it. A holder that fails is
refused and counted, and the next one asked.

Runs on the sync thread, as part of a round's sync (``rounds.RoundSync``); ``landed`` on the training
thread, as each refreshed copy is written into the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from spes_p2p.model.units import UnitLayout
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import SwarmMember, SwarmView
from spes_p2p.sync.aggregate import norm_of
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.versions import EXACT_VERSION, EXACT_WEIGHTS, Download, Want, is_version_round
from spes_p2p.train.merge import merge_experts

if TYPE_CHECKING:
    from spes_p2p.peer.job import RoundJob

logger = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

MAX_MOVE = 10.0  # an honest version moved a copy of a tiny model's expert by up to 1.2 of its norm
PROBE_MARGIN = 1e-3  # of the probe loss


class FrozenCopies:
    def __init__(
        self,
        settings: Settings,
        member: SwarmMember,
        sync: SyncEngine,
        layout: UnitLayout,
        read: Callable[[str], Tensors] | None = None,
        probe: Callable[..., list[float]] | None = None,
    ) -> None:
        """``read``: our copy of a unit (None: what holders serve is taken as it decodes); ``probe``:
        ``LocalTraining.probe`` (None with virtual compute)."""
        self.settings, self.member, self.sync, self.layout = settings, member, sync, layout
        self.read, self.probe = read, probe
        self.me = member.me
        self.every = settings.method.refresh_every_rounds

    def merge_due(self, round_: int) -> bool:
        """Merges come due at steps; they run at the next version round (on that round's versions)."""
        h = self.settings.method.steps_per_round
        due = any(self.settings.merge.due((r + 1) * h) for r in range(round_ - self.every + 1, round_ + 1))
        return due and is_version_round(round_, self.every)

    def merge_inputs(self, round_: int, experts: Callable[[], Tensors]) -> Tensors | None:
        """When a merge is due this round: our copies of the experts we do not train, which a change adds
        to (``experts()``); none when we hold them quantized, as then the merge takes exact versions."""
        if not self.merge_due(round_):
            return None
        return experts() if self._stored("experts/0") == "full" else {}

    def publish(self, job: RoundJob, view: SwarmView) -> None:
        """The next version of each unit we trained that others keep frozen copies of; a unit whose version
        chain we lack (we just took it over) joins a co-holder's first."""
        if not is_version_round(job.round, self.every) or self.settings.sync.frozen_refresh != "changes":
            return
        since = job.round - self.every
        for unit, result in job.results.items():
            if not self.versioned(unit):
                continue
            current = self.sync.version(unit)
            if current is None or current.round < since:  # from its holders then, or now
                holders = view.participants(unit, since) | view.participants(unit, job.round)
                self._join(unit, since, sorted(holders - {self.me}))
                current = self.sync.version(unit)
            if current is None or current.round < job.round:
                self.sync.advance_version(unit, job.round, since, result.new_weights)

    def _join(self, unit: str, since: int, holders: list[str]) -> None:
        """Our version chains of ``unit`` start from a co-holder's: its exact version, and what each of its
        quantized chains holds (a chain that does not come starts from the exact version: keepers of that
        format who ask us are told it is another chain, and fetch its version whole)."""
        got: dict[str, Download] = {}
        chains = self.sync.chains.of(unit)
        for want in (EXACT_VERSION, *(self.sync.chains.whole(unit, c) for c in chains)):
            self.sync.refresh(
                since,
                {unit: holders},
                self.sync.deadline_seconds(),
                want=want,
                on_unit=lambda u, download, chain=want.chain: got.__setitem__(chain, download),
            )
            if "full" not in got:  # (no co-holder had the version: its chains would not come either)
                return
        exact = got.pop("full")
        held = {c: d.tensors for c, d in got.items() if d.round == exact.round}
        if len(held) < len(chains):
            logger.info("%s: our quantized chains start anew (a co-holder's did not come)", unit)
        self.sync.start_version(unit, exact.round, exact.tensors, held)

    def versioned(self, unit: str) -> bool:
        """Whether some peers keep a frozen copy of ``unit``: an expert shard, or a dense block of several."""
        if self.settings.method.mode == "diloco":
            return False
        return unit.startswith("experts/") or len(self.layout.dense_units) > 1

    def refresh(self, job: RoundJob, view: SwarmView) -> None:
        """The units we start training next (their weights, exactly), and at a version round our frozen
        copies of every other unit."""
        versions = is_version_round(job.round, self.every)
        frozen = {
            u: sorted(view.participants(u, job.round) - {self.me})
            for u in self.layout.units
            if u not in job.units and (versions or u in self.member.units_held)
        }
        wants = {u: self._want(u, job) for u in frozen}
        got = self.sync.refresh(
            job.round,
            frozen,
            self.sync.deadline_seconds(),
            want=wants,
            on_unit=lambda unit, download: job.refreshed.__setitem__(unit, download),
            verify=partial(self._problem, job.round, wants) if self.read else None,
        )
        for unit, holders in frozen.items():
            if holders:
                self.member.served(unit, unit in got)
        failing = self.sync.failing()
        self.member.failing(failing)
        job.metrics["failing"] = {u: sorted(p) for u, p in sorted(failing.items())}

    def _problem(self, round_: int, wants: dict[str, Want], unit: str, tensors: Tensors) -> str:
        """Why what a holder served for our frozen copy of ``unit`` cannot be kept ('' when it can). (The
        exact weights of a unit we start training are checked by its co-holders' next exchange.)"""
        if unit in self.member.units_held:
            return ""
        copy = self.read(unit)
        new = {n: copy[n] + tensors[n] for n in copy} if wants[unit].kind == "change" else tensors
        moved, size = norm_of({n: new[n] - copy[n] for n in copy}), norm_of(copy)
        if not moved <= MAX_MOVE * size:
            return f"it moves our copy by {moved / max(size, 1e-30):.3g} of its norm (at most {MAX_MOVE})"
        if self.probe is None or self._stored(unit) != "full":
            return ""
        base, loss = self.probe(round_, unit, {}, [new])
        if not loss <= base + PROBE_MARGIN * abs(base):
            return f"it raises the validation loss by {loss - base:.4f} (from {base:.4f})"
        return ""

    def _want(self, unit: str, job: RoundJob) -> Want:
        """Exact weights of a unit we are about to train. For a frozen copy: the change since its version
        (or, when it is not one, the exact version); held quantized, the same of its format's chain. At a
        merge, every peer needs this round's version of every expert alike: exact ones."""
        if unit in self.member.units_held:
            return EXACT_WEIGHTS
        sync, stored = self.settings.sync, self._stored(unit)
        quantized = stored != "full"
        merging = job.experts is not None and unit.startswith("experts/")
        if sync.frozen_refresh == "weights":  # (a merge: every peer in the same codec)
            return Want("weights", stored if quantized and not merging else sync.refresh_codec)
        chain = self._chain(unit)
        if chain != "full" and merging:
            return EXACT_VERSION
        copy = self.sync.copy_version(unit)
        if copy is not None and copy[0] == job.round - self.every:
            return Want("change", sync.refresh_codec, copy, chain=chain)
        return self.sync.chains.whole(unit, chain)

    def _stored(self, unit: str) -> str:
        """How we hold our frozen copy of ``unit``: full, int8 or nf4."""
        train = self.settings.train
        return train.frozen_experts if unit.startswith("experts/") else train.frozen_dense

    def _chain(self, unit: str) -> str:
        """The version chain our copy of ``unit`` follows: its quantized format's, or the exact one (held
        in full, or none of its tensors is large enough to quantize)."""
        stored = self._stored(unit)
        return stored if stored in self.sync.chains.of(unit) else "full"

    def landed(self, unit: str, download: Download, held: Tensors | None) -> None:
        """A refreshed copy was written (``held``: as our model holds it, when it is a version)."""
        self.sync.copy_landed(unit, download, held, self._chain(unit))

    def merge(self, job: RoundJob) -> None:
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
            if by_weights:
                return job.results[unit].new_weights
            current = self.sync.version(unit)
            return current.weights if current is not None and current.round == job.round else None
        download = job.refreshed.get(unit)
        if download is None or download.round != job.round:
            return None
        if download.want.chain != "full":  # (a quantized chain: not the exact version)
            return None
        if download.want.makes_version or download.want.kind == "weights":  # (a change: onto our copy)
            return download.onto(lambda: job.experts)
        return None
