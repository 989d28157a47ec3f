"""The swarm: who is in it and what each holds. DHT records and their schema, the manifest, membership and
claims (of expert shards and dense blocks), and gossip of update announcements.

It reads and writes through the network seam (``spes_p2p.net.transport``), never a backend, and knows
nothing of training or of tensors.
"""
