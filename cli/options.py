"""Command-line options generated from the settings fields: one flag, help and default per setting, the same
in every command. ``settings_options`` adds them (and ``--config``) to a command and hands the command one
resolved ``Settings``; ``--help`` lists them under their ``[section]``."""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path

import click
from click.core import ParameterSource

from spes_p2p.fields import flag_of
from spes_p2p.settings import SECTIONS, load_settings


class SettingOption(click.Option):
    """An option that sets one setting (its ``key``: 'section.field')."""

    def __init__(self, *args, section: str, key: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.section, self.key = section, key


def settings_options(
    *names: str, exclude: tuple[str, ...] = (), defaults=None, default_file: bool = False, flags=None
):
    """Options for the settings ``names`` ('model': a whole section; 'run.out': one field) but not those in
    ``exclude``, shown with this command's ``defaults`` and its own ``flags`` ('section.field' -> flag, where
    a command that is about that setting names it plainly); the command receives ``settings``."""
    flags = flags or {}
    fields = [
        (section, f)
        for name in names
        for section, f in _select(name)
        if f"{section}.{f.name}" not in exclude and section not in exclude
    ]
    names_of = {f"{s}.{f.name}": flags.get(f"{s}.{f.name}", flag_of(f)) for s, f in fields}
    taken = list(names_of.values())
    duplicated = sorted({f for f in taken if taken.count(f) > 1})
    assert not duplicated, f"one flag for two settings: {duplicated}"

    def decorate(command):
        @functools.wraps(command)
        def with_settings(config, **kwargs):
            source = click.get_current_context().get_parameter_source
            values = {f"{s}.{f.name}": (_param(s, f), kwargs.pop(_param(s, f))) for s, f in fields}
            given = {k: v for k, (param, v) in values.items() if source(param) != ParameterSource.DEFAULT}
            settings = load_settings(
                config, given, defaults=defaults, default_file=default_file, flag_names=names_of
            )
            return command(settings=settings, **kwargs)

        for section, f in reversed(fields):
            default = (defaults or {}).get(f"{section}.{f.name}", f.default)
            with_settings = _option(section, f, default, names_of[f"{section}.{f.name}"])(with_settings)
        where = "default: ./peers.toml when present" if default_file else "default: none"
        return click.option(
            "--config",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help=f"A settings file (TOML; {where}). Flags win over it.",
        )(with_settings)

    return decorate


def _select(name: str) -> list[tuple[str, dataclasses.Field]]:
    section, _, field_name = name.partition(".")
    fields = dataclasses.fields(SECTIONS[section])
    chosen = [f for f in fields if not field_name or f.name == field_name]
    assert chosen, f"no setting {name!r}"
    return [(section, f) for f in chosen]


def _param(section: str, f: dataclasses.Field) -> str:
    """Click's name for the option's parameter (an identifier; the setting itself is 'section.field')."""
    return f"{section}_{f.name}"


def _option(section: str, f: dataclasses.Field, default, flag: str):
    hint = typing.get_type_hints(SECTIONS[section])[f.name]
    meta = f.metadata
    kwargs = {
        "help": meta["help"],
        "default": default,
        "show_default": default not in ("", ()),
        "section": section,
        "key": f"{section}.{f.name}",
    }
    if hint is bool:
        decls = [f"{flag}/--no-{flag[2:]}"]
    elif typing.get_origin(hint) is tuple:
        decls, kwargs["multiple"] = [flag], True
    else:
        decls = [flag]
        kwargs["type"] = click.Choice(meta["choices"]) if meta["choices"] else hint
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    return click.option(*decls, _param(section, f), cls=SettingOption, **kwargs)


def format_setting_options(
    command: click.Command, ctx: click.Context, formatter: click.HelpFormatter
) -> None:
    """--help: the command's own options, then its settings grouped by section."""
    groups: dict[str, list] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record:
            groups.setdefault(getattr(param, "section", ""), []).append(record)
    for section, records in groups.items():
        with formatter.section(f"Settings [{section}]" if section else "Options"):
            formatter.write_dl(records)
