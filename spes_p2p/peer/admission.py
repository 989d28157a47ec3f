"""How a peer comes to share its swarm's manifest (``spes_p2p.swarm.manifest``).

The founder (``--new-swarm``) writes the manifest from its own settings, tokenizer and initial model.

Anyone else never starts a swarm of its own. It waits (up to ``join_timeout_seconds``) until it sees live
peers, takes the manifest they share (the one its invite names, when it has one; the one the peers it
dialed share, when the records disagree, and none when those do not settle it), fetches it and the
tokenizer and checks both hashes, and is refused when the swarm speaks another protocol or when a setting it
was given (by file or flag) differs from the manifest's. Every other swarm-wide setting, and the tokenizer,
it adopts. A swarm with no live peer is an error that says so, with the round its last peers reached.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from spes_p2p.errors import SpesError
from spes_p2p.files import atomic_write_bytes
from spes_p2p.model.units import layout_of
from spes_p2p.net.transport import Transport
from spes_p2p.net.waiting import Deadline, poll
from spes_p2p.peer.swarmdata import pin
from spes_p2p.settings import Settings
from spes_p2p.swarm import manifest as manifests
from spes_p2p.swarm.manifest import PROTOCOL, DatasetPin, Manifest, ManifestRecord
from spes_p2p.swarm.member import SwarmMismatch
from spes_p2p.swarm.records import PeerRecord, decode_entries, peers_key, read_peers
from spes_p2p.train.dataset import PreparedData

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
FETCH_SECONDS = 60.0  # to fetch the manifest and the tokenizer, retrying peers that fail


class SwarmUnavailable(SpesError):
    """The swarm this peer was asked to join has no live peer."""


@dataclass(frozen=True)
class Admission:
    settings: Settings  # this peer's, with the swarm's swarm-wide settings and tokenizer
    manifest: Manifest
    tokenizer: bytes


def shared_manifest(
    settings: Settings, data: PreparedData, admission: Admission | None, initial_units: dict[str, str]
) -> tuple[Manifest, bytes]:
    """The manifest and tokenizer this peer shares: the swarm's when it was admitted, else those of the swarm
    it founds (or, in tests, the one every peer of its settings computes alike)."""
    if admission is not None:
        return admission.manifest, admission.tokenizer
    tokenizer = data.tokenizer.to_str().encode()
    return manifest_for(settings, tokenizer, pin(settings, data), initial_units), tokenizer


def manifest_for(
    settings: Settings, tokenizer: bytes, data: DatasetPin, initial_units: dict[str, str]
) -> Manifest:
    """The manifest of a swarm this peer founds."""
    return Manifest(
        protocol=PROTOCOL,
        run_id=settings.swarm.run_id,
        settings=settings.swarm_wide(),
        model=settings.model.architecture().to_dict(),
        units=layout_of(settings.model).units,
        tokenizer_sha256=hashlib.sha256(tokenizer).hexdigest(),
        tokenizer_bytes=len(tokenizer),
        data=data,
        initial_units=initial_units,
    )


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, shape and values (as float32): another torch build may draw other
    random weights from the same seed, and a newcomer that downloads the initial model from peers (a swarm
    founded from --init) must be able to tell each unit is the founder's, to the last value."""
    h = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        h.update(f"{name}{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def admit(settings: Settings, transport: Transport, stop: threading.Event) -> Admission:
    """Takes the manifest of the swarm that ``transport`` reached, and this peer's settings under it."""
    run_id = settings.swarm.run_id
    records = _live_manifests(transport, run_id, settings.swarm.join_timeout_seconds, stop)
    wanted = _wanted(settings, records)
    peers = sorted(p for p, r in records.items() if r.hash == wanted)
    if records[peers[0]].protocol != PROTOCOL:
        raise SwarmMismatch(manifests.protocol_mismatch(run_id, records[peers[0]].protocol, peers[0]))
    manifest, tokenizer = manifests.fetch(transport, peers, wanted, Deadline(FETCH_SECONDS, stop))
    adopted = settings.adopt(manifest.settings)
    mine = settings.data.tokenizer
    if mine and "data.tokenizer" in settings.given:
        if hashlib.sha256(Path(mine).read_bytes()).hexdigest() != manifest.tokenizer_sha256:
            raise SwarmMismatch(
                f"--tokenizer {mine} is not the swarm's tokenizer; leave it out to use the swarm's"
            )
    path = adopted.data.cache_path / f"swarm-tokenizer-{manifest.tokenizer_sha256[:16]}.json"
    atomic_write_bytes(path, tokenizer)
    logger.info("adopted manifest %s of swarm %s (%d peers share it)", wanted[:16], run_id, len(peers))
    return Admission(adopted.override({"data.tokenizer": str(path)}), manifest, tokenizer)


def _live_manifests(
    transport: Transport, run_id: str, seconds: float, stop: threading.Event
) -> dict[str, ManifestRecord]:
    def seen() -> dict[str, ManifestRecord] | None:
        live = read_peers(transport, run_id)
        records = {p: r for p, r in manifests.read_records(transport, run_id).items() if p in live}
        return records or None

    records = poll(seen, Deadline(seconds, stop), POLL_SECONDS)
    if records:
        return records
    legacy = manifests.legacy_protocol(transport, run_id)
    if legacy is not None:
        raise SwarmMismatch(manifests.protocol_mismatch(run_id, legacy))
    raise SwarmUnavailable(nobody_alive(transport, run_id, seconds))


def nobody_alive(transport: Transport, run_id: str, seconds: float) -> str:
    """Why a swarm shows no live peer, and what to do."""
    every = decode_entries(transport.read(peers_key(run_id)), PeerRecord, "peer", transport.guard)
    if every:
        last = max(r.round for r in every.values())
        return (
            f"swarm {run_id!r} has no live peer: its last peers left after round {last}. To train it again, "
            "found it anew with --new-swarm (from its initial model), or ask for an invite to a live swarm"
        )
    within = f" within {seconds:.0f}s" if seconds else ""
    return (
        f"no peer of swarm {run_id!r} showed up{within} (the peers you dialed answered): check --run-id "
        "against the invite, or found a swarm of your own with --new-swarm"
    )


def _wanted(settings: Settings, records: dict[str, ManifestRecord]) -> str:
    """The manifest to join: the invite's; or the one every live peer shares; or, when their records
    disagree, the one the peers this peer dialed share. Records alone never decide: identities are free,
    so a majority of them proves nothing."""
    counts = Counter(r.hash for r in records.values())
    pinned, run_id = settings.swarm.manifest, settings.swarm.run_id
    if pinned and pinned not in counts:
        shared = ", ".join(h[:16] for h in counts)
        raise SwarmMismatch(
            f"the invite names manifest {pinned[:16]}, but the live peers of swarm {run_id!r} "
            f"share {shared}: the swarm was founded anew; ask for a fresh invite"
        )
    if pinned or len(counts) == 1:
        return pinned or next(iter(counts))
    dialed = {address.rsplit("/p2p/", 1)[-1] for address in settings.swarm.initial_peers}
    theirs = {records[p].hash for p in dialed if p in records}
    if len(theirs) == 1:
        logger.warning("the live peers share %d manifests; joining the one of the peers dialed", len(counts))
        return theirs.pop()
    listed = ", ".join(f"{h[:16]} ({n} peers)" for h, n in counts.most_common())
    raise SwarmMismatch(
        f"the live peers of swarm {run_id!r} share {len(counts)} manifests ({listed}), and the peers you "
        "dialed do not settle which is the swarm's: join with an invite from a peer you trust, or pass "
        "--manifest HASH"
    )
