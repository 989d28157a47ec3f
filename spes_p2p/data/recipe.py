"""What a dataset is prepared from, and how (``Recipe``), and where a preparation is (``PrepareProgress``):
light values the command line builds without the tokenizer or numpy loaded."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

from spes_p2p.data.corpus import Document, first_bytes, iter_documents
from spes_p2p.errors import DataError


@dataclass(frozen=True)
class Recipe:
    """What a dataset is prepared from, and how; a resumed preparation must have the same."""

    source: str
    tokenizer: str = ""  # a tokenizer.json; empty: a byte-level BPE trained on the corpus's first documents
    vocab_size: int = 4096  # of the tokenizer trained (a given one's must be at most this)
    shard_tokens: int = 1 << 20
    val_percent: float = 2.0
    tokenizer_sample_mb: float = 64.0  # training text the tokenizer is trained on
    max_bytes: int | None = None  # read the corpus's documents up to the first that reaches this much text

    def documents(self) -> Iterator[Document]:
        return first_bytes(iter_documents(self.source), self.max_bytes)

    def settings(self) -> dict:
        """What a resumed preparation shares with the first (a given tokenizer: its hash, not its path)."""
        return {k: v for k, v in asdict(self).items() if k != "tokenizer"}

    def __post_init__(self) -> None:
        if self.shard_tokens < 1 or not 0 < self.val_percent < 50 or self.tokenizer_sample_mb <= 0:
            raise DataError("shard tokens must be at least 1, val percent in (0, 50), the sample above 0 MB")


@dataclass(frozen=True)
class PrepareProgress:
    """Where a preparation is, for a progress bar."""

    bytes_read: int
    bytes_total: int | None  # None: the source's size is unknown (a Hugging Face stream)
    documents: int
    shards: int
