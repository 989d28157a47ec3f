"""The swarm's dataset split among its peers: which training shards are done in each epoch, and which ones
peers are training now (a ``data.plan.DataPlan`` for a peer of a swarm).

The training split's shards are grouped in buckets of ``BUCKET_SHARDS``, each under its own DHT key:

    <run_id>/data/<dataset digest[:16]>/<epoch>/<bucket>   BucketRecord, one entry per writer

A writer's entry is what it knows of the bucket: the shards done, and the claims on the others (whose,
taken when (``since``), how many windows of the shard are trained (``position``), last refreshed when
(``seen``), and whether given back). Readers merge every entry (``Bucket``): a shard is done once an entry
says so; of the live claims on a shard (refreshed within the lease, not given back, by a peer whose record is
live) the oldest wins, then the lower peer id, and the others stop; a shard with no live claim is free, to be
continued from the furthest position any claim on it recorded.

Who writes a bucket: the peers training one of its shards, and its keepers, the ``KEEPERS`` live peers that
follow it on a ring of hashes (consistent hashing), which read it at every heartbeat and write back what
they merged, so a bucket's record outlives the peers that trained it. An entry is bounded by the bucket's
size, and a bucket's writers are its trainers and keepers: neither grows with the swarm. A peer reads the
buckets of an epoch in an order of its own, and takes a free shard at random (a given-back or stalled one
first), so peers rarely reach for the same shard; when two do, the loser learns it on its next read.

Known limit: a peer may mark shards done that it never trained (they are trained again next epoch). A live
claim counts only while its peer's own record is live (a claim invented for somebody else holds nothing),
dated no later than now, and for at most ``MAX_HELD`` shards of a bucket per peer.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from spes_p2p.data.plan import Work
from spes_p2p.net.transport import MAX_EXPIRY_AHEAD, Transport
from spes_p2p.net.wire import Short
from spes_p2p.swarm.records import Count, Record, decode_entries

logger = logging.getLogger(__name__)

BUCKET_SHARDS = 32  # (an entry of a full bucket stays well under the DHT's record size)
KEEPERS = 2  # peers that keep each bucket's record alive
CLAIMS_KEPT = 2  # claims per shard a writer carries (the most recently refreshed)
MAX_HELD = 8  # shards one peer claims live in a bucket: those read in rounds not landed yet, and the next
BUSY_READS = 1  # buckets whose shards others were training, re-read per shard taken (one may stall)
Offset = Annotated[int, msgspec.Meta(ge=0, lt=BUCKET_SHARDS)]


class Claim(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    peer: Short
    since: float  # the claimant's DHT time when it took the shard
    seen: float  # ... when it last refreshed the claim
    position: Count  # windows of the shard trained
    released: bool = False  # given back: free at once

    def __post_init__(self) -> None:
        if not (math.isfinite(self.since) and math.isfinite(self.seen)):
            raise ValueError("since and seen must be finite")


class BucketRecord(Record):
    done: Annotated[list[Offset], msgspec.Meta(max_length=BUCKET_SHARDS)] = msgspec.field(
        default_factory=list
    )
    claims: Annotated[
        dict[Offset, Annotated[list[Claim], msgspec.Meta(max_length=CLAIMS_KEPT)]],
        msgspec.Meta(max_length=BUCKET_SHARDS),
    ] = msgspec.field(default_factory=dict)


def bucket_key(run_id: str, dataset: str, epoch: int, bucket: int) -> str:
    return f"{run_id}/data/{dataset[:16]}/{epoch}/{bucket}"


@dataclass
class Bucket:
    """What the entries of a bucket say, merged."""

    done: set[int] = field(default_factory=set)
    claims: dict[int, dict[tuple[str, float], Claim]] = field(default_factory=dict)  # by (peer, since)

    def add(self, record: BucketRecord) -> None:
        self.done |= set(record.done)
        for offset, claims in record.claims.items():
            for claim in claims:
                old = self.claims.get(offset, {}).get((claim.peer, claim.since))
                if old is None or (claim.seen, claim.position) > (old.seen, old.position):
                    self.put(claim, offset)
        for offset in self.done & set(self.claims):
            del self.claims[offset]

    def put(self, claim: Claim, offset: int) -> None:
        kept = self.claims.setdefault(offset, {})
        kept[(claim.peer, claim.since)] = claim
        for old in sorted(kept, key=lambda k: kept[k].seen)[: -CLAIMS_KEPT - 2]:  # (a few spare: merges)
            del kept[old]

    def owner(self, offset: int, live: Callable[[Claim], bool]) -> Claim | None:
        """The live claim that holds the shard (the oldest), if any. A peer with more than ``MAX_HELD``
        shards claimed live in the bucket holds none of them (an honest one holds the shards read in its
        rounds in flight, and the next)."""
        counts = Counter(
            peer for kept in self.claims.values() for peer in {c.peer for c in kept.values() if live(c)}
        )
        holding = [c for c in self.claims.get(offset, {}).values() if live(c) and counts[c.peer] <= MAX_HELD]
        return min(holding, key=lambda c: (c.since, c.peer)) if holding else None

    def finish(self, offset: int) -> None:
        self.done.add(offset)
        self.claims.pop(offset, None)

    def position(self, offset: int) -> int:
        """How far the shard's claims got."""
        return max((c.position for c in self.claims.get(offset, {}).values()), default=0)

    def record(self) -> BucketRecord:
        claims = {
            offset: sorted(kept.values(), key=lambda c: -c.seen)[:CLAIMS_KEPT]
            for offset, kept in sorted(self.claims.items())
            if kept
        }
        return BucketRecord(done=sorted(self.done), claims=claims)


class DataClaims:
    """This peer's share of the swarm's dataset: ``take``, ``record`` and ``lost`` for the sampler (training
    thread), ``commit`` when a round lands, ``heartbeat`` (the heartbeat thread: refreshes its claims and
    keeps its buckets) and ``release`` (leaving). ``_state`` guards the fields below and is never held
    across a DHT call; ``_writing`` serializes whole writes, so an older snapshot of a bucket never
    overwrites a newer one."""

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        dataset: str,
        shards: int,
        live_peers: Callable[[], set[str]],
        lease: float,
    ) -> None:
        self.transport, self.run_id, self.dataset, self.shards = transport, run_id, dataset, shards
        self.live_peers, self.lease = live_peers, lease
        self.buckets = math.ceil(shards / BUCKET_SHARDS)
        self.ttl = min(4 * lease, MAX_EXPIRY_AHEAD - 1)  # entries outlive the lease: a crash's position stays
        self.epoch = 0
        self.done = 0  # shards this peer finished
        self._mine: dict[tuple[int, int], Claim] = {}  # (epoch, shard) -> this peer's claim
        self._known: dict[tuple[int, int], Bucket] = {}  # (epoch, bucket) -> as last read, with our changes
        self._full: set[int] = set()  # buckets of this epoch with no free shard
        self._busy: list[tuple[int, int]] = []  # (epoch, bucket)s whose last free shards others were training
        self._lost: set[tuple[int, int]] = set()
        self._writers: dict[str, float] = {}  # peer -> when it last wrote a claim of its own
        self._refreshed = self._kept_at = float("-inf")  # (heartbeat: when it last did each)
        self._finishing: dict[tuple[int, int], int] = {}  # (epoch, shard) read to its end -> its windows
        self._rng = random.Random(transport.peer_id)
        self._state = threading.RLock()
        self._writing = threading.Lock()

    @property
    def me(self) -> str:
        return self.transport.peer_id

    # -------------------------------------------------------------------------------- the sampler's side

    def take(self) -> Work:
        """A shard nobody trains or has trained this epoch (a stalled or given-back one first); when every
        shard of the epoch is done or taken, the next epoch's."""
        for _ in range(BUSY_READS):
            with self._state:
                if not self._busy:
                    break
                epoch, bucket = self._busy.pop(0)  # (put back at the end while still busy)
            work = self._take_from(epoch, bucket)
            if work is not None:
                return work
        while True:
            for bucket in bucket_order(self.me, self.epoch, self.buckets):
                if bucket in self._full:
                    continue
                work = self._take_from(self.epoch, bucket)
                if work is not None:
                    return work
                self._full.add(bucket)
            with self._state:
                self.epoch, self._full = self.epoch + 1, set()
                waiting = {e for e, _ in self._busy}
                self._known = {
                    k: b for k, b in self._known.items() if k[0] >= self.epoch - 1 or k[0] in waiting
                }
            logger.info(
                "every shard of epoch %d is done or being trained: epoch %d", self.epoch - 1, self.epoch
            )

    def record(self, work: Work, position: int, done: bool) -> None:
        """A shard read to its end is done once the round that read its last windows lands (``commit``);
        until then it stays claimed."""
        if done:
            with self._state:
                self._finishing[(work.epoch, work.shard)] = position

    def commit(self, trained: list[list[int]]) -> None:
        """A round's update landed: the windows it trained on (``ShardSampler.trained``) count as trained, in
        the positions this peer publishes and in the shards done. (Windows read for a round that never
        landed, a crash's last, are not recorded: whoever continues the shard trains them again.)"""
        finished = set()
        with self._state:
            for epoch, shard, _, end in trained:
                claim = self._mine.get((epoch, shard))
                if claim is not None and end > claim.position:
                    self._mine[(epoch, shard)] = msgspec.structs.replace(claim, position=end)
            for key, position in list(self._finishing.items()):
                claim = self._mine.get(key)
                if claim is None or claim.position >= position:
                    del self._finishing[key]
                if claim is not None and claim.position >= position:
                    del self._mine[key]
                    self._bucket(*key).finish(key[1] % BUCKET_SHARDS)
                    self.done += 1
                    finished.add((key[0], key[1] // BUCKET_SHARDS))
        for epoch, bucket in sorted(finished):  # (now, so nobody takes it up again meanwhile)
            self._write(epoch, bucket)

    def lost(self, work: Work) -> bool:
        with self._state:
            return (work.epoch, work.shard) in self._lost

    def resume(self, works: list[Work]) -> list[Work]:
        """Takes back the shards a checkpoint was training, where nobody else trains them now; from the
        furthest position recorded (by this peer, or by one that continued it)."""
        kept = []
        for work in works:
            bucket = self._read(work.epoch, work.shard // BUCKET_SHARDS)
            offset = work.shard % BUCKET_SHARDS
            owner = bucket.owner(offset, self._live_claim(self.live_peers()))
            if offset in bucket.done or (owner is not None and owner.peer != self.me):
                continue
            kept.append(self._claim(work.epoch, work.shard, max(work.position, bucket.position(offset))))
        return kept

    def start_in(self, epochs: list[int]) -> None:
        """A newcomer starts in the oldest of the epochs the swarm's live peers train (0: it is the first)."""
        with self._state:
            self.epoch = min(epochs, default=0)

    def state_dict(self) -> dict:
        with self._state:
            return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        with self._state:
            self.epoch = int(state["epoch"])

    # ----------------------------------------------------------------------------------- the records

    def heartbeat(self) -> None:
        """Every third of a lease, refreshes this peer's claims (and learns which of them another peer holds
        first); every half lease, keeps the buckets it is a keeper of (entries live 4 leases)."""
        now = self.transport.now()
        refresh, keep = now - self._refreshed >= self.lease / 3, now - self._kept_at >= self.lease / 2
        with self._state:
            training = {(e, s // BUCKET_SHARDS) for e, s in self._mine} if refresh else set()
            epochs = {self.epoch} | {e for e, _ in self._busy} if keep else set()
        self._refreshed = now if refresh else self._refreshed
        self._kept_at = now if keep else self._kept_at
        live = self.live_peers() if keep else set()
        kept = {(e, b) for e in epochs for b in kept_buckets(self.me, live, e, self.buckets)}
        for epoch, bucket in sorted(training | kept):
            self._read(epoch, bucket)
            self._write(epoch, bucket)

    def release(self) -> None:
        """Gives every shard back at the position it reached (leaving)."""
        with self._state:
            mine, self._mine = self._mine, {}
            for (epoch, shard), claim in mine.items():
                released = msgspec.structs.replace(claim, seen=self.transport.now(), released=True)
                self._bucket(epoch, shard).put(released, shard % BUCKET_SHARDS)
        for epoch, bucket in sorted({(e, s // BUCKET_SHARDS) for e, s in mine}):
            self._write(epoch, bucket)

    # ----------------------------------------------------------------------------------------- inside

    def _take_from(self, epoch: int, bucket: int) -> Work | None:
        """A free shard of the bucket, claimed (and the claim confirmed by a read back), or None."""
        state = self._read(epoch, bucket)
        live = self._live_claim(self.live_peers())
        shards = range(bucket * BUCKET_SHARDS, min((bucket + 1) * BUCKET_SHARDS, self.shards))
        busy = [
            s for s in shards if s % BUCKET_SHARDS not in state.done and state.owner(s % BUCKET_SHARDS, live)
        ]
        free = [s for s in shards if s % BUCKET_SHARDS not in state.done and s not in busy]
        with self._state:
            if busy and (epoch, bucket) not in self._busy:
                self._busy.append((epoch, bucket))  # (to look at again: one of them may stall)
        if not free:
            return None
        begun = [s for s in free if state.claims.get(s % BUCKET_SHARDS)]  # stalled or given back
        shard = self._rng.choice(begun or free)
        work = self._claim(epoch, shard, state.position(shard % BUCKET_SHARDS))
        self._write(epoch, bucket)
        state = self._read(epoch, bucket)
        owner = state.owner(shard % BUCKET_SHARDS, self._live_claim(self.live_peers()))
        if owner is not None and owner.peer != self.me:
            with self._state:
                self._mine.pop((epoch, shard), None)
            return self._take_from(epoch, bucket)  # (another peer was first: try again)
        return work

    def _claim(self, epoch: int, shard: int, position: int) -> Work:
        now = self.transport.now()
        with self._state:
            self._mine[(epoch, shard)] = Claim(self.me, now, now, position)
            self._lost.discard((epoch, shard))
        logger.info("data shard %d of epoch %d, from window %d", shard, epoch, position)
        return Work(epoch, shard, position)

    def _live_claim(self, live: set[str]) -> Callable[[Claim], bool]:
        """Whether a claim holds its shard: not given back, refreshed lately (a date in the future is a lie),
        by a peer that is live: its record is, or it wrote a bucket entry of its own lately (a newcomer's
        record may not be in this peer's view yet)."""
        now, lease = self.transport.now(), self.lease
        with self._state:
            writers = {p for p, at in self._writers.items() if now - at < lease}

        def holds(claim: Claim) -> bool:
            return (
                not claim.released
                and abs(now - claim.seen) < lease
                and (claim.peer in live or claim.peer in writers or claim.peer == self.me)
            )

        return holds

    def _bucket(self, epoch: int, shard: int) -> Bucket:
        return self._known.setdefault((epoch, shard // BUCKET_SHARDS), Bucket())

    def _read(self, epoch: int, bucket: int) -> Bucket:
        """The bucket's entries merged (with what this peer knows, and its own claims); marks the claims
        of this peer that another holds first as lost."""
        entries = self.transport.read(bucket_key(self.run_id, self.dataset, epoch, bucket))
        records = decode_entries(entries, BucketRecord, "data shard", self.transport.guard)
        peers, now = self.live_peers(), self.transport.now()
        with self._state:
            state = self._known.setdefault((epoch, bucket), Bucket())
            for writer, record in records.items():
                state.add(record)
                if any(
                    c.peer == writer and abs(now - c.seen) < self.lease
                    for cs in record.claims.values()
                    for c in cs
                ):
                    self._writers[writer] = now  # (an entry is its writer's own: the DHT signs it)
            self._writers = {p: at for p, at in self._writers.items() if now - at < self.lease}
            mine = {s: c for (e, s), c in self._mine.items() if (e, s // BUCKET_SHARDS) == (epoch, bucket)}
            for shard in taken_from(mine, state, self._live_claim(peers)):
                logger.info("data shard %d of epoch %d: another peer has it; taking another", shard, epoch)
                del self._mine[(epoch, shard)]
                self._lost.add((epoch, shard))
            return state

    def _write(self, epoch: int, bucket: int) -> None:
        with self._writing:
            now = self.transport.now()
            with self._state:
                state = self._known.setdefault((epoch, bucket), Bucket())
                for (e, shard), claim in self._mine.items():
                    if (e, shard // BUCKET_SHARDS) == (epoch, bucket):
                        claim = msgspec.structs.replace(claim, seen=now)
                        self._mine[(e, shard)] = claim
                        state.put(claim, shard % BUCKET_SHARDS)
                record = state.record()
            key = bucket_key(self.run_id, self.dataset, epoch, bucket)
            self.transport.publish(key, record.encode(), now + self.ttl)


def bucket_order(peer: str, epoch: int, buckets: int) -> list[int]:
    """The order in which ``peer`` looks through an epoch's buckets for a free shard (peers spread out)."""
    order = list(range(buckets))
    random.Random(f"{peer}/{epoch}").shuffle(order)
    return order


def kept_buckets(peer: str, live: set[str], epoch: int, buckets: int) -> list[int]:
    """The buckets of ``epoch`` that ``peer`` keeps: on a ring of hashes, a bucket is kept by the ``KEEPERS``
    live peers that follow it, so a peer keeps those between its ``KEEPERS``-th predecessor and it."""
    ring = sorted(_point(p) for p in live | {peer})
    if len(ring) <= KEEPERS:
        return list(range(buckets))
    mine = ring.index(_point(peer))
    after, upto = ring[mine - KEEPERS], ring[mine]  # (the arc wraps around when mine < KEEPERS)
    inside = (lambda x: after < x <= upto) if after < upto else (lambda x: x > after or x <= upto)
    return [b for b in range(buckets) if inside(_point(f"{epoch}/{b}"))]


def taken_from(mine: dict[int, Claim], bucket: Bucket, live: Callable[[Claim], bool]) -> list[int]:
    """Of ``mine`` (shard -> this peer's claim, shards of ``bucket``), the shards done, or held by another
    peer's live claim made before ours (the earlier claim wins a race)."""
    lost = []
    for shard, claim in mine.items():
        offset = shard % BUCKET_SHARDS
        owner = bucket.owner(offset, live)
        if offset in bucket.done or (
            owner is not None
            and owner.peer != claim.peer
            and (owner.since, owner.peer) < (claim.since, claim.peer)
        ):
            lost.append(shard)
    return lost


def _point(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def epoch_progress(
    transport: Transport, run_id: str, dataset: str, shards: int, epoch: int, live: set[str], lease: float
) -> dict:
    """What the swarm's records say of ``epoch``: shards done, being trained (by live peers), and
    stalled (begun, then left or given back); every bucket read once (for ``spes status``)."""
    now, done, training, stalled = transport.now(), 0, 0, 0
    for number in range(math.ceil(shards / BUCKET_SHARDS)):
        bucket = Bucket()
        entries = transport.read(bucket_key(run_id, dataset, epoch, number))
        for record in decode_entries(entries, BucketRecord, "data shard", transport.guard).values():
            bucket.add(record)
        done += len(bucket.done)
        for offset in bucket.claims:
            held = bucket.owner(
                offset, lambda c: not c.released and abs(now - c.seen) < lease and c.peer in live
            )
            training += held is not None
            stalled += held is None
    return {"epoch": epoch, "shards": shards, "done": done, "training": training, "stalled": stalled}
