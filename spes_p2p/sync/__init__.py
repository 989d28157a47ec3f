"""The sync: a round's exchange of updates among a unit's holders, and the frozen copies of other units.

It moves tensors between peers over the network layer (``spes_p2p.net``) and reads who holds what from the
swarm layer (``spes_p2p.swarm``); it knows nothing of optimizers or data, and never imports a backend.
``engine.SyncEngine`` is its one facade; docs/architecture.md draws the rest.
"""
