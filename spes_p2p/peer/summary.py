"""What `spes status` and `spes-join --new-swarm` print about a swarm."""

from __future__ import annotations

from spes_p2p.settings import Settings
from spes_p2p.swarm.member import read_identities, read_view
from spes_p2p.swarm.transport import Transport


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
    """A peers.toml fragment that lets others join this swarm."""
    peers = ", ".join(f'"{a}"' for a in addresses)
    s = settings
    return (
        f'[swarm]\nrun_id = "{s.swarm.run_id}"\ninitial_peers = [{peers}]\n\n'
        f'[model]\npreset = "{s.model.preset}"\nshards = {s.model.shards}\n\n'
        f'[method]\nsteps_per_round = {s.method.steps_per_round}\ncodec = "{s.method.codec}"\n'
    )
