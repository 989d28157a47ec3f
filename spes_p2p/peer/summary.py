"""What `spes status` and `spes-join --new-swarm` print about a swarm."""

from __future__ import annotations

from spes_p2p.settings import Settings
from spes_p2p.swarm.member import read_identities, read_view
from spes_p2p.swarm.transport import Transport


def read_swarm(settings: Settings) -> dict:
    """Joins the swarm as a client just long enough to read it: `spes status`."""
    from spes_p2p.peer.setup import open_transport

    transport = open_transport(settings, new_swarm=False, client=True)
    try:
        return swarm_summary(transport, settings.swarm.run_id)
    finally:
        transport.shutdown()


def swarm_summary(transport: Transport, run_id: str) -> dict:
    """The swarm as `spes status --json` prints it."""
    identities = read_identities(transport, run_id)
    hashes = sorted({i.hash for i in identities.values()})
    units = next(iter(identities.values())).fields.get("units", []) if identities else []
    view = read_view(transport, run_id, units)
    return {
        "run_id": run_id,
        "config_hashes": hashes,
        "peers": [
            {
                "peer_id": p.peer_id,
                "units": p.units,
                "round": p.round,
                "tokens_per_s": p.tokens_per_s,
                "loss": p.loss,
                "version": p.version,
                "addresses": p.addresses,
                "client_mode": p.client_mode,
            }
            for p in sorted(view.peers.values(), key=lambda p: p.peer_id)
        ],
        "units": {u: sorted(h) for u, h in view.holders.items()},
        "uncovered": view.uncovered(),
    }


def share_snippet(settings: Settings, addresses: list[str]) -> str:
    """A peers.toml that lets others join this swarm: its name, these addresses, and every setting that
    must match across the swarm."""
    with_peers = settings.override(swarm__initial_peers=tuple(addresses))
    return with_peers.to_toml(("swarm", "model", "method", "sync", "merge"))
