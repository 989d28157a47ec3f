"""A bare transport (hivemind or libp2p) in a network namespace, for tests/test_netns.py: serves ``echo``
(answers N bytes), publishes its addresses, then asks every other peer for ``size`` bytes (up to 3 tries)
and records what came back.

    python tests/relay_peer.py BACKEND FOLDER INDEX LISTEN PEERS SIZE [INITIAL_PEER] [--relayed]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from spes_p2p.net.transport import TransportError
from spes_p2p.peer.setup import backend_class


def main(
    backend: str, folder: Path, index: int, listen: str, peers: int, size: int, initial: str, relayed: bool
) -> None:
    announce = [] if relayed else [listen]
    transport = backend_class(backend)(
        initial_peers=[initial] if initial else [],
        listen=[listen],
        announce=announce,
        relays=[initial] if relayed else [],
    )
    transport.serve("echo", lambda caller, request: b"x" * int(request), max_request_bytes=1024)
    (folder / f"{index}.json").write_text(
        json.dumps({"id": transport.peer_id, "addrs": transport.addresses()})
    )
    while len(list(folder.glob("*.json"))) < peers:
        time.sleep(0.2)
    time.sleep(3)  # the relayed peers' reservations
    got = {}
    for other in range(peers):
        if other != index:
            info = json.loads((folder / f"{other}.json").read_text())
            transport.learn(info["id"], info["addrs"])
            for _ in range(3):  # as the protocol's fetches do, pass after pass (a connection may drop)
                try:
                    got[other] = len(transport.request(info["id"], "echo", str(size).encode(), timeout=20))
                    break
                except TransportError as exc:
                    got[other] = str(exc)
    (folder / f"{index}.got").write_text(json.dumps(got))
    while len(list(folder.glob("*.got"))) < peers:  # serve until everyone has asked
        time.sleep(0.2)
    transport.shutdown()


if __name__ == "__main__":
    backend, folder, index, listen, peers, size, initial = sys.argv[1:8]
    main(backend, Path(folder), int(index), listen, int(peers), int(size), initial, "--relayed" in sys.argv)
