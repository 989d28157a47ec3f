"""The network: moving bytes and small records between peers, knowing no protocol above it.

``transport.Transport`` is the seam every backend implements (expiring DHT records, requests with timeouts
and size limits, gossip where the backend has it, a guard); the seam imports no backend, and the peer's
setup picks one. Backends:

    memory.py   every peer in one process, deterministic, with fault hooks (tests, fast simulations)
    hivemind/   hivemind's DHT in a child process plus streams through its Go daemon, p2pd
    libp2p/     py-libp2p in pure Python, on a trio loop in a thread: Kademlia, streams, gossipsub

Beside them: ``wire`` (strict typed messages), ``guard`` (whom a peer listens to), ``waiting`` (bounded
waits), ``relays`` and ``forwarding`` (peers behind NAT), ``reachability`` (the dial-back test).
"""
