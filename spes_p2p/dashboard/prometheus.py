"""The dashboard's figures in Prometheus' text format (``/metrics``), from the latest read of the swarm: one
gauge or counter family per figure, labeled by peer or unit, so a founder can scrape and alert with
standard tools (docs/dashboard.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PEER_GAUGES = {  # status field -> (metric name, help)
    "round": ("spes_peer_round", "Rounds the peer has completed."),
    "tokens_per_s": ("spes_peer_tokens_per_second", "Tokens per second of the peer's last round."),
    "loss": ("spes_peer_loss", "Mean training loss of the peer's last round."),
    "val_loss": ("spes_peer_val_loss", "Validation loss at the peer's last evaluation."),
    "seen_seconds_ago": ("spes_peer_seen_seconds", "Seconds since the peer last wrote its record."),
    "dht_ops": ("spes_peer_dht_ops", "DHT reads and writes of the peer's last round."),
    "dht_bytes": ("spes_peer_dht_bytes", "Value bytes of the DHT reads and writes of the peer's last round."),
    "score": (
        "spes_peer_score",
        "Median score of its contributions, by the peers that scored them (0-1).",
    ),
}
PEER_COUNTERS = {
    "tokens": ("spes_peer_tokens", "Tokens the peer trained since it started."),
    "bytes_sent": ("spes_peer_sent_bytes", "Bytes the peer sent since it started."),
    "bytes_received": ("spes_peer_received_bytes", "Bytes the peer received since it started."),
    "rejected": ("spes_peer_rejected", "Messages of other peers the peer refused since it started."),
}


class SwarmCollector(Collector):
    """Collects from ``latest()``: (the last summary or None, the history's view)."""

    def __init__(self, latest: Callable[[], tuple[dict | None, dict]]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        summary, history = self.latest()
        up = GaugeMetricFamily(
            "spes_dashboard_read_ok", "1 when the last read of the swarm's records worked."
        )
        up.add_metric([], 0 if summary is None else 1)
        yield up
        if summary is None:
            return
        yield _gauge("spes_swarm_round", "Rounds the median live peer has completed.", history["round"])
        yield _gauge("spes_swarm_peers", "Live peers.", len(summary["peers"]))
        yield _gauge("spes_swarm_uncovered_units", "Units no live peer trains.", len(summary["uncovered"]))
        yield _gauge(
            "spes_swarm_under_replicated_units",
            "Expert shards with fewer holders than the replication target.",
            len(summary["under_replicated"]),
        )
        for name, key in (("rounds_per_hour", "Rounds"), ("tokens_per_hour", "Tokens")):
            if history[name] is not None:
                yield _gauge(
                    f"spes_swarm_{name}", f"{key} per hour while the dashboard watched.", history[name]
                )
        data = summary["data"]
        for key, text in (
            ("epoch", "The oldest epoch of the dataset a live peer trains."),
            ("shards", "Training shards in the swarm's dataset."),
            ("done", "Shards of that epoch trained to their end."),
            ("training", "Shards of that epoch live peers are training."),
            ("stalled", "Shards of that epoch begun and left (continued by the next peer to take one)."),
            ("tokens", "Tokens the live peers trained since they started."),
        ):
            yield _gauge(f"spes_data_{key}", text, data[key])
        holders = GaugeMetricFamily("spes_unit_holders", "Live peers training the unit.", labels=["unit"])
        for unit, peers in sorted(summary["units"].items()):
            holders.add_metric([unit], len(peers))
        yield holders
        yield _gauge("spes_unit_target_holders", "The replication target.", summary["target_replication"])
        yield from _per_peer(summary["peers"])


def _per_peer(peers: list[dict]) -> Iterator[Metric]:
    for field, (name, text) in PEER_GAUGES.items():
        family = GaugeMetricFamily(name, text, labels=["peer"])
        for p in peers:
            if p[field] is not None:
                family.add_metric([p["peer_id"]], p[field])
        yield family
    for field, (name, text) in PEER_COUNTERS.items():
        family = CounterMetricFamily(name, text, labels=["peer"])
        for p in peers:
            family.add_metric([p["peer_id"]], p[field])
        yield family
    reachable = GaugeMetricFamily("spes_peer_reachable", "1: others could dial it back.", labels=["peer"])
    banned = GaugeMetricFamily("spes_peer_banned_by", "Live peers that banned it.", labels=["peer"])
    for p in peers:
        reachable.add_metric([p["peer_id"]], 1 if p["reachable"] == "yes" else 0)
        banned.add_metric([p["peer_id"]], len(p["banned_by"]))
    yield reachable
    yield banned


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)
