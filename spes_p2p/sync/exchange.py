"""One unit's exchange in one round, among the peers that trained it (docs/protocol.md, "A round"):

1. our update = end - start weights, coded with error feedback (what the codec lost last round is added to
   this round's update); we decode our own payload too, so every holder aggregates exactly the same
   numbers; it goes to the outbox and is announced (an update that is not finite is not: a diverged peer
   takes the others' result);
2. the other participants' announced updates are fetched (``fetching.UpdateFetcher``), several at a time,
   until all have answered, left or been refused, or the round's deadline passed; a participant that missed
   ``MISS_LIMIT`` rounds in a row is fetched when it has announced, but no longer waited for. A deadline
   that passed before a participant even announced (it is behind: this peer ran ahead) makes the next round
   wait longer, so the peers fall back into step. Late updates of the last ``staleness`` rounds count too,
   from those rounds' participants only;
3. ``aggregate.decide`` says how the round ends: combined updates, or re-synchronized end weights.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from spes_p2p.net.transport import Transport
from spes_p2p.net.waiting import AdaptiveDeadline, Deadline, poll
from spes_p2p.swarm.gossip import Gossip
from spes_p2p.swarm.records import Announcement, updates_key
from spes_p2p.sync.aggregate import (
    RESYNC_FACTOR,
    Contribution,
    OuterStep,
    averaged,
    decide,
    norm_of,
    resynchronized,
)
from spes_p2p.sync.codecs import EXACT, Codecs, TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.fetching import Gone, Got, Refused, UpdateFetcher
from spes_p2p.sync.outcome import MISS_LIMIT, UnitRound, tensors_hash
from spes_p2p.sync.payload import ErrorFeedback, encode, payload_meta
from spes_p2p.sync.reduce_scatter import ReduceScatter
from spes_p2p.sync.serving import Outbox, Posted

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # between reads of a round's announcements
LIVENESS_CHECK_SECONDS = 1.0  # between checks that the participants we wait for are still in the swarm
ANNOUNCE_TTL = 120.0  # seconds an announcement lives in the DHT
RESYNC_LIMIT = 3  # rounds in a row a unit may stay off the swarm's base before it is downloaded

Tensors = dict[str, torch.Tensor]


def dense_group(peers: list[str], me: str, round_: int, run_id: str, size: int) -> list[str]:
    """This round's random group (at most ``size`` peers, in an order every member computes alike) that
    ``me`` averages the dense part with. A peer that is not among ``peers`` (a newcomer whose first round
    does not count) gets the group it follows."""
    order = sorted(peers)
    random.Random(f"{run_id}:{round_}").shuffle(order)
    n_groups = max(1, -(-len(order) // size))
    groups = [order[i::n_groups] for i in range(n_groups)]
    if not order:
        return [me]
    return next(
        (g for g in groups if me in g), groups[int(hashlib.sha256(me.encode()).hexdigest(), 16) % n_groups]
    )


class Exchange:
    """The round's exchange of updates. Runs on the sync thread; ``rejected`` is read by others."""

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        cfg: SyncConfig,
        codecs: Codecs,
        specs: dict[str, dict[str, TensorSpec]],
        outbox: Outbox,
        pool: ThreadPoolExecutor,
        abort: threading.Event,
        live_peers=None,
        aggregate: str = "mean",
    ) -> None:
        self.transport, self.run_id, self.cfg, self.specs = transport, run_id, cfg, specs
        self.codec = codecs.update
        self.aggregate, self.outbox, self.abort = aggregate, outbox, abort
        self.gossip = Gossip(transport, run_id)
        self.fetcher = UpdateFetcher(transport, run_id, cfg, self.codec, specs, pool, abort, self.gossip)
        self.live_peers = live_peers  # who is still in the swarm: no round waits for peers that left
        self.deadline = AdaptiveDeadline(cfg.deadline_min, cfg.deadline_max)
        self.base_hashes: dict[tuple[int, str], str] = {}  # (round, unit) -> our start-weights hash
        self.applied: set[tuple[str, int, str]] = set()  # (peer, round, unit) already aggregated
        self.participants: dict[tuple[int, str], set[str]] = {}  # (round, unit) -> who took part
        self.off_base: dict[str, int] = {}  # unit -> rounds in a row we were outnumbered on our base
        self.misses: dict[str, int] = {}  # peer -> rounds in a row it announced and did not deliver
        self.missed_in: dict[str, int] = {}  # peer -> the last round counted in ``misses``
        self.behind: dict[str, int] = {}  # peer -> rounds in a row the deadline passed before it announced
        self.behind_in: dict[str, int] = {}  # peer -> the last round counted in ``behind``
        self.feedback: dict[str, ErrorFeedback] = {}  # unit -> what our last update's coding lost
        self.outer: dict[str, OuterStep] = {}
        self.reduce_scatter = ReduceScatter(self)
        self.inputs: list = []  # the unit's decoded updates (or pieces) of the round in progress
        self.sample: Callable[[], None] = lambda: None  # measures memory when the round holds the most

    @property
    def rejected(self) -> int:
        return self.fetcher.rejected

    def run(
        self,
        round_: int,
        unit: str,
        start: Tensors,
        end: Tensors,
        tokens: int,
        participants: list[str],
        counted: bool = True,
        grouped: bool = False,
    ) -> UnitRound:
        """The unit's new weights and who took part. With ``counted`` False (a newcomer's first round, which
        the others do not wait for) our update is neither announced nor aggregated. A ``grouped`` unit (the
        dense part: ``participants`` is a group in its agreed order, without us when we do not count) goes
        by reduce-scatter when the swarm says so and the group has three members or more."""
        self.gossip.follow(unit)
        try:
            if grouped and self.cfg.dense_exchange == "reduce_scatter" and len(participants) >= 3:
                result = self.reduce_scatter.run(round_, unit, start, end, tokens, participants, counted)
            else:
                result = self._all_to_all(round_, unit, start, end, tokens, participants, counted)
            self.sample()
            return result
        finally:
            self.inputs = []

    def _all_to_all(self, round_, unit, start, end, tokens, participants, counted) -> UnitRound:
        me = self.transport.peer_id
        base = tensors_hash(start)
        update = {n: end[n] - start[n] for n in start}
        diverged = not all(torch.isfinite(t).all() for t in update.values())
        if diverged:
            logger.warning("round %d %s: our update is not finite; taking the others' result", round_, unit)
        own = None
        if counted and not diverged:
            tokens = self.fetcher.clamped(tokens)
            own = Contribution(me, tokens, self._announce(round_, unit, update, end, tokens, base), round_)
        self.participants[(round_, unit)] = set(participants)
        others = sorted(set(participants) - {me})
        deadline = Deadline(self.deadline.seconds(), self.abort)
        fetched, missing, rejected = self.gather(round_, unit, others, deadline)
        late = self._late_updates(round_, unit, deadline)
        decision = decide(base, own, fetched, late)
        result = UnitRound(unit, [me], missing, rejected, decision.resync, diverged)
        if decision.differ:
            logger.info("round %d %s: %s started from other weights", round_, unit, decision.differ)
        if decision.resync or diverged:  # our weights are replaced: what our coding lost is moot
            self.feedback.pop(unit, None)
        if decision.resync:
            counting = self.resync(round_, unit, end, own, decision, deadline, result)
        else:
            outer = self.outer.setdefault(
                unit, OuterStep(self.cfg.outer, self.cfg.outer_lr, self.cfg.outer_momentum)
            )
            fallback = start if diverged else end
            result.new_weights, outliers = averaged(
                start, fallback, decision.contributions, outer, self.aggregate, me if own else None
            )
            self.count_outliers(result, outliers)
            counting = [c for c in decision.contributions if c.peer_id not in outliers]
            self.off_base[unit] = 0
        own_counts = own is not None and me in {c.peer_id for c in counting}  # (an outlier's does not)
        result.participants = sorted({c.peer_id for c in counting} | ({me} if own_counts else set()))
        self.applied |= {(c.peer_id, c.round, unit) for c in counting}
        return result

    def resync(self, round_, unit, end, own, decision, deadline, result: UnitRound) -> list[Contribution]:
        """Our new weights from the leading participants' end weights, each within reach of ours: a peer that
        sends far-off weights is not averaged in, and one that stays outnumbered downloads the unit."""
        me = self.transport.peer_id
        ends = [Contribution(me, own.tokens, end, round_)] if own and decision.ours_leads else []
        ends += self.fetcher.ends(round_, unit, decision.resync_from, deadline)
        reach = math.inf if own is None else RESYNC_FACTOR * norm_of(own.tensors)
        result.new_weights, far = resynchronized(end, ends, reach)
        self.count_outliers(result, far)
        self.outer.pop(unit, None)
        near = [e.peer_id for e in ends if e.peer_id not in far and e.peer_id != me]
        kept_off = not decision.ours_leads and not near  # outnumbered, and nobody in reach
        self.off_base[unit] = self.off_base.get(unit, 0) + 1 if kept_off else 0
        if not decision.ours_leads and near:
            # The leaders land on their combined result, which the mean of their end weights only nears:
            # taking it puts us on their base, bit for bit, for the next round (else we resync every round).
            result.download_from = near
        elif self.off_base[unit] >= RESYNC_LIMIT:
            logger.warning("%s: off the swarm's weights for %d rounds; downloading it", unit, RESYNC_LIMIT)
            result.download_from, self.off_base[unit] = [c.peer_id for c in decision.resync_from], 0
        return [e for e in ends if e.peer_id not in far]

    def count_outliers(self, result: UnitRound, peers: list[str]) -> None:
        others = sorted(set(peers) - {self.transport.peer_id})  # our own, when an outlier, is only left out
        for peer in others:
            self.fetcher.refuse(peer, result.unit, "its update lies far beyond the round's others")
        result.rejected = sorted(set(result.rejected) | set(others))

    def forget_before(self, round_: int, keep: int) -> None:
        horizon = round_ - keep - self.cfg.staleness
        self.fetcher.forget_before(horizon)
        self.base_hashes = {k: v for k, v in self.base_hashes.items() if k[0] > horizon}
        self.applied = {k for k in self.applied if k[1] > horizon}
        self.participants = {k: v for k, v in self.participants.items() if k[0] > horizon}
        # a residual carries only into the next round: one older than the round just landed is of a unit
        # given up (and would be dropped on its return anyway)
        self.feedback = {u: f for u, f in self.feedback.items() if f.round is None or f.round >= round_ - 1}

    # ----------------------------------------------------------------------------------- our update

    def _announce(
        self, round_: int, unit: str, update: Tensors, end: Tensors, tokens: int, base: str
    ) -> Tensors:
        """Codes, posts and announces our update; returns its decoded form, which is what we aggregate."""
        meta = payload_meta(unit, round_, "delta")
        feedback = self.feedback.setdefault(unit, ErrorFeedback(self.codec))
        payload, sent = feedback.encode(update, meta, round_)
        self.post(round_, unit, payload, end, tokens, base)
        return sent

    def post(
        self, round_: int, unit: str, payload: bytes, end: Tensors, tokens: int, base: str, pieces=()
    ) -> None:
        """Serves our update (whole ``payload``, or in ``pieces``) and the ``end`` weights behind it, and
        announces it."""
        end_payload = encode(end, EXACT, meta=payload_meta(unit, round_, "end"))
        posted = Posted(payload, end_payload, tokens, base, tuple(pieces))
        self.outbox.post_update(round_, unit, posted)
        self.base_hashes[(round_, unit)] = posted.base
        digests = [hashlib.sha256(p).hexdigest() for p in posted.pieces]
        announcement = Announcement(
            round=round_,
            tokens=posted.tokens,
            bytes=len(posted.payload) + sum(len(p) for p in posted.pieces),
            codec=self.codec.name,
            sha256=hashlib.sha256(posted.payload or "".join(digests).encode()).hexdigest(),
            base=posted.base,
            pieces=digests,
        )
        key = updates_key(self.run_id, round_, unit)
        self.transport.publish(key, announcement.encode(), self.transport.now() + ANNOUNCE_TTL)
        self.gossip.tell(unit, announcement)

    # ----------------------------------------------------------------------------------- the others

    def gather(self, round_: int, unit: str, others: list[str], deadline: Deadline, part=None):
        """Fetches the others' updates of this round (with ``part``, that part of them) until all that are
        waited for answered, left, or the deadline passed. The deadline adapts to when the last answer came,
        whoever is still missing."""
        started = last_answer = time.monotonic()
        wanted, got, refused, announcing = set(others), {}, set(), set()
        waiting = {p for p in others if self.misses.get(p, 0) < MISS_LIMIT}
        next_liveness_check = started + LIVENESS_CHECK_SECONDS

        def one_pass() -> bool | None:
            nonlocal last_answer, next_liveness_check
            announced = self.fetcher.announcements(round_, unit)
            announcing.update(announced)
            todo = [(round_, p, announced[p]) for p in sorted(wanted) if p in announced]
            outcomes = self.fetcher.updates(unit, todo, deadline, part)
            for (_, peer, _), outcome in zip(todo, outcomes, strict=True):
                if isinstance(outcome, Got | Refused | Gone):
                    wanted.discard(peer)
                    waiting.discard(peer)
                if isinstance(outcome, Got):
                    got[peer], last_answer = outcome.fetched, time.monotonic()
                elif isinstance(outcome, Refused):
                    refused.add(peer)
            if waiting and self.live_peers is not None and time.monotonic() >= next_liveness_check:
                waiting.intersection_update(self.live_peers())  # one whose records vanished has left
                next_liveness_check = time.monotonic() + LIVENESS_CHECK_SECONDS
            return True if not waiting else None

        if not poll(one_pass, deadline, POLL_SECONDS):
            logger.info("round %d %s: deadline passed without %s", round_, unit, sorted(waiting))
        self.inputs.extend(f.contribution.tensors for f in got.values())
        behind = {p for p in waiting - announcing if self.behind.get(p, 0) < MISS_LIMIT}
        if behind:  # cut off while still training: this peer ran ahead, and waits longer next round to fall
            self.deadline.observe(time.monotonic() - started)  # back into step (a fake holder: MISS_LIMIT)
        elif got:
            self.deadline.observe(last_answer - started)
        missing = sorted(set(others) - set(got) - refused)
        self._count_misses(round_, others, got, missing, announcing)
        return [got[p] for p in sorted(got)], missing, sorted(refused)

    def _count_misses(self, round_: int, others, got, missing, announcing) -> None:
        """Once a round per peer: one that announced its update and did not deliver it (silent, or slow)
        counts a miss; an answer resets the count. A peer merely behind (not announced yet) counts no miss:
        honest peers held up by someone else do not stop waiting for each other. It counts in ``behind``,
        which stretches the next deadline for at most ``MISS_LIMIT`` rounds in a row."""
        for peer in others:
            if peer in got:
                self.misses[peer] = self.behind[peer] = 0
            elif peer in missing and peer in announcing and self.missed_in.get(peer, -1) < round_:
                self.misses[peer] = self.misses.get(peer, 0) + 1
                self.missed_in[peer] = round_
            elif peer in missing and peer not in announcing and self.behind_in.get(peer, -1) < round_:
                self.behind[peer] = self.behind.get(peer, 0) + 1
                self.behind_in[peer] = round_

    def _late_updates(self, round_: int, unit: str, deadline: Deadline) -> list[Contribution]:
        """Updates of the last ``staleness`` rounds that came after those rounds closed, on our old base,
        from peers that took part in those rounds (nobody else may slip an update in)."""
        todo = []
        for past in range(max(0, round_ - self.cfg.staleness), round_):
            our_base = self.base_hashes.get((past, unit))
            took_part = self.participants.get((past, unit), set()) - {self.transport.peer_id}
            for peer, announced in sorted(self.fetcher.announcements(past, unit).items()):
                fresh = peer in took_part and (peer, past, unit) not in self.applied
                if fresh and our_base is not None and announced.base == our_base:
                    todo.append((past, peer, announced))
        outcomes = self.fetcher.updates(unit, todo, deadline)
        return [o.fetched.contribution for o in outcomes if isinstance(o, Got)]
