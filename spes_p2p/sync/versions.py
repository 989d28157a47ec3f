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

Peers that hold frozen copies quantized (int8 or nf4) cannot add a change to the exact version before:
they hold only its rounding. Each quantized format has a **chain** of its own, which the holders keep beside
the exact one, for every unit that has tensors its keepers quantize (``Chains``: all of an expert shard's;
a dense block's large weights, not its norms), from the same start:

    change_q(r) = code(V(r) - X(r - k))        X(r) = quantize(X(r - k) + decode(change_q(r)))

(``X`` dequantized where it is added to, and quantized only in the tensors its keepers quantize). A keeper
whose copy is ``X(r - k)`` (its hash says so) adds the change and writes the sum, which its model quantizes
as the holders did, and holds ``X(r)`` bit for bit. The change is taken against what the keepers hold, not
against ``V``, so what quantizing drops is in the next change: the copy stays within a rounding of the
exact version, in the refresh codec's bytes. A keeper whose copy is not in its chain fetches the chain's
version whole once: in its format for an expert shard, exactly for a dense block (whose float32 norms a
quantized payload cannot carry).

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from spes_p2p.sync.codecs import CODECS, EXACT, Codec, TensorSpec
from spes_p2p.sync.payload import decode, encode, payload_meta, specs_of, tensors_hash, tensors_of

Tensors = dict[str, torch.Tensor]


def is_version_round(round_: int, every: int) -> bool:
    return (round_ + 1) % every == 0


QUANTIZED = ("int8", "nf4")  # the formats a copy may be held in, each with a chain of versions


class Chains:
    """Which tensors of each unit a keeper that holds it quantized keeps quantized (the model decides:
    ``model.units.quantized_when_frozen``; the others, norms and small weights, stay float32), and so the
    quantized chains each unit has: none where no tensor is quantized."""

    def __init__(self, names: dict[str, Iterable[str]], quantized: dict[str, frozenset[str]]) -> None:
        """``names``: every unit's tensors; ``quantized``: those kept quantized, by unit."""
        self._names = {u: frozenset(n) for u, n in names.items()}
        self._quantized = quantized

    @classmethod
    def experts_only(cls, names: dict[str, Iterable[str]]) -> Chains:
        """Every tensor of an expert shard quantized, none of a dense block (as when every dense weight is
        too small to quantize)."""
        return cls(
            names, {u: frozenset(n) if u.startswith("experts/") else frozenset() for u, n in names.items()}
        )

    def of(self, unit: str) -> tuple[str, ...]:
        return QUANTIZED if self._quantized.get(unit) else ()

    def split(self, unit: str, tensors: Tensors) -> tuple[Tensors, Tensors]:
        """(the tensors a keeper quantizes, the others)."""
        names = self._quantized.get(unit, frozenset())
        quantized = {n: t for n, t in tensors.items() if n in names}
        return quantized, {n: t for n, t in tensors.items() if n not in names}

    def whole(self, unit: str, chain: str) -> Want:
        """A chain's version, whole: in its format when the keeper quantizes every tensor of the unit (an
        expert shard), else exactly (a dense block, whose norms stay float32)."""
        if chain == "full":
            return EXACT_VERSION
        every = self._quantized.get(unit) == self._names.get(unit)
        return Want("version", chain if every else "none", chain=chain)


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
        before; or the version itself, exactly or in the chain's own format)."""
        return self.kind == "change" or (self.kind == "version" and self.codec in ("none", self.chain))


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
    """A quantized chain's version: what its keepers quantize, as the chain's format codes it, the rest
    (float32; empty when they quantize every tensor), and the hash of what they decode to."""

    payload: bytes
    rest: bytes
    hash: str


@dataclass(frozen=True)
class Version:
    round: int
    payload: bytes  # its weights, as served: a ``none`` payload
    hash: str
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    chains: dict[str, Held] = field(default_factory=dict)  # format -> that chain's version

    @classmethod
    def of(
        cls,
        unit: str,
        round_: int,
        weights: Tensors,
        kept: Chains,
        chains: dict[str, Tensors] | None = None,
    ) -> Version:
        """Version ``round_`` of ``unit``; each of its quantized chains is ``chains[format]`` (or, where not
        given, ``weights``: the chains start where the exact one does), quantized where its keepers
        quantize."""
        meta, specs = payload_meta(unit, round_, "version"), specs_of(weights)
        held = {}
        for chain in kept.of(unit):
            quantized, rest = kept.split(unit, (chains or {}).get(chain, weights))
            payload = encode(quantized, CODECS[chain], meta=meta)
            rest_payload = encode(rest, EXACT, meta=meta) if rest else b""
            decoded = _decoded(payload, rest_payload, chain, specs)
            held[chain] = Held(payload, rest_payload, tensors_hash(decoded))
        return cls(round_, encode(weights, EXACT, meta=meta), tensors_hash(weights), specs, held)

    @property
    def weights(self) -> Tensors:
        return tensors_of(self.payload)

    def hash_of(self, chain: str) -> str:
        return self.hash if chain == "full" else self.chains[chain].hash

    def held(self, chain: str) -> Tensors:
        """What a keeper of ``chain`` holds at this version (the exact weights for ``full``)."""
        if chain == "full":
            return self.weights
        held = self.chains[chain]
        return _decoded(held.payload, held.rest, chain, self.specs)


def _decoded(payload: bytes, rest: bytes, chain: str, specs: dict[str, TensorSpec]) -> Tensors:
    """What a quantized chain's version decodes to, as its keepers hold it: ``payload`` in the chain's
    format, ``rest`` (its float32 tensors, if any) exactly."""
    exact = tensors_of(rest) if rest else {}
    quantized = {n: s for n, s in specs.items() if n not in exact}
    return {**decode(payload, quantized, CODECS[chain]), **exact}


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

    def __init__(self, codec: Codec, chains: Chains) -> None:
        self.codec, self.chains = codec, chains  # how a change travels; the quantized chains of each unit
        self._lock = threading.Lock()
        self._current: dict[str, Version] = {}
        self._changes: dict[str, Change] = {}  # unit -> the change that made its current version

    def start(
        self, unit: str, round_: int, weights: Tensors, chains: dict[str, Tensors] | None = None
    ) -> Version:
        """This peer's version ``round_`` of ``unit`` (the initial model, or a co-holder's exact version and
        its ``chains``)."""
        version = Version.of(unit, round_, weights, self.chains, chains)
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
        payloads["full"], exact = self._change(unit, round_, since, before.hash, before.weights, weights)
        for chain in before.chains:
            payloads[chain], chains[chain] = self._change(
                unit, round_, since, before.hash_of(chain), before.held(chain), exact
            )
        version = Version.of(unit, round_, exact, self.chains, chains)
        with self._lock:
            self._current[unit] = version
            self._changes[unit] = Change(payloads, version)
        return version

    def _change(
        self, unit: str, round_: int, since: int, since_hash: str, before: Tensors, target: Tensors
    ) -> tuple[bytes, Tensors]:
        """The change from ``before`` (version ``since``, whose hash is ``since_hash``) toward ``target``,
        and where it lands."""
        meta = change_meta(unit, round_, since, since_hash)
        payload = encode({n: target[n] - before[n] for n in target}, self.codec, meta=meta)
        sent = decode(payload, specs_of(target), self.codec, meta=meta)
        return payload, {n: before[n] + sent[n] for n in target}

    def held(self) -> dict[str, list]:
        """The versions, and the changes served (``peer.footprint``)."""
        with self._lock:
            return {
                "versions": [
                    [v.payload, *(b for c in v.chains.values() for b in (c.payload, c.rest))]
                    for v in self._current.values()
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
