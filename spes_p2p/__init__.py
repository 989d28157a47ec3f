"""spes-p2p: volunteers pretrain a mixture-of-experts language model together, peer to peer.

Layers (each depends only on those above it in this list):
    spes_p2p.model   the MoE transformer, presets, and the map from units to parameters
    spes_p2p.train   data, tokenizer, the local trainer, checkpoints, memory accounting
The command line lives in the separate ``spes_cli`` package and only calls into these.
"""

__version__ = "0.1.0"
