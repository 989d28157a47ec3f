"""A bare transport of one backend, for tests that need a peer of it in another process: prints its first
address, then serves until it is stopped.

    python tests/backend_peer.py hivemind|libp2p
"""

from __future__ import annotations

import sys
import time

from spes_p2p.compat import setup_logging
from spes_p2p.peer.setup import backend_class

if __name__ == "__main__":
    setup_logging("warning")
    transport = backend_class(sys.argv[1])()
    print(transport.addresses()[0], flush=True)
    while True:
        time.sleep(1)
