"""The swarm's dataset split among its peers (swarm/datawork.py): shards taken once per epoch, progress
recorded, given back, continued after a crash, and a race for one shard lost by the later claim."""

from pathlib import Path

import pytest

from spes_p2p.data.shards import FORMAT, DatasetIndex, Shard
from spes_p2p.data.sources import ShardStore
from spes_p2p.net.memory import FakeClock, MemoryNetwork
from spes_p2p.swarm.datawork import BUCKET_SHARDS, BucketRecord, Claim, DataClaims, bucket_key, epoch_progress
from spes_p2p.train.dataset import PreparedData, ShardSampler

DIGEST = "d" * 64
LEASE = 20.0
HEARTBEAT = 5
WINDOWS = 12  # per shard


def fake_data(shards: int) -> PreparedData:
    """An index of ``shards`` shards of WINDOWS one-token windows (never read: virtual compute)."""
    train = [Shard(f"train/{i:06d}.safetensors", WINDOWS + 1, "0" * 64) for i in range(shards)]
    val = [Shard("val/000000.safetensors", 2, "0" * 64)]
    index = DatasetIndex(
        FORMAT, "test", "0" * 64, 300, "uint16", WINDOWS + 1, 2.0, 10, tuple(train), tuple(val)
    )
    return PreparedData(None, ShardStore(index, Path("/nonexistent"), [], False, 0))


class Swarm:
    """Peers that each train a window a tick; a killed one stops at once (its record lingers a lease)."""

    def __init__(self, shards: int) -> None:
        self.clock = FakeClock()
        self.net = MemoryNetwork(seed=0, clock=self.clock)
        self.data, self.shards = fake_data(shards), shards
        self.beats: dict[str, float] = {}
        self.peers: dict[str, tuple[DataClaims, ShardSampler]] = {}
        self.trained: list[tuple[str, int, int, int]] = []  # (peer, epoch, shard, window)
        self.reader = self.net.join("reader")

    def live(self) -> set[str]:
        return {p for p, t in self.beats.items() if self.clock() - t < LEASE}

    def join(self, name: str) -> DataClaims:
        claims = DataClaims(self.net.join(name), "run", DIGEST, self.shards, self.live, lease=LEASE)
        self.peers[name] = (claims, ShardSampler(self.data, 1, 1, "run", claims, read_tokens=False))
        self.beats[name] = self.clock()
        return claims

    def kill(self, name: str) -> tuple[int, int, int]:
        """The shard it was training, and the position its records last showed."""
        claims, sampler = self.peers.pop(name)
        epoch, shard, _ = sampler.work
        return epoch, shard, claims._bucket(epoch, shard).position(shard % BUCKET_SHARDS)  # (as last written)

    def tick(self, n: int) -> None:
        self.clock.advance(1.0)
        for name, (claims, sampler) in self.peers.items():
            sampler.skip_batch()
            work = sampler.work
            self.trained.append((name, work.epoch, work.shard, work.position - 1))
            claims.commit(sampler.trained())  # (each tick's update lands at once)
            if n % HEARTBEAT == 0:
                claims.heartbeat()
                self.beats[name] = self.clock()

    def progress(self) -> dict:
        return epoch_progress(self.reader, "run", DIGEST, self.shards, 0, self.live(), LEASE)


def test_peers_that_come_and_go_train_each_shard_once_and_continue_a_crashed_peers_shard():
    swarm = Swarm(shards=432)
    for i in range(8):
        swarm.join(f"p{i}")
    killed, n = [], 0
    while swarm.progress()["done"] < 432:
        n += 1
        assert n < 2000, swarm.progress()
        if n in (18, 39, 57):
            killed.append((f"p{len(killed)}", swarm.kill(f"p{len(killed)}")))
        if n in (20, 40):
            swarm.join(f"new{n}")
        swarm.tick(n)
    epoch0 = [(s, w) for _, e, s, w in swarm.trained if e == 0]
    assert set(epoch0) == {(s, w) for s in range(432) for w in range(WINDOWS)}
    twice = {s for s, w in epoch0 if epoch0.count((s, w)) > 1}
    assert len(twice) <= 432 // 100, twice  # (at most the killed peers' windows since their last record)
    for name, (epoch, shard, recorded) in killed:
        after = [(p, w) for p, e, s, w in swarm.trained if (e, s) == (epoch, shard) and p != name]
        assert after, f"{name}'s shard {shard} was never continued"
        assert min(w for _, w in after) == recorded  # from the position it recorded last
    assert swarm.progress() == {"epoch": 0, "shards": 432, "done": 432, "training": 0, "stalled": 0}


@pytest.fixture
def two():
    swarm = Swarm(shards=1)
    return swarm, swarm.join("a"), swarm.join("b")


def test_of_two_claims_on_one_shard_from_a_stale_view_the_later_loses(two, monkeypatch):
    swarm, a, b = two
    first = a.take()
    read = b.transport.read
    reads = iter(range(100))  # b's first read of the bucket misses a's claim
    monkeypatch.setattr(b.transport, "read", lambda key: {} if next(reads) == 0 else read(key))
    swarm.clock.advance(1.0)
    second = b.take()
    assert first == (0, 0, 0) and b.lost(first)  # b claimed it, then read a's older claim back
    assert second == (1, 0, 0)  # the only shard of epoch 0 is a's: b trains the next epoch's
    a.heartbeat()
    assert not a.lost(first)


def test_a_shard_given_back_is_continued_at_once_from_where_it_stopped(two):
    _, a, b = two
    work = a.take()
    a.commit([[*work[:2], 0, 3]])  # (a round trained its first 3 windows, and landed)
    a.release()
    assert b.take() == (0, 0, 3)


def test_a_restarted_peer_takes_its_shard_back_unless_another_continued_it(two):
    swarm, a, b = two
    work = a.take()
    a.commit([[*work[:2], 0, 2]])
    a.heartbeat()
    again = DataClaims(a.transport, "run", DIGEST, 1, swarm.live, lease=LEASE)
    assert again.resume([work._replace(position=2)]) == [(0, 0, 2)]
    # a's claims go stale while it is down; b continues the shard, and a restarted a leaves it to b
    swarm.clock.advance(LEASE + 1)
    swarm.beats["b"] = swarm.clock()
    assert b.take() == (0, 0, 2)
    b.commit([[0, 0, 2, 3]])
    b.heartbeat()
    assert again.resume([work._replace(position=2)]) == []


def stranger(shards: int, claims: dict) -> tuple[Swarm, DataClaims]:
    """A swarm whose bucket 0 holds a live stranger's entry with ``claims``, and an honest peer."""
    swarm = Swarm(shards)
    honest, liar = swarm.join("honest"), swarm.net.join("liar")
    swarm.beats["liar"] = swarm.clock()  # (its own record is live)
    record = BucketRecord(claims={i: [Claim("liar", 0.0, swarm.clock() + c, 0)] for i, c in claims.items()})
    liar.publish(bucket_key("run", DIGEST, 0, 0), record.encode(), swarm.clock() + 60)
    return swarm, honest


def test_claims_a_stranger_writes_to_hoard_shards_hold_none_and_garbage_is_counted():
    _, honest = stranger(BUCKET_SHARDS, dict.fromkeys(range(BUCKET_SHARDS), 0.0))  # the oldest claims on all
    assert honest.take().epoch == 0  # (not pushed to the next epoch: the hoard holds nothing)
    _, honest = stranger(1, {0: 1e6})  # refreshed a million seconds from now: a lie
    assert honest.take() == (0, 0, 0)
    swarm, honest = stranger(1, {})
    swarm.net.join("vandal").publish(
        bucket_key("run", DIGEST, 0, 0), b"\x81\xa4done\xa3bad", swarm.clock() + 60
    )
    rejected = honest.transport.guard.total()
    assert honest.take() == (0, 0, 0) and honest.transport.guard.total() > rejected


def test_a_buckets_record_outlives_the_peers_that_trained_it():
    swarm = Swarm(shards=BUCKET_SHARDS)
    trainer, *others = [swarm.join(name) for name in ("trainer", "k0", "k1", "k2")]
    work = trainer.take()
    trainer.record(work, WINDOWS, done=True)
    trainer.commit([[*work[:2], 0, WINDOWS]])
    del swarm.beats["trainer"]  # it leaves; its entry expires 4 record TTLs later
    for _ in range(int(5 * LEASE / HEARTBEAT)):
        swarm.clock.advance(HEARTBEAT)
        for peer in others:
            swarm.beats[peer.me] = swarm.clock()
            peer.heartbeat()  # (the bucket's keepers among them carry what they read)
    assert "trainer" not in swarm.reader.read(bucket_key("run", DIGEST, 0, 0))  # (expired)
    assert swarm.progress()["done"] == 1
    assert others[0].take().shard != work.shard
