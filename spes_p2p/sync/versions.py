"""Versions: what the peers that keep a frozen copy of a unit have, so that they receive only what changed.

Every ``refresh_every_rounds`` rounds (a **version round** ``r``), the holders of a unit publish its next
version, from their weights ``W`` of that round (after the exchange, before any merge):

    change(r) = code(W(r) - V(r - k))          V(r) = V(r - k) + decode(change(r))

in the refresh codec, where ``V(r - k)`` is the version before. Holders end a round with the same weights
and share the version before, so they publish the same change, bit for bit. A peer whose frozen copy is
version ``r - k`` exactly adds the change and has version ``r`` exactly: what the codec drops in one version
is in the next one's change, so a copy never drifts further from the holders' weights than one change's
rounding, however many rounds pass.

A copy that is not a version (a newcomer's, one that missed a version round, or one whose check failed)
is replaced by the holders' exact version (``none`` codec) once, and follows the changes from then on.
Peers that hold frozen experts quantized fetch each version in their own codec instead.

Holders keep the current version of each unit they hold (``Versions``), as the payload it is served as;
peers keep, for each frozen copy that is a version, its round and hash (``Copies``). A change names the
version it applies to (``since``: round and hash); a copy whose hash is not that one has drifted, and is
replaced by the exact version.

What a peer asks of a unit's holders is a ``Want`` (weights, a version, or a change, in a codec); what comes
back is a ``Download`` (``refresh.Refresh`` fetches them), which makes the unit's new weights from our copy
(``Download.onto``: a change is added to it; anything else replaces it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spes_p2p.sync.codecs import EXACT, Codec, TensorSpec
from spes_p2p.sync.payload import decode, encode, payload_meta, tensors_hash, tensors_of

Tensors = dict[str, torch.Tensor]


def is_version_round(round_: int, every: int) -> bool:
    return (round_ + 1) % every == 0


@dataclass(frozen=True)
class Want:
    """What to fetch of a unit: ``weights`` (as of a round), its ``version``, or the ``change`` to a version
    from the one we have (``since``: its round and hash), in ``codec`` (a name: it travels in the request)."""

    kind: str = "weights"
    codec: str = "none"
    since: tuple[int, str] | None = None

    @property
    def makes_version(self) -> bool:
        """Whether what comes makes the holders' version exactly (a change, added to our version before; or
        the exact version itself)."""
        return self.kind == "change" or self == EXACT_VERSION


EXACT_WEIGHTS = Want("weights", "none")
EXACT_VERSION = Want("version", "none")


@dataclass(frozen=True)
class Download:
    """What came of a unit: the round it is of, what it was, and its payload, checked. It is kept coded until
    it is used (a copy held as int8 waits for its landing in a quarter of the bytes) and decoded on each
    use."""

    round: int
    want: Want
    payload: bytes = b""
    decoder: Callable[[bytes], Tensors] = lambda payload: {}

    @property
    def tensors(self) -> Tensors:
        """Its tensors (a change: what to add)."""
        return self.decoder(self.payload)

    def onto(self, copy: Callable[[], Tensors]) -> Tensors:
        """The unit's new weights: a change added to our copy (of the version before; ``copy()`` is read only
        for a change), anything else as it came."""
        if self.want.kind != "change":
            return self.tensors
        before = copy()
        return {n: before[n] + t for n, t in self.tensors.items()}


NOBODY = Download(-2, Want())  # every holder left and there is no fallback: stop asking
ELSEWHERE = Download(-3, Want())  # a change to another version than ours: that holder's chain differs


@dataclass(frozen=True)
class Version:
    round: int
    payload: bytes  # its weights, as served: a ``none`` payload
    hash: str

    @classmethod
    def of(cls, unit: str, round_: int, weights: Tensors) -> Version:
        payload = encode(weights, EXACT, meta=payload_meta(unit, round_, "version"))
        return cls(round_, payload, tensors_hash(weights))

    @property
    def weights(self) -> Tensors:
        return tensors_of(self.payload)


@dataclass(frozen=True)
class Change:
    """A version's change, as served (its payload names the version it applies to), and the one it makes."""

    payload: bytes
    version: Version


def change_meta(unit: str, round_: int, since: int, since_hash: str) -> dict[str, str]:
    """A change's metadata: the version it applies to, by round and hash (its receiver checks both)."""
    return {"unit": unit, "round": str(round_), "kind": "change", "since": f"{since}:{since_hash}"}


class Versions:
    """The current version of each unit this peer holds, and the change that made it. Thread-safe: the
    sync thread advances; handler threads serve."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec  # how a change travels
        self._lock = threading.Lock()
        self._current: dict[str, Version] = {}
        self._changes: dict[str, Change] = {}  # unit -> the change that made its current version

    def start(self, unit: str, round_: int, weights: Tensors) -> Version:
        """This peer's version ``round_`` of ``unit`` (the initial model, or a co-holder's exact version)."""
        version = Version.of(unit, round_, weights)
        with self._lock:
            self._current[unit] = version
            self._changes.pop(unit, None)
        return version

    def current(self, unit: str) -> Version | None:
        with self._lock:
            return self._current.get(unit)

    def change(self, unit: str, round_: int) -> Change | None:
        with self._lock:
            change = self._changes.get(unit)
        return change if change is not None and change.version.round == round_ else None

    def advance(self, unit: str, round_: int, since: int, weights: Tensors) -> Version:
        """Version ``round_`` from ``weights``: a change on version ``since`` when we have it, else (a chain
        we do not have) the weights themselves, with no change to serve this time."""
        before = self.current(unit)
        if before is None or before.round != since:
            return self.start(unit, round_, weights)
        meta = change_meta(unit, round_, since, before.hash)
        previous = before.weights
        delta = {n: weights[n] - previous[n] for n in weights}
        payload = encode(delta, self.codec, meta=meta)
        specs = {n: TensorSpec(tuple(t.shape)) for n, t in weights.items()}
        sent = decode(payload, specs, self.codec, meta=meta)
        version = Version.of(unit, round_, {n: previous[n] + sent[n] for n in weights})
        with self._lock:
            self._current[unit] = version
            self._changes[unit] = Change(payload, version)
        return version

    def held(self) -> dict[str, list]:
        """The versions, and the changes served (``peer.footprint``)."""
        with self._lock:
            return {
                "versions": [v.payload for v in self._current.values()],
                "served": [c.payload for c in self._changes.values()],
            }

    def forget(self, held: set[str], before: int) -> None:
        """Forgets the versions of units this peer no longer holds, once older than round ``before`` (until
        then it serves them, so that the unit's next holder continues its chain)."""
        with self._lock:
            for unit in [u for u, v in self._current.items() if u not in held and v.round < before]:
                self._current.pop(unit, None)
                self._changes.pop(unit, None)


class Copies:
    """For each frozen copy that is a version exactly: its round and hash. Written when a refresh lands
    (training thread), read when the next refresh starts (sync thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[int, str]] = {}

    def get(self, unit: str) -> tuple[int, str] | None:
        with self._lock:
            return self._known.get(unit)

    def set(self, unit: str, round_: int, hash_: str) -> None:
        with self._lock:
            self._known[unit] = (round_, hash_)

    def forget(self, unit: str | None = None) -> None:
        """A copy that stopped being a version (every copy: ``unit`` None, after a download)."""
        with self._lock:
            if unit is None:
                self._known.clear()
            else:
                self._known.pop(unit, None)
