"""Reduce-scatter: how the participants of a unit that all of them train (the dense part) average it, in
rows of at most G that merge.

The round's grid (``exchange.dense_grid``) deals the participants into rows, in an order each computes alike.
Every row splits the unit's flattened update alike, into one contiguous part per member of the longest row
(``codecs.part_bounds``); member ``i`` of a row owns part ``i`` (``exchange.owner``: in a row one shorter,
the first member owns the last part too):

1. every member codes its update (with error feedback) as one piece per part, posts the pieces and announces
   their SHA-256s, with its start-weights hash as in the all-to-all exchange;
2. the owner of a part fetches that piece of every other member's update, exactly as the all-to-all
   exchange fetches whole updates (``gather.Gatherer``: same deadline, misses, checks and start-weights
   vote), combines the pieces on its base with the swarm's rule (``aggregate.combine``), codes the result
   once and serves it, naming the members it combined ("reduced"); a sparse codec codes it with room for
   every entry the pieces carried (``Codec.combined``), so only its values are rounded again;
3. with several rows, the owner of a part fetches that part's "reduced" from its owner in every other row,
   and combines the rows' parts by the same rule, each weighted by the tokens its row counts for, codes that
   once and serves it ("merged"): every row merges the same numbers;
4. every member fetches the other parts' results (merged ones, with several rows) from their owners and
   decodes them (an owner decodes its own too), then applies the whole with the outer rule: every
   participant of every row ends with the same weights.

A member sends and receives about two unit-sized messages per round whatever the row's size: G - 1 pieces
of 1/G each way, then G - 1 combined parts each way; with R rows, R - 1 parts of 1/G each way more for each
part it owns. Rows that averaged on their own would end a round on as many weights as there are rows.

A part whose owner does not serve it in time (it crashed, re-synchronizes on other start weights, or
serves a result that fails its checks) costs only that part: each member then fetches that part's pieces
from the members and combines them itself, the same pieces by the same rule, and codes the result as its
owner would have, so members still agree (also a member whose wait for the owner ran out while the others
got the owner's part, when it combined the same pieces). So does an owner merging the rows for a row whose
owner of that part failed it: it combines that row's part from that row's pieces.

A combined part is checked before use: it must decode, be finite, name only members of the row, and,
when it says it combined our piece, lie within ``REJECT_FACTOR`` times that piece's norm and point along
it (a cosine above ``screening.AGREE_MIN``: a part of zeros or noise fails too). A part that leaves our
piece out, and any part a member with no piece this round (a newcomer, or its update diverged) receives,
is held to the same bounds against the part as the member combines it itself from the members' pieces;
when it fetched none of them in time either, it has nothing to hold the part against and does not use it
(``UNCHECKED``): it combines the part from the pieces that come by a second deadline, or leaves it out, and
the next round's start-weights vote puts it back on the row's weights (an owner's unchecked part, taken
as it came, let a poisoned part through under load).
Another row's part is held to the same bounds against our row's, and must name only members of its row,
count at most their tokens and have been combined on our base. An owner can still steer its part within
those bounds (a mild bend); a swarm that will not trust owners with that sets ``sync.dense_exchange =
"all_to_all"`` (one row of all participants, each fetching every other's update).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.sync.aggregate import REJECT_FACTOR, Combined, Contribution, Received, combine
from spes_p2p.sync.codecs import Codec, TensorSpec, part_bounds
from spes_p2p.sync.exchange import Exchange, owner
from spes_p2p.sync.fetching import Reduced, Refused, combined_codec
from spes_p2p.sync.gather import Gathered
from spes_p2p.sync.jobs import UnitJob, UnitResult
from spes_p2p.sync.payload import decode, encode, flatten, payload_meta, unflatten
from spes_p2p.sync.screening import AGREE_MIN, cosine, screen

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # between asks for the combined parts not served yet
# why an owner's part is not used by a member with no piece of it that fetched none of the others' either:
# nothing to hold it against (the member then combines the part itself, from what pieces come in time, and
# is back on the row's weights through the next round's start-weights vote)
UNCHECKED = "we have no piece of its part and fetched none to check it against"

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
        split = _Split(part_bounds(numel, job.parts), self.fetcher.clamped(job.tokens))
        self.ledger.opened(job.round, unit, group)
        if self.me not in group:  # a newcomer's first round: it takes the row's result
            return self._follow(job, split)
        first, *more = [j for j in range(job.parts) if owner(group, j) == self.me]
        if job.counted and not job.diverged:
            split.pieces = self._post_pieces(job, split)
        deadline = self.gatherer.round_deadline(job.unit)
        gathered = self.gatherer.gather(job.round, unit, job.others(self.me), deadline, (first, job.parts))
        own = split.own(self.me, job.round, first)
        result, decision = self.settle(job, own, gathered, [])
        if decision.resync:  # we combine nothing this round: the others combine our parts themselves
            whole = None if own is None else self._whole(unit, split.pieces)
            mean = None if whole is None else Contribution(self.me, split.tokens, whole, job.round)
            return self.resync(job, mean, decision, deadline, result)
        screened = self.screen(job, result, decision.contributions, whole=False)
        combined = combine(screened, self.aggregate, self.me if own else None)
        self.count_outliers(result, combined.rejected)
        ours = {first: self._serve(job, first, *self._coded(job, split, first, combined))}
        for j in more:  # (a short row's last part: its pieces fetched as when an owner fails us)
            ours[j] = self._serve(job, j, *self._coded(job, split, j, self._combined_here(job, split, j)))
        if len(job.grid) > 1:
            ours = self._merge(job, split, ours)
        parts = self._collect(job, split, ours)
        return self._apply(job, job.start if job.diverged else job.end, parts, result)

    def _follow(self, job: UnitJob, split: _Split) -> UnitResult:
        """Not a member: the row's combined parts applied to our start weights when they are the row's, or
        (they are not) the members' end weights averaged."""
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
        nobody's update arrived anywhere). The round's participants: our row's contributors, and the members
        of the rows merged."""
        peers = set().union(*(p.contributors for p in parts))
        peers |= {m for p in parts for row in p.rows for m in job.grid[row]}
        if peers:
            whole = self._whole(job.unit, [p.piece for p in parts])
            result.new_weights = self.ledger.outer(job.unit).apply(job.start, whole)
        else:
            result.new_weights = {n: t.clone() for n, t in fallback.items()}
        return self.close(job, result, peers)

    # ---------------------------------------------------------------------------------- our parts

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

    def _serve(self, job: UnitJob, part: int, payload: bytes, reduced: Reduced) -> Reduced:
        """Serves our row's combined part; returns it."""
        self.outbox.post_reduced(job.round, job.unit, "reduced", part, job.parts, payload)
        return reduced

    def _merge(self, job: UnitJob, split: _Split, ours: dict[int, Reduced]) -> dict[int, Reduced]:
        """Merges the rows' combined parts of the parts we own and serves them to our row; returns them."""
        merged = self._merged(job, split, ours)
        for part, (payload, _) in merged.items():
            self.outbox.post_reduced(job.round, job.unit, "merged", part, job.parts, payload)
        return {part: reduced for part, (_, reduced) in merged.items()}

    def _coded(self, job: UnitJob, split: _Split, part: int, combined: Combined) -> tuple[bytes, Reduced]:
        """A part's combined update (zeros when nothing arrived) as its owner serves it, and as that decodes:
        members that combine the same pieces get the same numbers, whether from the owner or by themselves."""
        a, b = split.bounds[part]
        piece = combined.update["piece"] if combined.used else torch.zeros(b - a)
        contributors = sorted(c.peer_id for c in combined.used)
        tokens = sum(c.tokens for c in combined.used)
        return self._code(job, part, piece, "reduced", contributors, tokens)

    def _code(
        self,
        job: UnitJob,
        part: int,
        piece: torch.Tensor,
        kind: str,
        peers: list[str],
        tokens: int,
        rows: tuple[int, ...] = (),
    ) -> tuple[bytes, Reduced]:
        """A combined part's payload, and the part as it decodes. With several rows, it says what merging
        needs: the tokens it counts for, the start weights it was combined on, the other rows merged."""
        meta = {**payload_meta(job.unit, job.round, kind, part, job.parts), "peers": ",".join(peers)}
        if len(job.grid) > 1:
            meta.update(tokens=str(tokens), base=job.base, rows=",".join(map(str, rows)))
        codec = combined_codec(self.codec, job.parts, len(job.grid) if kind == "merged" else 0)[1]
        payload = self._encode(piece, meta, codec)
        return payload, Reduced(self._decode(payload, len(piece), meta, codec), peers, tokens, job.base, rows)

    # ---------------------------------------------------------------------------------- the rows

    def _merged(
        self,
        job: UnitJob,
        split: _Split,
        mine: dict[int, Reduced],
        deadlines: tuple[Deadline, Deadline] | None = None,
    ) -> dict[int, tuple[bytes, Reduced]]:
        """Each part in ``mine`` (part -> our row's combined part) merged across the grid's rows: ours and
        each other row's, from its owner of the part (every row splits the unit alike), checked, then combined
        by the swarm's rule, weighted by the tokens each row counts for, alike on every peer (no row is the
        yardstick). Returns each part's payload and what it decodes to. A row whose owner of a part is gone,
        on other start weights, not waited for (it missed ``MISS_LIMIT`` rounds), refused, or serves nothing
        in time is combined here from its members' pieces, as its own members combine it then. ``deadlines``:
        for the asks to the owners and for what is combined here (default: one each, from now)."""
        wait, later = deadlines or (self.gatherer.round_deadline(job.unit), None)
        asks = {(j, s): owner(row, j) for j in mine for s, row in enumerate(job.grid) if s != job.row}
        rows: dict[int, dict[int, Reduced]] = {j: {job.row: mine[j]} for j in mine}
        here = {key for key, o in asks.items() if not self.ledger.waited_for(o)}
        pending = set(asks) - here

        def one_pass() -> bool | None:
            announced = self.gatherer.announcements(job.round, job.unit)
            live = self.gatherer.taking_part(job.round, job.unit, set(asks.values()))
            for key in sorted(pending):
                o = asks[key]
                if o not in live or (o in announced and announced[o].base != job.base):
                    here.add(key)
            pending.difference_update(here)
            todo = {key: (asks[key], key[0]) for key in sorted(pending)}
            for key, outcome in self.fetcher.reduced(job.round, job.unit, todo, job.parts, wait).items():
                j, s = key
                problem = isinstance(outcome, Reduced) and row_problem(
                    job, s, outcome, mine[j], announced, self.fetcher.cfg.max_round_tokens
                )
                if isinstance(outcome, Reduced) and not problem:
                    rows[j][s] = outcome
                elif problem:
                    self.fetcher.refuse(asks[key], job.unit, problem)
                if isinstance(outcome, Reduced | Refused):
                    pending.discard(key)
                    here.update([key] if s not in rows[j] else [])
            return True if not pending else None

        poll(one_pass, wait, POLL_SECONDS)
        later = later or self.gatherer.round_deadline(job.unit)
        for j, s in sorted(here | pending):
            rows[j][s] = self._combine_here(job, split, j, later, row=s)
        return {j: self._merge_rows(job, j, rows[j], asks) for j in mine}

    def _merge_rows(
        self, job: UnitJob, part: int, rows: dict[int, Reduced], asks: dict[tuple[int, int], str]
    ) -> tuple[bytes, Reduced]:
        """One part's rows combined (those with no contributor left out): its payload, and what that decodes
        to."""
        used = [
            Contribution(f"{s:04d}", r.tokens, {"piece": r.piece}, job.round)
            for s, r in sorted(rows.items())
            if r.contributors
        ]
        combined = combine(used, self.aggregate)
        for s in sorted(int(r) for r in combined.rejected):
            if s != job.row and (part, s) in asks:  # (an owner that served it; not one combined here)
                self.fetcher.refuse(
                    asks[(part, s)], job.unit, "its row's combined part lies far beyond the others"
                )
        merged = combined.update["piece"] if combined.used else torch.zeros_like(rows[job.row].piece)
        merged_rows = {int(c.peer_id) for c in combined.used}
        tokens = sum(c.tokens for c in combined.used)
        contributors = rows[job.row].contributors if job.row in merged_rows else []
        others = tuple(sorted(merged_rows - {job.row}))
        return self._code(job, part, merged, "merged", contributors, tokens, others)

    # ---------------------------------------------------------------------------------- the others

    def _collect(self, job: UnitJob, split: _Split, got: dict[int, Reduced]) -> list[Reduced]:
        """Every part's combined update (``got``: those we have; with several rows, merged) from its owner,
        or combined here from its pieces (and merged). An owner that missed ``MISS_LIMIT`` rounds in a row
        is not waited for."""
        group, parts, rows = job.participants, job.parts, len(job.grid) if len(job.grid) > 1 else 0
        pending = set(range(parts)) - set(got)
        fallback = {j for j in pending if not self.ledger.waited_for(owner(group, j))}
        deadline = self.gatherer.round_deadline(job.unit)

        def one_pass() -> bool | None:
            announced = self.gatherer.announcements(job.round, job.unit)
            live = self.gatherer.taking_part(job.round, job.unit, group)
            for j in sorted(pending):  # an owner on other start weights, or gone, combines nothing for us
                o = owner(group, j)
                if o not in live or (o in announced and announced[o].base != job.base):
                    fallback.add(j)
            pending.difference_update(fallback)
            asks = {j: (owner(group, j), j) for j in sorted(pending)}
            for j, outcome in self.fetcher.reduced(job.round, job.unit, asks, parts, deadline, rows).items():
                if isinstance(outcome, Reduced):
                    # (a member with no piece checks against the pieces it can fetch within this deadline,
                    # so that a dead member delays all the parts' references by one deadline, not one each)
                    here = partial(self._combine_here, job, split, j, deadline)
                    own = split.pieces[j] if split.pieces else None
                    problem = part_problem(outcome, job, self.me, own, here)
                    if not problem:
                        got[j] = outcome
                        pending.discard(j)
                        continue
                    if problem == UNCHECKED:  # (not held against the owner: it may be honest)
                        logger.info("round %d %s: part %d not used: %s", job.round, job.unit, j, problem)
                        outcome = Refused(problem)
                    else:
                        outcome = self.fetcher.refuse(owner(group, j), job.unit, problem)
                if isinstance(outcome, Refused):
                    pending.discard(j)
                    fallback.add(j)
            return True if not pending else None

        poll(one_pass, deadline, POLL_SECONDS)
        later = self.gatherer.round_deadline(job.unit)  # (one wait for all the parts combined here)
        here = {j: self._combine_here(job, split, j, later) for j in sorted(fallback | pending)}
        if rows and here:
            merged = self._merged(job, split, here, (later, later))
            here = {j: reduced for j, (_, reduced) in merged.items()}
        return [{**got, **here}[j] for j in range(parts)]

    def _combine_here(
        self, job: UnitJob, split: _Split, part: int, deadline: Deadline | None = None, row: int | None = None
    ) -> Reduced:
        """A row's part (ours unless ``row``) whose owner failed us, combined here as its owner would have
        served it."""
        return self._coded(job, split, part, self._combined_here(job, split, part, deadline, row))[1]

    def _combined_here(
        self,
        job: UnitJob,
        split: _Split,
        part: int,
        deadline: Deadline | None = None,
        row: int | None = None,
    ) -> Combined:
        """A part of a row (ours unless ``row``) combined from its pieces, fetched from its members on our
        base (within a deadline of its own unless given one): a part whose owner failed us, or the second
        part we own. Of fewer than three pieces, the yardstick of their norms is ours, as an owner's own is
        when it combines (else the smallest), never the owner's: the owner that failed us may be lying, and
        its own piece, 1000 times too large, would be the yardstick that lets itself through (for a member
        that fetched no other piece of that part in time)."""
        row = job.row if row is None else row
        members = [p for p in job.grid[row] if p != self.me]
        deadline = deadline or self.gatherer.round_deadline(job.unit)
        where = (part, job.parts)
        contributions = self.gatherer.pieces(job.round, job.unit, members, job.base, where, deadline)
        own = split.own(self.me, job.round, part) if row == job.row else None
        kept = screen(contributions + ([own] if own else []), {}, None).kept
        return combine(kept, self.aggregate, self.me if own else None)

    # ---------------------------------------------------------------------------------- helpers

    def _whole(self, unit: str, pieces: list[torch.Tensor]) -> Tensors:
        return unflatten(torch.cat(pieces), self.specs[unit])

    def _encode(self, piece: torch.Tensor, meta: dict[str, str], codec: Codec | None = None) -> bytes:
        return encode({"piece": piece}, codec or self.codec, meta=meta)

    def _decode(
        self, payload: bytes, numel: int, meta: dict[str, str], codec: Codec | None = None
    ) -> torch.Tensor:
        return decode(payload, {"piece": TensorSpec((numel,))}, codec or self.codec, meta=meta)["piece"]


# ---------------------------------------------------------------------------------- the checks


def part_problem(
    reduced: Reduced, job: UnitJob, me: str, own: torch.Tensor | None, here: Callable[[], Reduced]
) -> str:
    """Why a combined part from its owner cannot be used by ``me`` ('' when it can). It is checked against our
    own piece of it when it says it combined that piece, else (it left ours out, or we have none: our
    update does not count this round, or its piece is zero) against the part as we combine it ourselves
    from the row's pieces (``here``): an owner cannot dodge the check by leaving us out. With neither, the
    part cannot be checked: ``UNCHECKED``."""
    if not set(reduced.contributors) <= set(job.participants):
        return "its combined part names peers outside the row"
    if not set(reduced.rows) <= set(range(len(job.grid))) - {job.row}:
        return "its combined part names rows outside the grid"
    if own is not None and float(own.norm()) > 0 and me in reduced.contributors:
        reference, what = own, "our own piece of it"
    else:
        local = here()
        if not local.contributors:  # we fetched no piece either: nothing to check it against
            return UNCHECKED
        reference, what = local.piece, "the part as we combine it from the pieces"
    if float(reduced.piece.norm()) > REJECT_FACTOR * float(reference.norm()):
        return f"its combined part lies far beyond {what}"
    if not cosine({"p": reduced.piece}, {"p": reference}) > AGREE_MIN:  # (zeros and noise too)
        return f"its combined part does not point along {what}"
    return ""


def row_problem(
    job: UnitJob, row: int, reduced: Reduced, mine: Reduced, announced: dict, max_tokens: int
) -> str:
    """Why another row's combined part cannot be merged ('' when it can): it must name only members of
    that row, each once, count at most the tokens they announced (``max_tokens`` a member, at most), have
    been combined on our start weights, and lie within ``REJECT_FACTOR`` of our row's part either way and
    point along it."""
    named = set(reduced.contributors)
    if not named <= set(job.grid[row]) or len(named) < len(reduced.contributors) or reduced.rows:
        return "its row's combined part names peers outside its row"
    if reduced.base != job.base:
        return "its row's combined part was combined on other start weights than it announced"
    most = sum(min(announced[p].tokens, max_tokens) if p in announced else max_tokens for p in named)
    if reduced.tokens > most:
        return "its row's combined part claims more tokens than its members announced"
    ours, theirs = float(mine.piece.norm()), float(reduced.piece.norm())
    if not named or not mine.contributors or ours == 0:
        return ""
    if not ours / REJECT_FACTOR <= theirs <= REJECT_FACTOR * ours:
        return "its row's combined part lies far from our row's"
    if not cosine({"p": reduced.piece}, {"p": mine.piece}) > AGREE_MIN:
        return "its row's combined part does not point along our row's"
    return ""
