"""A bare transport of one backend, for tests that need a peer of it in another process: prints its first
address, then serves until it is stopped.

    python tests/backend_peer.py hivemind|libp2p
"""

from __future__ import annotations

import sys
import time

if __name__ == "__main__":
    if sys.argv[1] == "hivemind":
        from spes_p2p.swarm.hivemind_backend import HivemindTransport as Backend
    else:
        from spes_p2p.swarm.libp2p_backend import Libp2pTransport as Backend
    transport = Backend()
    print(transport.addresses()[0], flush=True)
    while True:
        time.sleep(1)
