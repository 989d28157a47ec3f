"""The volunteer's life cycle, wiring the trainer (spes_p2p.train) to the swarm (spes_p2p.swarm) and the sync
(spes_p2p.sync).

The names below are imported on first use: ``spes_p2p.peer.config`` (its settings) stays light.
"""

from spes_p2p.compat import lazy_exports

_EXPORTS = {
    "Peer": "node",
    "PeerStatus": "node",
    "open_transport": "setup",
    "SwarmReader": "status",
    "swarm_summary": "status",
    "write_invite": "status",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
