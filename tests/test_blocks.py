"""Block coordinate descent over the dense part: the partition into blocks, the claims and their rotation,
and the optimizer across switches."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spes_p2p.errors import ConfigError
from spes_p2p.model import MoETransformer, UnitLayout, get_preset
from spes_p2p.model.units import (
    balanced_starts,
    dense_partition,
    layout_of,
    named_weights,
    quantized_when_frozen,
    read_unit,
)
from spes_p2p.net.memory import FakeClock, MemoryNetwork
from spes_p2p.peer.frozen import FrozenCopies
from spes_p2p.peer.setup import member_config
from spes_p2p.settings import Settings
from spes_p2p.sim import run, simulation
from spes_p2p.sim.summary import read_rows
from spes_p2p.swarm.claims import block_permutation, carry_block, holders_at_epoch
from spes_p2p.swarm.member import SwarmMember
from spes_p2p.sync.versions import Chains, Download, Want
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.optim import tensor_bytes
from spes_p2p.train.trainer import Trainer

TINY = get_preset("tiny")
SMALL = get_preset("small")

# ------------------------------------------------------------------------------------------- partition


def test_one_block_is_the_whole_dense_part_as_before():
    layout = UnitLayout.for_model(TINY, 2, 1)
    assert layout == UnitLayout(TINY.n_experts, 2)
    assert layout.units == ["dense/0", "experts/0", "experts/1"]
    assert layout.unit_of("lm_head.weight") == layout.unit_of("embed.weight") == "dense/0"
    settings = Settings().override({"model.shards": 2, "model.dense_blocks": 1})  # every peer holds dense/0
    cfg = member_config(settings)
    assert cfg.always_held == ["dense/0"] and cfg.dense_claimable == []
    assert cfg.claimable == ["experts/0", "experts/1"]


def test_blocks_are_contiguous_atoms_balanced_by_parameter_count():
    layout = UnitLayout.for_model(SMALL, 4, 4)  # embedding | layers 0-1 | layers 2-3 | norm + lm_head
    assert layout.dense_units == ["dense/0", "dense/1", "dense/2", "dense/3"]
    assert layout.unit_of("embed.weight") == "dense/0"
    assert layout.unit_of("layers.0.attn.q_proj.weight") == "dense/1"
    assert layout.unit_of("layers.1.moe.router.weight") == "dense/1"
    assert layout.unit_of("layers.2.attn_norm.weight") == "dense/2"
    assert layout.unit_of("layers.3.moe.router.weight") == "dense/2"
    assert layout.unit_of("norm.weight") == layout.unit_of("lm_head.weight") == "dense/3"
    assert layout.unit_of("layers.2.moe.experts.5.w1") == "experts/2"
    model = MoETransformer(SMALL)
    sizes = {u: sum(t.numel() for t in read_unit(model, layout, u).values()) for u in layout.units}
    assert sum(sizes.values()) == model.num_params()  # every parameter is in exactly one unit
    dense = [sizes[u] for u in layout.dense_units]
    assert max(dense) / min(dense) < 2.0


def test_balanced_starts_is_the_most_even_split():
    assert balanced_starts([1, 1, 1, 1], 2) == (2,)
    assert balanced_starts([5, 1, 1, 1, 5], 3) == (1, 4)
    assert balanced_starts([3, 3, 3], 3) == (1, 2)
    assert balanced_starts([7], 1) == ()


def test_too_many_blocks_is_a_clear_error():
    with pytest.raises(ConfigError, match="between 1 and 4"):
        dense_partition(TINY, 5)  # tiny: embedding, 2 layers, head


# --------------------------------------------------------------------------------------------- rotation


@pytest.mark.parametrize("order", ["cyclic", "random"])
def test_rotation_permutes_blocks_alike_for_everyone(order):
    perm = block_permutation(4, 3, order, "run")
    assert sorted(perm) == [0, 1, 2, 3]
    assert perm == block_permutation(4, 3, order, "run")
    assert carry_block(0, 0, 2, 4, "cyclic", "run") == 2
    # a view where one peer has rotated to epoch 1 and the others not yet: carried to epoch 1 alike
    view = {"dense/0": {"a": 0, "b": 1}, "dense/1": {"c": 0}, "dense/2": {}, "dense/3": {"d": 1}}
    at_1 = holders_at_epoch(view, 1, "cyclic", "run")
    assert at_1 == {"dense/0": {"b"}, "dense/1": {"a"}, "dense/2": {"c"}, "dense/3": {"d"}}


def blocks_settings(blocks=4, active=1, rotate=2, order="cyclic") -> Settings:
    return Settings().override(
        {
            "model.shards": 2,
            "train.frozen_experts": "full",
            "train.frozen_dense": "full",
            "model.dense_blocks": blocks,
            "peer.active_blocks": active,
            "method.rotate_every_rounds": rotate,
            "method.block_order": order,
            "swarm.record_ttl_seconds": 20.0,
        }
    )


def dense_coverage(members: list[SwarmMember], blocks: list[str]) -> dict[str, int]:
    held = [u for m in members for u in m.units_held]
    return {b: held.count(b) for b in blocks}


@settings(max_examples=25, deadline=None)
@given(
    schedule=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.booleans()), min_size=3, max_size=12
    ),
    blocks=st.integers(2, 4),
    active=st.integers(1, 2),
    order=st.sampled_from(["cyclic", "random"]),
)
# peers that rebalance one after another, each seeing the claims the others just made (found by hypothesis)
@example(schedule=[(2, 1, False), (1, 2, False), (0, 2, False)], blocks=4, active=2, order="cyclic")
def test_coverage_holds_under_rotation_and_churn(manifest_of, schedule, blocks, active, order):
    """Boundaries where peers join, leave or crash while the blocks rotate every 2 rounds: whenever the live
    peers have room for every block, no block is ever left without a holder."""
    active = min(active, blocks)
    cfg = blocks_settings(blocks, active, rotate=2, order=order)
    manifest = manifest_of(cfg)
    clock = FakeClock()
    net = MemoryNetwork(seed=0, clock=clock)
    live: list[SwarmMember] = []
    names = iter(f"p{i}" for i in range(100))
    units = [f"dense/{b}" for b in range(blocks)]

    def join(round_):
        m = SwarmMember(net.join(next(names)), manifest, member_config(cfg))
        m.round = round_
        m.join(first_round=round_)
        live.append(m)

    for _ in range(blocks):
        join(0)
    for round_, (joins, leaves, crash) in enumerate(schedule, start=1):
        for _ in range(min(leaves, len(live) - 1)):
            gone = live.pop(0)
            if crash:  # its records stay until they expire
                gone.transport.shutdown(0)
            else:
                gone.leave()
        clock.advance(25.0 if crash else 0.0)  # crashed peers' records have expired by the boundary
        for m in live:
            m.round = round_
            m.heartbeat()
        for m in live:
            m.rebalance(first_round=round_)
        for _ in range(joins):
            join(round_)
        if len(live) * active >= blocks:
            cover = dense_coverage(live, units)
            assert min(cover.values()) >= 1, (round_, cover)
        assert all(len([u for u in m.units_held if u in units]) == active for m in live)


# -------------------------------------------------------------------------------------------- optimizer


def state_bytes(trainer: Trainer) -> int:
    """Per-parameter optimizer state; bitsandbytes' 1 KiB quantization maps (one per optimizer, shared by its
    parameters, and kept by the state carried over from an earlier optimizer) are left out."""
    states = trainer.optimizer.state.values()
    return tensor_bytes([{k: v for k, v in st.items() if not k.startswith("qmap")} for st in states])


def one_step(trainer: Trainer) -> None:
    tokens = torch.randint(0, TINY.vocab_size, (2, 33))
    trainer.train_step(tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw"])
def test_optimizer_state_follows_the_trainable_set_without_leaking(optimizer):
    torch.manual_seed(0)
    layout = UnitLayout.for_model(TINY, 2, 4)
    model = MoETransformer(TINY)
    cfg = TrainConfig(optimizer=optimizer, warmup_steps=0)
    trainer = Trainer(model, layout, ["dense/0", "experts/0"], cfg)
    expected = {}
    for b in range(4):  # the state a fresh trainer of each set holds after one step
        fresh = Trainer(MoETransformer(TINY), layout, [f"dense/{b}", "experts/0"], cfg)
        one_step(fresh)
        expected[b] = state_bytes(fresh)
    for switch in range(12):
        block = switch % 4
        trainer.retarget([f"dense/{block}", "experts/0"])
        one_step(trainer)
        assert state_bytes(trainer) == expected[block]
        assert set(trainer.optimizer.state) == set(trainer.trainable)
        assert trainer.parked == {}
        assert all(p.grad is None for p in model.parameters())


def test_switch_state_cpu_parks_and_restores_the_state_of_a_block():
    torch.manual_seed(0)
    layout = UnitLayout.for_model(TINY, 2, 2)
    model = MoETransformer(TINY)
    config = TrainConfig(warmup_steps=0, switch_state="cpu", frozen_dense="full")  # (all parameters)
    trainer = Trainer(model, layout, ["dense/0"], config)
    one_step(trainer)
    embed = model.embed.weight
    before = {k: v.clone() for k, v in trainer.optimizer.state[embed].items() if torch.is_tensor(v)}
    trainer.retarget(["dense/1"])
    assert embed not in trainer.optimizer.state and "embed.weight" in trainer.parked
    assert trainer.parked_bytes() > 0
    one_step(trainer)
    trainer.retarget(["dense/0"])
    assert trainer.parked.keys() == {n for n, _ in model.named_parameters() if layout.unit_of(n) == "dense/1"}
    restored = trainer.optimizer.state[embed]
    assert all(torch.equal(restored[k], v) for k, v in before.items())
    one_step(trainer)  # and it trains on from there


# ------------------------------------------------------------------------ frozen copies held quantized


class FakeSync:
    """The sync's record of which frozen copies are versions of their chain: here every copy is the version
    before (``on_chain``), or none is."""

    def __init__(self, round_: int, chains: Chains, on_chain: bool = True) -> None:
        self.round, self.chains, self.on_chain, self.landed = round_, chains, on_chain, []

    def copy_version(self, unit):
        return (self.round, "hash") if self.on_chain else None

    def copy_landed(self, unit, download, held, stored):
        self.landed.append((unit, stored))


@pytest.mark.parametrize("refresh", ["changes", "weights"])
def test_a_dense_block_held_quantized_follows_its_formats_chain(refresh):
    s = blocks_settings().override({"train.frozen_dense": "nf4", "sync.frozen_refresh": refresh})
    member = SimpleNamespace(me="me", units_held=["dense/1", "experts/0"])
    every, layout = s.method.refresh_every_rounds, layout_of(s.model)
    with torch.device("meta"):
        model = MoETransformer(s.model.architecture())
    names = {u: read_unit_names(model, layout, u) for u in layout.units}
    chains = Chains(names, quantized_when_frozen(model, layout))
    assert chains.of("dense/2") == ("int8", "nf4")  # (its attention is quantized, its norms are not)
    since = (10 - every, "hash")
    for on_chain in (True, False):
        sync = FakeSync(10 - every, chains, on_chain)
        frozen = FrozenCopies(s, member, sync, layout)
        for experts in (None, {}):  # an ordinary version round, and a merge (which reads experts only)
            job = SimpleNamespace(round=10, experts=experts)
            if refresh == "weights":
                assert frozen._want("dense/2", job) == Want("weights", "nf4")
            elif on_chain:  # the change of its chain, in the refresh codec
                assert frozen._want("dense/2", job) == Want(
                    "change", s.sync.refresh_codec, since, chain="nf4"
                )
            else:  # off it: the chain's version whole, exactly (its norms are float32)
                assert frozen._want("dense/2", job) == Want("version", "none", chain="nf4")
            assert frozen._want("dense/1", job) == Want("weights", "none")  # ours: exact
    sync = FakeSync(10 - every, chains)
    frozen = FrozenCopies(s, member, sync, layout)
    job = SimpleNamespace(round=10, experts=None)
    if refresh == "changes":  # experts stay in full precision: the change since our copy's version
        assert frozen._want("experts/1", job) == Want("change", s.sync.refresh_codec, since)
    frozen.landed("dense/2", Download(10, Want("version", "none")), {"w": torch.zeros(1)})
    assert sync.landed == [("dense/2", "nf4")]  # (an exact version held in nf4 is none: test_versions.py)


class HolderlessSync(FakeSync):
    """A sync whose refreshes find nothing: no co-holder has the version asked for."""

    def __init__(self, chains: Chains) -> None:
        super().__init__(0, chains)
        self.asked: list[Want] = []

    def deadline_seconds(self) -> float:
        return 5.0

    def refresh(self, min_round, holders, seconds, want, on_unit):
        self.asked.append(want)
        return {}


def test_a_chain_joined_from_co_holders_that_lack_its_version_asks_once():
    """A peer that takes a unit over joins a co-holder's version chains; when the exact version does not
    come, the quantized chains would not either, and each would hold the round up for a whole deadline (a
    late-joins simulation under load: three refreshes of 5 s in one round)."""
    s = blocks_settings().override({"train.frozen_dense": "nf4"})
    with torch.device("meta"):
        model = MoETransformer(s.model.architecture())
    layout = layout_of(s.model)
    names = {u: read_unit_names(model, layout, u) for u in layout.units}
    sync = HolderlessSync(Chains(names, quantized_when_frozen(model, layout)))
    assert sync.chains.of("dense/2") == ("int8", "nf4")
    frozen = FrozenCopies(s, SimpleNamespace(me="me", units_held=["dense/2"]), sync, layout)
    frozen._join("dense/2", 8, ["them"])
    assert [w.chain for w in sync.asked] == ["full"]


def read_unit_names(model, layout, unit) -> list[str]:
    return [name for name, _, _ in named_weights(model) if layout.unit_of(name) == unit]


# ----------------------------------------------------------------------------------- simulated swarms

SIM = {"sim.peers": 4, "model.shards": 2, "run.rounds": 6, "swarm.backend": "memory"}
SIM |= {
    "method.steps_per_round": 5,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "data.max_corpus_mb": 1.0,
}


def peer_rows(out) -> dict[str, list[dict]]:
    return {d.name: read_rows(d) for d in sorted((out / "peers").iterdir())}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_dense_blocks_rotate_stay_covered_and_lower_the_loss(tmp_path):
    summary = run(
        simulation(
            {
                "model.dense_blocks": 4,
                "peer.active_blocks": 1,
                "method.rotate_every_rounds": 2,
                "run.out": str(tmp_path),
                **SIM,
            }
        )
    )
    assert not summary["failures"]
    assert summary["rounds_completed"] == 6
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["uncovered_unit_rounds"] == 0
    assert {u for u in summary["units"] if u.startswith("dense/")} == {f"dense/{b}" for b in range(4)}
    for unit, info in summary["units"].items():
        assert info["max_holder_difference"] in (0.0, None), unit
    for name, rows in peer_rows(tmp_path).items():
        blocks = [[u for u in row["units"] if u.startswith("dense/")] for row in rows]
        assert all(len(b) == 1 for b in blocks), name  # one block at a time
        assert len({b[0] for b in blocks}) > 1, f"{name} never rotated"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["nf4"])
def test_quantized_frozen_experts_in_a_simulated_swarm(tmp_path, kind):
    summary = run(simulation({"train.frozen_experts": kind, "run.out": str(tmp_path), **SIM}))
    assert not summary["failures"]
    assert summary["final_loss"] < summary["initial_loss"]
    for unit, info in summary["units"].items():  # holders still agree exactly; frozen copies are lossy
        assert info["max_holder_difference"] in (0.0, None), unit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quantized_frozen_dense_blocks_in_a_simulated_swarm(tmp_path):
    summary = run(
        simulation(
            {
                "model.dense_blocks": 4,
                "peer.active_blocks": 1,
                "method.rotate_every_rounds": 2,
                "train.frozen_dense": "nf4",
                "run.out": str(tmp_path),
                **SIM,
            }
        )
    )
    assert not summary["failures"] and summary["uncovered_unit_rounds"] == 0
    assert summary["final_loss"] < summary["initial_loss"]
    for unit, info in summary["units"].items():  # holders agree exactly, rotation included
        assert info["max_holder_difference"] in (0.0, None), unit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_active_blocks_without_overlap_keep_their_holders_identical(tmp_path):
    """Without overlap a claim takes effect at once: the new holder takes the exact weights, adopts the
    others' result for one round, then counts; every block's two holders stay bit-identical."""
    summary = run(
        simulation(
            {
                "model.dense_blocks": 4,
                "peer.active_blocks": 2,
                "method.rotate_every_rounds": 2,
                "method.overlap": False,
                "run.out": str(tmp_path),
                **SIM,
            }
        )
    )
    assert not summary["failures"] and summary["uncovered_unit_rounds"] == 0
    assert summary["final_loss"] < summary["initial_loss"]
    for unit, info in summary["units"].items():
        assert info["max_holder_difference"] == 0.0, unit
