"""Token streams ready for training: the prepared corpus, per-peer data shards and the batch sampler.

Training windows are ``seq_len + 1`` tokens cut from the token stream every ``seq_len`` tokens. Each epoch
visits the windows in a fresh permutation seeded by (seed, shard key, epoch). A shard is either
``index`` of ``count`` (peers with the same key split each permutation into disjoint parts) or a key derived
from a peer id (each peer gets its own order over all the data).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from spes_p2p.data.corpus import SPLIT_SEED, fingerprint, load_documents, split_documents
from spes_p2p.data.tokenizer import (
    encode_documents,
    load_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)
from spes_p2p.errors import ConfigError, DataError
from spes_p2p.files import atomic_write_bytes
from spes_p2p.train.config import DataConfig


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train_ids: np.ndarray
    val_ids: np.ndarray
    corpus_hash: str  # identifies the documents
    tokenizer_hash: str


def prepare_data(cfg: DataConfig, vocab_size: int) -> PreparedData:
    """Reads, splits and tokenizes the corpus; reuses the cached tokenizer and token ids when present."""
    docs = load_documents(cfg.corpus, cfg.max_bytes)
    train_docs, val_docs = split_documents(docs, cfg.val_percent, SPLIT_SEED)
    corpus_hash = fingerprint(docs)
    cache = cfg.cache_path
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer, vocab_size)
    else:
        tok_path = cache / f"tokenizer-{corpus_hash[:16]}-{SPLIT_SEED}-v{vocab_size}.json"
        if tok_path.exists():
            tok = load_tokenizer(tok_path, vocab_size)
        else:
            tok = train_tokenizer(train_docs, vocab_size)
            atomic_write_bytes(tok_path, tok.to_str().encode())
    tok_hash = tokenizer_hash(tok)
    key = hashlib.sha256(f"{corpus_hash}:{tok_hash}:{SPLIT_SEED}:{cfg.val_percent}".encode()).hexdigest()[:16]
    train_ids = _cached_ids(cache / f"ids-{key}-train.npy", tok, train_docs)
    val_ids = _cached_ids(cache / f"ids-{key}-val.npy", tok, val_docs)
    return PreparedData(tok, train_ids, val_ids, corpus_hash, tok_hash)


def _cached_ids(path, tok: Tokenizer, docs) -> np.ndarray:
    if path.exists():
        try:
            return np.load(path, allow_pickle=False)
        except (ValueError, OSError):
            path.unlink()  # a damaged cache entry is rebuilt, never trusted
    ids = encode_documents(tok, docs)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())
    return ids


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
        self, ids: np.ndarray, seq_len: int, batch_size: int, seed: int, shard: DataShard = DataShard()
    ):
        self.ids, self.seq_len, self.batch_size, self.seed, self.shard = ids, seq_len, batch_size, seed, shard
        self.n_windows = (len(ids) - 1) // seq_len
        if self.n_windows // shard.count < batch_size:
            raise DataError(
                f"the training split has {self.n_windows} windows of {seq_len} tokens, too few for batches "
                f"of {batch_size} across {shard.count} shard(s); use a larger corpus or smaller batches"
            )
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.shard.key, self.epoch])
        return rng.permutation(self.n_windows)[self.shard.index :: self.shard.count]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = []
        while len(starts) < self.batch_size:
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order()
            starts.append(int(self._order[self.cursor]) * self.seq_len)
            self.cursor += 1
        return windows_to_batch(self.ids, starts, self.seq_len)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order()


def windows_to_batch(ids: np.ndarray, starts: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([ids[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    batch = torch.from_numpy(rows)
    return batch[:, :-1], batch[:, 1:]


def validation_batches(ids: np.ndarray, seq_len: int, batch_size: int, max_batches: int):
    """The same validation batches every time: the first windows of the validation split, in order."""
    n_windows = (len(ids) - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"the validation split has fewer than {seq_len + 1} tokens; use a larger corpus")
    starts = [w * seq_len for w in range(min(n_windows, batch_size * max_batches))]
    return [
        windows_to_batch(ids, starts[i : i + batch_size], seq_len) for i in range(0, len(starts), batch_size)
    ]
