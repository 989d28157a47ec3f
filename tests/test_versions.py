"""Frozen copies by version changes: a copy that follows the changes stays bit-identical to the holders'
version and within one change's rounding of their weights over 60 rounds; a copy off the chain is
replaced by the exact version; merges give holders the same weights whatever they store frozen experts as."""

import msgspec
import pytest
import torch

from spes_p2p.model.quant import QuantizedTensor
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.wire import BadRequest
from spes_p2p.sim import run, simulation
from spes_p2p.sim.fleets import MemoryFleet
from spes_p2p.sim.summary import read_rows
from spes_p2p.sync.codecs import TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.messages import WeightsRequest
from spes_p2p.sync.payload import metadata_of, tensors_hash
from spes_p2p.sync.versions import Want, is_version_round

UNIT = "experts/0"
SWARM = {  # a small swarm of 4 peers in one process, 2 shards, rounds of 5 steps
    "sim.peers": 4,
    "swarm.backend": "memory",
    "model.shards": 2,
    "method.steps_per_round": 5,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "data.max_corpus_mb": 1.0,
}
SPECS = {UNIT: {"w1": TensorSpec((64, 128))}}


def pair(codec="int8"):
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(refresh_codec=codec, deadline_min=0.2, deadline_max=2.0, request_timeout=1.0)
    return SyncEngine(net.join("holder"), "t", cfg, SPECS), SyncEngine(net.join("peer"), "t", cfg, SPECS)


def refresh(peer: SyncEngine, round_: int, want: Want, unit: str = UNIT):
    got = []
    peer.refresh(round_, {unit: ["holder"]}, 2.0, want=want, on_unit=lambda _, fetched: got.append(fetched))
    assert got, f"round {round_}: nothing came"
    return got[0]


@pytest.mark.parametrize(("codec", "every"), [("int8", 1), ("nf4", 1), ("int8", 3)])
def test_a_copy_that_follows_the_changes_never_drifts(codec, every):
    holder, peer = pair(codec)
    g = torch.Generator().manual_seed(0)
    weights = {"w1": torch.randn(64, 128, generator=g)}
    drift = torch.randn(64, 128, generator=g) * 1e-3  # a steady direction, as training has
    holder.start_version(UNIT, -1, weights)
    copy = dict(weights)
    peer.start_versions(-1, lambda _: copy, held=[], versioned=lambda _: True)  # our copy: version -1
    errors, kinds = [], []
    for round_ in range(60):
        weights = {"w1": weights["w1"] + drift + torch.randn(64, 128, generator=g) * 1e-4}
        if not is_version_round(round_, every):
            continue
        version = holder.advance_version(UNIT, round_, round_ - every, weights)
        fetched = refresh(peer, round_, Want("change", codec, peer.copy_version(UNIT)))
        kinds.append(fetched.want.kind)
        copy = fetched.onto(lambda: copy)  # noqa: B023
        peer.copy_landed(UNIT, fetched, copy, "full")
        assert tensors_hash(copy) == version.hash, round_  # the copy is the holders' version, bit for bit
        errors.append(float((copy["w1"] - weights["w1"]).abs().max()))
    assert set(kinds) == {"change"}  # no exact copy was ever needed
    assert max(errors[-5:]) < 3 * max(errors[:5])  # bounded: one change's rounding, however many rounds


def test_a_copy_that_follows_sparse_changes_in_sparseloco_never_drifts():
    """Under the sparse codec a unit's weights change in a few entries a chunk each round (the mean of its
    holders' sparse updates): the changes in ``sparseloco`` carry them, and the copy stays within one
    change's rounding of the holders' weights."""
    holder, peer = pair("sparseloco")
    g = torch.Generator().manual_seed(0)
    weights = {"w1": torch.randn(64, 128, generator=g)}
    holder.start_version(UNIT, -1, weights)
    copy = dict(weights)
    peer.start_versions(-1, lambda _: copy, held=[], versioned=lambda _: True)
    errors = []
    for round_ in range(40):
        step = torch.zeros(64 * 128)
        step[torch.randperm(64 * 128, generator=g)[:100]] = torch.randn(100, generator=g) * 1e-3
        weights = {"w1": weights["w1"] + step.view(64, 128)}
        version = holder.advance_version(UNIT, round_, round_ - 1, weights)
        fetched = refresh(peer, round_, Want("change", "sparseloco", peer.copy_version(UNIT)))
        assert fetched.want.kind == "change"
        copy = fetched.onto(lambda: copy)  # noqa: B023
        peer.copy_landed(UNIT, fetched, copy, "full")
        assert tensors_hash(copy) == version.hash, round_  # the copy is the holders' version, bit for bit
        errors.append(float((copy["w1"] - weights["w1"]).abs().max()))
    assert max(errors[-5:]) < 3 * max(errors[:5])  # bounded: one change's rounding, however many rounds


@pytest.mark.parametrize(
    ("stored", "codec"), [("int8", "sparseloco"), ("nf4", "sparseloco"), ("int8", "int8")]
)
def test_a_quantized_copy_follows_its_chain_bit_for_bit_and_stays_within_a_rounding(stored, codec):
    """A keeper that holds the expert in ``stored`` adds each change of its format's chain and quantizes, as
    its model does on writing a copy: it holds the chain's version bit for bit, stays as close to the
    holders' weights as the version quantized whole would be (within 2x of its rounding), and receives a
    sparse change where a whole version would cost the format's bytes."""
    holder, peer = pair(codec)
    g = torch.Generator().manual_seed(0)
    weights = {"w1": torch.randn(64, 128, generator=g) * 0.02}
    holder.start_version(UNIT, -1, weights)
    copy = QuantizedTensor.quantize(weights["w1"], stored)  # the model's frozen copy
    peer.start_versions(-1, lambda _: {"w1": copy.dequantize()}, held=[], versioned=lambda _: True)
    ours, whole, sizes = [], [], []
    for round_ in range(30):
        step = torch.zeros(64 * 128)
        step[torch.randperm(64 * 128, generator=g)[:200]] = torch.randn(200, generator=g) * 1e-3
        weights = {"w1": weights["w1"] + step.view(64, 128)}
        version = holder.advance_version(UNIT, round_, round_ - 1, weights)
        fetched = refresh(peer, round_, Want("change", codec, peer.copy_version(UNIT), chain=stored))
        assert fetched.want.kind == "change", round_
        sizes.append(len(fetched.payload))
        copy = QuantizedTensor.quantize(fetched.onto(lambda: {"w1": copy.dequantize()})["w1"], stored)  # noqa: B023
        held = {"w1": copy.dequantize()}
        peer.copy_landed(UNIT, fetched, held, stored)
        assert tensors_hash(held) == version.chains[stored].hash, round_  # the chain's version, exactly
        ours.append(float((held["w1"] - version.weights["w1"]).norm()))
        rounded = QuantizedTensor.quantize(version.weights["w1"], stored).dequantize()
        whole.append(float((rounded - version.weights["w1"]).norm()))
    assert max(ours[-10:]) < 2 * max(whole[-10:]), (ours[-10:], whole[-10:])
    if codec == "sparseloco":
        assert max(sizes) < 0.5 * len(holder.version(UNIT).chains[stored].payload)


def test_a_dense_block_held_quantized_follows_its_chain_with_its_norms_in_float32():
    """A keeper of a dense block quantizes its large weights and keeps its norms float32: the chain does the
    same, so the keeper holds its version bit for bit; off it, the version comes whole, exactly."""
    unit, specs = "dense/1", {"w": TensorSpec((64, 128)), "norm": TensorSpec((64,))}
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(refresh_codec="sparseloco", deadline_min=0.2, deadline_max=2.0, request_timeout=1.0)
    holder, peer = (
        SyncEngine(net.join(p), "t", cfg, {unit: specs}, quantized={unit: frozenset({"w"})})
        for p in ("holder", "peer")
    )
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(64, 128, generator=g) * 0.02, "norm": torch.ones(64)}
    holder.start_version(unit, -1, weights)

    def keep(tensors):  # as the keeper's model holds the block
        return {
            "w": QuantizedTensor.quantize(tensors["w"], "int8").dequantize(),
            "norm": tensors["norm"].clone(),
        }

    copy = keep(weights)
    peer.start_versions(-1, lambda _: copy, held=[], versioned=lambda _: True)
    for round_ in range(5):
        weights = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
        version = holder.advance_version(unit, round_, round_ - 1, weights)
        fetched = refresh(
            peer, round_, Want("change", "sparseloco", peer.copy_version(unit), chain="int8"), unit
        )
        assert fetched.want.kind == "change", round_
        copy = keep(fetched.onto(lambda: copy))  # noqa: B023
        peer.copy_landed(unit, fetched, copy, "int8")
        assert tensors_hash(copy) == version.chains["int8"].hash, round_
    assert peer.chains.whole(unit, "int8") == Want("version", "none", chain="int8")
    got = []
    peer.refresh(
        4,
        {unit: ["holder"]},
        2.0,
        want=Want("version", "none", chain="int8"),
        on_unit=lambda _, f: got.append(f),
    )
    assert tensors_hash(got[0].tensors) == version.chains["int8"].hash


def test_a_quantized_copy_off_its_chain_gets_the_chains_version_whole():
    holder, peer = pair("sparseloco")
    weights = {"w1": torch.randn(64, 128)}
    holder.start_version(UNIT, 4, weights)
    holder.advance_version(UNIT, 5, 4, {"w1": weights["w1"] + 0.01})
    fetched = refresh(peer, 5, Want("change", "sparseloco", (4, "0" * 16), chain="int8"))
    assert fetched.want == Want("version", "int8", chain="int8")
    held = {"w1": QuantizedTensor.quantize(fetched.tensors["w1"], "int8").dequantize()}
    peer.copy_landed(UNIT, fetched, held, "int8")
    assert peer.copy_version(UNIT) == (5, holder.version(UNIT).chains["int8"].hash)
    exact = refresh(peer, 5, Want("version", "none"))  # (a merge's): held in int8, it is no version
    peer.copy_landed(UNIT, exact, held, "int8")
    assert peer.copy_version(UNIT) is None


def test_a_holder_joining_a_chain_with_a_co_holders_quantized_chains_publishes_the_same_changes():
    first, second = pair("sparseloco")
    weights = {"w1": torch.randn(64, 128)}
    first.start_version(UNIT, -1, weights)
    for round_ in range(3):
        first.advance_version(UNIT, round_, round_ - 1, {"w1": weights["w1"] + 0.01 * (round_ + 1)})
    version = first.version(UNIT)  # the second holder takes the unit over from here
    second.start_version(UNIT, 2, version.weights, {c: version.held(c) for c in version.chains})
    new = {"w1": weights["w1"] + 0.05}
    for engine in (first, second):
        engine.advance_version(UNIT, 3, 2, new)
    for chain in ("full", "int8", "nf4"):
        changes = [engine._versions.change(UNIT, 3, chain) for engine in (first, second)]
        assert metadata_of(changes[0]) == metadata_of(changes[1]), chain  # (its buffers' SHA-256 included)


@pytest.mark.parametrize(("kind", "codec"), [("weights", "int8"), ("version", "nf4")])
def test_a_request_for_a_quantized_chain_other_than_its_versions_and_changes_is_malformed(kind, codec):
    request = {"unit": UNIT, "codec": codec, "kind": kind, "chain": "int8"}
    with pytest.raises(BadRequest):
        WeightsRequest.decode(msgspec.msgpack.encode(request))


def test_the_changes_carry_what_the_codec_dropped():
    """Coding each round's difference alone accumulates the codec's rounding; the version chain does not."""
    holder, peer = pair("nf4")
    g = torch.Generator().manual_seed(1)
    weights = {"w1": torch.randn(64, 128, generator=g)}
    drift = torch.randn(64, 128, generator=g) * 1e-3
    holder.start_version(UNIT, -1, weights)
    peer.start_versions(-1, lambda _: weights, held=[], versioned=lambda _: True)
    copy = naive = weights["w1"].clone()
    for round_ in range(60):
        new = {"w1": weights["w1"] + drift}
        holder.advance_version(UNIT, round_, round_ - 1, new)
        fetched = refresh(peer, round_, Want("change", "nf4", peer.copy_version(UNIT)))
        copy = copy + fetched.tensors["w1"]
        peer.copy_landed(UNIT, fetched, {"w1": copy}, "full")
        other, _ = pair("nf4")
        other.start_version(UNIT, 0, weights)  # a chain restarted every round: no memory of what dropped
        naive = naive + (other.advance_version(UNIT, 1, 0, new).weights["w1"] - weights["w1"])
        weights = new
    chained, alone = (copy - weights["w1"]).abs().max(), (naive - weights["w1"]).abs().max()
    assert chained < 0.1 * alone, (chained, alone)


def test_a_copy_off_the_holders_chain_gets_the_exact_version():
    holder, peer = pair()
    weights = {"w1": torch.randn(64, 128)}
    holder.start_version(UNIT, 4, {"w1": weights["w1"] + 1})  # the holder's chain is not ours
    holder.advance_version(UNIT, 5, 4, weights)
    fetched = refresh(peer, 5, Want("change", "int8", (4, tensors_hash(weights))))
    assert fetched.want == Want("version", "none")
    assert tensors_hash(fetched.tensors) == holder.version(UNIT).hash


def test_a_holder_without_the_version_before_serves_its_weights_as_the_next_version():
    holder, peer = pair()
    weights = {"w1": torch.randn(64, 128)}
    version = holder.advance_version(UNIT, 3, 2, weights)  # it never had version 2
    assert torch.equal(version.weights["w1"], weights["w1"]) and holder._versions.change(UNIT, 3) is None
    fetched = refresh(peer, 3, Want("change", "int8", (2, "0" * 16)))
    assert fetched.want.kind == "version" and torch.equal(fetched.tensors["w1"], weights["w1"])


def test_a_version_of_a_round_far_ahead_is_refused_and_the_next_holder_asked():
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(refresh_codec="int8", deadline_min=0.2, deadline_max=2.0, request_timeout=1.0)
    liar, honest, peer = (SyncEngine(net.join(p), "t", cfg, SPECS) for p in ("liar", "honest", "peer"))
    weights = {"w1": torch.randn(64, 128)}
    liar.advance_version(UNIT, 10**9, 10**9 - 1, weights)
    honest.advance_version(UNIT, 3, 2, weights)
    got = []
    peer.refresh(
        3, {UNIT: ["liar", "honest"]}, 2.0, want=Want("version", "none"), on_unit=lambda _, f: got.append(f)
    )
    assert [f.round for f in got] == [3] and peer.transport.guard.rejections["liar"] == 1


def engines(*names: str) -> list[SyncEngine]:
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(refresh_codec="int8", deadline_min=0.2, deadline_max=2.0, request_timeout=1.0)
    return [SyncEngine(net.join(p), "t", cfg, SPECS) for p in names]


def fetch_version(peer: SyncEngine, round_: int, holders: list[str]) -> list:
    got = []
    peer.refresh(
        round_, {UNIT: holders}, 2.0, want=Want("version", "none"), on_unit=lambda _, f: got.append(f)
    )
    return got


def test_weights_two_other_holders_agree_against_are_refused_and_an_honest_holders_kept():
    liar, a, b, peer = engines("liar", "a", "b", "peer")
    weights = {"w1": torch.randn(64, 128)}
    liar.advance_version(UNIT, 8, 7, {"w1": weights["w1"] + 0.01})  # of the round asked, and small: only
    for holder in (a, b):  # the other holders can tell
        holder.advance_version(UNIT, 8, 7, weights)
    got = fetch_version(peer, 8, ["liar", "a", "b"])  # (of round 8: "peer" asks the liar first)
    assert len(got) == 1 and torch.equal(got[0].tensors["w1"], weights["w1"])
    assert peer.transport.guard.rejections["liar"] == 1
    # of two holders that disagree, nobody can tell which is right: what came is kept
    liar, honest, peer = engines("liar", "honest", "peer")
    liar.advance_version(UNIT, 8, 7, {"w1": weights["w1"] + 0.01})
    honest.advance_version(UNIT, 8, 7, weights)
    got = fetch_version(peer, 8, ["liar", "honest"])  # (the liar asked first again)
    assert torch.equal(got[0].tensors["w1"], weights["w1"] + 0.01) and not peer.transport.guard.rejections


def test_a_holder_that_claims_a_unit_it_does_not_serve_is_failing_after_three_asks():
    fake, honest, late, peer = engines("fake", "honest", "late", "peer")
    weights = {"w1": torch.randn(64, 128)}
    for round_ in range(1, 7):  # (holders are asked to confirm in turn: the fake one every other round)
        assert "late" not in peer.failing().get(UNIT, ())
        honest.advance_version(UNIT, round_, round_ - 1, weights)
        if round_ > 1:  # a holder one round behind says so, and is not failing
            late.advance_version(UNIT, round_ - 1, round_ - 2, weights)
        assert fetch_version(peer, round_, ["honest", "fake", "late"])
    assert peer.failing() == {UNIT: {"fake"}}
    fake.advance_version(UNIT, 4, 3, weights)  # once it serves (or confirms), it counts again
    honest.advance_version(UNIT, 4, 3, weights)
    assert fetch_version(peer, 4, ["fake"]) and peer.failing() == {}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_holders_that_store_frozen_experts_differently_merge_alike(tmp_path, monkeypatch):
    """4 peers, 2 shards, a merge every round with a large alpha: the two holders of each shard keep their
    frozen experts as full, int8, nf4 and full, and still end bit-identical."""
    stored = ["full", "int8", "nf4", "full"]
    peer_settings = MemoryFleet.peer_settings

    def mixed(self, index, join_round, changes=None):
        own = {"train.frozen_experts": stored[index], **(changes or {})}
        return peer_settings(self, index, join_round, own)

    monkeypatch.setattr(MemoryFleet, "peer_settings", mixed)
    summary = run(
        simulation(
            {
                "run.out": str(tmp_path),
                "run.rounds": 5,
                "merge.interval": 5,
                "merge.alpha": 0.5,
                "merge.horizon": 1000,
                **SWARM,
            }
        )
    )
    assert not summary["failures"]
    for unit in ("experts/0", "experts/1"):
        info = summary["units"][unit]
        assert len(info["holders"]["4"]) == 2 and info["max_holder_difference"] == 0.0, (unit, info)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dense_block_changing_hands_keeps_its_version_chain(tmp_path):
    """4 dense blocks, each trained by one peer, rotating every 2 rounds: the block's next holder continues
    its version chain, so the others keep receiving changes. Only a block a peer just gave up (its copy is
    its own trained weights, no version) comes as the exact version, and, on a busy machine, a block whose
    last change this peer's copy missed, or its new holder's copy did (so its chain starts anew)."""
    run(
        simulation(
            {
                "run.out": str(tmp_path),
                "run.rounds": 6,
                "model.dense_blocks": 4,
                "peer.active_blocks": 1,
                "method.rotate_every_rounds": 2,
                "train.frozen_dense": "full",
                **SWARM,
            }
        )
    )
    rows = {
        f.name: {r["round"]: r for r in read_rows(f) if "refreshed" in r}
        for f in (tmp_path / "peers").iterdir()
    }

    def missed(name: str, round_: int, unit: str) -> bool:
        """Whether ``name`` had neither held nor refreshed ``unit`` in ``round_``."""
        row = rows[name].get(round_)
        return row is None or (unit not in row["units"] and unit not in row["refreshed"])

    for name, by_round in sorted(rows.items()):
        for r, row in sorted(by_round.items()):
            before = by_round.get(r - 1)
            if before is None:
                continue
            for unit, kind in row["refreshed"].items():
                if not unit.startswith("dense/") or unit in before["units"] or unit in row["units"]:
                    continue  # (a copy of its own: it held the unit, or holds it)
                new_holders = [p for p in rows if unit in rows[p].get(r, {}).get("units", ()) and p != name]
                broken = missed(name, r - 1, unit) or any(missed(p, r - 1, unit) for p in new_holders)
                assert kind in ("change", "weights") or broken, (name, r, unit, kind)


@pytest.mark.timeout(300)
def test_peers_holding_frozen_copies_in_int8_receive_sparse_changes(tmp_path):
    """The default peer keeps the experts and the dense block it does not train in int8: under
    ``sparseloco`` the experts come as changes of the int8 chain from the first round on (never whole), the
    dense block too until it rotates (then the block a peer gave up comes whole: its copy was its own
    weights), and their holders end bit-identical."""
    summary = run(
        simulation(
            {
                "run.out": str(tmp_path),
                "run.rounds": 3,
                "sync.codec": "sparseloco",
                "sync.refresh_codec": "sparseloco",
                **SWARM,
            }
        )
    )
    assert not summary["failures"]
    for unit in ("experts/0", "experts/1"):
        assert summary["units"][unit]["max_holder_difference"] == 0.0
    for folder in sorted((tmp_path / "peers").iterdir()):
        kinds = [
            kind
            for row in read_rows(folder)
            for unit, kind in row.get("refreshed", {}).items()
            if unit.startswith("experts/")
        ]
        assert kinds == ["change"] * 3, (folder.name, kinds)
        first = read_rows(folder)[0]["refreshed"]
        assert [kind for unit, kind in first.items() if unit.startswith("dense/")] == ["change"], first
