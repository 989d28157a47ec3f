"""One network backend measured on its own: start and join time, DHT write and read latency, and stream
throughput, among 4 peers in 4 processes on 127.0.0.1 (``benchmarks/run.py``'s ``backends`` section runs it
once per backend, each in a process of its own: hivemind and py-libp2p cannot share one).

    python benchmarks/backends.py BACKEND                 # one JSON line of figures
    python benchmarks/backends.py BACKEND --serve [PEER]  # a peer that serves ``blob``; prints its address
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from spes_p2p.compat import setup_logging
from spes_p2p.peer.setup import backend_class

PEERS = 4  # this process and 3 servers
OPS = 20  # DHT writes and reads timed
BLOB_MIB, BLOBS = 32, 5  # stream throughput: 5 requests of 32 MiB each
KEY = "bench/peers"


def serve(backend: str, initial: list[str]) -> None:
    transport = backend_class(backend)(initial_peers=initial)
    transport.serve("blob", lambda caller, request: bytes(int(request)), max_request_bytes=1024)
    transport.publish(KEY, transport.peer_id.encode(), transport.now() + 600)
    print(transport.addresses()[0], flush=True)
    while True:
        time.sleep(1)


def measure(backend: str) -> dict:
    servers = []
    try:
        founder = _server(backend, [], servers)
        for _ in range(PEERS - 2):
            _server(backend, [founder], servers)
        cls = backend_class(backend)
        started = time.perf_counter()
        alone = cls()
        start_seconds = time.perf_counter() - started
        alone.shutdown()
        started = time.perf_counter()
        me = cls(initial_peers=[founder])
        join_seconds = time.perf_counter() - started
        writes, reads = [], []
        for i in range(OPS):
            started = time.perf_counter()
            assert me.publish(f"bench/{i}", b"x" * 1000, me.now() + 600)
            writes.append(time.perf_counter() - started)
        me.publish(KEY, me.peer_id.encode(), me.now() + 600)
        for _ in range(OPS):
            started = time.perf_counter()
            seen = me.read(KEY)
            reads.append(time.perf_counter() - started)
        target = founder.rsplit("/p2p/", 1)[1]
        rates = []
        for _ in range(BLOBS):
            started = time.perf_counter()
            blob = me.request(target, "blob", str(BLOB_MIB << 20).encode(), timeout=120)
            rates.append(len(blob) / 2**20 / (time.perf_counter() - started))
        me.shutdown()
        return {
            "start_seconds": start_seconds,
            "join_seconds": join_seconds,
            "dht_write_ms": 1000 * statistics.median(writes),
            "dht_read_ms": 1000 * statistics.median(reads),
            "entries_read": len(seen),
            "stream_mib_per_s": statistics.median(rates),
        }
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


def _server(backend: str, initial: list[str], servers: list) -> str:
    proc = subprocess.Popen(
        [sys.executable, __file__, backend, "--serve", *initial], stdout=subprocess.PIPE, text=True
    )
    servers.append(proc)
    address = proc.stdout.readline().strip()
    if "/p2p/" not in address:
        raise RuntimeError(f"a {backend} server did not start")
    return address


if __name__ == "__main__":
    setup_logging("warning")
    if "--serve" in sys.argv:
        serve(sys.argv[1], sys.argv[3:])
    else:
        print(json.dumps(measure(sys.argv[1])))
