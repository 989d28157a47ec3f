"""The swarm's DHT records: their keys, their typed schema, and strict decoding.

Keys, all under the swarm's ``run_id``; every peer writes only its own entry under each key:

    <run_id>/manifest               ManifestRecord (swarm/manifest.py): the swarm's manifest, by hash
    <run_id>/peers                  PeerRecord: what peers act on: addresses, units held (since, until),
                                    round, data epoch, version, bans; read by every peer at its boundaries
    <run_id>/progress               ProgressRecord: what only people look at (throughput, losses, traffic,
                                    rejections, scores); read by ``spes status`` and the dashboard alone
    <run_id>/updates/<round>/<unit> Announcement: this peer's update of <unit> for <round> is ready

Entries are msgpack, written and read as msgspec structs. Decoding is strict: a wrong type, a missing or
unknown field, a value out of range, or oversized input is a ``RecordError``; readers skip the entry and
report it to the transport's guard, which logs it once per peer and counts it. Entries expire unless
refreshed by the heartbeat; a peer that leaves overwrites its peer record with a ``state = "left"``
tombstone. A peer's claims live in its one peer record, so reading the swarm's state is one DHT read; its
progress figures live apart, so that the reads peers make at every round boundary do not carry them.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, TypeVar

import msgspec

from spes_p2p.net.guard import Guard
from spes_p2p.net.transport import MAX_RECORD_BYTES, Transport
from spes_p2p.net.wire import RecordError, Short, Strict

MAX_ADDRESSES = 16
MAX_UNITS = 256
MAX_BANNED = 64
MAX_SCORES = 64  # the scores a record carries: the lowest first
MAX_PARTS = 64  # the most parts a unit is split into for a reduce-scatter (one per group member)

Unit = Annotated[str, msgspec.Meta(pattern=r"^(experts|dense)/\d{1,4}$")]
Round = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16,64}$")]
Score = Annotated[float, msgspec.Meta(ge=0, le=1)]

R = TypeVar("R", bound="Record")


class Record(Strict):
    """Base of every DHT record."""

    MAX_BYTES = MAX_RECORD_BYTES
    ERROR = RecordError


class Holding(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A unit this peer trains from round ``since`` on; with ``until``, it gave the unit up after training it
    in that round, and still serves that round's weights."""

    since: Round = 0
    until: Round | None = None


class Progress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer reports of its training (rates and losses of its last round, totals since it started)
    and of its traffic, for ``spes status`` and the dashboard (``ProgressRecord``). No peer reads it: a liar
    fools only the page."""

    tokens_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    loss: float | None = None  # its last round's mean training loss
    val_loss: float | None = None  # at its last evaluation
    tokens: Count = 0  # trained since it started
    sent: Count = 0  # bytes
    received: Count = 0
    rejected: Count = 0  # messages of other peers it refused (records, requests, payloads)
    shards: Count = 0  # data shards it trained to their end, since it started
    dht_ops: Count = 0  # DHT reads and writes of its last round
    dht_bytes: Count = 0  # the value bytes they moved

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) for x in (self.tokens_per_s, self.loss or 0.0, self.val_loss or 0.0)):
            raise ValueError("tokens_per_s, loss and val_loss must be finite")


class PeerRecord(Record):
    peer_id: Short
    addresses: Annotated[list[Short], msgspec.Meta(max_length=MAX_ADDRESSES)]
    holds: Annotated[dict[Unit, Holding], msgspec.Meta(max_length=MAX_UNITS)] = msgspec.field(
        default_factory=dict
    )
    epoch: Round = 0  # the dense-block rotation epoch of its claims
    round: Round = 0
    trained: bool = False  # it has trained a round since it started (newcomers then download the model)
    data_epoch: Count = 0  # the epoch of the dataset it trains (swarm/datawork.py)
    version: Short = ""
    manifest: Short = ""  # the hash of the swarm manifest this peer shares
    state: Literal["active", "left"] = "active"
    client_mode: bool = False
    seen: float = 0.0  # the writer's DHT time when it wrote this record
    reachable: Literal["yes", "no", "unknown"] = "unknown"  # whether peers could dial it back
    banned: Annotated[list[Short], msgspec.Meta(max_length=MAX_BANNED)] = msgspec.field(default_factory=list)
    capacity: Annotated[int, msgspec.Meta(ge=0, le=MAX_UNITS)] = 1  # expert shards it may hold at once

    def __post_init__(self) -> None:
        if not math.isfinite(self.seen):
            raise ValueError("seen must be finite")

    @property
    def units(self) -> list[str]:
        """The units it trains now (not those given up)."""
        return [u for u, h in self.holds.items() if h.until is None]


class ProgressRecord(Record):
    """A peer's progress, and how the contributions of other peers fared with it (``Guard.score``): shown,
    never acted on."""

    peer_id: Short
    round: Round = 0
    progress: Progress = msgspec.field(default_factory=Progress)
    scores: Annotated[dict[Short, Score], msgspec.Meta(max_length=MAX_SCORES)] = msgspec.field(
        default_factory=dict
    )


class Announcement(Record):
    """An update is ready: its size, codec, SHA-256, and ``base`` (the hash of its start weights). An
    update served in parts (a reduce-scatter) lists each part's SHA-256 in ``pieces``; ``sha256`` hashes
    that list."""

    round: Round
    tokens: Annotated[int, msgspec.Meta(ge=0)]
    bytes: Annotated[int, msgspec.Meta(ge=1)]
    codec: Short
    sha256: Hex
    base: Hex
    pieces: Annotated[list[Hex], msgspec.Meta(max_length=MAX_PARTS)] = msgspec.field(default_factory=list)


def peers_key(run_id: str) -> str:
    return f"{run_id}/peers"


def progress_key(run_id: str) -> str:
    return f"{run_id}/progress"


def updates_key(run_id: str, round_: int, unit: str) -> str:
    return f"{run_id}/updates/{round_}/{unit}"


def decode_entries(entries: dict, cls: type[R], what: str, guard: Guard | None = None) -> dict[str, R]:
    """Valid records by the peer id that wrote them; invalid ones are skipped, and reported to ``guard``
    (which logs each kind once per peer and counts it). A record that names a peer must name its writer."""
    guard = guard or Guard()
    valid = {}
    for peer_id, entry in entries.items():
        try:
            record = cls.decode(entry.value)
        except RecordError as exc:
            guard.reject(peer_id, f"{what} record", str(exc), counts_toward_ban=False)
            continue
        if getattr(record, "peer_id", peer_id) != peer_id:
            guard.reject(peer_id, f"{what} record", f"it names {record.peer_id}", counts_toward_ban=False)
        else:
            valid[peer_id] = record
    return valid


def parse_peers(entries: dict, guard: Guard | None = None) -> dict[str, PeerRecord]:
    """Valid, active peer records by peer id."""
    records = decode_entries(entries, PeerRecord, "peer", guard)
    return {peer_id: record for peer_id, record in records.items() if record.state == "active"}


def read_progress(transport: Transport, run_id: str) -> dict[str, ProgressRecord]:
    """The swarm's valid progress records by peer id (one DHT read)."""
    return decode_entries(transport.read(progress_key(run_id)), ProgressRecord, "progress", transport.guard)


def read_peers(transport: Transport, run_id: str, banned: bool = False) -> dict[str, PeerRecord]:
    """The swarm's valid, active peer records by peer id (one DHT read; with ``banned``, those of the peers
    this one banned too); invalid ones are reported to the transport's guard."""
    return parse_peers(transport.read(peers_key(run_id), banned=banned), transport.guard)
