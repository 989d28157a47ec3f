"""Entering a swarm that is training, and catching up with it.

A newcomer to a swarm that has not trained yet starts from the initial model, which it builds from the
swarm's seed, or downloads from the peers when that is not the manifest's (the founder's came from
``--init``). A newcomer to a swarm that trains waits (bounded) until the swarm lands the round in progress,
then downloads every unit, uncompressed, as of the swarm's last landed round, from its holders (in chunks
from all of them at once: ``sync/chunks.py``; a unit no live holder can serve, from any peer's own copy),
and takes the swarm's round. A peer that falls more than ``staleness`` rounds behind does the same. A peer
that starts training a unit fetches that unit's last round exactly.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable

import torch

from spes_p2p.errors import SwarmMismatch
from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.peer.admission import fingerprint
from spes_p2p.swarm.member import SwarmMember, SwarmView
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.versions import EXACT_WEIGHTS

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2

Write = Callable[[str, dict[str, torch.Tensor]], None]


def wait_for_peers(member: SwarmMember, count: int, timeout: float, stop: threading.Event) -> int:
    """Waits (bounded) for ``count`` peers in the swarm, so a local swarm starts its rounds together."""

    def enough() -> bool | None:
        return len(member.recent_view().peers) >= count or None

    poll(enough, Deadline(timeout, stop), POLL_SECONDS)
    return len(member.last_view.peers)


def settle_founders(member: SwarmMember, round_: int) -> None:
    """Founders that waited for each other settle their claims before the first round (the peer's
    first round then trains what they settled on); a peer that joined a training swarm does nothing."""
    if round_ == 0 and not is_training(member.view(), member.me):
        member.settle()


def wait_for_round(member: SwarmMember, round_: int, timeout: float, stop: threading.Event) -> bool:
    """Waits (bounded) until the swarm has reached ``round_``, before joining it."""

    def reached() -> bool | None:
        view = member.recent_view()
        return swarm_round(others_of(view, member.me)) >= round_ or None

    return bool(poll(reached, Deadline(timeout, stop), POLL_SECONDS))


def others_of(view: SwarmView, me: str) -> list:
    return [p for p in view.peers.values() if p.peer_id != me]


def swarm_round(others: list) -> int:
    """The round the swarm is at, as most of the others report it (one peer that claims a round far ahead, or
    simply runs ahead, does not make the rest believe they are behind)."""
    return statistics.median_low(p.round for p in others) if others else 0


def is_training(view: SwarmView, me: str) -> bool:
    """Whether the others have finished a round (peers that start together all hold the seeded model)."""
    return any(p.trained or p.round > 0 for p in others_of(view, me))


def at_round_boundary(member: SwarmMember, seconds: float) -> SwarmView:
    """If the swarm is training, waits (bounded) until it lands its current round, so a newcomer starts with
    the next round from that round's results instead of joining a round it cannot finish in time."""
    view, me = member.view(), member.me
    others = others_of(view, me)
    if not is_training(view, me):  # nobody has finished a round yet
        return view
    current = swarm_round(others)

    def landed() -> SwarmView | None:
        fresh = member.recent_view()
        return fresh if swarm_round(others_of(fresh, me)) > current else None

    return poll(landed, Deadline(seconds), POLL_SECONDS) or member.last_view


def catch_up(view: SwarmView, me: str, sync: SyncEngine, write: Write, seconds: float) -> int | None:
    """Downloads every unit from the swarm; returns the swarm's round (None when nobody else is there)."""
    others = others_of(view, me)
    if not others:
        return None
    holders = {u: sorted(h - {me}) for u, h in view.holders.items()}
    furthest_first = [p.peer_id for p in sorted(others, key=lambda p: -p.round)]
    landed = swarm_round(others) - 1  # the swarm's last landed round: holders catch up to it
    got = sync.refresh(
        max(landed, -1),
        holders,
        seconds,
        want=EXACT_WEIGHTS,
        on_unit=lambda unit, found: write(unit, found.tensors),
        fallback=furthest_first,  # a unit whose holders are newcomers too comes from any peer's copy
    )
    sync.forget_copies()  # downloaded weights are no versions: the next refresh fetches those
    round_ = landed + 1
    logger.info("caught up at round %d: downloaded %s (unit: its round; -1: a peer's own copy)", round_, got)
    return round_


def serve_initial_model(sync: SyncEngine, read: Callable[[str], dict], units: list[str]) -> None:
    """A founder from ``--init``, the one peer with the initial model, serves all of it exactly (as round
    -1): newcomers download it from here, also the units this peer holds only as frozen, quantized copies.
    Like any served weights, they are forgotten a few rounds later."""
    for unit in units:
        sync.serve_initial(unit, read(unit))


def download_initial_model(
    view: SwarmView, me: str, sync: SyncEngine, write: Write, seconds: float, units: dict[str, str]
) -> None:
    """The initial weights of ``units`` (unit -> the manifest's fingerprint of them), for a newcomer whose own
    are others (the founder's came from ``--init``, or another torch build drew these from the seed): from
    any live peer (holders first), each unit checked against its fingerprint. A peer that serves other
    weights is refused and counted, and the next one asked: one liar does not lock newcomers out."""
    others = [p.peer_id for p in others_of(view, me)]
    # (each peer once, in order: dict.fromkeys)
    sources = {u: list(dict.fromkeys([*sorted(view.holders.get(u, set()) - {me}), *others])) for u in units}

    def verify(unit: str, tensors: dict[str, torch.Tensor]) -> str:
        return "" if fingerprint(tensors) == units[unit] else "its initial weights are not the manifest's"

    got = sync.refresh(
        -1,
        sources,
        seconds,
        want=EXACT_WEIGHTS,
        on_unit=lambda u, found: write(u, found.tensors),
        verify=verify,
    )
    missing = ", ".join(sorted(set(units) - set(got)))
    if missing:
        raise SwarmMismatch(
            f"could not download the swarm's initial model from its peers (no peer served {missing} as the "
            "manifest has it): try again, or join once the swarm trains"
        )


def rounds_behind(view: SwarmView, me: str, round_: int) -> int:
    return swarm_round(others_of(view, me)) - round_


def fetch_exact(
    units: list[str], round_: int, view: SwarmView, me: str, sync: SyncEngine, write: Write, seconds: float
) -> None:
    """The weights of round ``round_`` of units this peer starts training, uncompressed, from those that
    trained them then (bounded; on failure the local copy stays, and the next exchange re-synchronizes)."""
    sync.refresh(
        round_,
        {u: sorted(view.participants(u, round_) - {me}) for u in units},
        seconds,
        want=EXACT_WEIGHTS,
        on_unit=lambda unit, found: write(unit, found.tensors),
    )
