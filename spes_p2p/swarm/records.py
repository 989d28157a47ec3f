"""The swarm's DHT records: their keys, their schema, and their validation.

Keys, all under the swarm's ``run_id``; every peer writes only its own entry under each key:

    <run_id>/config           SwarmIdentity: the settings that must match, and their hash
    <run_id>/peers            PeerRecord: addresses, units held, round, throughput, loss, version
    <run_id>/holders/<unit>   {"round": int}: this peer holds <unit>

Entries expire unless refreshed by the heartbeat. A peer that leaves overwrites its entries with
``state = "left"`` and no units, so it stops counting at once instead of at expiry.
Anything read from the DHT is validated here before use; an entry that fails is logged and ignored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_UNIT = re.compile(r"^(experts|dense)/\d{1,4}$")
MAX_ADDRESSES = 16
MAX_UNITS = 256


class RecordError(ValueError):
    """An entry read from the DHT that does not match its schema."""


def config_key(run_id: str) -> str:
    return f"{run_id}/config"


def peers_key(run_id: str) -> str:
    return f"{run_id}/peers"


def holders_key(run_id: str, unit: str) -> str:
    return f"{run_id}/holders/{unit}"


@dataclass(frozen=True)
class SwarmIdentity:
    """The settings every peer of a swarm must share (model, shards, method), and their hash."""

    fields: dict[str, Any]

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()[:16]

    def to_record(self) -> dict:
        return {"hash": self.hash, "fields": self.fields}

    @classmethod
    def from_record(cls, value: Any) -> SwarmIdentity:
        if not isinstance(value, dict) or not isinstance(value.get("fields"), dict):
            raise RecordError("config entry is not {'hash': str, 'fields': dict}")
        identity = cls(value["fields"])
        if value.get("hash") != identity.hash:
            raise RecordError("config entry's hash does not match its fields")
        return identity

    def differences(self, other: SwarmIdentity) -> list[str]:
        """'field: ours vs theirs' for every field that differs."""
        names = sorted(set(self.fields) | set(other.fields))
        return [
            f"{n}: {self.fields.get(n)!r} here vs {other.fields.get(n)!r} in the swarm"
            for n in names
            if self.fields.get(n) != other.fields.get(n)
        ]


@dataclass(frozen=True)
class PeerRecord:
    peer_id: str
    addresses: list[str]
    units: list[str]
    round: int = 0
    tokens_per_s: float = 0.0
    loss: float | None = None
    version: str = ""
    config_hash: str = ""
    state: str = "active"  # "active" or "left"
    client_mode: bool = False
    extra: dict = field(default_factory=dict)  # room for later fields without breaking old readers

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, peer_id: str, value: Any) -> PeerRecord:
        """Validates an entry written by ``peer_id``; raises RecordError."""
        if not isinstance(value, dict):
            raise RecordError("peer entry is not a dict")
        v = dict(value)
        _expect(v.get("peer_id") == peer_id, "peer_id differs from the entry's owner")
        _expect(_str_list(v.get("addresses"), MAX_ADDRESSES), "addresses must be a list of strings")
        _expect(
            _str_list(v.get("units"), MAX_UNITS) and all(_UNIT.match(u) for u in v["units"]),
            "units must be a list of unit names",
        )
        _expect(isinstance(v.get("round"), int) and v["round"] >= 0, "round must be a non-negative int")
        _expect(_finite(v.get("tokens_per_s")) and v["tokens_per_s"] >= 0, "tokens_per_s must be >= 0")
        _expect(v.get("loss") is None or _finite(v["loss"]), "loss must be a finite number or null")
        _expect(
            isinstance(v.get("version"), str) and isinstance(v.get("config_hash"), str),
            "version and config_hash must be strings",
        )
        _expect(v.get("state") in ("active", "left"), "state must be 'active' or 'left'")
        _expect(isinstance(v.get("client_mode", False), bool), "client_mode must be a bool")
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            **{k: val for k, val in v.items() if k in known and k != "extra"},
            extra={k: val for k, val in v.items() if k not in known},
        )


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise RecordError(message)


def _str_list(value: Any, limit: int) -> bool:
    return isinstance(value, list) and len(value) <= limit and all(isinstance(x, str) for x in value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_peers(entries: dict) -> dict[str, PeerRecord]:
    """Valid, active peer records by peer id; invalid entries are logged and skipped."""
    peers = {}
    for peer_id, entry in entries.items():
        try:
            record = PeerRecord.from_record(peer_id, entry.value)
        except RecordError as exc:
            logger.warning("ignoring the peer record of %s: %s", peer_id, exc)
            continue
        if record.state == "active":
            peers[peer_id] = record
    return peers
