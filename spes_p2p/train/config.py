"""The train layer's settings sections: ``[train]`` (the trainer), ``[data]`` (corpus and tokenizer) and
``[merge]`` (the expert-merging warm-up). Plain values; no torch is imported here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from spes_p2p.fields import SWARM, Section, check, setting
from spes_p2p.model.config import FROZEN_FORMATS

OPTIMIZERS = ("adamw8bit", "adamw")
DEVICES = ("auto", "cpu", "cuda")
SWITCH_STATES = ("reset", "cpu")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Section):
    """[train]: the local trainer, its 8-bit optimizer and schedule, evaluation and checkpoints."""

    device: str = setting(
        "auto", "Where the model trains: auto (cuda when available, else cpu), cpu or cuda.", choices=DEVICES
    )
    optimizer: str = setting(
        "adamw8bit", "Optimizer: 8-bit AdamW (bitsandbytes) or torch's.", choices=OPTIMIZERS
    )
    lr: float = setting(1e-3, "Peak learning rate.")
    min_lr_ratio: float = setting(0.1, "The cosine schedule decays to this fraction of lr.")
    warmup_steps: int = setting(50, "Linear warmup steps.")
    total_steps: int = setting(10_000, "Length of the learning-rate schedule, in optimizer steps.")
    weight_decay: float = setting(0.1, "AdamW weight decay (norm weights get none).")
    beta1: float = setting(0.9, "AdamW beta1.")
    beta2: float = setting(0.95, "AdamW beta2.")
    grad_clip: float = setting(1.0, "Gradient norm clip.")
    batch_size: int = setting(8, "Sequences per step.")
    seq_len: int = setting(128, "Tokens per sequence.")
    seed: int = setting(0, "Seed of the model's initial weights and of local randomness.")
    log_every: int = setting(10, "spes train: steps between metric rows (a peer writes one per round).")
    eval_every: int = setting(500, "Steps between validation-loss evaluations.")
    eval_batches: int = setting(4, "Validation batches per evaluation.")
    checkpoint_every: int = setting(500, "Steps between checkpoints.")
    keep_checkpoints: int = setting(2, "Newest checkpoints kept.")
    frozen_experts: str = setting(
        "int8", "How experts this peer does not train are held in memory.", choices=FROZEN_FORMATS
    )
    frozen_dense: str = setting(
        "int8",
        "How dense blocks this peer does not train are held in memory (with dense_blocks > 1).",
        choices=FROZEN_FORMATS,
    )
    switch_state: str = setting(
        "reset",
        "Optimizer state of a unit given up: reset (freed) or cpu (kept there for its return).",
        choices=SWITCH_STATES,
    )

    def validate(self) -> None:
        for name in (
            "total_steps",
            "batch_size",
            "seq_len",
            "log_every",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            check(getattr(self, name) >= 1, name, "must be at least 1")
        check(self.lr > 0, "lr", "must be positive")
        check(self.warmup_steps >= 0, "warmup_steps", "must be at least 0")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(self.weight_decay >= 0, "weight_decay", "must be at least 0")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1", "beta1 and beta2 must be in [0, 1)")
        check(self.grad_clip > 0, "grad_clip", "must be positive")


@dataclass(frozen=True, kw_only=True)
class DataConfig(Section):
    """[data]: where this peer's text comes from, and its tokenizer."""

    corpus: str = setting(
        "stdlib",
        "stdlib (this machine's Python sources), a text/.jsonl/.parquet file or folder, or hf:NAME[:SPLIT].",
    )
    dataset: str = setting(
        "",
        "A prepared dataset (spes data prepare): its folder, the http(s) URL it is served under, or "
        "hf://datasets/OWNER/NAME[@REVISION][/FOLDER]; empty: the corpus, prepared into the cache.",
    )
    max_corpus_mb: float = setting(0.0, "Read at most this many MB of the corpus; 0: all of it.")
    val_percent: float = setting(2.0, "Share of documents held out for validation, in percent.")
    tokenizer: str = setting("", "A tokenizer.json to use; empty: train a byte-level BPE on the corpus.")
    cache_dir: str = setting("", "Prepared corpora's cache; empty: $SPES_CACHE_DIR or ~/.cache/spes-p2p.")
    mirrors: tuple[str, ...] = setting(
        (),
        "More places a new swarm's dataset is served from (folders, http(s) URLs, hf://datasets/...), "
        "written into its manifest for newcomers (repeatable); the swarm's peers serve it too.",
        flag="--mirror",
        metavar="PLACE",
    )
    cache_mb: float = setting(
        4096.0, "Shards of a dataset fetched from elsewhere (a URL, the peers) kept here at most, in MB."
    )

    def validate(self) -> None:
        check(self.max_corpus_mb >= 0, "max_corpus_mb", "must be at least 0 (0: all of it)")
        check(0 < self.val_percent < 50, "val_percent", "must be in (0, 50)")
        check(self.cache_mb > 0, "cache_mb", "must be above 0")

    @property
    def max_bytes(self) -> int | None:
        return int(self.max_corpus_mb * 1e6) if self.max_corpus_mb > 0 else None

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir or os.environ.get("SPES_CACHE_DIR") or Path.home() / ".cache" / "spes-p2p")


@dataclass(frozen=True, kw_only=True)
class MergeConfig(Section):
    """[merge]: the expert-merging warm-up of SPES: early on, pull each expert toward its nearest ones."""

    SCOPE = SWARM

    enabled: bool = setting(True, "Expert-merging warm-up.", flag="--merge")
    interval: int = setting(200, "Steps between merges.", flag="--merge-interval")
    alpha: float = setting(
        0.05, "a_0: how far an expert moves toward its neighbours at step 0.", flag="--merge-alpha"
    )
    horizon: int = setting(2000, "T: merging fades out linearly by this step.", flag="--merge-horizon")
    neighbours: int = setting(4, "K: neighbours per expert.", flag="--merge-neighbours")

    def validate(self) -> None:
        for name in ("interval", "horizon", "neighbours"):
            check(getattr(self, name) >= 1, name, "must be at least 1")
        check(0 <= self.alpha <= 1, "alpha", "must be in [0, 1]")

    def alpha_at(self, step: int) -> float:
        return self.alpha * (1 - min(step / self.horizon, 1.0))

    def due(self, step: int) -> bool:
        return self.enabled and step > 0 and step % self.interval == 0 and self.alpha_at(step) > 0
