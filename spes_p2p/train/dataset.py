"""Token streams ready for training: a prepared dataset (``data/shards.py``) read shard by shard, and the
batch sampler.

Training windows are ``seq_len + 1`` tokens cut from a shard every ``seq_len`` tokens (a window never spans
two shards). The sampler reads one shard at a time, the one its plan (``data/plan.py``) hands out: the next
in a seeded order in one process, one nobody else trains in a swarm. A shard's windows are read in a
permutation seeded by (seed, epoch, shard), the same for every reader, so a shard left half-trained by one
peer is continued by another from the same place. Only the shard being read (and the next, fetched ahead)
is in memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from spes_p2p.data.plan import DataPlan, Work
from spes_p2p.data.prepare import prepare_cached
from spes_p2p.data.recipe import Recipe
from spes_p2p.data.shards import TOKENIZER, DatasetIndex
from spes_p2p.data.sources import ShardStore, open_dataset
from spes_p2p.data.tokenizer import load_tokenizer, tokenizer_hash
from spes_p2p.errors import DataError
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
    data = open_prepared(store, vocab_size)
    if (
        cfg.dataset  # (a corpus prepared here was encoded with the given tokenizer)
        and cfg.tokenizer
        and tokenizer_hash(load_tokenizer(cfg.tokenizer, vocab_size)) != store.index.tokenizer_sha256
    ):
        raise DataError(
            f"the dataset {cfg.dataset} was prepared with another tokenizer than {cfg.tokenizer}; prepare it "
            "with that one (spes data prepare --tokenizer)"
        )
    return data


def open_prepared(store: ShardStore, vocab_size: int) -> PreparedData:
    """The dataset of ``store`` with its tokenizer (which must be the one its index names)."""
    tok = load_tokenizer(store.folder / TOKENIZER, vocab_size)
    if tokenizer_hash(tok) != store.index.tokenizer_sha256:
        raise DataError(
            f"{store.folder / TOKENIZER} is not the tokenizer its index names; prepare the dataset again"
        )
    return PreparedData(tok, store)


class ShardSampler:
    """Yields (inputs_BS, targets_BS) batches from the shards its plan hands out; its position can be saved
    and restored exactly. Half way through a shard it takes the next one from the plan and fetches it
    meanwhile. Without ``read_tokens`` (virtual compute) it only moves through the windows."""

    def __init__(
        self,
        data: PreparedData,
        seq_len: int,
        batch_size: int,
        seed: int | str,
        plan: DataPlan,
        read_tokens: bool = True,
    ) -> None:
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed
        self.plan, self.read_tokens = plan, read_tokens
        self.windows = [(s.tokens - 1) // seq_len for s in data.index.train]  # per shard
        if sum(self.windows) < batch_size:
            raise DataError(
                f"the training split has {sum(self.windows)} windows of {seq_len} tokens, too few for "
                f"batches of {batch_size}; use a larger corpus or smaller batches"
            )
        self.work: Work | None = None  # the shard being read, and how far
        self.ahead: Work | None = None  # the next one, taken half way through this one
        self._read: tuple[Work, np.ndarray | None, np.ndarray] | None = None  # (its tokens, windows' order)
        self._trained: list[list[int]] = []  # [epoch, shard, first window, last + 1] read since ``trained``

    @property
    def epoch(self) -> int:
        return self.work.epoch if self.work else 0

    def _next_work(self) -> None:
        if self.work is not None:
            self.plan.record(self.work, self.work.position, done=True)
        self.work, self.ahead = self.ahead or self.plan.take(), None

    def _window(self) -> np.ndarray | None:
        """The next window of the current shard (None without ``read_tokens``); moves on to the next shard
        when this one is done or another peer took it."""
        while self.work is None or self.work.position >= self.windows[self.work.shard]:
            self._next_work()
        if self.plan.lost(self.work):  # (not done: another peer trains it)
            self.work = None
            return self._window()
        work = self.work
        if self._read is None or self._read[0][:2] != work[:2]:
            key = hashlib.sha256(f"{self.seed}/{work.epoch}/{work.shard}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(key[:8], "big"))
            tokens = self.data.shard("train", work.shard) if self.read_tokens else None
            self._read = (work, tokens, rng.permutation(self.windows[work.shard]))
        if self.ahead is None and work.position >= self.windows[work.shard] // 2:
            self.ahead = self.plan.take()
            if self.read_tokens:
                self.data.store.prefetch("train", self.ahead.shard)  # (on its way while this one trains)
        _, tokens, order = self._read
        self.work = work._replace(position=work.position + 1)
        last = self._trained[-1] if self._trained else None
        if last and last[:2] == [work.epoch, work.shard] and last[3] == work.position:
            last[3] += 1
        else:
            self._trained.append([work.epoch, work.shard, work.position, work.position + 1])
        if tokens is None:
            return None
        start = int(order[work.position]) * self.seq_len
        return tokens[start : start + self.seq_len + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self._window() for _ in range(self.batch_size)]
        self.plan.record(self.work, self.work.position, done=False)
        return rows_to_batch(rows)

    def skip_batch(self) -> None:
        """Moves through one batch's windows without reading them (virtual compute)."""
        for _ in range(self.batch_size):
            self._window()
        self.plan.record(self.work, self.work.position, done=False)

    def trained(self) -> list[list[int]]:
        """The windows read since the last call, as [epoch, shard, first, last + 1] ranges."""
        ranges, self._trained = self._trained, []
        return ranges

    def state_dict(self) -> dict:
        works = [w for w in (self.work, self.ahead) if w is not None]
        return {"works": [list(w) for w in works], "plan": self.plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "works" not in state:
            raise DataError(
                "this checkpoint's data position was written by an older spes-p2p (before data shards were "
                "taken one at a time): start a new run, or train it on with that version"
            )
        self.plan.load_state_dict(state["plan"])
        works = self.plan.resume([Work(*map(int, w)) for w in state["works"]])
        self.work, self.ahead = [*works, None, None][:2]
        self._read = None


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
