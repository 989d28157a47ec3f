"""``spes-join``: join a swarm and train its experts with the other volunteers."""

from __future__ import annotations

import click
from spes_cli.common import SpesCommand, err_console


@click.command(cls=SpesCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spes-p2p")
def spes_join() -> None:
    """Join a swarm, claim the expert shard it needs most, and train it with the peers that hold it.

    Not available in this version: the swarm layer is the next milestone. Train locally with `spes train`.
    """
    err_console.print(
        "[bold red]error:[/] spes-join is not available in spes-p2p 0.1.0 yet (the swarm layer is "
        "the next milestone); train locally with `spes train`"
    )
    raise SystemExit(2)
