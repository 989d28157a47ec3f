"""A round's metrics row (``metrics.jsonl``, the live view, the simulation summary)."""

from __future__ import annotations

import time
from dataclasses import asdict

from spes_p2p.net.transport import DhtCounts, Transport
from spes_p2p.peer.job import RoundJob
from spes_p2p.swarm.records import Progress


def crossed(round_: int, steps_per_round: int, every: int) -> bool:
    """Whether landing round ``round_ - 1`` took the step count past a multiple of ``every``."""
    return round_ * steps_per_round // every > (round_ - 1) * steps_per_round // every


class RoundMetrics:
    """Turns a landed job into its row; traffic is counted from one landing to the next (this round's
    exchange, plus what others fetched from this peer meanwhile). Training thread only."""

    def __init__(self, transport: Transport) -> None:
        self.peer_id, self.stats, self.guard = transport.peer_id, transport.stats, transport.guard
        self._last = self._now()

    def _now(self) -> tuple[int, int, dict[str, DhtCounts]]:
        return self.stats.bytes_sent, self.stats.bytes_received, self.stats.dht_snapshot()

    def row(self, job: RoundJob, step: int, tokens: int, rejected: int) -> dict:
        m = job.metrics
        (sent0, received0, dht0), now = self._last, self._now()
        self._last = now
        sent, received, dht = now
        dht = {kind: c.since(dht0.get(kind)) for kind, c in sorted(dht.items())}
        ops = sum(c.ops for c in dht.values())
        return {
            "peer": self.peer_id,
            "round": job.round,
            "step": step,
            "tokens": tokens,
            "compute": m["compute"],  # real, or virtual: no model ran, the loss is None
            "loss": m["loss"],
            "lr": m["lr"],
            "round_tokens": m["round_tokens"],
            "tokens_per_s": m["round_tokens"] / max(m["compute_seconds"], 1e-9),
            "bytes_sent": sent - sent0,
            "bytes_received": received - received0,
            "sync_seconds": time.perf_counter() - m["sync_started"],  # from the round's end until landed
            "sync_wait_seconds": m.get("sync_wait_seconds", 0.0),  # of which training was blocked
            "compute_seconds": m["compute_seconds"],
            # DHT reads and writes since the last row: in all, their mean latency, their value bytes, and
            # by the kind of key (net.transport.DhtCounts)
            "dht_ops": ops,
            "dht_ms": 1000 * sum(c.seconds for c in dht.values()) / max(1, ops),
            "dht_bytes": sum(c.read_bytes + c.written_bytes for c in dht.values()),
            "dht": {kind: {**asdict(c), "seconds": round(c.seconds, 4)} for kind, c in dht.items() if c.ops},
            "units": job.units,
            "participants": {u: r.participants for u, r in job.results.items()},
            "missing": {u: r.missing for u, r in job.results.items() if r.missing},
            "apart": {u: r.apart for u, r in job.results.items() if r.apart},  # came, from other weights
            "refused": {u: r.rejected for u, r in job.results.items() if r.rejected},
            "left_out": {u: r.left_out for u, r in job.results.items() if r.left_out},
            # the validation loss each participant's update took off (screening.screen)
            "scores": {
                u: {p: round(s, 5) for p, s in r.scores.items()} for u, r in job.results.items() if r.scores
            },
            "resynced": sorted(u for u, r in job.results.items() if r.resynced),
            "failing": m.get("failing", {}),  # unit -> holders that neither serve nor confirm it (frozen.py)
            "refreshed": {u: f.want.kind for u, f in sorted(job.refreshed.items())},  # how each came
            "rejected_payloads": rejected,
            "rejected": self.guard.total(),  # everything refused: records, requests, payloads, outliers
            "banned": self.guard.banned(),
            "data": m["data"],  # where the peer is in the dataset, and the windows this update trained on
        }


def progress(row: dict, last: Progress) -> Progress:
    """A round's row as the peer record's figures; a validation loss stands until the next evaluation."""
    return Progress(
        tokens_per_s=row["tokens_per_s"],
        loss=row["loss"],
        val_loss=row.get("val_loss", last.val_loss),
        tokens=row["tokens"],
        shards=row["data"]["shards_done"],
        dht_ops=row["dht_ops"],
        dht_bytes=row["dht_bytes"],
    )
