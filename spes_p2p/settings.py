"""A peer's settings: ``peers.toml`` (data, never code), overridden by command-line flags.

Sections and fields are the dataclasses below; ``peers.toml`` at the top of the repository lists every one
with its default. A bad file gets a ``ConfigError`` naming the file, the field and, where known, the line.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spes_p2p.errors import ConfigError

CODECS = ("none", "fp16", "int8", "nf4", "topk")
DEFAULT_CONFIG = Path("peers.toml")  # looked up in the working directory


@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    run_id: str = "spes-demo"
    initial_peers: tuple[str, ...] = ()  # multiaddrs of running peers, each ending in /p2p/<peer id>
    target_replication: int = 2  # holders wanted per expert shard
    hysteresis: int = 1  # extra holders a unit needs before a peer leaves it for a less-covered one
    heartbeat_seconds: float = 5.0
    record_ttl_seconds: float = 20.0  # records of a silent peer vanish after this long
    join_timeout_seconds: float = 20.0  # bound on reaching the initial peers
    sync_deadline_min: float = 2.0  # a round waits for late participants at least this long...
    sync_deadline_max: float = 60.0  # ...and at most this long (adapting in between)

    def __post_init__(self) -> None:
        _check(
            bool(re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.run_id)),
            "run_id",
            "must be 1-64 letters, digits, '.', '_' or '-'",
        )
        for addr in self.initial_peers:
            _check_multiaddr(addr, "initial_peers", need_peer_id=True)
        _check(self.target_replication >= 1, "target_replication", "must be at least 1")
        _check(self.hysteresis >= 0, "hysteresis", "must be at least 0")
        _check(self.heartbeat_seconds > 0, "heartbeat_seconds", "must be positive")
        _check(
            self.record_ttl_seconds > 2 * self.heartbeat_seconds,
            "record_ttl_seconds",
            "must exceed twice heartbeat_seconds, or records expire between heartbeats",
        )
        _check(self.join_timeout_seconds > 0, "join_timeout_seconds", "must be positive")
        _check(
            0 < self.sync_deadline_min <= self.sync_deadline_max,
            "sync_deadline_min",
            "must be positive and at most sync_deadline_max",
        )


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    preset: str = "tiny"
    shards: int = 4  # expert shards: units experts/0 .. experts/<shards-1>
    experts: int = 0  # experts per MoE layer; 0: the preset's
    dense_blocks: int = 1  # B: the dense part in blocks dense/0 .. dense/<B-1>; 1: every peer trains it all

    def __post_init__(self) -> None:
        _check(self.shards >= 1, "shards", "must be at least 1")
        _check(self.experts >= 0, "experts", "must be 0 (the preset's) or more")
        _check(self.dense_blocks >= 1, "dense_blocks", "must be at least 1")


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    mode: str = "spes"  # spes, or diloco: every peer trains and averages the full model (a baseline)
    steps_per_round: int = 100  # H: local optimizer steps between synchronizations
    codec: str = "int8"  # how updates travel: none, fp16, int8, topk
    refresh_codec: str = "int8"  # how frozen copies of other units travel
    outer: str = "fedavg"  # outer rule: fedavg (SPES) or nesterov (DiLoCo)
    outer_lr: float = 1.0
    outer_momentum: float = 0.9  # nesterov only
    dense_group_size: int = 16  # G: the dense part is averaged in random groups of at most G peers
    staleness: int = 1  # rounds a late update still counts
    overlap: bool = True  # exchange round k in the background while round k+1 trains
    merge: bool = True  # expert-merging warm-up
    merge_interval: int = 200  # steps
    merge_alpha: float = 0.05  # a_0
    merge_horizon: int = 2000  # T, steps
    merge_neighbours: int = 4  # K
    rotate_every_rounds: int = 10  # dense blocks (B > 1): rounds between rotations; 0: never rotate
    block_order: str = "cyclic"  # how holders move at a rotation: cyclic (block b -> b+1) or random

    def __post_init__(self) -> None:
        _check(self.mode in ("spes", "diloco"), "mode", "must be spes or diloco")
        _check(self.steps_per_round >= 1, "steps_per_round", "must be at least 1")
        _check(self.codec in CODECS, "codec", f"must be one of {', '.join(CODECS)}")
        _check(self.refresh_codec in CODECS, "refresh_codec", f"must be one of {', '.join(CODECS)}")
        _check(self.outer in ("fedavg", "nesterov"), "outer", "must be fedavg or nesterov")
        _check(
            self.outer_lr > 0 and 0 <= self.outer_momentum < 1, "outer_lr", "must be > 0 (momentum in [0, 1))"
        )
        _check(self.dense_group_size >= 2, "dense_group_size", "must be at least 2")
        _check(self.staleness >= 0, "staleness", "must be at least 0")
        _check(
            self.merge_interval >= 1 and self.merge_horizon >= 1 and self.merge_neighbours >= 1,
            "merge_interval",
            "merge_interval, merge_horizon and merge_neighbours must be at least 1",
        )
        _check(0 <= self.merge_alpha <= 1, "merge_alpha", "must be in [0, 1]")
        _check(self.rotate_every_rounds >= 0, "rotate_every_rounds", "must be at least 0")
        _check(self.block_order in ("cyclic", "random"), "block_order", "must be cyclic or random")


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    optimizer: str = "adamw8bit"
    lr: float = 1e-3
    warmup_steps: int = 50
    total_steps: int = 10_000  # length of the learning-rate schedule
    batch_size: int = 8
    seq_len: int = 128
    eval_every_rounds: int = 5
    eval_batches: int = 4
    checkpoint_every_rounds: int = 5
    frozen_experts: str = "full"  # how experts this peer does not train are held: full, int8 or nf4
    switch_state: str = "reset"  # optimizer state of a unit given up: reset (freed) or cpu (kept there)

    def __post_init__(self) -> None:
        _check(self.optimizer in ("adamw8bit", "adamw"), "optimizer", "must be adamw8bit or adamw")
        _check(self.frozen_experts in ("full", "int8", "nf4"), "frozen_experts", "must be full, int8 or nf4")
        _check(self.switch_state in ("reset", "cpu"), "switch_state", "must be reset or cpu")
        for name in (
            "total_steps",
            "batch_size",
            "seq_len",
            "eval_every_rounds",
            "eval_batches",
            "checkpoint_every_rounds",
        ):
            _check(getattr(self, name) >= 1, name, "must be at least 1")
        _check(self.lr > 0 and self.warmup_steps >= 0, "lr", "lr must be > 0 and warmup_steps >= 0")


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    corpus: str = "stdlib"
    max_corpus_mb: float = 0.0  # read at most this many MB of the corpus; 0: all of it


@dataclass(frozen=True, kw_only=True)
class NetworkSettings:
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce: tuple[str, ...] = ()  # public multiaddrs to advertise (after port forwarding)
    identity: str = "~/.spes/identity.key"  # private key: a restarted peer keeps its peer id
    client_mode: bool = False  # dial out only; nobody can dial this peer
    use_relay: bool = False  # reach and be reached through relays when behind NAT

    def __post_init__(self) -> None:
        _check(bool(self.listen), "listen", "needs at least one multiaddr")
        for addr in self.listen:
            _check_multiaddr(addr, "listen")
        for addr in self.announce:
            _check_multiaddr(addr, "announce")


@dataclass(frozen=True, kw_only=True)
class PeerSettings:
    capacity: int = 1  # expert shards this peer trains at once
    active_blocks: int = 1  # dense blocks this peer trains at once (with [model] dense_blocks > 1)

    def __post_init__(self) -> None:
        _check(self.capacity >= 1, "capacity", "must be at least 1")
        _check(self.active_blocks >= 1, "active_blocks", "must be at least 1")


@dataclass(frozen=True, kw_only=True)
class Settings:
    swarm: SwarmSettings = field(default_factory=SwarmSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    method: MethodSettings = field(default_factory=MethodSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)
    network: NetworkSettings = field(default_factory=NetworkSettings)
    peer: PeerSettings = field(default_factory=PeerSettings)

    def __post_init__(self) -> None:
        _check(
            self.method.mode == "spes" or self.model.dense_blocks == 1,
            "dense_blocks",
            "must be 1 with [method] mode = diloco (every peer trains the full model)",
        )
        _check(
            self.peer.active_blocks <= self.model.dense_blocks,
            "active_blocks",
            f"must be at most [model] dense_blocks ({self.model.dense_blocks})",
        )

    def override(self, **changes: Any) -> Settings:
        """Applies ``section__field=value`` overrides (None means: keep the file's value)."""
        sections: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if value is None:
                continue
            section, _, key = name.partition("__")
            sections.setdefault(section, {})[key] = value
        try:
            return dataclasses.replace(
                self, **{s: dataclasses.replace(getattr(self, s), **kv) for s, kv in sections.items()}
            )
        except _FieldError as exc:
            raise ConfigError(f"{exc.field} {exc.problem}") from None


def load_settings(path: Path | None = None) -> Settings:
    """Reads ``path``, or ./peers.toml when it exists, or the defaults."""
    if path is None:
        if not DEFAULT_CONFIG.exists():
            return Settings()
        path = DEFAULT_CONFIG
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return _from_dict(data, path, text)


def _from_dict(data: dict, path: Path, text: str) -> Settings:
    sections = {f.name: f.type for f in dataclasses.fields(Settings)}
    built = {}
    for section, values in data.items():
        if section not in sections:
            raise ConfigError(f"{path}: unknown section [{section}]; known: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: {section} must be a [{section}] table")
        cls = _SECTION_CLASSES[section]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            where = f"{path}{_line_of(text, section, key)}: [{section}] {key}"
            if key not in hints:
                raise ConfigError(f"{where} is not a setting; known: {', '.join(hints)}")
            kwargs[key] = _coerce(value, hints[key], where)
        try:
            built[section] = cls(**kwargs)
        except _FieldError as exc:
            raise ConfigError(
                f"{path}{_line_of(text, section, exc.field)}: [{section}] {exc.field} {exc.problem}"
            ) from None
    try:
        return Settings(**built)
    except _FieldError as exc:  # across sections: [peer] active_blocks against [model] dense_blocks
        raise ConfigError(
            f"{path}{_line_of(text, 'peer', exc.field)}: [peer] {exc.field} {exc.problem}"
        ) from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return tuple(value)
    expected = {str: str, int: int, float: (int, float), bool: bool}[hint]
    if (isinstance(value, bool) and hint is not bool) or not isinstance(value, expected):
        raise ConfigError(f"{where} must be {hint.__name__}, got {value!r}")
    return float(value) if hint is float else value


def _line_of(text: str, section: str, key: str) -> str:
    """':<line>' of ``key`` inside ``[section]``, or '' when it cannot be found."""
    current = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            current = header.group(1).strip()
        elif current == section and re.match(rf"\s*{re.escape(key)}\s*=", line):
            return f":{lineno}"
    return ""


class _FieldError(ValueError):
    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name} {problem}")
        self.field, self.problem = field_name, problem


def _check(ok: bool, field_name: str, problem: str) -> None:
    if not ok:
        raise _FieldError(field_name, problem)


def _check_multiaddr(addr: str, field_name: str, need_peer_id: bool = False) -> None:
    from multiaddr import Multiaddr

    try:
        parsed = Multiaddr(addr)
    except Exception:  # multiaddr raises several ValueError and ParseError kinds
        raise _FieldError(
            field_name,
            f"has a malformed multiaddr {addr!r} (expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/<peer id>)",
        ) from None
    if need_peer_id and "p2p" not in [p.name for p in parsed.protocols()]:
        raise _FieldError(field_name, f"multiaddr {addr!r} lacks its /p2p/<peer id> part")


_SECTION_CLASSES = {
    "swarm": SwarmSettings,
    "model": ModelSettings,
    "method": MethodSettings,
    "train": TrainSettings,
    "data": DataSettings,
    "network": NetworkSettings,
    "peer": PeerSettings,
}


def to_toml(settings: Settings) -> str:
    """The settings as a peers.toml that ``load_settings`` reads back to the same values."""
    lines = []
    for section in dataclasses.fields(settings):
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(getattr(settings, section.name)):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(settings, section.name), f.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"
