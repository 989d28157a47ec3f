"""One unit's exchange in one round, among the peers that trained it (docs/protocol.md, "A round"), and the
steps its two strategies share:

- ``AllToAll`` (``all_to_all.py``): every participant fetches every other's whole update;
- ``ReduceScatter`` (``reduce_scatter.py``): a group's members each combine one part of the update and
  serve it (the dense part, in groups of three or more).

Both post our update (coded with error feedback: what the codec lost last round is added to this round's;
we decode our own payload too, so every holder combines exactly the same numbers) and announce it, unless
it does not count or is not finite; gather the others' (``gather.Gatherer``); and **settle** the round the
same way: ``aggregate.decide`` says whether the participants' updates are combined on our start weights, or
whether (our start weights are outnumbered) we re-synchronize on the leading participants' end weights.
What carries across rounds is the ``Ledger``'s; each strategy keeps only its round's own state.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from abc import ABC, abstractmethod

import torch

from spes_p2p.net.waiting import Deadline
from spes_p2p.swarm.records import Announcement
from spes_p2p.sync.aggregate import RESYNC_FACTOR, Contribution, Decision, decide, norm_of, resynchronized
from spes_p2p.sync.codecs import EXACT, Codec, TensorSpec
from spes_p2p.sync.fetching import UpdateFetcher
from spes_p2p.sync.gather import Gathered, Gatherer
from spes_p2p.sync.jobs import UnitJob, UnitResult
from spes_p2p.sync.ledger import RESYNC_LIMIT, Ledger
from spes_p2p.sync.payload import encode, payload_meta
from spes_p2p.sync.screening import screen
from spes_p2p.sync.serving import Outbox, Posted

logger = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


Grid = tuple[tuple[str, ...], ...]


def dense_grid(peers: list[str], round_: int, run_id: str, size: int) -> Grid:
    """This round's rows of a grouped unit's participants: at most ``size`` peers each, their lengths within
    one of each other, in an order every participant computes alike (``reduce_scatter.py``: each row averages
    on its own, then the rows merge)."""
    order = sorted(peers)
    random.Random(f"{run_id}:{round_}").shuffle(order)
    rows = max(1, -(-len(order) // size))
    return tuple(tuple(order[i::rows]) for i in range(rows))


def dense_group(grid: Grid, me: str) -> tuple[str, ...]:
    """Our row of the grid; a peer that is not in it (a newcomer whose first round does not count) gets the
    row it follows."""
    mine = [row for row in grid if me in row]
    if mine or not grid[0]:
        return mine[0] if mine else (me,)
    return grid[int(hashlib.sha256(me.encode()).hexdigest(), 16) % len(grid)]


def owner(row: tuple[str, ...], part: int) -> str:
    """Who combines a part in a row: its member at that place (in a row one shorter than the grid's longest,
    the first member owns the last part too, so every row splits the unit alike)."""
    return row[part % len(row)]


class Exchange(ABC):
    """A strategy for a unit's round. Runs on the sync thread."""

    def __init__(
        self,
        me: str,
        codec: Codec,
        specs: dict[str, dict[str, TensorSpec]],
        aggregate: str,
        outbox: Outbox,
        ledger: Ledger,
        gatherer: Gatherer,
        fetcher: UpdateFetcher,
    ) -> None:
        """``codec``: how updates travel; ``aggregate``: the rule that combines them (``aggregate.combine``);
        the ledger, the gatherer and the fetcher are shared by both strategies."""
        self.me, self.codec, self.specs, self.aggregate = me, codec, specs, aggregate
        self.outbox, self.ledger, self.gatherer, self.fetcher = outbox, ledger, gatherer, fetcher

    @abstractmethod
    def run(self, job: UnitJob) -> UnitResult:
        """The unit's new weights, and who took part."""

    def post(self, job: UnitJob, tokens: int, payload: bytes, pieces: tuple[bytes, ...] = ()) -> None:
        """Serves our update (whole ``payload``, or in ``pieces``) and the end weights behind it, and
        announces it."""
        end = encode(job.end, EXACT, meta=payload_meta(job.unit, job.round, "end"))
        self.outbox.post_update(job.round, job.unit, Posted(payload, end, tokens, job.base, pieces))
        self.ledger.posted(job.round, job.unit, job.base)
        digests = [hashlib.sha256(p).hexdigest() for p in pieces]
        announcement = Announcement(
            round=job.round,
            tokens=tokens,
            bytes=len(payload) + sum(len(p) for p in pieces),
            codec=self.codec.name,
            sha256=hashlib.sha256(payload or "".join(digests).encode()).hexdigest(),
            base=job.base,
            pieces=digests,
        )
        self.gatherer.announce(job.round, job.unit, announcement)

    def settle(
        self, job: UnitJob, own: Contribution | None, gathered: Gathered, late: list[Contribution]
    ) -> tuple[UnitResult, Decision]:
        """How the round ends, from our contribution (``own``, as it decodes; None when it does not count)
        and what was gathered: the strategy then either ``resync``s or combines ``decision.contributions``
        and closes the result."""
        decision = decide(job.base, own, gathered.received, late)
        result = UnitResult(
            job.unit,
            [self.me],
            gathered.missing,
            gathered.refused,
            apart=decision.differ,
            resynced=decision.resync,
            diverged=job.diverged,
        )
        if decision.differ:
            logger.info("round %d %s: %s started from other weights", job.round, job.unit, decision.differ)
        if decision.resync or job.diverged:  # our weights are replaced: what our coding lost is moot
            self.ledger.replaced(job.unit)
        if not decision.resync:
            self.ledger.on_base(job.unit)
        return result, decision

    def resync(
        self,
        job: UnitJob,
        whole: Contribution | None,
        decision: Decision,
        deadline: Deadline,
        result: UnitResult,
    ) -> UnitResult:
        """Our new weights from the leading participants' end weights, each within reach of ours (``whole``:
        our whole update as it decodes, when it counts): a peer that sends far-off weights is not averaged
        in, and one that stays outnumbered downloads the unit."""
        ends = (
            [Contribution(self.me, whole.tokens, job.end, job.round)] if whole and decision.ours_leads else []
        )
        ends += self.fetcher.ends(job.round, job.unit, decision.resync_from, deadline)
        reach = math.inf if whole is None else RESYNC_FACTOR * norm_of(whole.tensors)
        result.new_weights, far = resynchronized(job.end, ends, reach)
        self.count_outliers(result, far)
        self.ledger.restart_outer(job.unit)
        near = [e.peer_id for e in ends if e.peer_id not in far and e.peer_id != self.me]
        if decision.ours_leads or near:
            self.ledger.on_base(job.unit)
            if not decision.ours_leads:
                # The leaders land on their combined result, which the mean of their end weights only nears:
                # taking it puts us on their base, bit for bit, next round (else we resync every round).
                result.download_from = near
        elif self.ledger.kept_off_base(job.unit):  # outnumbered, and nobody in reach, for too long
            logger.warning(
                "%s: off the swarm's weights for %d rounds; downloading it", job.unit, RESYNC_LIMIT
            )
            result.download_from = [c.peer_id for c in decision.resync_from]
        return self.close(job, result, {e.peer_id for e in ends if e.peer_id not in far})

    def screen(
        self, job: UnitJob, result: UnitResult, updates: list[Contribution], whole: bool = True
    ) -> list[Contribution]:
        """The updates (``whole``, or pieces of one part of a reduce-scatter: screened without the probe,
        as a piece moves the loss by a sliver) that pass their screening (``screening.screen``) as the
        round combines them; the others are refused or left out, with the reason, and every update's score
        goes in the result. Each refusal and each kept update goes into the peer's score (``Guard.score``):
        only screening's, which every holder decides alike (a peer off the swarm's weights finds the honest
        ones far off: its refusals of them must not ban them); what is left out, on no evidence against
        its peer, does not."""
        screened = screen(updates, job.start, job.probe if whole else None)
        for peer, reason in sorted(screened.refused.items()):
            if peer == self.me:
                logger.warning("round %d %s: our update fails its screening: %s", job.round, job.unit, reason)
            else:
                self.fetcher.refuse(peer, job.unit, reason)
                self.fetcher.rate(peer, 0.0)
        for peer, reason in sorted(screened.left_out.items()):
            whose = "our" if peer == self.me else f"{peer}'s"
            logger.info("round %d %s: %s update is left out: %s", job.round, job.unit, whose, reason)
        result.rejected = sorted(set(result.rejected) | set(screened.refused) - {self.me})
        result.left_out = sorted(set(screened.left_out) - {self.me})
        result.scores.update(screened.scores)
        for c in screened.kept:
            if c.peer_id != self.me:
                self.fetcher.rate(c.peer_id, 1.0)
        return screened.kept

    def count_outliers(self, result: UnitResult, peers: list[str]) -> None:
        """Refuses the updates of ``peers`` (but ours, which is only left out) that lie far from the rest."""
        others = sorted(set(peers) - {self.me})
        for peer in others:
            self.fetcher.refuse(peer, result.unit, "its update lies far beyond the round's others")
        result.rejected = sorted(set(result.rejected) | set(others))

    def close(self, job: UnitJob, result: UnitResult, peers: set[str]) -> UnitResult:
        """The round's participants are ``peers``: their updates of it are applied. Those it refused or
        left out are settled too: they came in time, and must not come back as late updates next round."""
        result.participants = sorted(peers)
        self.ledger.settle(peers | set(result.rejected) | set(result.left_out), job.round, job.unit)
        return result
