"""The volunteer's life cycle: join, catch up, then rounds of H local steps and a sync, until stopped.

A round: snapshot the start weights of the units this peer trains; train H steps; for each trained unit
exchange updates with its other holders (the dense part: with this round's group); serve the new weights;
refresh the frozen copies of every other unit from its holders ("the sync"). Landing the sync writes it into
the model, applies the expert-merging warm-up when due, writes the round's metrics and re-runs the claim
policy; the trainer follows a change of claims at the next round's start.

With ``overlap`` on, the sync of round k runs on a background thread while round k+1 trains from the local
end-of-round weights. When it lands, the difference between its result and those local weights is added to
the model, and round k+1's update is measured from the synced weights.

A background thread refreshes this peer's DHT records every heartbeat, so long rounds never expire them.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spes_p2p.errors import CheckpointError
from spes_p2p.model import MoETransformer, read_unit, write_unit
from spes_p2p.peer.outputs import RunOutputs
from spes_p2p.peer.setup import (
    data_config,
    member_config,
    merge_config,
    model_config,
    swarm_identity,
    sync_config,
    train_config,
    unit_layout,
)
from spes_p2p.settings import Settings
from spes_p2p.swarm.codecs import specs_of
from spes_p2p.swarm.member import SwarmMember, SwarmView
from spes_p2p.swarm.reachability import Reachability, assess
from spes_p2p.swarm.sync import SyncEngine, UnitRound, dense_group
from spes_p2p.swarm.transport import Transport
from spes_p2p.train.checkpoint import load_checkpoint
from spes_p2p.train.dataset import BatchSampler, DataShard, prepare_data, validation_batches
from spes_p2p.train.merge import merge_experts
from spes_p2p.train.trainer import Trainer, evaluate

logger = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
_SEEDED = threading.Lock()


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


@dataclass
class _Sync:
    """One round's sync, from the end of its training until it has landed in the model."""

    round: int
    units: list[str]  # the units trained this round
    start: dict[str, Tensors]
    end: dict[str, Tensors]  # local end-of-round weights
    tokens: int
    metrics: dict
    results: dict[str, UnitRound] = field(default_factory=dict)  # trained units
    refreshed: dict[str, Tensors] = field(default_factory=dict)  # frozen copies
    thread: threading.Thread | None = None
    error: BaseException | None = None


class Peer:
    def __init__(self, settings: Settings, transport: Transport, out_dir: Path | None = None) -> None:
        self.settings, self.transport = settings, transport
        self.identity = swarm_identity(settings)
        self.member = SwarmMember(transport, self.identity, member_config(settings, self.identity))
        model_cfg = model_config(settings)
        self.layout = unit_layout(settings)
        with _SEEDED:  # every peer of a swarm starts from one model (the lock: simulated peers share torch)
            torch.manual_seed(int(self.identity.hash, 16) % 2**31)
            self.model = MoETransformer(model_cfg)
        specs = {u: specs_of(read_unit(self.model, self.layout, u)) for u in self.layout.units}
        self.sync = SyncEngine(
            transport,
            sync_config(settings),
            specs,
            local_copy=lambda unit: read_unit(self.model, self.layout, unit),
            live_peers=self.member.live_peers,
        )
        self.data = prepare_data(data_config(settings), model_cfg.vocab_size)
        t = settings.train
        self.sampler = BatchSampler(
            self.data.train_ids,
            t.seq_len,
            t.batch_size,
            seed=0,
            shard=DataShard.for_peer_id(transport.peer_id),
        )
        self.val_batches = validation_batches(self.data.val_ids, t.seq_len, t.batch_size, t.eval_batches)
        self.merge = merge_config(settings)
        self.trainer: Trainer | None = None
        self.round = 0
        self.outputs = RunOutputs(Path(out_dir)) if out_dir else None
        self.joined = False
        self.resumed_from: Path | None = None
        self._in_flight: _Sync | None = None
        self._synced_start: dict[str, Tensors] = {}  # overlap: where the next update is measured from
        self._round_start: dict[str, Tensors] = {}  # the start weights of the round training now
        self._lock = threading.RLock()  # the member's state, shared with the heartbeat thread
        self._stop_heartbeat = threading.Event()
        self._last_row: dict = {}
        self._stats_at_land = (0, 0, 0, 0.0)

    # --------------------------------------------------------------------------------------- joining

    def reachability(self) -> Reachability:
        net = self.settings.network
        return assess(
            self.transport.addresses(),
            client_mode=net.client_mode,
            announced=bool(net.announce),
            relay=net.use_relay,
        )

    def join(self, resume: bool = False) -> PeerStatus:
        """Checks the swarm identity, downloads the swarm's current model (a newcomer), then claims units
        and starts heartbeats. With ``resume``, first restores the newest checkpoint of its run folder."""
        with self._lock:
            self.member.check_identity()
        checkpoint = self._restore() if resume else None
        view = self._at_round_boundary(self.member.view())
        training = any(p.loss is not None or p.round > 0 for p in view.peers.values())
        if training:  # (peers that start together all hold the seeded initial model)
            self._catch_up(view)
        with self._lock:
            self.member.round = self.round
            # in a swarm that is training, the others read their participants before we can claim: our first
            # round is not counted, we adopt its result
            self.member.join(first_round=self.round + 1 if training else self.round)
        self.joined = True
        threading.Thread(target=self._heartbeats, name="spes-heartbeat", daemon=True).start()
        units = checkpoint.meta["units"] if checkpoint else self.member.units_held
        self.trainer = Trainer(self.model, self.layout, units, train_config(self.settings))
        self.trainer.step = self.round * self.settings.method.steps_per_round
        if checkpoint:
            self.trainer.optimizer.load_state_dict(checkpoint.optimizer)
            self.trainer.tokens = checkpoint.meta["tokens"]
            self.trainer.retarget(self.member.units_held)  # keeps the state of what it still trains
        for unit in self.member.units_held:
            self.sync.serve_weights(self.round - 1, unit, read_unit(self.model, self.layout, unit))
        stats = self.transport.stats
        self._stats_at_land = (stats.bytes_sent, stats.bytes_received, stats.dht_ops, stats.dht_seconds)
        return self.status()

    def _restore(self):
        """Loads the newest checkpoint of this peer's run folder (model, data position, round)."""
        if self.outputs is None:
            raise CheckpointError("--resume needs --out: the run folder that holds the checkpoints")
        checkpoint = load_checkpoint(self.outputs.dir)
        if checkpoint.meta.get("swarm_hash") != self.identity.hash:
            raise CheckpointError(
                f"{checkpoint.path} was written in a swarm with other settings; resume with "
                "the settings it was trained with, or start without --resume"
            )
        self.model.load_state_dict(checkpoint.model)
        self.sampler.load_state_dict(checkpoint.meta["data_position"])
        self.round = checkpoint.meta["round"]
        logger.info("resumed from %s at round %d", checkpoint.path, self.round)
        self.resumed_from = checkpoint.path
        return checkpoint

    def _at_round_boundary(self, view: SwarmView) -> SwarmView:
        """If the swarm is training, waits (bounded) until it lands its current round, so a newcomer starts
        with the next round from that round's results instead of joining a round it cannot finish in time."""
        others = [p for p in view.peers.values() if p.peer_id != self.transport.peer_id]
        if not others or all(p.loss is None for p in others):  # nobody has finished a round yet
            return view
        current = max(p.round for p in others)
        deadline = time.monotonic() + self.settings.swarm.sync_deadline_max
        while time.monotonic() < deadline:
            view = self.member.view()
            if max((p.round for p in view.peers.values()), default=0) > current:
                return view
            time.sleep(0.2)
        return view

    def _catch_up(self, view: SwarmView) -> None:
        """A newcomer takes the swarm's round and every unit, uncompressed, from live holders."""
        me = self.transport.peer_id
        others = [p for p in view.peers.values() if p.peer_id != me]
        if not others:
            return
        holders = {u: sorted(h - {me}) for u, h in view.holders.items()}
        furthest_first = [p.peer_id for p in sorted(others, key=lambda p: -p.round)]
        landed = max(p.round for p in others) - 1  # the swarm's last landed round: holders catch up to it
        got = self.sync.refresh(
            max(landed, -1),
            holders,
            self.settings.swarm.sync_deadline_max,
            codec="none",
            on_unit=lambda unit, _, w: write_unit(self.model, self.layout, unit, w),
            fallback=furthest_first,  # a unit whose holders are newcomers too comes from any peer's copy
        )
        self.round = max(p.round for p in others)
        logger.info(
            "caught up at round %d: downloaded %s (unit: its round; -1: a peer's own copy)", self.round, got
        )

    def wait_for_peers(self, count: int, timeout: float, stop: threading.Event) -> int:
        """Waits (bounded) for ``count`` peers in the swarm, so a local swarm starts its rounds together."""
        deadline = time.monotonic() + timeout
        while True:
            seen = len(self.member.view().peers)
            if seen >= count or stop.is_set() or time.monotonic() >= deadline:
                return seen
            stop.wait(0.2)

    def drain(self, timeout: float) -> bool:
        """After the last round: keeps serving until every live peer has landed that round too (or timeout),
        so nobody misses this peer's final update or weights."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            peers = self.member.view().peers.values()
            if all(p.round >= self.round for p in peers):
                return True
            time.sleep(0.2)
        return False

    def _jump_ahead_if_behind(self) -> None:
        """A peer more than ``staleness`` rounds behind the swarm cannot fetch the updates it needs any more
        (peers keep them a few rounds): it downloads the current model and takes the swarm's round."""
        view = self.member.view()
        me = self.transport.peer_id
        ahead = max((p.round for p in view.peers.values() if p.peer_id != me), default=0)
        if ahead <= self.round + self.settings.method.staleness:
            return
        logger.warning("%d rounds behind the swarm: downloading its model", ahead - self.round)
        self._catch_up(view)
        with self._lock:
            self.member.start_at(self.round)
        self.trainer.step = self.round * self.settings.method.steps_per_round
        # this round's update is measured from the downloaded weights
        self._synced_start = {u: read_unit(self.model, self.layout, u) for u in self.trainer.units}

    def _heartbeats(self) -> None:
        while not self._stop_heartbeat.wait(self.settings.swarm.heartbeat_seconds):
            try:
                with self._lock:
                    self.member.heartbeat()
            except Exception:  # a network hiccup must not kill the peer; the next heartbeat retries
                logger.exception("heartbeat failed")

    # ---------------------------------------------------------------------------------------- rounds

    def run(
        self,
        stop: threading.Event,
        on_update: Callable[[PeerStatus], None] | None = None,
        max_rounds: int | None = None,
        until_round: int | None = None,
    ) -> None:
        """Rounds until ``stop`` is set, ``max_rounds`` rounds are done or the swarm's round reaches
        ``until_round``; the last sync always lands."""
        done = 0
        while not stop.is_set() and (max_rounds is None or done < max_rounds):
            trained = self._in_flight.round + 1 if self._in_flight else self.round  # rounds done or in flight
            if until_round is not None and trained >= until_round:
                break
            if not self._train_round(stop):
                break
            done += 1
            if on_update:
                on_update(self.status())
        if stop.is_set():
            self.sync.abort.set()  # the in-flight sync stops waiting and lands with what it has
        self._land_in_flight()

    def crash(self) -> None:
        """Simulations: vanish like a killed process, without releasing claims or writing anything."""
        self._stop_heartbeat.set()
        self.sync.abort.set()
        self.transport.shutdown(0)

    def _train_round(self, stop: threading.Event) -> bool:
        """H local steps, then this round's sync (in the background with overlap). False if stopped."""
        self._follow_claims()
        units = list(self.trainer.units)
        start = self._round_start = {u: read_unit(self.model, self.layout, u) for u in units}
        started, losses, tokens = time.perf_counter(), [], 0
        for _ in range(self.settings.method.steps_per_round):
            if stop.is_set():
                return False
            step = self.trainer.train_step(*self.sampler.next_batch())
            losses.append(step.loss)
            tokens += step.tokens
            if self._in_flight is not None and not self._in_flight.thread.is_alive():
                self._land_in_flight()
        compute = time.perf_counter() - started
        self._land_in_flight()  # the previous round's sync lands before this one's starts
        start = {u: self._synced_start.pop(u, start[u]) for u in units}
        metrics = {
            "loss": statistics.fmean(losses),
            "round_tokens": tokens,
            "compute_seconds": compute,
            "lr": self.trainer.lr(),
            "sync_started": time.perf_counter(),
        }
        sync = _Sync(
            self.round,
            units,
            start,
            {u: read_unit(self.model, self.layout, u) for u in units},
            tokens,
            metrics,
        )
        if self.settings.method.overlap:
            sync.thread = threading.Thread(target=self._run_sync, args=(sync,), name="spes-sync", daemon=True)
            self._in_flight = sync
            sync.thread.start()
        else:
            waited = time.perf_counter()
            self._run_sync(sync)
            sync.metrics["sync_wait_seconds"] = time.perf_counter() - waited
            self._land(sync)
        return True

    def _run_sync(self, sync: _Sync) -> None:
        """Exchanges every trained unit's update and refreshes the frozen copies (no writes to the model)."""
        try:
            view = self.member.view()
            me = self.transport.peer_id
            for unit in sync.units:
                participants = sorted(view.participants(unit, sync.round) | {me})
                if unit.startswith("dense/") or self.settings.method.mode == "diloco":
                    participants = dense_group(
                        participants,
                        me,
                        sync.round,
                        self.settings.swarm.run_id,
                        self.settings.method.dense_group_size,
                    )
                counted = self.member.since.get(unit, 0) <= sync.round
                sync.results[unit] = self.sync.exchange(
                    sync.round, unit, sync.start[unit], sync.end[unit], sync.tokens, participants, counted
                )
            self._merge_if_due(sync)
            for unit, result in sync.results.items():
                self.sync.serve_weights(sync.round, unit, result.new_weights)
            frozen = {
                u: sorted(view.participants(u, sync.round) - {me})
                for u in self.layout.units
                if u not in sync.units
            }
            self.sync.refresh(
                sync.round,
                frozen,
                self.sync.deadline.seconds(),
                codec={u: self._refresh_codec(u) for u in frozen},
                on_unit=lambda unit, _, weights: sync.refreshed.__setitem__(unit, weights),
            )
        except BaseException as exc:  # re-raised on the training thread when the sync lands
            sync.error = exc

    def _refresh_codec(self, unit: str) -> str:
        """Exact for a unit this peer is about to train; a frozen expert held quantized: in its own format."""
        if unit in self.member.units_held:
            return "none"
        frozen = self.settings.train.frozen_experts
        return (
            frozen if unit.startswith("experts/") and frozen != "full" else self.settings.method.refresh_codec
        )

    def _land_in_flight(self) -> None:
        sync, self._in_flight = self._in_flight, None
        if sync is not None:
            waited = time.perf_counter()
            sync.thread.join()
            sync.metrics["sync_wait_seconds"] = time.perf_counter() - waited  # training was blocked this long
            self._land(sync)

    def _land(self, sync: _Sync) -> None:
        """Writes a finished sync into the model and closes the round's books."""
        if sync.error is not None:
            raise sync.error
        overlap = self.settings.method.overlap
        for unit, result in sync.results.items():
            if overlap:  # keep the progress made since the round ended, on top of the synced weights
                self._write_under_progress(unit, result.new_weights, since=sync.end[unit])
            else:
                write_unit(self.model, self.layout, unit, result.new_weights)
        for unit, weights in sync.refreshed.items():
            if overlap and unit in self._round_start:  # trained since this round began: keep that progress
                self._write_under_progress(unit, weights, since=self._round_start[unit])
            else:
                write_unit(self.model, self.layout, unit, weights)
        self.round = sync.round + 1
        self._jump_ahead_if_behind()
        row = self._round_row(sync)
        with self._lock:
            self.member.round, self.member.loss, self.member.tokens_per_s = (
                self.round,
                row["loss"],
                row["tokens_per_s"],
            )
            # without overlap a new claim takes effect at once, before every other peer can see it: like a
            # newcomer's, its first round is not counted (it adopts the others' result)
            self.member.rebalance(
                first_round=self.round + 1 if overlap else self.round, count_from=self.round + 1
            )
        self.sync.forget_before(self.round)
        self._last_row = row
        if self.outputs:
            self.outputs.append(row)
            if self.round % self.settings.train.checkpoint_every_rounds == 0:
                self.outputs.checkpoint(self)

    def _write_under_progress(self, unit: str, synced: Tensors, since: Tensors) -> None:
        """Overlap: the unit becomes ``synced`` plus the local progress made since ``since``, and the update
        of the round now training is measured from ``synced``."""
        now = read_unit(self.model, self.layout, unit)
        self._synced_start[unit] = synced
        write_unit(self.model, self.layout, unit, {n: synced[n] + (now[n] - since[n]) for n in now})

    def _merge_if_due(self, sync: _Sync) -> None:
        """Expert-merging warm-up on the round's new weights, before they are served. Neighbours come from
        this peer's frozen copies, which every holder of a shard got from the same payloads, so holders merge
        alike; frozen units do not change while training, so reading them here is safe."""
        step = (sync.round + 1) * self.settings.method.steps_per_round
        if not self.merge.due(step):
            return
        weights: Tensors = {}
        for unit in self.layout.units:
            if unit in sync.results:
                weights.update(sync.results[unit].new_weights)
            elif unit.startswith("experts/"):
                weights.update(read_unit(self.model, self.layout, unit))
        n = self.layout.experts_per_shard
        owned = {
            int(u.split("/")[1]) * n + i for u in sync.results if u.startswith("experts/") for i in range(n)
        }
        merged = merge_experts(weights, self.merge.alpha(step), self.merge.neighbours, only=owned)
        for result in sync.results.values():
            result.new_weights.update({k: v for k, v in merged.items() if k in result.new_weights})

    def _round_row(self, sync: _Sync) -> dict:
        m = sync.metrics
        # traffic since the previous round landed: this round's exchange, plus what others fetched from us
        stats = self.transport.stats
        now = (stats.bytes_sent, stats.bytes_received, stats.dht_ops, stats.dht_seconds)
        (sent0, received0, ops0, dht0), self._stats_at_land = self._stats_at_land, now
        sent, received, ops, dht = now
        row = {
            "round": sync.round,
            "step": self.trainer.step,
            "tokens": self.trainer.tokens,
            "loss": m["loss"],
            "lr": m["lr"],
            "round_tokens": m["round_tokens"],
            "tokens_per_s": m["round_tokens"] / max(m["compute_seconds"], 1e-9),
            "bytes_sent": sent - sent0,
            "bytes_received": received - received0,
            "sync_seconds": time.perf_counter() - m["sync_started"],  # from the round's end until landed
            "sync_wait_seconds": m.get("sync_wait_seconds", 0.0),  # of which training was blocked
            "compute_seconds": m["compute_seconds"],
            "dht_ms": 1000 * (dht - dht0) / max(1, ops - ops0),  # mean latency of a store or read
            "units": sync.units,
            "participants": {u: r.participants for u, r in sync.results.items()},
            "missing": {u: r.missing for u, r in sync.results.items() if r.missing},
            "resynced": sorted(u for u, r in sync.results.items() if r.resynced),
            "refreshed": sorted(sync.refreshed),
            "rejected_payloads": self.sync.rejected_payloads,
        }
        if self.round % self.settings.train.eval_every_rounds == 0:
            row["val_loss"] = evaluate(self.model, self.val_batches)
        return row

    def _follow_claims(self) -> None:
        """At a round's start, the trainer and the served weights follow the claims of the last boundary."""
        held = list(self.member.units_held)
        if sorted(held) == self.trainer.units:
            return
        logger.info("now training %s (was %s)", sorted(held), self.trainer.units)
        new = sorted(set(held) - set(self.trainer.units))
        if not self.settings.method.overlap:  # (with overlap, the sync in flight fetches them exactly)
            self._fetch_exact(new)
        for unit in new:
            self.sync.serve_weights(self.round - 1, unit, read_unit(self.model, self.layout, unit))
        self.trainer.retarget(held)  # units given up are still served for a few rounds, to their new holders

    def _fetch_exact(self, units: list[str]) -> None:
        """The last round's weights of units this peer starts training, uncompressed, from those that trained
        them then (bounded; on failure the local copy stays, and the round's exchange re-synchronizes)."""
        view, me = self.member.view(), self.transport.peer_id
        self.sync.refresh(
            self.round - 1,
            {u: sorted(view.participants(u, self.round - 1) - {me}) for u in units},
            self.settings.swarm.sync_deadline_max,
            codec="none",
            on_unit=lambda unit, _, weights: write_unit(self.model, self.layout, unit, weights),
        )

    # -------------------------------------------------------------------------------------- leaving

    def status(self) -> PeerStatus:
        return PeerStatus(
            self.transport.peer_id,
            self.transport.addresses(),
            self.member.units_held,
            self.member.last_view,
            self.round,
            self.member.loss,
            self.member.tokens_per_s,
            self.transport.stats.bytes_sent,
            self.transport.stats.bytes_received,
            self._last_row,
        )

    def close(self, timeout: float = 5.0) -> None:
        """Writes the final outputs, releases claims (if it joined) and leaves; bounded by ``timeout``s."""
        self._stop_heartbeat.set()
        if self.outputs and self.trainer is not None:
            self.outputs.finish(self)
        if self.joined:
            releasing = threading.Thread(target=self._release, name="release-claims", daemon=True)
            releasing.start()
            releasing.join(timeout)
            if releasing.is_alive():
                logger.warning("releasing claims took over %.0fs; they will expire by themselves", timeout)
        self.sync.close()
        self.transport.shutdown(timeout)

    def _release(self) -> None:
        try:
            with self._lock:
                self.member.leave()
        except Exception:  # leaving must not fail: the records expire on their own anyway
            logger.exception("could not release claims; they expire by themselves")
