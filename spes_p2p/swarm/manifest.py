"""A swarm's manifest: what every peer of the swarm shares, fixed when the swarm is founded.

It holds the protocol version, the run id, every swarm-wide setting, the model's architecture and units, the
tokenizer (by SHA-256 of its ``tokenizer.json``), the dataset (``DatasetPin``) and the initial model's
SHA-256. The DHT carries only a small ``ManifestRecord`` per peer (its hash, protocol and size, under
``<run>/manifest``); every peer serves the manifest in full (``spes/manifest``) and the tokenizer's bytes
(``spes/tokenizer``). Whoever fetches them checks both against their hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Annotated, Any

import msgspec

from spes_p2p.net.transport import RemoteError, Transport, TransportError
from spes_p2p.net.waiting import MIN_REQUEST_SECONDS, Deadline, poll
from spes_p2p.net.wire import RecordError, Short, Strict
from spes_p2p.swarm.records import Hex, Record, Unit, decode_entries

logger = logging.getLogger(__name__)

PROTOCOL = 14  # bumped when peers of different versions can no longer work together
RPC_MANIFEST = "spes/manifest"
RPC_TOKENIZER = "spes/tokenizer"
MAX_MANIFEST_BYTES = 256 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
REQUEST_SECONDS = 20.0  # one request for the manifest or the tokenizer
RETRY_SECONDS = 1.0  # between rounds of asking the peers that failed to answer


class ManifestError(RecordError):
    """A manifest (or tokenizer) that does not match its hash, or does not decode."""


class DatasetPin(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The swarm's dataset: the SHA-256 of its index (which covers every shard's), its training shards'
    count, the places it can be fetched from besides the peers, and what it was prepared from (for
    people)."""

    dataset: Hex = "0" * 64
    train_shards: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1
    sources: Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=16)] = (
        msgspec.field(default_factory=list)
    )
    corpus: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Manifest(Strict):
    MAX_BYTES = MAX_MANIFEST_BYTES
    ERROR = ManifestError

    protocol: int
    run_id: Short
    settings: dict[str, Any]  # "section.field" -> value, for every swarm-wide setting
    model: dict[str, Any]  # the architecture
    units: Annotated[list[Unit], msgspec.Meta(max_length=4096)]
    tokenizer_sha256: Hex
    tokenizer_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENIZER_BYTES)]
    data: DatasetPin
    initial_units: Annotated[dict[Unit, Hex], msgspec.Meta(max_length=4096)]  # unit -> its fingerprint

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(msgspec.to_builtins(self), sort_keys=True).encode()).hexdigest()

    def record(self) -> ManifestRecord:
        return ManifestRecord(hash=self.hash, protocol=self.protocol, bytes=len(self.encode()))


class ManifestRecord(Record):
    """A peer's manifest, in the DHT: its hash, protocol version and size."""

    hash: Hex
    protocol: int
    bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_MANIFEST_BYTES)]


def protocol_mismatch(run_id: str, protocol: int, peer: str = "") -> str:
    where = f" (peer {peer})" if peer else ""
    return (
        f"swarm {run_id!r} speaks protocol {protocol}{where} and this peer protocol {PROTOCOL}: their "
        "spes-p2p versions cannot work together; install the swarm's version"
    )


def manifest_key(run_id: str) -> str:
    return f"{run_id}/manifest"


def differences(ours: Manifest, theirs: Manifest) -> list[str]:
    """'what: ours here vs theirs in the swarm' for everything that differs."""
    a, b = _flat(ours), _flat(theirs)
    return [
        f"{k}: {a.get(k)!r} here vs {b.get(k)!r} in the swarm"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def _flat(manifest: Manifest) -> dict[str, Any]:
    values = msgspec.to_builtins(manifest)
    flat = {k: v for k, v in values.items() if not isinstance(v, dict)}
    for group in ("settings", "model", "data"):
        prefix = "model." if group == "model" else "data." if group == "data" else ""
        flat.update({prefix + k: v for k, v in values[group].items()})
    return flat


def read_records(transport: Transport, run_id: str) -> dict[str, ManifestRecord]:
    return decode_entries(transport.read(manifest_key(run_id)), ManifestRecord, "manifest", transport.guard)


class _LegacyConfig(msgspec.Struct):
    """What a protocol-1 peer published under ``<run>/config``: enough to name its protocol."""

    fields: dict[str, Any]


def legacy_protocol(transport: Transport, run_id: str) -> int | None:
    """The protocol of a swarm of the protocol-1 release (which published no manifest), if one is there."""
    for entry in transport.read(f"{run_id}/config").values():
        try:
            protocol = msgspec.msgpack.decode(entry.value, type=_LegacyConfig).fields.get("protocol")
        except msgspec.MsgspecError:
            continue
        if isinstance(protocol, int):
            return protocol
    return None


class ManifestServer:
    """Serves this peer's manifest and tokenizer to anyone who asks (handler threads; both are immutable)."""

    def __init__(self, transport: Transport, manifest: Manifest, tokenizer: bytes) -> None:
        self.manifest, self.tokenizer = manifest, tokenizer
        transport.serve(RPC_MANIFEST, lambda caller, request: manifest.encode(), max_request_bytes=64)
        transport.serve(RPC_TOKENIZER, lambda caller, request: tokenizer, max_request_bytes=64)


def fetch(transport: Transport, peers: list[str], wanted: str, deadline: Deadline) -> tuple[Manifest, bytes]:
    """The manifest with hash ``wanted`` and its tokenizer, from the first of ``peers`` that serves both
    correctly. A peer that failed to answer is asked again (streams do break) until the deadline; one that
    served a wrong manifest or tokenizer is not. Raises ManifestError naming what went wrong with each."""
    problems: dict[str, str] = {}
    wrong: set[str] = set()

    def from_any() -> tuple[Manifest, bytes] | None:
        for peer in (p for p in peers if p not in wrong):
            try:
                timeout = max(MIN_REQUEST_SECONDS, min(REQUEST_SECONDS, deadline.remaining()))
                return _fetch_from(transport, peer, wanted, timeout)
            except ManifestError as exc:
                wrong.add(peer)
                problems[peer] = str(exc)
            except (TransportError, RemoteError) as exc:
                problems[peer] = str(exc)
            logger.warning("manifest from %s: %s", peer, problems[peer])
        if wrong.issuperset(peers):
            raise ManifestError(f"no peer served the swarm's manifest ({_listed(problems)})")
        return None

    fetched = poll(from_any, deadline, RETRY_SECONDS)
    if fetched is None:
        raise ManifestError(f"no peer served the swarm's manifest ({_listed(problems)})")
    return fetched


def _listed(problems: dict[str, str]) -> str:
    return "; ".join(f"{peer[-8:]}: {problem}" for peer, problem in problems.items()) or "nobody to ask"


def _fetch_from(transport: Transport, peer: str, wanted: str, timeout: float) -> tuple[Manifest, bytes]:
    raw = transport.request(peer, RPC_MANIFEST, b"", timeout=timeout, max_response_bytes=MAX_MANIFEST_BYTES)
    manifest = Manifest.decode(raw)
    if manifest.hash != wanted:
        raise ManifestError(f"its manifest hashes to {manifest.hash[:16]}, not {wanted[:16]}")
    limit = manifest.tokenizer_bytes
    tokenizer = transport.request(peer, RPC_TOKENIZER, b"", timeout=timeout, max_response_bytes=limit)
    if hashlib.sha256(tokenizer).hexdigest() != manifest.tokenizer_sha256:
        raise ManifestError("its tokenizer does not match the manifest's SHA-256")
    return manifest, tokenizer
