"""The volunteer's peer: join, catch up, then rounds of H local steps and a sync, until stopped.

A round: snapshot the units this peer trains; train H steps; hand the round to the sync (``rounds``), which
exchanges each trained unit's update with its other holders, serves the new weights and refreshes the
frozen copies of every other unit; land the result (``landing``), write the round's metrics and re-run the
claim policy; the trainer follows a change of claims at the next round's start. With ``overlap`` the sync
of round k runs while round k+1 trains.

``Peer`` only orchestrates. Its parts, and the threads that touch them:

    local      model, trainer, data     the training thread; handler threads read units under its lock
    member     claims and DHT records   thread-safe; the heartbeat thread refreshes the records
    sync       serving, exchange, refresh   the sync thread, the fetch pool and the handler threads
    pipeline   the round in flight      the training thread hands it to the sync thread and takes it back
    landing, metrics, outputs           the training thread only
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spes_p2p.errors import CheckpointError
from spes_p2p.model.units import layout_of, quantized_when_frozen
from spes_p2p.net.reachability import SelfCheck
from spes_p2p.net.transport import Transport
from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.peer import joining
from spes_p2p.peer.admission import Admission, fingerprint, shared_manifest
from spes_p2p.peer.footprint import Footprint
from spes_p2p.peer.heartbeat import Heartbeat
from spes_p2p.peer.job import RoundJob
from spes_p2p.peer.landing import Landing
from spes_p2p.peer.metrics import RoundMetrics, crossed, progress
from spes_p2p.peer.outputs import RunOutputs
from spes_p2p.peer.rounds import Pipeline, RoundSync
from spes_p2p.peer.setup import initial_seed, local_training, member_config, sync_engine
from spes_p2p.peer.swarmdata import data_claims, dataset_of, serve_data
from spes_p2p.settings import Settings
from spes_p2p.swarm.manifest import ManifestServer
from spes_p2p.swarm.member import SwarmMember, SwarmView
from spes_p2p.swarm.records import Progress
from spes_p2p.sync.payload import specs_of
from spes_p2p.train.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2


@dataclass
class PeerStatus:
    peer_id: str
    addresses: list[str]
    units: list[str]
    view: SwarmView
    round: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    last: dict = field(default_factory=dict)  # the latest round's metrics row
    reachable: str = "unknown"  # whether peers could dial this one back
    banned: list[str] = field(default_factory=list)  # peers this one ignores for the rest of the run

    @classmethod
    def of(cls, transport: Transport, member: SwarmMember, round_: int, last: dict) -> PeerStatus:
        stats = transport.stats
        return cls(
            transport.peer_id,
            transport.addresses(),
            member.units_held,
            member.last_view,
            round_,
            member.progress.loss,
            member.progress.tokens_per_s,
            stats.bytes_sent,
            stats.bytes_received,
            last,
            member.reachable,
            transport.guard.banned(),
        )


class Peer:
    """One volunteer's peer in a swarm, over a transport; ``out_dir`` keeps its metrics, checkpoints and
    final model. Call ``join``, then ``run``, then ``close`` (``spes_p2p.peer.life.live`` does)."""

    def __init__(
        self,
        settings: Settings,
        transport: Transport,
        out_dir: Path | None = None,
        admission: Admission | None = None,
    ) -> None:
        """``admission``: the swarm's manifest, taken from its peers; without one, this peer founds the swarm
        (or, in tests, computes the manifest every peer of its settings computes alike)."""
        self.settings, self.transport, self.me = settings, transport, transport.peer_id
        transport.guard.allow_only(settings.swarm.allowlist)
        self.layout = layout_of(settings.model)
        data = dataset_of(settings, transport, admission and admission.manifest)
        self.local = local_training(settings, self.layout, initial_seed(settings), self.me, data)
        self.admission = admission
        self.initial_units = {u: fingerprint(self.local.read(u)) for u in self.layout.units}
        self.manifest, tokenizer = shared_manifest(settings, data, admission, self.initial_units)
        ManifestServer(transport, self.manifest, tokenizer)
        serve_data(transport, data.store.file)
        self.member = member = SwarmMember(transport, self.manifest, member_config(settings))
        self.data = data_claims(settings, transport, data, self.member.live_peers)
        self.local.plan_with(self.data)
        specs = {u: specs_of(self.local.read(u)) for u in self.layout.units}
        quantized = quantized_when_frozen(self.local.model, self.layout)
        self.sync = sync_engine(settings, transport, specs, self.local.read, self.member, quantized)
        overlap = settings.method.overlap
        probe = self.local.probe if self.local.compute == "real" else None
        round_sync = RoundSync(settings, self.member, self.sync, self.layout, self.local.read, probe)
        self.pipeline, self.frozen = Pipeline(round_sync, overlap), round_sync.frozen
        self.landing = Landing(
            self.local.read, self.local.write, overlap, self.local.reset_state, self.frozen.landed
        )
        self.metrics = RoundMetrics(transport)
        self.footprint = Footprint(self.local, (self.landing, self.pipeline, self.sync), self.local.device)
        self.reachability = SelfCheck(transport, settings.network, member.live_peers, member.set_reachable)
        beats = {"before": [self.reachability.recheck], "after": [self.data.heartbeat]}
        self.heartbeat = Heartbeat(self.member, settings.swarm.heartbeat_seconds, **beats)
        self.outputs = (
            RunOutputs(Path(out_dir), tokenizer, settings.train.keep_checkpoints) if out_dir else None
        )
        self.round = 0
        self.joined = self.crashed = False
        self.resumed_from: Path | None = None
        self._last_row: dict = {}

    # --------------------------------------------------------------------------------------- joining

    def join(self, resume: bool = False, mark: Callable[[str], None] = lambda milestone: None) -> PeerStatus:
        """Checks the swarm identity, downloads the swarm's current model (a newcomer), then claims units and
        starts heartbeats (``resume``: from its newest checkpoint). ``mark`` hears "boundary", "caught_up"."""
        self.member.check_manifest()
        checkpoint = self._restore() if resume else None
        view = joining.at_round_boundary(self.member, self.sync.longest_wait())
        mark("boundary")
        training = joining.is_training(view, self.me)
        if not checkpoint:  # (a newcomer starts in the oldest epoch the swarm still trains)
            self.data.start_in([p.data_epoch for p in view.peers.values() if p.peer_id != self.me])
        if training:
            self._catch_up(view)
            mark("caught_up")
        elif not checkpoint and self.initial_units != self.manifest.initial_units:
            # the founder's model came from --init, or another torch drew this one
            differ = {u: h for u, h in self.manifest.initial_units.items() if self.initial_units.get(u) != h}
            wait = self.sync.longest_wait()
            joining.download_initial_model(view, self.me, self.sync, self.local.write, wait, differ)
        self.member.report(self.round, Progress(), self.data.epoch)
        # in a swarm that is training, the others read their participants before we can claim: our first
        # round is not counted, we adopt its result
        self.member.join(first_round=self.round + 1 if training else self.round)
        self.joined = True
        self.heartbeat.start()
        if self.settings.model.init and not training and not checkpoint:  # before frozen units are quantized
            joining.serve_initial_model(self.sync, self.local.read, self.layout.units)
        self.local.start(self.member.units_held, self.round, checkpoint, sample=self.footprint.sample)
        self.sync.measure_with(self.footprint.recount)
        for unit in self.member.units_held:
            self.sync.serve_weights(self.round - 1, unit, self.local.read(unit))
        if not training and not checkpoint:  # every peer has the initial model: its first version
            self.sync.start_versions(-1, self.local.read, self.member.units_held, self.frozen.versioned)
        self.metrics = RoundMetrics(self.transport)  # traffic counts from here
        return self.status()

    def _restore(self) -> Checkpoint:
        """Loads the newest checkpoint of this peer's run folder (model, data position, round)."""
        if self.outputs is None:
            raise CheckpointError("--resume needs --out: the run folder that holds the checkpoints")
        checkpoint = self.outputs.resume(self.manifest.hash)
        self.local.restore(checkpoint)
        self.round, self.resumed_from = checkpoint.meta["round"], checkpoint.path
        logger.info("resumed from %s at round %d", checkpoint.path, self.round)
        return checkpoint

    def _catch_up(self, view: SwarmView) -> None:
        round_ = joining.catch_up(view, self.me, self.sync, self.local.write, self.sync.longest_wait())
        self.round = self.round if round_ is None else round_

    def drain(self, timeout: float) -> bool:
        """After the last round: keeps serving until every live peer has landed that round too (or timeout),
        so nobody misses this peer's final update or weights."""

        def everyone_landed() -> bool | None:
            return all(p.round >= self.round for p in self.member.recent_view().peers.values()) or None

        return bool(poll(everyone_landed, Deadline(timeout), POLL_SECONDS))

    # ---------------------------------------------------------------------------------------- rounds

    def run(
        self, stop: threading.Event, on_update: Callable[[PeerStatus], None] | None = None, rounds: int = 0
    ) -> None:
        """Rounds until ``stop`` is set or the swarm's round reaches ``rounds`` (0: no end); the last sync
        always lands."""
        while not stop.is_set():
            in_flight = self.pipeline.in_flight
            trained = in_flight.round + 1 if in_flight else self.round  # rounds done or in flight
            if (rounds and trained >= rounds) or not self._train_round(stop, rounds):
                break
            if on_update:
                on_update(self.status())
        if stop.is_set():
            self.sync.stop_waiting()  # the sync in flight stops waiting and lands with what it has
        self._land(self.pipeline.take(), leaving=stop.is_set())

    def _train_round(self, stop: threading.Event, rounds: int) -> bool:
        """H local steps, then this round's sync (in the background with overlap). False if stopped, or if
        landing the previous round caught up with a swarm that has done ``rounds`` already."""
        self._follow_claims()
        units = list(self.local.units)
        self.landing.begin_round(units, self.pipeline.in_flight)
        steps = self.local.steps(stop, between=self._land_if_synced)
        if steps is None:
            return False
        self._land(self.pipeline.take())  # the previous round's sync lands before this one's starts
        if rounds and self.round >= rounds:
            return False
        if rounds and self.round == rounds - 1:
            self.sync.last_round()  # (holders that stop together end on the same weights)
        job = RoundJob(
            self.round,
            units,
            self.landing.update_start(units),
            {u: self.local.read(u) for u in units},
            steps.tokens,
            {
                "loss": steps.loss,
                "round_tokens": steps.tokens,
                "compute_seconds": steps.seconds,
                "lr": self.local.lr(),
                "compute": self.local.compute,
                "sync_started": time.perf_counter(),
                "data": {**self.local.data_read(), "shards_done": self.data.done},
            },
            experts=self.frozen.merge_inputs(self.round, lambda: self.local.frozen_experts(units)),
        )
        self._land(self.pipeline.submit(job))
        return True

    def _land_if_synced(self) -> None:
        if self.pipeline.finished():
            self._land(self.pipeline.take())

    def _land(self, job: RoundJob | None, leaving: bool = False) -> None:
        """Writes a finished sync into the model and closes the round's books; then, unless ``leaving`` (the
        peer stops: it neither catches up nor claims, and reads nothing more of the swarm), follows the
        swarm."""
        if job is None:
            return
        if job.error is not None:
            raise job.error
        self.landing.land(job)
        self.data.commit(job.metrics["data"]["trained"])  # (its windows now count as trained)
        self.round = job.round + 1
        view = None if leaving else self._catch_up_if_behind()
        row = self.metrics.row(job, self.local.step, self.local.tokens, self.sync.rejected_payloads)
        row.update(self.footprint.take())
        row["probe_seconds"] = self.local.probing_seconds()  # (screening; training paused meanwhile)
        every = self.settings.train.eval_every
        if crossed(self.round, self.settings.method.steps_per_round, every) and self.local.compute == "real":
            row["val_loss"] = self.local.evaluate()
        self.member.report(self.round, progress(row, self.member.progress), row["data"]["epoch"])
        if not leaving:
            # without overlap a new claim takes effect at once, before every other peer can see it: like a
            # newcomer's, its first round is not counted (it adopts the others' result)
            first = self.round + 1 if self.settings.method.overlap else self.round
            self.member.rebalance(first_round=first, count_from=self.round + 1, view=view)
            self.sync.forget_before(self.round, self.member.units_held)
        self._last_row = row
        self._write_outputs(row)

    def _catch_up_if_behind(self) -> SwarmView | None:
        """The view read, when this peer is at most ``staleness`` rounds behind the swarm; else (it cannot
        fetch the updates it needs: peers keep a few rounds) None: it took the swarm's model and round."""
        view = self.member.view()
        behind = joining.rounds_behind(view, self.me, self.round)
        if behind <= self.settings.sync.staleness:
            return view
        logger.warning("%d rounds behind the swarm: downloading its model", behind)
        self._catch_up(view)
        self.member.start_at(self.round)
        self.local.at_round(self.round)
        self.landing.restart(self.local.units)  # this round's update is measured from the download
        return None

    def _follow_claims(self) -> None:
        """At a round's start, the trainer and the served weights follow the claims of the last boundary."""
        held = list(self.member.units_held)
        if sorted(held) == self.local.units:
            return
        logger.info("now training %s (was %s)", sorted(held), self.local.units)
        new = sorted(set(held) - set(self.local.units))
        if not self.settings.method.overlap:  # (with overlap, the sync in flight fetches them exactly)
            seconds = self.sync.longest_wait()
            view = self.member.view()
            joining.fetch_exact(new, self.round - 1, view, self.me, self.sync, self.local.write, seconds)
        for unit in new:
            self.sync.serve_weights(self.round - 1, unit, self.local.read(unit))
        self.local.retarget(held)  # units given up are still served for a few rounds, to their new holders

    def _write_outputs(self, row: dict) -> None:
        if self.outputs is None:
            return
        self.outputs.append(row)
        if crossed(self.round, self.settings.method.steps_per_round, self.settings.train.checkpoint_every):
            meta = {"peer_id": self.me, "round": self.round, "swarm_hash": self.manifest.hash}
            position = {**meta, **self.local.position()}
            self.outputs.checkpoint(self.local.model, self.local.optimizer, self.local.step, position)

    # -------------------------------------------------------------------------------------- leaving

    def status(self) -> PeerStatus:
        return PeerStatus.of(self.transport, self.member, self.round, self._last_row)

    def crash(self) -> None:
        """Simulations: vanish like a killed process, without releasing claims or writing anything."""
        self.crashed = True
        self.heartbeat.stop()
        self.sync.stop_waiting()
        self.transport.shutdown(0)

    def close(self, timeout: float = 5.0) -> None:
        """Writes the final outputs, releases claims (if it joined) and leaves; bounded by ``timeout``s."""
        if self.crashed:
            return
        self.heartbeat.stop()
        if self.outputs and self.local.started:
            state = {"peer_id": self.me, "round": self.round, "step": self.local.step}
            self.outputs.finish(self.local.model, {**state, **self.local.position()})
        if self.joined:
            self.member.leave_within(timeout, first=self.data.release)
        self.sync.close()
        self.transport.shutdown(timeout)
