"""Reduce-scatter: how a group averages a unit that all its members train (the dense part), in two hops.

The group's members (``exchange.dense_group``, in its order) split the unit's flattened update into one
contiguous part each (``codecs.part_bounds``); member ``i`` owns part ``i``:

1. every member codes its update (with error feedback) as one piece per part, posts the pieces and announces
   their SHA-256s, with its start-weights hash as in the all-to-all exchange;
2. the owner of a part fetches that piece of every other member's update, exactly as the all-to-all
   exchange fetches whole updates (``gather.Gatherer``: same deadline, misses, checks and start-weights
   vote), combines the pieces on its base with the swarm's rule (``aggregate.combine``), codes the result
   once and serves it, naming the members it combined ("reduced"); a sparse codec codes it with room for
   every entry the pieces carried (``Codec.combined``), so only its values are rounded again;
3. every member fetches the other parts' results from their owners and decodes them (an owner decodes its
   own too), then applies the whole with the outer rule: members end with the same weights.

A member sends and receives about two unit-sized messages per round whatever the group's size: G - 1 pieces
of 1/G each way, then G - 1 combined parts each way.

A part whose owner does not serve it in time (it crashed, re-synchronizes on other start weights, or
serves a result that fails its checks) costs only that part: each member then fetches that part's pieces
from the members and combines them itself, the same pieces by the same rule, and codes the result as its
owner would have, so members still agree (also a member whose wait for the owner ran out while the others
got the owner's part, when it combined the same pieces).

A combined part is checked before use: it must decode, be finite, name only members of the group, and,
when it says it combined our piece, lie within ``REJECT_FACTOR`` times that piece's norm and point along
it (a cosine above ``screening.AGREE_MIN``: a part of zeros or noise fails too). A part that leaves our
piece out, and any part a member with no piece this round (a newcomer, or its update diverged) receives,
is held to the same bounds against the part as the member combines it itself from the members' pieces.
An owner can still steer its part within those bounds (a mild bend); a swarm that will not trust owners
with that sets ``sync.dense_exchange = "all_to_all"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.sync.aggregate import REJECT_FACTOR, Combined, Contribution, Received, combine
from spes_p2p.sync.codecs import Codec, TensorSpec, part_bounds
from spes_p2p.sync.exchange import Exchange
from spes_p2p.sync.fetching import Reduced, Refused
from spes_p2p.sync.gather import Gathered
from spes_p2p.sync.jobs import UnitJob, UnitResult
from spes_p2p.sync.payload import decode, encode, flatten, payload_meta, unflatten
from spes_p2p.sync.screening import AGREE_MIN, cosine, screen

POLL_SECONDS = 0.1  # between asks for the combined parts not served yet

Tensors = dict[str, torch.Tensor]


@dataclass
class _Split:
    """Our side of a grouped unit's round: how its flattened update is split, the tokens our update counts
    for, and our pieces as they decode (None: our update does not count this round)."""

    bounds: list[tuple[int, int]]
    tokens: int
    pieces: list[torch.Tensor] | None = None

    def own(self, me: str, round_: int, part: int) -> Contribution | None:
        if self.pieces is None:
            return None
        return Contribution(me, self.tokens, {"piece": self.pieces[part]}, round_)


class ReduceScatter(Exchange):
    def run(self, job: UnitJob) -> UnitResult:
        group, unit = job.participants, job.unit
        numel = sum(s.numel for s in self.specs[unit].values())
        split = _Split(part_bounds(numel, len(group)), self.fetcher.clamped(job.tokens))
        self.ledger.opened(job.round, unit, group)
        if self.me not in group:  # a newcomer's first round: it takes the group's result
            return self._follow(job, split)
        mine = group.index(self.me)
        if job.counted and not job.diverged:
            split.pieces = self._post_pieces(job, split)
        deadline = self.gatherer.round_deadline(job.unit)
        gathered = self.gatherer.gather(job.round, unit, job.others(self.me), deadline, (mine, len(group)))
        own = split.own(self.me, job.round, mine)
        result, decision = self.settle(job, own, gathered, [])
        if decision.resync:  # we combine nothing this round: the others combine our part themselves
            whole = None if own is None else self._whole(unit, split.pieces)
            mean = None if whole is None else Contribution(self.me, split.tokens, whole, job.round)
            return self.resync(job, mean, decision, deadline, result)
        screened = self.screen(job, result, decision.contributions, whole=False)
        combined = combine(screened, self.aggregate, self.me if own else None)
        self.count_outliers(result, combined.rejected)
        parts = self._collect(job, split, {mine: self._post_reduced(job, split, mine, combined)})
        return self._apply(job, job.start if job.diverged else job.end, parts, result)

    def _follow(self, job: UnitJob, split: _Split) -> UnitResult:
        """Not a member: the group's combined parts applied to our start weights when they are the group's,
        or (they are not) the members' end weights averaged."""
        deadline = self.gatherer.round_deadline(job.unit)

        def bases() -> dict | None:  # (from the members that still take part)
            announced = self.gatherer.announcements(job.round, job.unit)
            members = self.gatherer.taking_part(job.round, job.unit, job.participants)
            return announced if members <= set(announced) else None

        announced = poll(bases, deadline, POLL_SECONDS) or self.gatherer.announcements(job.round, job.unit)
        members = [
            Received(Contribution(p, self.fetcher.clamped(a.tokens), {}, job.round), a.base)
            for p, a in sorted(announced.items())
            if p in job.participants
        ]
        result, decision = self.settle(job, None, Gathered(members, [], []), [])
        if decision.resync or not members:
            return self.resync(job, None, decision, deadline, result)
        return self._apply(job, job.start, self._collect(job, split, {}), result)

    def _apply(self, job: UnitJob, fallback: Tensors, parts: list[Reduced], result: UnitResult) -> UnitResult:
        """The parts' combined updates applied to the start weights with the outer rule (``fallback`` when
        nobody's update arrived anywhere)."""
        peers = set().union(*(p.contributors for p in parts))
        if peers:
            whole = self._whole(job.unit, [p.piece for p in parts])
            result.new_weights = self.ledger.outer(job.unit).apply(job.start, whole)
        else:
            result.new_weights = {n: t.clone() for n, t in fallback.items()}
        return self.close(job, result, peers)

    # ---------------------------------------------------------------------------------- our pieces

    def _post_pieces(self, job: UnitJob, split: _Split) -> list[torch.Tensor]:
        """Codes our update (plus what coding lost last round) as one piece per part, posts and announces
        them; returns the pieces as they decode."""
        feedback = self.ledger.feedback(job.unit)
        full = feedback.carry(job.update, job.round)
        flat = flatten(full)
        payloads, decoded = [], []
        for part, (a, b) in enumerate(split.bounds):
            meta = payload_meta(job.unit, job.round, "piece", part, len(split.bounds))
            payloads.append(self._encode(flat[a:b], meta))
            decoded.append(self._decode(payloads[-1], b - a, meta))
        feedback.keep(full, self._whole(job.unit, decoded), job.round)
        self.post(job, split.tokens, b"", tuple(payloads))
        return decoded

    def _post_reduced(self, job: UnitJob, split: _Split, part: int, combined: Combined) -> Reduced:
        """Serves our part's combined update; returns it as it decodes."""
        payload, reduced = self._coded(job, split, part, combined)
        self.outbox.post_reduced(job.round, job.unit, part, len(split.bounds), payload)
        return reduced

    def _coded(self, job: UnitJob, split: _Split, part: int, combined: Combined) -> tuple[bytes, Reduced]:
        """A part's combined update (zeros when nothing arrived) as its owner serves it, and as that decodes:
        members that combine the same pieces get the same numbers, whether from the owner or by themselves."""
        a, b = split.bounds[part]
        piece = combined.update["piece"] if combined.used else torch.zeros(b - a)
        contributors = sorted(c.peer_id for c in combined.used)
        parts = len(split.bounds)
        meta = {**payload_meta(job.unit, job.round, "reduced", part, parts), "peers": ",".join(contributors)}
        codec = self.codec.combined(parts)
        payload = self._encode(piece, meta, codec)
        return payload, Reduced(self._decode(payload, b - a, meta, codec), contributors)

    # ---------------------------------------------------------------------------------- the others

    def _collect(self, job: UnitJob, split: _Split, got: dict[int, Reduced]) -> list[Reduced]:
        """Every part's combined update (``got``: those we have): from its owner, or combined here from its
        pieces. An owner that missed ``MISS_LIMIT`` rounds in a row is not waited for."""
        group, parts = job.participants, len(split.bounds)
        pending = set(range(parts)) - set(got)
        fallback = {j for j in pending if not self.ledger.waited_for(group[j])}
        deadline = self.gatherer.round_deadline(job.unit)

        def one_pass() -> bool | None:
            announced = self.gatherer.announcements(job.round, job.unit)
            live = self.gatherer.taking_part(job.round, job.unit, group)
            for j in sorted(pending):  # an owner on other start weights, or gone, combines nothing for us
                if group[j] not in live or (group[j] in announced and announced[group[j]].base != job.base):
                    fallback.add(j)
            pending.difference_update(fallback)
            owners = {j: group[j] for j in sorted(pending)}
            for j, outcome in self.fetcher.reduced(job.round, job.unit, owners, parts, deadline).items():
                if isinstance(outcome, Reduced):
                    # (a member with no piece checks against the pieces it can fetch within this deadline,
                    # so that a dead member delays all the parts' references by one deadline, not one each)
                    here = partial(self._combine_here, job, split, j, deadline)
                    problem = self._problem(outcome, group, split.pieces[j] if split.pieces else None, here)
                    if not problem:
                        got[j] = outcome
                        pending.discard(j)
                        continue
                    outcome = self.fetcher.refuse(group[j], job.unit, problem)
                if isinstance(outcome, Refused):
                    pending.discard(j)
                    fallback.add(j)
            return True if not pending else None

        poll(one_pass, deadline, POLL_SECONDS)
        for j in sorted(fallback | pending):
            got[j] = self._combine_here(job, split, j)
        return [got[j] for j in range(parts)]

    def _problem(
        self, reduced: Reduced, group: tuple[str, ...], own: torch.Tensor | None, here: Callable[[], Reduced]
    ) -> str:
        """Why a combined part from its owner cannot be used ('' when it can). It is checked against our
        own piece of it when it says it combined that piece, else (it left ours out, or we have none: our
        update does not count this round, or its piece is zero) against the part as we combine it ourselves
        from the members' pieces (``here``): an owner cannot dodge the check by leaving us out."""
        if not set(reduced.contributors) <= set(group):
            return "its combined part names peers outside the group"
        if own is not None and float(own.norm()) > 0 and self.me in reduced.contributors:
            reference, what = own, "our own piece of it"
        else:
            local = here()
            if not local.contributors:  # we fetched no piece either: nothing to check against
                return ""
            reference, what = local.piece, "the part as we combine it from the pieces"
        if float(reduced.piece.norm()) > REJECT_FACTOR * float(reference.norm()):
            return f"its combined part lies far beyond {what}"
        if not cosine({"p": reduced.piece}, {"p": reference}) > AGREE_MIN:  # (zeros and noise too)
            return f"its combined part does not point along {what}"
        return ""

    def _combine_here(
        self, job: UnitJob, split: _Split, part: int, deadline: Deadline | None = None
    ) -> Reduced:
        """A part whose owner failed us: its pieces, fetched from the members on our base (within a deadline
        of its own unless given one), combined here. Every member that does this combines the same pieces,
        with no reference of its own, and agrees."""
        others = [p for p in job.participants if p != self.me]
        where = (part, len(split.bounds))
        deadline = deadline or self.gatherer.round_deadline(job.unit)
        contributions = self.gatherer.pieces(job.round, job.unit, others, job.base, where, deadline)
        own = split.own(self.me, job.round, part)
        pieces = contributions + ([own] if own else [])
        combined = combine(screen(pieces, {}, None).kept, self.aggregate)
        return self._coded(job, split, part, combined)[1]

    # ---------------------------------------------------------------------------------- helpers

    def _whole(self, unit: str, pieces: list[torch.Tensor]) -> Tensors:
        return unflatten(torch.cat(pieces), self.specs[unit])

    def _encode(self, piece: torch.Tensor, meta: dict[str, str], codec: Codec | None = None) -> bytes:
        return encode({"piece": piece}, codec or self.codec, meta=meta)

    def _decode(
        self, payload: bytes, numel: int, meta: dict[str, str], codec: Codec | None = None
    ) -> torch.Tensor:
        return decode(payload, {"piece": TensorSpec((numel,))}, codec or self.codec, meta=meta)["piece"]
