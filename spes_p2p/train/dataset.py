"""Token streams ready for training: a prepared dataset (``data/shards.py``) read shard by shard, and the
batch sampler.

Training windows are ``seq_len + 1`` tokens cut from a shard every ``seq_len`` tokens (a window never spans
two shards). Each epoch visits the shards in a fresh order and each shard's windows in a fresh permutation,
both seeded by (seed, shard key, epoch). A ``DataShard`` is either ``index`` of ``count`` (peers with the same
key split that sequence into disjoint parts) or a key derived from a peer id (each peer gets its own order
over all the data). Only the shard being read is in memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from spes_p2p.data.prepare import prepare_cached
from spes_p2p.data.recipe import Recipe
from spes_p2p.data.shards import TOKENIZER, DatasetIndex
from spes_p2p.data.sources import ShardStore, open_dataset
from spes_p2p.data.tokenizer import load_tokenizer, tokenizer_hash
from spes_p2p.errors import ConfigError, DataError
from spes_p2p.train.config import DataConfig


@dataclass
class PreparedData:
    """A prepared dataset and its tokenizer; shards are read (or fetched) when asked for."""

    tokenizer: Tokenizer
    store: ShardStore

    @property
    def index(self) -> DatasetIndex:
        return self.store.index

    @property
    def dataset_hash(self) -> str:
        return self.index.digest

    @property
    def tokenizer_hash(self) -> str:
        return self.index.tokenizer_sha256

    def shard(self, split: str, number: int) -> np.ndarray:
        return self.store.tokens(split, number)


def prepare_data(cfg: DataConfig, vocab_size: int) -> PreparedData:
    """The dataset ``cfg`` names (a prepared folder or a URL), or its corpus prepared into the cache on first
    use."""
    if cfg.dataset:
        store = open_dataset(cfg.dataset, cfg.cache_path, int(cfg.cache_mb * 1e6))
    else:
        recipe = Recipe(
            cfg.corpus, cfg.tokenizer, vocab_size, val_percent=cfg.val_percent, max_bytes=cfg.max_bytes
        )
        folder = prepare_cached(recipe, cfg.cache_path)
        store = ShardStore(DatasetIndex.read(folder), folder, [], cached=False, max_bytes=0)
    tok = load_tokenizer(store.folder / TOKENIZER, vocab_size)
    if tokenizer_hash(tok) != store.index.tokenizer_sha256:
        raise DataError(
            f"{store.folder / TOKENIZER} is not the tokenizer its index names; prepare the dataset again"
        )
    if (
        cfg.dataset  # (a corpus prepared here was encoded with the given tokenizer)
        and cfg.tokenizer
        and tokenizer_hash(load_tokenizer(cfg.tokenizer, vocab_size)) != store.index.tokenizer_sha256
    ):
        raise DataError(
            f"the dataset {cfg.dataset} was prepared with another tokenizer than {cfg.tokenizer}; prepare it "
            "with that one (spes data prepare --tokenizer)"
        )
    return PreparedData(tok, store)


@dataclass(frozen=True)
class DataShard:
    """Which part of the training windows a peer reads."""

    key: int = 0
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ConfigError(f"data shard index must be in 0..{self.count - 1}, got {self.index}")

    @classmethod
    def for_peer_id(cls, peer_id: str) -> DataShard:
        return cls(key=int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big"))


class BatchSampler:
    """Yields (inputs_BS, targets_BS) batches; its position can be saved and restored exactly."""

    def __init__(
        self, data: PreparedData, seq_len: int, batch_size: int, seed: int, shard: DataShard = DataShard()
    ):
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.seed, self.shard = seed, shard
        self.windows = [(s.tokens - 1) // seq_len for s in data.index.train]  # per shard
        if sum(self.windows) // shard.count < batch_size:
            raise DataError(
                f"the training split has {sum(self.windows)} windows of {seq_len} tokens, too few for "
                f"batches of {batch_size} in {shard.count} part(s); use a larger corpus or smaller batches"
            )
        self.epoch, self.cursor = 0, 0
        self._plan()

    def _plan(self) -> None:
        """This epoch's order of shards, and where each one's windows end in it."""
        self._order = np.random.default_rng([self.seed, self.shard.key, self.epoch]).permutation(
            len(self.windows)
        )
        self._ends = np.cumsum([self.windows[n] for n in self._order])
        self._length = (int(self._ends[-1]) - self.shard.index + self.shard.count - 1) // self.shard.count
        self._read: tuple[int, np.ndarray, np.ndarray] | None = None  # (shard, tokens, its windows' order)

    def _window(self, position: int) -> np.ndarray:
        """The window at ``position`` of this epoch's sequence."""
        place = int(np.searchsorted(self._ends, position, side="right"))
        number = int(self._order[place])
        if self._read is None or self._read[0] != number:
            rng = np.random.default_rng([self.seed, self.shard.key, self.epoch, number])
            self._read = (number, self.data.shard("train", number), rng.permutation(self.windows[number]))
            if place + 1 < len(self._order):
                self.data.store.prefetch("train", int(self._order[place + 1]))  # (the next one, on its way)
        _, tokens, order = self._read
        start = int(order[position - (int(self._ends[place - 1]) if place else 0)]) * self.seq_len
        return tokens[start : start + self.seq_len + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        while len(rows) < self.batch_size:
            if self.cursor >= self._length:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._plan()
            rows.append(self._window(self.shard.index + self.cursor * self.shard.count))
            self.cursor += 1
        return rows_to_batch(rows)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._plan()


def rows_to_batch(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(np.stack(rows).astype(np.int64))
    return batch[:, :-1], batch[:, 1:]


def validation_batches(data: PreparedData, seq_len: int, batch_size: int, max_batches: int):
    """The same validation batches every time: the first windows of the validation shards, in order."""
    rows = []
    for number, shard in enumerate(data.index.val):
        if len(rows) >= batch_size * max_batches:
            break
        tokens = data.shard("val", number)
        rows += [tokens[s : s + seq_len + 1] for s in range(0, shard.tokens - seq_len, seq_len)]
    rows = rows[: batch_size * max_batches]
    if not rows:
        raise DataError(f"the validation split has fewer than {seq_len + 1} tokens; use a larger corpus")
    return [rows_to_batch(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
