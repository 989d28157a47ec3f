"""Everything that talks to other peers: the Transport seam and its backends, records, claims, membership.

It moves bytes and small records; it knows nothing of optimizers or data. Backends:
    memory     in-process and deterministic, with fault hooks (tests, fast simulations)
    hivemind   hivemind's DHT plus libp2p streams through its p2pd daemon; one OS process per peer
"""
