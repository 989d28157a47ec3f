"""What every command shares: the console, the error boundary, and option parsers."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from spes_p2p.errors import SpesError

console = Console()
err_console = Console(stderr=True)

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class SpesGroup(click.Group):
    """A click group that turns our own errors into one red line and a non-zero exit code."""

    def invoke(self, ctx: click.Context):
        return run_guarded(lambda: super(SpesGroup, self).invoke(ctx))


class SpesCommand(click.Command):
    def invoke(self, ctx: click.Context):
        return run_guarded(lambda: super(SpesCommand, self).invoke(ctx))


def run_guarded(fn):
    try:
        return fn()
    except SpesError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(EXIT_INTERRUPTED)


def swarm_options(fn):
    """Options shared by the commands that talk to a swarm."""
    options = [
        click.option(
            "--config",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Settings file (default: ./peers.toml when present).",
        ),
        click.option(
            "--peers",
            multiple=True,
            metavar="MULTIADDR",
            help="A running peer's multiaddr (repeatable); overrides initial_peers.",
        ),
        click.option("--run-id", help="The swarm's name."),
        click.option(
            "--log-level",
            type=click.Choice(["debug", "info", "warning", "error"]),
            default="warning",
            show_default=True,
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def dense_block_options(fn):
    """Block coordinate descent over the dense part, and how frozen experts are held (default: the config
    file's, or SPES as published: one dense block, full-precision frozen experts)."""
    options = [
        click.option(
            "--dense-blocks",
            type=click.IntRange(min=1),
            help="B: blocks of the dense part (1: train it all).",
        ),
        click.option(
            "--active-blocks", type=click.IntRange(min=1), help="Dense blocks a peer trains at once."
        ),
        click.option(
            "--frozen-experts",
            type=click.Choice(["full", "int8", "nf4"]),
            help="How experts a peer does not train are held in memory.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def setup_logging(level: str) -> None:
    """Our logs and hivemind's through one handler, at ``level``."""
    import logging
    import os

    os.environ.setdefault("HIVEMIND_LOGLEVEL", level.upper())
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def parse_shard_list(ctx, param, value: str | None) -> tuple[int, ...] | None:
    """'1', '0,2' or '0-3' -> shard indices."""
    if value is None:
        return None
    shards: list[int] = []
    try:
        for part in value.split(","):
            lo, _, hi = part.strip().partition("-")
            shards.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a list of shard indices like '1', '0,2' or '0-3'"
        ) from None
    if not shards:
        raise click.BadParameter("name at least one shard")
    return tuple(shards)
