"""What `spes status` shows of a swarm, and the invites that let a volunteer join it with one file."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from pathlib import Path

from spes_p2p.files import atomic_write_bytes
from spes_p2p.net.transport import Transport
from spes_p2p.net.waiting import Deadline
from spes_p2p.peer.admission import FETCH_SECONDS, SwarmUnavailable, nobody_alive
from spes_p2p.settings import Settings
from spes_p2p.swarm import manifest as manifests
from spes_p2p.swarm.config import SwarmConfig
from spes_p2p.swarm.datawork import epoch_progress
from spes_p2p.swarm.manifest import Manifest, ManifestError
from spes_p2p.swarm.member import read_view
from spes_p2p.swarm.records import Progress, ProgressRecord, read_peers, read_progress

INVITE_SECTIONS = ("swarm", "model", "method", "sync", "merge")


class SwarmReader:
    """A client's view of a swarm: it joins the DHT as a client (claims nothing, serves nothing), reads the
    swarm's manifest once and its records whenever asked."""

    def __init__(self, settings: Settings, transport: Transport | None = None) -> None:
        from spes_p2p.peer.setup import open_transport

        self.run_id = settings.swarm.run_id
        self.transport = transport or open_transport(settings, new_swarm=False, client=True)
        self.manifest: Manifest | None = None

    def __enter__(self) -> SwarmReader:
        return self

    def __exit__(self, *exc) -> None:
        self.transport.shutdown()

    def read(self) -> dict:
        """The swarm as `spes status --json` prints it; SwarmUnavailable when no peer of it is alive."""
        live = read_peers(self.transport, self.run_id)
        if not live:
            raise SwarmUnavailable(nobody_alive(self.transport, self.run_id, 0))
        if self.manifest is None:
            self.manifest = self._fetch_manifest(set(live))
        return swarm_summary(self.transport, self.run_id, self.manifest)

    def watch(self, seconds: float, show: Callable[[dict], None], stop: threading.Event) -> None:
        """``show`` the swarm every ``seconds`` until ``stop`` is set."""
        while not stop.is_set():
            show(self.read())
            stop.wait(seconds)

    def _fetch_manifest(self, live: set[str]) -> Manifest:
        records = {p: r for p, r in manifests.read_records(self.transport, self.run_id).items() if p in live}
        for wanted in {r.hash for r in records.values()}:
            peers = sorted(p for p, r in records.items() if r.hash == wanted)
            try:
                return manifests.fetch(self.transport, peers, wanted, Deadline(FETCH_SECONDS))[0]
            except ManifestError:
                continue
        raise SwarmUnavailable(f"no live peer of swarm {self.run_id!r} served its manifest")


def swarm_summary(transport: Transport, run_id: str, manifest: Manifest) -> dict:
    """Peers (with how long ago each wrote its record), units and their holders against the target."""
    view = read_view(transport, run_id, manifest.units, manifest.hash)
    shown = read_progress(transport, run_id)
    progress = {p: shown[p].progress if p in shown else Progress() for p in view.peers}
    now, target = transport.now(), manifest.settings.get("swarm.target_replication", 1)
    experts = [u for u in manifest.units if u.startswith("experts/")]
    return {
        "run_id": run_id,
        "manifest": manifest.hash,
        "protocol": manifest.protocol,
        "round": max((p.round for p in view.peers.values()), default=0),
        "peers": [
            {
                "peer_id": p.peer_id,
                "units": p.units,
                "round": p.round,
                "tokens_per_s": progress[p.peer_id].tokens_per_s,
                "loss": progress[p.peer_id].loss,
                "val_loss": progress[p.peer_id].val_loss,
                "tokens": progress[p.peer_id].tokens,
                "bytes_sent": progress[p.peer_id].sent,
                "bytes_received": progress[p.peer_id].received,
                "rejected": progress[p.peer_id].rejected,
                "dht_ops": progress[p.peer_id].dht_ops,  # of its last round
                "dht_bytes": progress[p.peer_id].dht_bytes,
                "version": p.version,
                "addresses": p.addresses,
                "client_mode": p.client_mode,
                "reachable": p.reachable,
                "seen_seconds_ago": max(0.0, now - p.seen),
                "banned": p.banned,  # peers this one has banned
                "banned_by": sorted(q.peer_id for q in view.peers.values() if p.peer_id in q.banned),
                # the median of the scores the peers that scored its contributions gave it (None: none did)
                "score": _median_score(p.peer_id, [shown[q] for q in view.peers if q in shown]),
            }
            for p in sorted(view.peers.values(), key=lambda p: p.peer_id)
        ],
        "units": {u: sorted(h) for u, h in view.holders.items()},
        "data": data_summary(transport, run_id, manifest, view, progress),
        "target_replication": target,
        "uncovered": view.uncovered(),
        "under_replicated": [u for u in experts if 0 < len(view.holders.get(u, ())) < target],
    }


def data_summary(transport: Transport, run_id: str, manifest: Manifest, view, progress: dict) -> dict:
    """The swarm's way through its dataset: tokens trained (by the live peers: ``progress``, by peer), the
    oldest epoch a live peer trains, and that epoch's shards done, being trained and stalled."""
    pin, peers = manifest.data, view.peers.values()
    epoch = min((p.data_epoch for p in peers), default=0)
    lease = SwarmConfig().record_ttl_seconds  # (a claim is live while its peer's record is, too)
    counts = epoch_progress(transport, run_id, pin.dataset, pin.train_shards, epoch, set(view.peers), lease)
    return {"dataset": pin.dataset, "tokens": sum(p.tokens for p in progress.values()), **counts}


def _median_score(peer_id: str, shown: list[ProgressRecord]) -> float | None:
    """The median (lower) of the scores the peers that scored ``peer_id``'s contributions gave it."""
    given = [q.scores[peer_id] for q in shown if peer_id in q.scores]
    return statistics.median_low(given) if given else None


def invite(settings: Settings, manifest: Manifest, addresses: list[str]) -> str:
    """A complete peers.toml that joins this swarm: its name, where to dial it, its manifest's hash, and
    its swarm-wide settings (for the record: they come from the manifest anyway)."""
    joined = settings.override(
        {
            "swarm.run_id": manifest.run_id,
            "swarm.initial_peers": tuple(addresses),
            "swarm.manifest": manifest.hash,
        }
    ).adopt(manifest.settings)
    head = f"# An invite to swarm {manifest.run_id!r}; join it with: spes-join --config THIS_FILE\n"
    return head + joined.to_toml(INVITE_SECTIONS)


def write_invite(path: Path, settings: Settings, manifest: Manifest, addresses: list[str]) -> None:
    atomic_write_bytes(Path(path), invite(settings, manifest, addresses).encode())


def live_addresses(transport: Transport, run_id: str) -> list[str]:
    """Every dialable address of the swarm's live peers (client-mode peers cannot be dialed)."""
    peers = read_peers(transport, run_id)
    return [
        a for p in sorted(peers.values(), key=lambda p: p.peer_id) if not p.client_mode for a in p.addresses
    ]
