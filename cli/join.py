"""``spes-join``: join a swarm (or found one), claim the expert shards it needs most, and train them."""

from __future__ import annotations

import click
from spes_cli.common import SpesCommand, console
from spes_cli.options import settings_options

PEER_SETTINGS = ("swarm", "model", "method", "sync", "merge", "train", "data", "network", "peer", "dashboard")
RUN_SETTINGS = (
    "out",
    "resume",
    "rounds",
    "new_swarm",
    "min_peers",
    "join_round",
    "wait_seconds",
    "addr_file",
    "invite",
    "log_level",
)


@click.command(cls=SpesCommand, context_settings={"help_option_names": ["-h", "--help"]})
@settings_options(
    *PEER_SETTINGS,
    *(f"run.{name}" for name in RUN_SETTINGS),
    exclude=("train.log_every",),
    default_file=True,
)
@click.version_option(package_name="spes-p2p")
def spes_join(settings) -> None:
    """Join a swarm (or found one with --new-swarm), claim the expert shard it needs most, and train it with
    the shard's other holders until --rounds or Ctrl-C."""
    from spes_cli.render import JoinView

    from spes_p2p.compat import setup_logging
    from spes_p2p.peer.life import live, stop_on_signals

    setup_logging(settings.run.log_level)
    with JoinView(console, settings) as view:
        live(settings, stop_on_signals(), view)
