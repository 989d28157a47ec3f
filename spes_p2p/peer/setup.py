"""Wiring: from a peer's settings to what the layers below need (the membership config, the seed of the
initial model, the sync engine) and to its transport."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from spes_p2p import __version__
from spes_p2p.errors import CheckpointError, ConfigError
from spes_p2p.model.config import ModelConfig
from spes_p2p.model.units import UnitLayout, layout_of
from spes_p2p.net.transport import Transport
from spes_p2p.peer.local import LocalModel, LocalTraining
from spes_p2p.peer.virtual import VirtualTraining
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import MemberConfig
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.train.checkpoint import list_checkpoints, read_meta
from spes_p2p.train.dataset import PreparedData


def founded_from(settings: Settings) -> Settings:
    """A founder's settings with its ``--init`` checkpoint's model config and tokenizer (whose weights the
    peer loads); without ``--init``, the settings as they are."""
    init = settings.model.init
    if not init:
        return settings
    if not settings.run.new_swarm:
        raise ConfigError(
            "--init founds a swarm: add --new-swarm (a newcomer downloads the swarm's model from its peers)"
        )
    path = Path(init)
    found = list_checkpoints(path) if not (path / "meta.json").is_file() else [path]
    if not found:
        raise CheckpointError(f"--init {init}: no checkpoint there (spes upcycle and spes train write one)")
    meta = read_meta(found[-1])
    if not isinstance(meta.get("model_config"), dict) or not (found[-1] / "tokenizer.json").is_file():
        raise CheckpointError(f"--init {found[-1]}: a checkpoint without its model config or tokenizer.json")
    return settings.override(
        {
            "model.init": str(found[-1]),
            "model.config_json": ModelConfig.from_dict(meta["model_config"]).to_json(),
            "data.tokenizer": str(found[-1] / "tokenizer.json"),
        }
    )


def initial_seed(settings: Settings) -> int:
    """The seed of a swarm's initial model: every peer that starts with the swarm computes the same."""
    swarm = {"run_id": settings.swarm.run_id, **settings.swarm_wide()}
    return int(hashlib.sha256(json.dumps(swarm, sort_keys=True).encode()).hexdigest()[:8], 16)


def local_training(
    settings: Settings, layout: UnitLayout, seed: int, peer_id: str, data: PreparedData
) -> LocalModel:
    """The peer's training: real, or virtual when ``sim.compute`` says so."""
    if settings.sim.virtual:
        return VirtualTraining(settings, layout, seed, peer_id, data)
    return LocalTraining(settings, layout, seed, peer_id, data)


def member_config(settings: Settings) -> MemberConfig:
    units = layout_of(settings.model).units
    dense = [u for u in units if u.startswith("dense/")]
    blocks = len(dense) > 1  # block coordinate descent over the dense part; B = 1 is SPES as published
    diloco = settings.method.mode == "diloco"  # the baseline: every peer trains every unit
    return MemberConfig(
        swarm=settings.swarm,
        peer=settings.peer,
        network=settings.network,
        claimable=[] if diloco else [u for u in units if u.startswith("experts/")],
        always_held=units if diloco else [] if blocks else dense,
        dense_claimable=dense if blocks else [],
        rotate_every=settings.method.rotate_every_rounds,
        block_order=settings.method.block_order,
        version=__version__,
    )


def sync_engine(
    settings: Settings, transport: Transport, specs: dict, local_copy, roster, quantized: dict
) -> SyncEngine:
    return SyncEngine(
        transport,
        settings.swarm.run_id,
        settings.sync,
        specs,
        local_copy,
        roster,
        settings.method.aggregate,
        quantized,
    )


def open_transport(settings: Settings, *, new_swarm: bool, client: bool = False) -> Transport:
    """The transport of the swarm's backend; a new swarm dials nobody, a joining peer needs initial peers.
    A peer nobody can dial (``--client-mode``, ``--use-relay``) is reached through relays: its initial
    peers."""
    net = settings.network
    if settings.swarm.backend == "memory":
        raise ConfigError(
            "--backend memory runs only inside spes simulate (every peer in one process): pick hivemind or "
            "libp2p"
        )
    initial = [] if new_swarm else list(settings.swarm.initial_peers)
    if not new_swarm and not initial:
        raise ConfigError(
            "no initial peers: pass --peers ADDR (a running peer's multiaddr), set initial_peers "
            "in peers.toml, or start a new swarm with --new-swarm"
        )
    relayed = (net.client_mode or net.use_relay) and not client
    if relayed and new_swarm:
        raise ConfigError(
            "a peer that nobody can dial (--client-mode or --use-relay) cannot found a swarm: found it on a "
            "reachable machine, then join this one with --peers ADDR"
        )
    return backend_class(settings.swarm.backend)(
        initial_peers=initial,
        listen=net.listen,
        announce=net.announce,
        identity_path=None if client else Path(net.identity).expanduser(),
        client_mode=client or net.client_mode,
        relays=initial if relayed else (),
        startup_timeout=settings.swarm.join_timeout_seconds,
    )


def backend_class(backend: str) -> type[Transport]:
    """The transport class of a network backend, ``hivemind`` or ``libp2p``, imported only when asked for:
    the two cannot share a process (both register the protobuf package ``crypto.pb``)."""
    if backend == "hivemind":
        from spes_p2p.net.hivemind.daemon import HivemindTransport

        return HivemindTransport
    if backend == "libp2p":
        from spes_p2p.net.libp2p.host import Libp2pTransport

        return Libp2pTransport
    raise ValueError(f"no network backend {backend!r}")
