"""Wiring: from a peer's settings to the configs of the layers below (swarm identity, membership, sync,
trainer, data) and to its transport."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from spes_p2p import __version__
from spes_p2p.errors import ConfigError
from spes_p2p.model.config import ModelConfig, get_preset
from spes_p2p.model.units import UnitLayout
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import MemberConfig
from spes_p2p.swarm.records import SwarmIdentity
from spes_p2p.swarm.sync import SyncConfig
from spes_p2p.swarm.transport import Transport
from spes_p2p.train.data import DataConfig
from spes_p2p.train.merge import MergeConfig
from spes_p2p.train.trainer import TrainConfig

PROTOCOL = 1  # bumped when peers of different versions can no longer work together


def model_config(settings: Settings) -> ModelConfig:
    """The preset, with the number of experts overridden when ``[model] experts`` is set."""
    model = get_preset(settings.model.preset)
    return model.replace(n_experts=settings.model.experts) if settings.model.experts else model


def unit_layout(settings: Settings) -> UnitLayout:
    return UnitLayout.for_model(model_config(settings), settings.model.shards, settings.model.dense_blocks)


def swarm_identity(settings: Settings) -> SwarmIdentity:
    """The settings that must match across the swarm: model, shards, dense blocks, method, protocol."""
    model = model_config(settings)
    layout = unit_layout(settings)
    fields = {f"model.{k}": v for k, v in model.to_dict().items()}
    fields.update(
        {
            "model.preset": settings.model.preset,
            "model.shards": settings.model.shards,
            "model.dense_blocks": settings.model.dense_blocks,
            **{f"method.{k}": v for k, v in dataclasses.asdict(settings.method).items()},
            "protocol": PROTOCOL,
            "units": layout.units,
        }
    )
    return SwarmIdentity(fields)


def member_config(settings: Settings, identity: SwarmIdentity) -> MemberConfig:
    units = identity.fields["units"]
    dense = [u for u in units if u.startswith("dense/")]
    blocks = len(dense) > 1  # block coordinate descent over the dense part; B = 1 is SPES as published
    diloco = settings.method.mode == "diloco"  # the baseline: every peer trains every unit
    return MemberConfig(
        run_id=settings.swarm.run_id,
        claimable=[] if diloco else [u for u in units if u.startswith("experts/")],
        always_held=units if diloco else [] if blocks else dense,
        dense_claimable=dense if blocks else [],
        dense_capacity=settings.peer.active_blocks,
        rotate_every=settings.method.rotate_every_rounds,
        block_order=settings.method.block_order,
        capacity=settings.peer.capacity,
        target_replication=settings.swarm.target_replication,
        hysteresis=settings.swarm.hysteresis,
        record_ttl=settings.swarm.record_ttl_seconds,
        version=__version__,
        client_mode=settings.network.client_mode,
    )


def open_transport(settings: Settings, *, new_swarm: bool, client: bool = False) -> Transport:
    """The hivemind transport; a new swarm dials nobody, a joining peer needs initial peers."""
    initial = [] if new_swarm else list(settings.swarm.initial_peers)
    if not new_swarm and not initial:
        raise ConfigError(
            "no initial peers: pass --peers ADDR (a running peer's multiaddr), set initial_peers "
            "in peers.toml, or start a new swarm with --new-swarm"
        )
    from spes_p2p.swarm.hivemind_backend import HivemindTransport  # heavy: imported only when used

    net = settings.network
    return HivemindTransport(
        initial_peers=initial,
        listen=net.listen,
        announce=net.announce,
        identity_path=None if client else Path(net.identity).expanduser(),
        client_mode=client or net.client_mode,
        use_relay=net.use_relay,
        startup_timeout=settings.swarm.join_timeout_seconds,
    )


def sync_config(settings: Settings) -> SyncConfig:
    m, s = settings.method, settings.swarm
    return SyncConfig(
        run_id=s.run_id,
        codec=m.codec,
        refresh_codec=m.refresh_codec,
        outer=m.outer,
        outer_lr=m.outer_lr,
        outer_momentum=m.outer_momentum,
        dense_group_size=m.dense_group_size,
        staleness=m.staleness,
        deadline_min=s.sync_deadline_min,
        deadline_max=s.sync_deadline_max,
    )


def train_config(settings: Settings) -> TrainConfig:
    t = settings.train
    return TrainConfig(
        optimizer=t.optimizer,
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        max_steps=t.total_steps,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        eval_batches=t.eval_batches,
        frozen_experts=t.frozen_experts,
        switch_state=t.switch_state,
    )


def data_config(settings: Settings) -> DataConfig:
    mb = settings.data.max_corpus_mb
    return DataConfig(corpus=settings.data.corpus, max_bytes=int(mb * 1e6) if mb > 0 else None)


def merge_config(settings: Settings) -> MergeConfig:
    m = settings.method
    return MergeConfig(
        enabled=m.merge,
        interval=m.merge_interval,
        alpha0=m.merge_alpha,
        horizon=m.merge_horizon,
        neighbours=m.merge_neighbours,
    )
