"""The sync layer's settings section: ``[sync]`` (how a round's updates are coded, combined and waited for).
Plain values; no torch and no networking here."""

from __future__ import annotations

from dataclasses import dataclass

from spes_p2p.fields import PEER, SWARM, Section, check, setting
from spes_p2p.swarm.records import MAX_PARTS
from spes_p2p.sync.codecs import CODECS, SparseLoCo, TopK

OUTER_RULES = ("fedavg", "nesterov")
AGGREGATES = ("mean", "clipped_mean", "trimmed_mean", "median")
DENSE_EXCHANGES = ("reduce_scatter", "all_to_all")
FROZEN_REFRESHES = ("changes", "weights")


@dataclass(frozen=True, kw_only=True)
class SyncConfig(Section):
    """[sync]: how a round's updates are coded, combined and waited for (docs/protocol.md)."""

    SCOPE = SWARM

    codec: str = setting("int8", "How updates travel.", choices=tuple(CODECS))
    refresh_codec: str = setting(
        "int8", "How frozen copies of other units travel (their changes, or weights).", choices=tuple(CODECS)
    )
    frozen_refresh: str = setting(
        "changes",
        "How frozen copies are brought up to date: changes (what changed since the copy's version, in "
        "refresh_codec) or weights (the holders' weights in full, every time).",
        choices=FROZEN_REFRESHES,
    )
    topk_fraction: float = setting(TopK.fraction, "topk codec: the share of entries sent.")
    sparse_chunk: int = setting(SparseLoCo.chunk, "sparseloco codec: values per chunk (at most 65536).")
    sparse_k: int = setting(SparseLoCo.k, "sparseloco codec: entries sent per chunk.")
    sparse_bits: int = setting(
        SparseLoCo.bits, "sparseloco codec: bits per value sent (a sign and the rest)."
    )
    sparse_decay: float = setting(
        SparseLoCo.feedback_decay, "sparseloco codec: what error feedback keeps of the last residual."
    )
    outer: str = setting("fedavg", "Outer rule: fedavg (SPES) or nesterov (DiLoCo).", choices=OUTER_RULES)
    outer_lr: float = setting(1.0, "Outer learning rate.")
    outer_momentum: float = setting(0.9, "Outer momentum (nesterov only).")
    dense_group_size: int = setting(
        16, "G: the dense part is averaged by reduce-scatter in random rows of at most G peers, which merge."
    )
    dense_exchange: str = setting(
        "reduce_scatter",
        "How a group averages the dense part: reduce_scatter (each member combines 1/G of it: about two "
        "dense-sized messages each way per peer) or all_to_all (each pulls every other member's update).",
        choices=DENSE_EXCHANGES,
    )
    staleness: int = setting(1, "Rounds a late update still counts.")
    max_round_tokens: int = setting(
        1 << 24, "The most tokens one update may count for; a larger count is clamped to this."
    )
    deadline_min: float = setting(
        2.0,
        "A round waits for late participants at least this long...",
        flag="--sync-deadline-min",
        scope=PEER,
    )
    deadline_max: float = setting(
        60.0, "...and at most this long, adapting in between.", flag="--sync-deadline-max", scope=PEER
    )
    request_timeout: float = setting(30.0, "Seconds one request to a peer may take.", scope=PEER)

    def validate(self) -> None:
        check(0 < self.topk_fraction <= 1, "topk_fraction", "must be in (0, 1]")
        check(2 <= self.sparse_chunk <= 1 << 16, "sparse_chunk", "must be in [2, 65536]")
        check(1 <= self.sparse_k <= self.sparse_chunk, "sparse_k", "must be in [1, sparse_chunk]")
        check(1 <= self.sparse_bits <= 8, "sparse_bits", "must be in [1, 8]")
        check(0 <= self.sparse_decay <= 1, "sparse_decay", "must be in [0, 1]")
        check(self.outer_lr > 0, "outer_lr", "must be positive")
        check(0 <= self.outer_momentum < 1, "outer_momentum", "must be in [0, 1)")
        check(2 <= self.dense_group_size <= MAX_PARTS, "dense_group_size", f"must be in [2, {MAX_PARTS}]")
        check(self.staleness >= 0, "staleness", "must be at least 0")
        check(self.max_round_tokens >= 1, "max_round_tokens", "must be at least 1")
        check(
            0 < self.deadline_min <= self.deadline_max,
            "deadline_min",
            "must be positive and at most deadline_max",
        )
        check(self.request_timeout > 0, "request_timeout", "must be positive")
