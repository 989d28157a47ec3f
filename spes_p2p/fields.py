"""Settings as data: each setting is one dataclass field that carries its help, choices, flag and scope.

A **section** is a small frozen dataclass owned by the component it configures (``[train]`` by the trainer,
``[sync]`` by the sync protocol, ...) and kept in that layer's light ``config.py``, which imports no torch
and no networking. ``spes_p2p.settings.Settings`` composes the sections; the command line generates its
options from the fields, and ``peers.toml`` is generated from them too.

A section checks itself: choices automatically, anything else in ``validate`` with ``check``. A failed check
raises ``FieldError(field, problem)``; the loader adds where the bad value came from (a file and line, or a
flag), so the section never needs to know.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from spes_p2p.errors import ConfigError

SWARM, PEER = "swarm", "peer"  # scopes: must match across the swarm, or each volunteer's own
Key = str  # a setting's one name: 'section.field' (in code, files' errors, the manifest and on the wire)


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    flag: str | None = None,
    metavar: str | None = None,
    scope: str | None = None,
) -> Any:
    """A section field. ``flag`` defaults to ``--<field-name>``; ``scope`` defaults to the section's."""
    metadata = {"help": help, "choices": tuple(choices), "flag": flag, "metavar": metavar, "scope": scope}
    return dataclasses.field(default=default, metadata=metadata)


class FieldError(ConfigError):
    """A value a section refuses. ``section`` is filled in by whoever knows it (the root settings)."""

    def __init__(self, field: str, problem: str, section: str | None = None) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem, self.section = field, problem, section


def check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise FieldError(field, problem)


@dataclass(frozen=True, kw_only=True)
class Section:
    """Base of every settings section. ``SCOPE``: whether its fields must match across a swarm."""

    SCOPE = PEER

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise FieldError(
                    f.name, f"must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )
        self.validate()

    def validate(self) -> None:
        """Checks beyond choices; raise with ``check``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def scope_of(cls, field: dataclasses.Field) -> str:
        return field.metadata.get("scope") or cls.SCOPE


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")
