"""Which training shard a reader takes next: a ``DataPlan``.

A reader (``train.dataset.ShardSampler``) trains one shard of the training split at a time, from a
position (the windows of it already trained, in an order every reader draws alike), and asks its plan for
the next one. Two plans:

    LocalPlan                 one process (``spes train``, the benchmarks): every epoch, every shard, in
                              an order seeded by the epoch
    swarm.datawork.DataClaims a peer of a swarm: a shard no other peer trains or has trained this epoch,
                              recorded in the DHT, so the swarm splits its dataset among its peers

Stdlib only: the swarm layer implements the protocol without importing any model or array library.
"""

from __future__ import annotations

import random
from typing import NamedTuple, Protocol


class Work(NamedTuple):
    """A training shard to read in ``epoch``, from window ``position`` on."""

    epoch: int
    shard: int
    position: int = 0


class DataPlan(Protocol):
    def take(self) -> Work:
        """The next shard to train."""

    def record(self, work: Work, position: int, done: bool) -> None:
        """``position`` windows of ``work``'s shard are trained; ``done``: all of them."""

    def lost(self, work: Work) -> bool:
        """Whether ``work`` is no longer this reader's to train (another peer took it first)."""

    def resume(self, works: list[Work]) -> list[Work]:
        """After a restart: which of the shards it was training it trains still (from where)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class LocalPlan:
    """Every shard once per epoch, in an order seeded by (``seed``, epoch)."""

    def __init__(self, shards: int, seed: int) -> None:
        self.shards, self.seed = shards, seed
        self.epoch, self.next = 0, 0
        self._drawn: tuple[int, list[int]] = (-1, [])  # (epoch, its order)

    def _order(self) -> list[int]:
        if self._drawn[0] != self.epoch:
            order = list(range(self.shards))
            random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
            self._drawn = (self.epoch, order)
        return self._drawn[1]

    def take(self) -> Work:
        if self.next >= self.shards:
            self.epoch, self.next = self.epoch + 1, 0
        self.next += 1
        return Work(self.epoch, self._order()[self.next - 1])

    def record(self, work: Work, position: int, done: bool) -> None:
        """(Nothing to record: this process is the only reader.)"""

    def lost(self, work: Work) -> bool:
        return False

    def resume(self, works: list[Work]) -> list[Work]:
        return works

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.next = int(state["epoch"]), int(state["next"])
