"""All settings of a peer, a simulation or a training run: the sections of every layer, composed.

Each setting is one field of a section owned by the code it configures (see ``spes_p2p.fields``)::

    [swarm] [sync] [network]   spes_p2p.swarm.config     [model]          spes_p2p.model.config
    [method]                   spes_p2p.peer.config      [train] [data] [merge]  spes_p2p.train.config
    [sim]                      spes_p2p.sim.config       [run]            below: this invocation
    [dashboard]                spes_p2p.dashboard.config

Values come in layers, later ones winning: the section defaults, a command's own defaults (``spes simulate``
runs a local swarm with short heartbeats and rounds), the chosen method's defaults (DiLoCo's outer step),
a TOML file, then command-line flags. A bad value is a ``ConfigError`` that names where it came from (the
file and line, or the flag), its section and its field.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from spes_p2p.dashboard.config import DashboardConfig
from spes_p2p.errors import ConfigError, SwarmMismatch
from spes_p2p.fields import SWARM, FieldError, Key, Section, check, flag_of, setting
from spes_p2p.model.config import STEP_SECONDS, ModelSettings
from spes_p2p.net.config import NetworkConfig
from spes_p2p.peer.config import METHOD_DEFAULTS, MethodConfig
from spes_p2p.sim.config import SimConfig
from spes_p2p.swarm.config import PeerConfig, SwarmConfig
from spes_p2p.sync.config import SyncConfig
from spes_p2p.train.config import DataConfig, MergeConfig, TrainConfig

DEFAULT_CONFIG = Path("peers.toml")  # spes-join and spes status read it from the working directory
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
    """[run]: this invocation: where outputs go and when to stop. Never part of a swarm's identity."""

    out: str = setting(
        "", "Run folder: metrics.jsonl, checkpoints, and on exit model.safetensors, state.json."
    )
    resume: bool = setting(False, "Continue from the newest checkpoint in --out (a peer keeps its peer id).")
    rounds: int = setting(0, "Stop once the swarm has completed this many rounds; 0: run until stopped.")
    new_swarm: bool = setting(False, "Found a new swarm: dial nobody.")
    min_peers: int = setting(1, "Wait (up to --wait-seconds) for this many peers before the first round.")
    join_round: int = setting(
        0, "Join once the swarm has reached this round (simulated newcomers start early)."
    )
    wait_seconds: float = setting(300.0, "Bound on waiting for --min-peers or --join-round.")
    addr_file: str = setting("", "Write this peer's dialable multiaddrs here, one per line, once it is up.")
    invite: str = setting(
        "", "Once joined, write an invite to the swarm here: a peers.toml others join with."
    )
    log_level: str = setting("warning", "Log level.", choices=LOG_LEVELS)
    owned_shards: str = setting(
        "", "spes train: train only these expert shards and the dense part ('1', '0,2', '0-3'); empty: all."
    )
    stop_after: int = setting(0, "spes train: stop (with a checkpoint) after this many steps; 0: at the end.")

    def validate(self) -> None:
        check(self.rounds >= 0, "rounds", "must be at least 0 (0: until stopped)")
        check(self.min_peers >= 1, "min_peers", "must be at least 1")
        check(self.join_round >= 0, "join_round", "must be at least 0")
        check(self.wait_seconds >= 0, "wait_seconds", "must be at least 0")
        check(self.stop_after >= 0, "stop_after", "must be at least 0")
        self.shard_list()

    def shard_list(self) -> tuple[int, ...] | None:
        """``owned_shards`` as indices; None: every shard."""
        if not self.owned_shards:
            return None
        shards: list[int] = []
        try:
            for part in self.owned_shards.split(","):
                lo, _, hi = part.strip().partition("-")
                shards.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise FieldError(
                "owned_shards", f"{self.owned_shards!r} is not a list of shards like '1', '0,2' or '0-3'"
            ) from None
        return tuple(shards)


SECTIONS: dict[str, type[Section]] = {
    "swarm": SwarmConfig,
    "model": ModelSettings,
    "method": MethodConfig,
    "sync": SyncConfig,
    "merge": MergeConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "network": NetworkConfig,
    "peer": PeerConfig,
    "run": RunConfig,
    "sim": SimConfig,
    "dashboard": DashboardConfig,
}


@dataclass(frozen=True, kw_only=True)
class Settings:
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    model: ModelSettings = field(default_factory=ModelSettings)
    method: MethodConfig = field(default_factory=MethodConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    given: frozenset[Key] = field(default=frozenset(), compare=False, repr=False)  # set by a file or flag

    def __post_init__(self) -> None:
        """Checks that span sections; each names the field to change."""
        if self.method.mode == "diloco" and self.model.dense_blocks != 1:
            raise FieldError(
                "dense_blocks", "must be 1 with method.mode = diloco (it trains the full model)", "model"
            )
        if self.peer.active_blocks > self.model.dense_blocks:
            raise FieldError(
                "active_blocks", f"must be at most model.dense_blocks ({self.model.dense_blocks})", "peer"
            )
        max_len = self.model.architecture().max_seq_len
        if self.train.seq_len > max_len:
            raise FieldError(
                "seq_len", f"({self.train.seq_len}) exceeds the model's max_seq_len ({max_len})", "train"
            )
        round_tokens = self.method.steps_per_round * self.train.batch_size * self.train.seq_len
        if round_tokens > self.sync.max_round_tokens:
            raise FieldError(
                "batch_size",
                f"x seq_len x steps_per_round ({round_tokens}) is over sync.max_round_tokens "
                f"({self.sync.max_round_tokens}): train on smaller batches",
                "train",
            )
        if self.sim.virtual and self.sim.step_seconds is None and self.model.preset not in STEP_SECONDS:
            raise FieldError(
                "compute",
                f"virtual needs its seconds per step with preset {self.model.preset}, whose step time was "
                "not measured: write virtual=SECONDS (e.g. virtual=30)",
                "sim",
            )
        try:
            self.sim.check_backend(self.swarm.backend)
        except FieldError as exc:
            raise FieldError(exc.field, exc.problem, "swarm") from None
        shards = self.run.shard_list() or ()
        bad = [s for s in shards if not 0 <= s < self.model.shards]
        if bad:
            raise FieldError(
                "owned_shards", f"names shard {bad[0]}; shards are 0..{self.model.shards - 1}", "run"
            )

    def override(self, changes: Mapping[Key, Any]) -> Settings:
        """These settings with ``{'section.field': value}`` changes (None: keep). Choosing another method
        brings its defaults for the fields not also given."""
        values = {check_key(key): value for key, value in changes.items() if value is not None}
        given = self.given | set(values)
        mode = values.get("method.mode", self.method.mode)
        if mode != self.method.mode:
            values = {**METHOD_DEFAULTS.get(mode, {}), **values}
        return _build(_values_of(self) | values, origins={}, given=given)

    def adopt(self, swarm_wide: dict[str, Any]) -> Settings:
        """These settings with a swarm's ``swarm_wide`` values ('section.field' -> value) in place of their
        own; a value this peer was given (by file or flag) that differs is a ConfigError naming each one."""
        ours = self.swarm_wide()
        differ = [
            f"{key}: {ours.get(key)!r} here vs {v!r} in the swarm"
            for key, v in sorted(swarm_wide.items())
            if key in self.given and _normal(ours.get(key)) != _normal(v)
        ]
        if differ:
            raise SwarmMismatch(f"settings that must match the swarm's differ: {'; '.join(differ)}")
        unknown = sorted(key for key in swarm_wide if not _known(key))
        if unknown:
            raise ConfigError(
                f"the swarm's manifest has settings this version does not know: {', '.join(unknown)}"
            )
        return _build(_values_of(self) | dict(swarm_wide), origins={}, given=self.given)

    def swarm_wide(self) -> dict[str, Any]:
        """'section.field' -> value of every setting that must match across a swarm."""
        return {
            f"{name}.{f.name}": getattr(getattr(self, name), f.name)
            for name, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)
            if cls.scope_of(f) == SWARM
        }

    def to_toml(self, sections: tuple[str, ...] = tuple(SECTIONS)) -> str:
        """The given sections, every field, as TOML that ``load_settings`` reads back to the same values."""
        return tomli_w.dumps({s: getattr(self, s).to_dict() for s in sections})


@dataclass
class Layer:
    """Values from one source, with where each came from ('peers.toml:12', '--codec')."""

    values: dict[Key, Any] = field(default_factory=dict)
    origins: dict[Key, str] = field(default_factory=dict)


def load_settings(
    config: Path | None = None,
    flags: dict[Key, Any] | None = None,
    *,
    defaults: dict[Key, Any] | None = None,
    default_file: bool = False,
    flag_names: dict[Key, str] | None = None,
) -> Settings:
    """The layers in order: ``defaults`` (a command's own), the method's defaults, ``config`` (or, with
    ``default_file``, ./peers.toml when it exists), then ``flags`` (None values are ignored), named in
    errors by their ``flag_names`` (default: each field's own flag)."""
    if config is None and default_file and DEFAULT_CONFIG.exists():
        config = DEFAULT_CONFIG
    explicit = [read_toml(Path(config))] if config is not None else []
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    names = flag_names or {}
    explicit.append(Layer(given, {k: names.get(k) or flag_of(_field(k)) for k in given}))
    chosen = {**(defaults or {}), **{k: v for layer in explicit for k, v in layer.values.items()}}
    mode = chosen.get("method.mode", MethodConfig().mode)
    values = {**(defaults or {}), **METHOD_DEFAULTS.get(mode, {})}
    for layer in explicit:
        values.update(layer.values)
    origins = {k: o for layer in explicit for k, o in layer.origins.items()}
    return _build(values, origins, given=frozenset(origins))


def read_toml(path: Path) -> Layer:
    """A TOML file's values, type-checked, each with its file and line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    layer = Layer()
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a [{section}] table")
        hints = typing.get_type_hints(SECTIONS[section])
        for name, value in table.items():
            where = f"{path}{_line_of(text, section, name)}"
            if name not in hints or name.isupper():
                raise ConfigError(
                    f"{where}: {section}.{name} is not a setting; known: {', '.join(_field_names(section))}"
                )
            layer.values[f"{section}.{name}"] = _coerce(value, hints[name], f"{where}: {section}.{name}")
            layer.origins[f"{section}.{name}"] = where
    return layer


def _build(values: dict[Key, Any], origins: dict[Key, str], given: frozenset[Key] = frozenset()) -> Settings:
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = check_key(key).split(".")
        by_section.setdefault(section, {})[name] = value
    built = {}
    for section, cls in SECTIONS.items():
        try:
            built[section] = cls(**by_section.get(section, {}))
        except FieldError as exc:
            raise _located(exc, section, origins) from None
    try:
        return Settings(**built, given=frozenset(given))
    except FieldError as exc:
        raise _located(exc, exc.section, origins) from None


def _located(exc: FieldError, section: str, origins: dict[Key, str]) -> ConfigError:
    origin = origins.get(f"{section}.{exc.field}")
    return ConfigError(f"{origin + ': ' if origin else ''}{section}.{exc.field} {exc.problem}")


def _normal(value: Any) -> Any:
    """Values as they travel (tuples as lists), for comparing."""
    return list(value) if isinstance(value, tuple) else value


def _values_of(settings: Settings) -> dict[Key, Any]:
    return {f"{s}.{name}": value for s in SECTIONS for name, value in getattr(settings, s).to_dict().items()}


def check_key(key: Key) -> Key:
    """``key`` when it names a setting ('section.field'); else a ConfigError."""
    if not _known(key):
        section, _, name = key.partition(".")
        raise ConfigError(
            f"{section}.{name} is not a setting" if name else f"{key!r}: expected section.field"
        )
    return key


def _known(key: Key) -> bool:
    section, _, name = key.partition(".")
    return section in SECTIONS and name in _field_names(section)


def _field(key: Key) -> dataclasses.Field:
    section, name = check_key(key).split(".")
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)


def _field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if typing.get_origin(hint) is tuple:
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


def reference_toml() -> str:
    """Every setting with its flag, help and default, commented out: the repository's peers.toml."""
    lines = [
        "# spes-p2p settings: every one, commented out at its default. Generated from the code:",
        "#     python -m spes_p2p.settings > peers.toml",
        "# spes-join and spes status read ./peers.toml; every command that runs peers or a model takes",
        "# another file with --config. Uncomment what you change; a flag on the command line wins over it.",
    ]
    for name, cls in SECTIONS.items():
        lines += ["", f"[{name}]  # {cls.__doc__.splitlines()[0].split(': ', 1)[1]}"]
        for f in dataclasses.fields(cls):
            lines.append(f"# {flag_of(f)}: {f.metadata['help']}")
            value = tomli_w.dumps({f.name: getattr(cls(), f.name)})
            lines += [f"# {line}" for line in value.splitlines()]
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """Every setting as a table per section (key, flag, default, scope, help): the repository's
    docs/settings.md."""
    lines = [
        "# Settings",
        "",
        "Every setting of spes-p2p, generated from the code (`python -m spes_p2p.settings --markdown >",
        "docs/settings.md`; `tests/test_settings.py` checks that this page is current). The repository's",
        "`peers.toml` lists the same settings, commented out at their defaults. How values are layered",
        "(section defaults, a command's own, the method's, a file, flags) and what a swarm-wide setting",
        "means is in [joining.md](joining.md#settings-peerstoml). *swarm*: must match across the swarm (it",
        "comes from the manifest); *peer*: each volunteer's own.",
    ]
    for name, cls in SECTIONS.items():
        about = cls.__doc__.splitlines()[0].split(": ", 1)[1]
        lines += ["", f"## [{name}]", "", about[0].upper() + about[1:], ""]
        lines += ["| setting | flag | default | scope | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = tomli_w.dumps({"v": getattr(cls(), f.name)}).strip().removeprefix("v = ")
            help_ = f.metadata["help"].replace("|", "\\|").replace("<", "&lt;")
            scope = cls.scope_of(f)
            lines.append(f"| `{name}.{f.name}` | `{flag_of(f)}` | `{default}` | {scope} | {help_} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(reference_markdown() if sys.argv[1:] == ["--markdown"] else reference_toml(), end="")
