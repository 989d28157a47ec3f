"""``python -m spes_p2p.peer SETTINGS.toml``: one peer, all of its settings in one file, logging to stderr.

The simulator starts its peer processes this way, and they leave the swarm (SIGTERM) when the simulator
dies, even by SIGKILL; ``spes-join`` runs the same life cycle (``spes_p2p.peer.life.live``) with a terminal
view. Exit status: 0 after a clean exit, 1 on an error.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from spes_p2p.compat import die_with_parent, setup_logging
from spes_p2p.errors import SpesError


def main(argv: list[str], transport_for=None) -> int:
    """``transport_for(settings)``: the transport to run over (default: the one the settings name)."""
    if len(argv) != 2:
        print("usage: python -m spes_p2p.peer SETTINGS.toml", file=sys.stderr)
        return 2
    die_with_parent(signal.SIGTERM)
    from spes_p2p.settings import load_settings

    try:
        settings = load_settings(Path(argv[1]))
        setup_logging(settings.run.log_level)
        from spes_p2p.peer.life import live, stop_on_signals

        live(settings, stop_on_signals(), transport=transport_for(settings) if transport_for else None)
    except SpesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
