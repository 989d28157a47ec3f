"""The all-to-all exchange: every participant fetches every other's whole update of the unit, and all
combine the same updates alike (``exchange.py`` has the steps it shares with the reduce-scatter)."""

from __future__ import annotations

import logging

from spes_p2p.sync.aggregate import Contribution, averaged
from spes_p2p.sync.exchange import Exchange
from spes_p2p.sync.jobs import UnitJob, UnitResult
from spes_p2p.sync.payload import payload_meta

logger = logging.getLogger(__name__)


class AllToAll(Exchange):
    def run(self, job: UnitJob) -> UnitResult:
        own = None
        if job.diverged:
            logger.warning(
                "round %d %s: our update is not finite; taking the others' result", job.round, job.unit
            )
        elif job.counted:
            own = self._post(job)
        self.ledger.opened(job.round, job.unit, job.participants)
        deadline = self.gatherer.round_deadline(job.unit)
        gathered = self.gatherer.gather(job.round, job.unit, job.others(self.me), deadline)
        late = self.gatherer.late_updates(job, deadline)
        result, decision = self.settle(job, own, gathered, late)
        if decision.resync:
            return self.resync(job, own, decision, deadline, result)
        outer = self.ledger.outer(job.unit)
        fallback = job.start if job.diverged else job.end
        screened = self.screen(job, result, decision.contributions)
        result.new_weights, outliers = averaged(
            job.start, fallback, screened, outer, self.aggregate, self.me if own else None
        )
        self.count_outliers(result, outliers)
        return self.close(job, result, {c.peer_id for c in screened if c.peer_id not in outliers})

    def _post(self, job: UnitJob) -> Contribution:
        """Codes, posts and announces our update; returns it as it decodes, which is what we combine."""
        tokens = self.fetcher.clamped(job.tokens)
        meta = payload_meta(job.unit, job.round, "delta")
        payload, sent = self.ledger.feedback(job.unit).encode(job.update, meta, job.round)
        self.post(job, tokens, payload)
        return Contribution(self.me, tokens, sent, job.round)
