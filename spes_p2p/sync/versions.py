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

Peers that hold frozen experts quantized (int8 or nf4) cannot add a change to the exact version before:
they hold only its rounding. Each quantized format has a **chain** of its own, which the holders keep beside
the exact one, for every expert shard, from the same start:

    change_q(r) = code(V(r) - X(r - k))        X(r) = quantize(X(r - k) + decode(change_q(r)))

(``X`` dequantized where it is added to). A keeper whose copy is ``X(r - k)`` (its hash says so) adds the
change and quantizes, as its model does on writing a copy, and holds ``X(r)`` bit for bit. The change is
taken against what the keepers hold, not against ``V``, so what quantizing drops is in the next change: the
copy stays within a rounding of the exact version, in the refresh codec's bytes. A keeper whose copy is not
in its chain fetches the chain's version whole, in its own format, once. (Dense blocks held quantized, with
``dense_blocks`` > 1, quantize only some of their tensors: they fetch each version whole in their format.)

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
from dataclasses import dataclass, field

import torch

from spes_p2p.sync.codecs import CODECS, EXACT, Codec
from spes_p2p.sync.payload import decode, encode, payload_meta, specs_of, tensors_hash, tensors_of

Tensors = dict[str, torch.Tensor]


def is_version_round(round_: int, every: int) -> bool:
    return (round_ + 1) % every == 0


QUANTIZED = ("int8", "nf4")  # the formats a copy may be held in, each with a chain of versions


def chains_of(unit: str) -> tuple[str, ...]:
    """The quantized chains a unit's holders keep (the module's docstring): those of an expert shard."""
    return QUANTIZED if unit.startswith("experts/") else ()


@dataclass(frozen=True)
class Want:
    """What to fetch of a unit: ``weights`` (as of a round), its ``version``, or the ``change`` to a version
    from the one we have (``since``: its round and hash), in ``codec`` (a name: it travels in the request);
    versions and changes of ``chain``: ``full`` (the exact versions) or a quantized format's."""

    kind: str = "weights"
    codec: str = "none"
    since: tuple[int, str] | None = None
    chain: str = "full"

    @property
    def makes_version(self) -> bool:
        """Whether what comes makes the holders' version of its chain exactly (a change, added to our version
        before; or the version itself, in the chain's own format)."""
        return self.kind == "change" or self == self.whole

    @property
    def whole(self) -> Want:
        """The version of our chain, whole: what to fetch when a change does not come."""
        return Want("version", "none" if self.chain == "full" else self.chain, chain=self.chain)


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
class Held:
    """A version as served: its payload (``none``, or a quantized chain's format) and the hash of what it
    decodes to."""

    payload: bytes
    hash: str


@dataclass(frozen=True)
class Version:
    round: int
    payload: bytes  # its weights, as served: a ``none`` payload
    hash: str
    chains: dict[str, Held] = field(default_factory=dict)  # format -> that chain's version

    @classmethod
    def of(
        cls, unit: str, round_: int, weights: Tensors, chains: dict[str, Tensors] | None = None
    ) -> Version:
        """Version ``round_`` of ``unit``; each of its quantized chains is ``chains[format]`` quantized (or,
        where not given, ``weights`` quantized: the chains start where the exact one does)."""
        meta = payload_meta(unit, round_, "version")
        held = {}
        for chain in chains_of(unit):
            payload = encode((chains or {}).get(chain, weights), CODECS[chain], meta=meta)
            held[chain] = Held(payload, tensors_hash(_decoded(payload, chain, weights)))
        return cls(round_, encode(weights, EXACT, meta=meta), tensors_hash(weights), held)

    @property
    def weights(self) -> Tensors:
        return tensors_of(self.payload)

    def chain(self, chain: str) -> Held:
        return Held(self.payload, self.hash) if chain == "full" else self.chains[chain]

    def held(self, chain: str) -> Tensors:
        """What a keeper of ``chain`` holds at this version (the exact weights for ``full``)."""
        return self.weights if chain == "full" else _decoded(self.chains[chain].payload, chain, self.weights)


def _decoded(payload: bytes, codec: str, like: Tensors) -> Tensors:
    return decode(payload, specs_of(like), CODECS[codec])


@dataclass(frozen=True)
class Change:
    """A version's changes, by chain, as served (each payload names the version it applies to), and the
    version they make."""

    payloads: dict[str, bytes]
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

    def start(
        self, unit: str, round_: int, weights: Tensors, chains: dict[str, Tensors] | None = None
    ) -> Version:
        """This peer's version ``round_`` of ``unit`` (the initial model, or a co-holder's exact version and
        its ``chains``)."""
        version = Version.of(unit, round_, weights, chains)
        with self._lock:
            self._current[unit] = version
            self._changes.pop(unit, None)
        return version

    def current(self, unit: str) -> Version | None:
        with self._lock:
            return self._current.get(unit)

    def change(self, unit: str, round_: int, chain: str = "full") -> bytes | None:
        """The change of ``chain`` that made version ``round_`` of ``unit``, when it is our current one."""
        with self._lock:
            change = self._changes.get(unit)
        if change is None or change.version.round != round_:
            return None
        return change.payloads.get(chain)

    def advance(self, unit: str, round_: int, since: int, weights: Tensors) -> Version:
        """Version ``round_`` from ``weights``: a change on version ``since`` when we have it, else (a chain
        we do not have) the weights themselves, with no change to serve this time."""
        before = self.current(unit)
        if before is None or before.round != since:
            return self.start(unit, round_, weights)
        payloads, chains = {}, {}
        full = before.chain("full")
        payloads["full"], exact = self._change(unit, round_, since, full, before.weights, weights)
        for chain in before.chains:
            payloads[chain], chains[chain] = self._change(
                unit, round_, since, before.chain(chain), before.held(chain), exact
            )
        version = Version.of(unit, round_, exact, chains)
        with self._lock:
            self._current[unit] = version
            self._changes[unit] = Change(payloads, version)
        return version

    def _change(
        self, unit: str, round_: int, since: int, held: Held, before: Tensors, target: Tensors
    ) -> tuple[bytes, Tensors]:
        """The change from ``before`` (what ``held`` decodes to) toward ``target``, and where it lands."""
        meta = change_meta(unit, round_, since, held.hash)
        payload = encode({n: target[n] - before[n] for n in target}, self.codec, meta=meta)
        sent = decode(payload, specs_of(target), self.codec, meta=meta)
        return payload, {n: before[n] + sent[n] for n in target}

    def held(self) -> dict[str, list]:
        """The versions, and the changes served (``peer.footprint``)."""
        with self._lock:
            return {
                "versions": [
                    [v.payload, *(c.payload for c in v.chains.values())] for v in self._current.values()
                ],
                "served": [list(c.payloads.values()) for c in self._changes.values()],
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
