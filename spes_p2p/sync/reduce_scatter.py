"""Reduce-scatter: how a group averages a unit that all its members train (the dense part), in two hops.

The group's members (``exchange.dense_group``, in its order) split the unit's flattened update into one
contiguous part each (``codecs.part_bounds``); member ``i`` owns part ``i``:

1. every member codes its update (with error feedback) as one piece per part, posts the pieces and announces
   their SHA-256s, with its start-weights hash as in the all-to-all exchange;
2. the owner of a part fetches that piece of every other member's update, exactly as the all-to-all
   exchange fetches whole updates (same deadline, misses, checks and start-weights vote), combines the
   pieces on its base with the swarm's rule (``aggregate.combine``), codes the result once and serves it,
   naming the members it combined ("reduced");
3. every member fetches the other parts' results from their owners and decodes them (an owner decodes its
   own too), then applies the whole with the outer rule: members end with the same weights.

A member sends and receives about two unit-sized messages per round whatever the group's size: G - 1 pieces
of 1/G each way, then G - 1 combined parts each way.

A part whose owner does not serve it in time (it crashed, re-synchronizes on other start weights, or
serves a result that fails its checks) costs only that part: each member then fetches that part's pieces
from the members and combines them itself, the same pieces by the same rule, so members still agree.

A combined part is checked before use: it must decode, be finite, name only members of the group, lie
within ``REJECT_FACTOR`` times the norm of our own piece of it, and not point against our piece when ours
is among those it combined. A member with no piece this round (a newcomer, or its update diverged) checks
the part against the one it combines itself from the members' pieces instead. An owner can still steer
its part within those bounds (a mild sign-flip); a swarm that will not trust owners with that sets
``[sync] dense_exchange = "all_to_all"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.sync.aggregate import (
    REJECT_FACTOR,
    Combined,
    Contribution,
    Fetched,
    OuterStep,
    combine,
    decide,
)
from spes_p2p.sync.codecs import TensorSpec, part_bounds
from spes_p2p.sync.fetching import Got, Reduced, Refused
from spes_p2p.sync.outcome import MISS_LIMIT, UnitRound, tensors_hash
from spes_p2p.sync.payload import ErrorFeedback, decode, encode, flatten, payload_meta, unflatten

if TYPE_CHECKING:
    from spes_p2p.sync.exchange import Exchange

POLL_SECONDS = 0.1  # between asks for the combined parts not served yet

Tensors = dict[str, torch.Tensor]


@dataclass
class _Round:
    """One member's view of a grouped unit's round."""

    round: int
    unit: str
    group: list[str]
    base: str  # the hash of our start weights
    bounds: list[tuple[int, int]]  # each part's range of the flattened unit
    tokens: int
    pieces: list[torch.Tensor] | None = None  # our update's parts as they decode; None: ours does not count

    def own(self, me: str, part: int) -> Contribution | None:
        if self.pieces is None:
            return None
        return Contribution(me, self.tokens, {"piece": self.pieces[part]}, self.round)


class ReduceScatter:
    """A grouped unit's round, on the exchange's state (fetcher, deadline, misses, outer steps, error
    feedback). Sync thread only."""

    def __init__(self, exchange: Exchange) -> None:
        self.x = exchange
        self.me = exchange.transport.peer_id

    def run(
        self,
        round_: int,
        unit: str,
        start: Tensors,
        end: Tensors,
        tokens: int,
        group: list[str],
        counted: bool,
    ) -> UnitRound:
        x, me = self.x, self.me
        numel = sum(s.numel for s in x.specs[unit].values())
        bounds = part_bounds(numel, len(group))
        r = _Round(round_, unit, group, tensors_hash(start), bounds, x.fetcher.clamped(tokens))
        x.participants[(round_, unit)] = set(group)
        update = {n: end[n] - start[n] for n in start}
        diverged = not all(torch.isfinite(t).all() for t in update.values())
        if me not in group:  # a newcomer's first round: it takes the group's result
            return self._follow(r, start, end, UnitRound(unit, [], [], [], diverged=diverged))
        mine = group.index(me)
        if counted and not diverged:
            r.pieces = self._post_pieces(r, update, end)
        deadline = Deadline(x.deadline.seconds(), x.abort)
        others = [p for p in group if p != me]
        fetched, missing, rejected = x.gather(round_, unit, others, deadline, (mine, len(group)))
        own = r.own(me, mine)
        decision = decide(r.base, own, fetched, [])
        result = UnitRound(unit, [me], missing, rejected, decision.resync, diverged)
        if decision.resync or diverged:
            x.feedback.pop(unit, None)
        if decision.resync:  # we combine nothing this round: the others combine our part themselves
            whole = None if own is None else Contribution(me, r.tokens, self._whole(unit, r.pieces), round_)
            counting = x.resync(round_, unit, end, whole, decision, deadline, result)
            leads = whole is not None and decision.ours_leads
            return self._close(r, result, {c.peer_id for c in counting} | ({me} if leads else set()))
        x.off_base[unit] = 0
        combined = combine(decision.contributions, x.aggregate, me if own else None)
        x.count_outliers(result, combined.rejected)
        parts = self._collect(r, {mine: self._post_reduced(r, mine, combined)})
        return self._apply(r, start, start if diverged else end, parts, result)

    def _follow(self, r: _Round, start: Tensors, end: Tensors, result: UnitRound) -> UnitRound:
        """Not a member: the group's combined parts applied to our start weights when they are the group's,
        or (they are not) the members' end weights averaged."""
        x = self.x
        deadline = Deadline(x.deadline.seconds(), x.abort)

        def bases() -> dict | None:
            announced = x.fetcher.announcements(r.round, r.unit)
            return announced if set(r.group) <= set(announced) else None

        announced = poll(bases, deadline, POLL_SECONDS) or x.fetcher.announcements(r.round, r.unit)
        members = [
            Fetched(Contribution(p, x.fetcher.clamped(a.tokens), {}, r.round), a.base)
            for p, a in sorted(announced.items())
            if p in r.group
        ]
        decision = decide(r.base, None, members, [])
        if decision.resync or not members:
            result.resynced = decision.resync
            counting = x.resync(r.round, r.unit, end, None, decision, deadline, result)
            return self._close(r, result, {c.peer_id for c in counting})
        return self._apply(r, start, start, self._collect(r, {}), result)

    def _apply(
        self, r: _Round, start: Tensors, fallback: Tensors, parts: list[Reduced], result: UnitRound
    ) -> UnitRound:
        """The parts' combined updates applied to ``start`` with the outer rule (``fallback`` when nobody's
        update arrived anywhere)."""
        x = self.x
        peers = set().union(*(p.contributors for p in parts))
        if peers:
            rule = x.outer.setdefault(r.unit, OuterStep(x.cfg.outer, x.cfg.outer_lr, x.cfg.outer_momentum))
            result.new_weights = rule.apply(start, self._whole(r.unit, [p.piece for p in parts]))
        else:
            result.new_weights = {n: t.clone() for n, t in fallback.items()}
        return self._close(r, result, peers)

    def _close(self, r: _Round, result: UnitRound, peers: set[str]) -> UnitRound:
        result.participants = sorted(peers)
        self.x.applied |= {(p, r.round, r.unit) for p in peers}
        return result

    # ---------------------------------------------------------------------------------- our pieces

    def _post_pieces(self, r: _Round, update: Tensors, end: Tensors) -> list[torch.Tensor]:
        """Codes our update (plus what coding lost last round) as one piece per part, posts and announces
        them; returns the pieces as they decode."""
        x = self.x
        feedback = x.feedback.setdefault(r.unit, ErrorFeedback(x.codec))
        full = feedback.carry(update, r.round)
        flat = flatten(full)
        payloads, decoded = [], []
        for part, (a, b) in enumerate(r.bounds):
            meta = payload_meta(r.unit, r.round, "piece", part, len(r.bounds))
            payloads.append(self._encode(flat[a:b], meta))
            decoded.append(self._decode(payloads[-1], b - a, meta))
        feedback.keep(full, self._whole(r.unit, decoded), r.round)
        x.post(r.round, r.unit, b"", end, r.tokens, r.base, payloads)
        return decoded

    def _post_reduced(self, r: _Round, part: int, combined: Combined) -> Reduced:
        """Serves our part's combined update (zeros when nothing arrived); returns it as it decodes."""
        a, b = r.bounds[part]
        piece = combined.update["piece"] if combined.used else torch.zeros(b - a)
        contributors = sorted(c.peer_id for c in combined.used)
        meta = {
            **payload_meta(r.unit, r.round, "reduced", part, len(r.group)),
            "peers": ",".join(contributors),
        }
        payload = self._encode(piece, meta)
        self.x.outbox.post_reduced(r.round, r.unit, part, len(r.group), payload)
        return Reduced(self._decode(payload, b - a, meta), contributors)

    # ---------------------------------------------------------------------------------- the others

    def _collect(self, r: _Round, got: dict[int, Reduced]) -> list[Reduced]:
        """Every part's combined update (``got``: those we have): from its owner, or combined here from its
        pieces. An owner that missed ``MISS_LIMIT`` rounds in a row is not waited for."""
        x, group, parts = self.x, r.group, len(r.group)
        pending = set(range(parts)) - set(got)
        fallback = {j for j in pending if x.misses.get(group[j], 0) >= MISS_LIMIT}
        deadline = Deadline(x.deadline.seconds(), x.abort)

        def ask(j: int):
            return x.fetcher.reduced(r.round, r.unit, group[j], j, parts, deadline)

        def one_pass() -> bool | None:
            announced = x.fetcher.announcements(r.round, r.unit)
            live = x.live_peers() if x.live_peers is not None else set(group)
            for j in sorted(pending):  # an owner on other start weights, or gone, combines nothing for us
                if group[j] not in live or (group[j] in announced and announced[group[j]].base != r.base):
                    fallback.add(j)
            pending.difference_update(fallback)
            todo = sorted(pending)
            for j, outcome in zip(todo, x.fetcher.pool.map(ask, todo), strict=True):
                if isinstance(outcome, Reduced):
                    # (a member with no piece checks against the pieces it can fetch within this deadline,
                    # so that a dead member delays all the parts' references by one deadline, not one each)
                    here = partial(self._combine_here, r, j, deadline)
                    problem = self._problem(outcome, group, r.pieces[j] if r.pieces else None, here)
                    if not problem:
                        got[j] = outcome
                        pending.discard(j)
                        continue
                    outcome = x.fetcher.refuse(group[j], r.unit, problem)
                if isinstance(outcome, Refused):
                    pending.discard(j)
                    fallback.add(j)
            return True if not pending else None

        poll(one_pass, deadline, POLL_SECONDS)
        for j in sorted(fallback | pending):
            got[j] = self._combine_here(r, j)
        return [got[j] for j in range(parts)]

    def _problem(
        self, reduced: Reduced, group: list[str], own: torch.Tensor | None, here: Callable[[], Reduced]
    ) -> str:
        """Why a combined part from its owner cannot be used ('' when it can). It is checked against our
        own piece of it or, when we have none (our update does not count this round, or its piece is
        zero), against the part as we combine it ourselves from the members' pieces (``here``)."""
        if not set(reduced.contributors) <= set(group):
            return "its combined part names peers outside the group"
        if own is not None and float(own.norm()) > 0:
            reference, what, signed = own, "our own piece of it", self.me in reduced.contributors
        else:
            local = here()
            if not local.contributors:  # we fetched no piece either: nothing to check against
                return ""
            reference, what, signed = local.piece, "the part as we combine it from the pieces", True
        if float(reduced.piece.norm()) > REJECT_FACTOR * float(reference.norm()):
            return f"its combined part lies far beyond {what}"
        if signed and float(reduced.piece @ reference) < 0:
            return f"its combined part points against {what}"
        return ""

    def _combine_here(self, r: _Round, part: int, deadline: Deadline | None = None) -> Reduced:
        """A part whose owner failed us: its pieces, fetched from the members on our base (within a deadline
        of its own unless given one), combined here. Every member that does this combines the same pieces,
        with no reference of its own, and agrees."""
        x = self.x
        announced = x.fetcher.announcements(r.round, r.unit)
        todo = [
            (r.round, p, a)
            for p, a in sorted(announced.items())
            if p in r.group and p != self.me and a.base == r.base
        ]
        deadline = deadline or Deadline(x.deadline.seconds(), x.abort)
        outcomes = x.fetcher.updates(r.unit, todo, deadline, (part, len(r.group)))
        contributions = [o.fetched.contribution for o in outcomes if isinstance(o, Got)]
        own = r.own(self.me, part)
        combined = combine(contributions + ([own] if own else []), x.aggregate)
        if not combined.used:
            a, b = r.bounds[part]
            return Reduced(torch.zeros(b - a), [])
        return Reduced(combined.update["piece"], sorted(c.peer_id for c in combined.used))

    # ---------------------------------------------------------------------------------- helpers

    def _whole(self, unit: str, pieces: list[torch.Tensor]) -> Tensors:
        return unflatten(torch.cat(pieces), self.x.specs[unit])

    def _encode(self, piece: torch.Tensor, meta: dict[str, str]) -> bytes:
        return encode({"piece": piece}, self.x.codec, meta=meta)

    def _decode(self, payload: bytes, numel: int, meta: dict[str, str]) -> torch.Tensor:
        spec = {"piece": TensorSpec((numel,))}
        return decode(payload, spec, self.x.codec, meta=meta)["piece"]
