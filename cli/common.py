"""What every command shares: the console, the error boundary, and logging."""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape
from spes_cli.options import format_setting_options

from spes_p2p.errors import SpesError

console = Console()
err_console = Console(stderr=True)

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class SpesCommand(click.Command):
    """A command whose errors of ours become one red line and a non-zero exit code, and whose --help groups
    the settings by section."""

    def invoke(self, ctx: click.Context):
        return run_guarded(lambda: super(SpesCommand, self).invoke(ctx))

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        format_setting_options(self, ctx, formatter)


class SpesGroup(click.Group):
    command_class = SpesCommand

    def invoke(self, ctx: click.Context):
        return run_guarded(lambda: super(SpesGroup, self).invoke(ctx))


def run_guarded(fn):
    try:
        return fn()
    except SpesError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(EXIT_INTERRUPTED)
