"""spes-p2p: volunteers pretrain a mixture-of-experts language model together, peer to peer.

Layers (each depends only on those above it in this list; see docs/architecture.md):
    spes_p2p.model   the MoE transformer, presets, and the map from units to parameters
    spes_p2p.train   data, tokenizer, the local trainer, checkpoints, memory accounting
    spes_p2p.net     the transport seam and its backends (memory, hivemind, libp2p), relays, the guard
    spes_p2p.swarm   who is in the swarm and what each holds: records, manifest, membership, claims, gossip
    spes_p2p.sync    the round's exchange of updates, codecs and payloads, frozen copies and versions
    spes_p2p.peer    one volunteer's peer: the life cycle that wires the trainer to the swarm and the sync
    spes_p2p.sim     local swarms with crashes, late joins and network faults
Settings: each layer's ``config.py`` declares its sections; ``spes_p2p.settings`` composes them. The command
line lives in the separate ``spes_cli`` package and only calls into these.
"""

__version__ = "0.1.0"
