"""Which units a peer holds: a pure policy over the swarm's coverage.

Rules, in order:
1. A peer below its capacity takes the least-covered units first (uncovered ones before anything else).
   Ties break on a hash of (peer id, unit): deterministic for a peer, different across peers, so peers that
   join at the same moment spread out instead of piling onto one unit.
2. A peer at capacity moves only as part of a **plan** that every peer computes alike from the same view:
   while some unit is uncovered and another has two or more holders, or the least-covered unit is below the
   target replication and the most-covered one has ``2 + hysteresis`` more holders, one holder of the
   most-covered unit (the one with the lowest hash for the destination) moves to the least-covered one.
   Each peer moves at most once per evaluation, and a move never uncovers a unit. Peers that already moved
   at this boundary (seen in the view) are not moved again: peers that evaluate one after another, each
   reading the others' new claims, still complete the plan.
3. A peer above its capacity drops its most-covered units.

Evaluated at sync boundaries; hysteresis keeps peers from flapping on small differences.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping


def tiebreak(peer_id: str, unit: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{peer_id}|{unit}".encode()).digest()[:8], "big")


def choose_units(
    *,
    me: str,
    held: Iterable[str],
    units: list[str],
    holders: Mapping[str, Iterable[str]],
    capacity: int,
    target: int,
    hysteresis: int = 1,
    settled: Iterable[str] = (),
) -> set[str]:
    """The units ``me`` should hold next, given who holds what (``holders`` may or may not include me) and
    which other peers already moved at this boundary (``settled``)."""
    mine = {u for u in held if u in units}
    view = {u: set(holders.get(u, ())) - {me} for u in units}
    for u in mine:
        view[u].add(me)

    def others(u: str) -> int:
        return len(view[u] - {me})

    while len(mine) > capacity:
        drop = max(mine, key=lambda u: (others(u), tiebreak(me, u)))
        mine.remove(drop)
        view[drop].discard(me)
    if len(mine) < capacity:
        free = sorted((u for u in units if u not in mine), key=lambda u: (others(u), tiebreak(me, u)))
        return mine | set(free[: capacity - len(mine)])
    for peer, src, dst in plan_moves(view, target=target, hysteresis=hysteresis, settled=set(settled) - {me}):
        if peer == me:
            return (mine - {src}) | {dst}
    return mine


def plan_moves(
    holders: Mapping[str, Iterable[str]], *, target: int, hysteresis: int, settled: Iterable[str] = ()
) -> list[tuple[str, str, str]]:
    """Moves (peer, from, to) that rebalance coverage; every peer with the same view computes the same. Peers
    in ``settled`` are not moved."""
    view = {u: set(h) for u, h in holders.items()}
    order = {u: i for i, u in enumerate(sorted(view))}
    moved: set[str] = set(settled)
    moves = []
    while True:
        dst = min(view, key=lambda u: (len(view[u]), order[u]))
        sources = sorted(view, key=lambda u: (-len(view[u]), order[u]))
        gap_needed = 2 if not view[dst] else 2 + hysteresis
        move = None
        for src in sources:
            if len(view[src]) - len(view[dst]) < gap_needed or (view[dst] and len(view[dst]) >= target):
                break
            movers = [p for p in view[src] if p not in moved and p not in view[dst]]
            if movers:
                move = (min(movers, key=lambda p: tiebreak(p, dst)), src, dst)
                break
        if move is None:
            return moves
        peer, src, dst = move
        view[src].remove(peer)
        view[dst].add(peer)
        moved.add(peer)
        moves.append(move)


# ------------------------------------------------------------------------------------ dense blocks (BCD)
#
# With B > 1 dense blocks, each peer trains ``active_blocks`` of them. Every ``rotate_every`` rounds the
# holders of block b move to block perm(b), for a permutation of the blocks that every peer computes alike
# from the epoch number (round // rotate_every). A permutation maps a covered set of blocks onto a covered
# set, so rotation alone never leaves a block without an owner; the claim policy above repairs what churn
# uncovers. Peer records carry the epoch their claims were made in, so a view read while some peers have
# rotated and others not yet is first carried forward to one epoch (``holders_at_epoch``): every peer plans
# from the same view.

BLOCK_ORDERS = ("cyclic", "random")


def block_permutation(n_blocks: int, epoch: int, order: str, seed: str) -> list[int]:
    """perm[b]: the block that block b's holders train from the start of ``epoch`` on."""
    if order == "cyclic":
        return [(b + 1) % n_blocks for b in range(n_blocks)]
    perm = list(range(n_blocks))
    random.Random(f"{seed}:{epoch}").shuffle(perm)
    return perm


def carry_block(block: int, from_epoch: int, to_epoch: int, n_blocks: int, order: str, seed: str) -> int:
    """Where a holder of ``block`` in ``from_epoch`` is in ``to_epoch`` (later epochs only)."""
    for epoch in range(from_epoch + 1, to_epoch + 1):
        block = block_permutation(n_blocks, epoch, order, seed)[block]
    return block


def holders_at_epoch(
    holders: Mapping[str, Mapping[str, int]], epoch: int, order: str, seed: str
) -> dict[str, set[str]]:
    """``holders`` (dense unit -> holder -> the epoch of its record) as they are in ``epoch``."""
    units = sorted(holders, key=lambda u: int(u.split("/")[1]))
    out: dict[str, set[str]] = {u: set() for u in units}
    for unit, peers in holders.items():
        for peer, held_in in peers.items():
            block = carry_block(int(unit.split("/")[1]), held_in, epoch, len(units), order, seed)
            out[units[block]].add(peer)
    return out
