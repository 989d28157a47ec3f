"""The volunteer's life cycle, wiring the trainer (spes_p2p.train) to the swarm layer (spes_p2p.swarm)."""

from spes_p2p.peer.node import Peer, PeerStatus
from spes_p2p.peer.setup import open_transport, swarm_identity
from spes_p2p.peer.summary import share_snippet, swarm_summary

__all__ = ["Peer", "PeerStatus", "open_transport", "share_snippet", "swarm_identity", "swarm_summary"]
