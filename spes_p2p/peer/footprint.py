"""What a running peer holds in memory, by kind, measured while it trains and syncs.

Each part of a peer says what it holds (``held()``: tensors and payload bytes, by kind); ``Footprint`` adds
them up at the moments memory peaks (after each backward pass, while gradients are live, and after each
unit's exchange and the refresh, while the round's updates and copies are decoded) and keeps each round's
peak. The trainer's tensors are counted on the training thread only; a storage named twice counts once.
The row of a round (``metrics.jsonl``) gets the peak's total and its breakdown, and the process's resident
memory (in a simulation, the process holds every simulated peer).

Kinds:

    weights     the trained units' weights
    frozen      the copies of every other unit (quantized ones as codes and scales)
    gradients   gradient buffers, during a step
    optimizer   optimizer state (and state parked for units given up)
    outer       the sync's state across rounds: error-feedback residuals, outer momentum
    versions    the current version of each unit held (for the peers that keep frozen copies)
    snapshots   weights kept for a round's arithmetic: where updates start, the round's end, its result
    served      what the peer serves: coded updates, end weights, weights and version changes (payloads)
    received    what came from other peers and is not landed yet: decoded updates and refreshed copies
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import psutil
import torch

logger = logging.getLogger(__name__)

KINDS = (
    "weights",
    "frozen",
    "gradients",
    "optimizer",
    "outer",
    "versions",
    "snapshots",
    "served",
    "received",
)

Held = dict[str, list]  # kind -> tensors, payload bytes, and lists or dicts of them


def count(held: Held) -> dict[str, int]:
    """Bytes per kind; a storage (or a bytes object) named twice counts once, for the first kind in
    ``KINDS`` order that names it."""
    seen: set[int] = set()
    out = {}
    for kind in KINDS:
        out[kind] = sum(_bytes(obj, seen) for obj in held.get(kind, ()))
    return out


def _bytes(obj, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.device.type == "meta":
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, bytes | bytearray):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return len(obj)
    if isinstance(obj, dict):
        return sum(_bytes(v, seen) for v in list(obj.values()))
    if isinstance(obj, list | tuple):
        return sum(_bytes(v, seen) for v in obj)
    return 0


def merged(*parts: Held) -> Held:
    out: Held = {}
    for part in parts:
        for kind, objs in part.items():
            out.setdefault(kind, []).extend(objs)
    return out


class Holder(Protocol):
    def held(self) -> Held:
        """What it holds, by kind; it must only read (the lists and dicts it walks are copied first)."""


class Footprint:
    """The peak, since the last ``take``, of what a peer holds: its ``trainer`` (the model, gradients and
    optimizer state, which only the training thread may touch: a backward pass rewrites gradients under
    another thread's feet) and its other ``parts`` (snapshots, the sync's state and payloads: tensors that
    are replaced, never changed in shape, so any thread may count them). They share no storage."""

    def __init__(self, trainer: Holder, parts: Sequence[Holder], device: torch.device | None = None) -> None:
        self.trainer, self.parts, self.device = trainer, parts, device
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._peak: dict[str, int] = {}
        self._trainer: dict[str, int] = {}  # the trainer's bytes at the last sample of the training thread
        self._rss = 0

    def sample(self) -> None:
        """Counts everything; from the training thread."""
        self._trainer = count(self.trainer.held())
        self.recount()

    def recount(self) -> None:
        """Counts the other parts again (the trainer as last counted); from any thread."""
        try:
            parts = count(merged(*(p.held() for p in self.parts)))
        except RuntimeError as exc:  # a dict resized while we walked it: the next sample counts it
            logger.debug("memory sample skipped: %s", exc)
            return
        by_kind = {k: parts[k] + self._trainer.get(k, 0) for k in KINDS}
        rss = self._process.memory_info().rss
        with self._lock:
            if sum(by_kind.values()) > sum(self._peak.values()):
                self._peak = by_kind
            self._rss = max(self._rss, rss)

    def take(self) -> dict:
        """The peak since the last call, for a metrics row: ``memory_peak_bytes``, ``memory_bytes`` (by
        kind, at that peak), ``rss_bytes`` (the process's largest resident set seen) and, on a GPU,
        ``device_peak_bytes`` (everything allocated there, activations included)."""
        self.sample()
        with self._lock:
            peak, rss = self._peak, self._rss
            self._peak, self._rss = {}, 0
        row = {"memory_peak_bytes": sum(peak.values()), "memory_bytes": peak, "rss_bytes": rss}
        if self.device is not None and self.device.type == "cuda":
            row["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return row
