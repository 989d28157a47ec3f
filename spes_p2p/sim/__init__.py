"""Local swarms for research and for proving the client survives what volunteers do: late joins, crashes,
lossy networks, restarts. ``run`` starts real peer processes (hivemind backend) or runs the peers in this
process (memory backend, with network faults), then writes ``summary.json`` and ``loss.png``."""

from spes_p2p.compat import lazy_exports

_EXPORTS = {"run": "runner", "simulation": "runner"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
