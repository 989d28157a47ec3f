"""Bytes each peer sends and receives per round, by preset and codec, against a full-model fp32 exchange.

Runs a 4-peer swarm (2 expert shards, so replication 2) in one process on the memory backend, whose byte
counts are the payload sizes the hivemind backend moves too, and reports the medians over peers of the last
round (the first round includes newcomers' downloads). The baseline is what one peer of a full-model
exchange moves per round: the fp32 model out and the fp32 model in (DiLoCo's all-reduce moves about that).

    python benchmarks/sync_bytes.py --presets tiny small --out runs/bench-bytes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from spes_p2p.peer import Peer
from spes_p2p.settings import Settings
from spes_p2p.swarm.memory import MemoryNetwork


def measure(preset: str, codec: str, peers: int = 4, shards: int = 2, rounds: int = 2) -> dict:
    s = Settings().override(
        model__preset=preset,
        model__shards=shards,
        method__codec=codec,
        method__steps_per_round=2,
        method__merge=False,
        method__overlap=False,
        data__max_corpus_mb=2.0,
        train__batch_size=2,
        train__seq_len=64,
        swarm__sync_deadline_min=0.5,
        swarm__sync_deadline_max=60.0,
    )
    net = MemoryNetwork(seed=0)
    swarm = [Peer(s, net.join(f"p{i}")) for i in range(peers)]
    for p in swarm:
        p.join()
    stop = threading.Event()
    threads = [threading.Thread(target=p.run, args=(stop, None, rounds)) for p in swarm]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    rows = [p._last_row for p in swarm]
    full = 4 * swarm[0].model.num_params()
    sent = statistics.median(r["bytes_sent"] for r in rows)
    received = statistics.median(r["bytes_received"] for r in rows)
    for p in swarm:
        p.close()
    return {
        "preset": preset,
        "codec": codec,
        "params": swarm[0].model.num_params(),
        "bytes_sent": sent,
        "bytes_received": received,
        "full_fp32_exchange": 2 * full,
        "ratio_vs_full_fp32": (sent + received) / (2 * full),
        "sync_seconds_median": statistics.median(r["sync_seconds"] for r in rows),
        "wall_seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--codecs", nargs="+", default=["none", "fp16", "int8", "topk"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    print(
        f"{'preset':6} {'codec':5} {'sent MiB':>9} {'recv MiB':>9} {'full MiB':>9} {'ratio':>6} {'sync s':>7}"
    )
    for preset in args.presets:
        for codec in args.codecs:
            r = measure(preset, codec)
            results.append(r)
            print(
                f"{preset:6} {codec:5} {r['bytes_sent'] / 2**20:9.2f} {r['bytes_received'] / 2**20:9.2f} "
                f"{r['full_fp32_exchange'] / 2**20:9.2f} {r['ratio_vs_full_fp32']:6.3f} "
                f"{r['sync_seconds_median']:7.2f}",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
