"""What a running peer holds: counting by kind, and an outbox that keeps payloads only."""

from types import SimpleNamespace

import pytest
import torch

from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.transport import Unavailable
from spes_p2p.peer.footprint import KINDS, Footprint, count
from spes_p2p.settings import Settings
from spes_p2p.sim.running_memory import report
from spes_p2p.sync.codecs import CODECS, Codecs
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.messages import UpdateRequest, WeightsRequest
from spes_p2p.sync.payload import decode, specs_of
from spes_p2p.sync.serving import Outbox, Posted
from spes_p2p.sync.versions import Chains, Versions

UNIT = "experts/0"


def test_a_storage_named_twice_counts_once_for_the_first_kind():
    a, b = torch.zeros(100), torch.zeros(10, dtype=torch.float64)
    held = {
        "weights": [a],
        "snapshots": [{"x": a[:50], "y": b}],  # a view of a counts nothing more
        "served": [[b"x" * 7, b]],
    }
    by_kind = count(held)
    assert set(by_kind) == set(KINDS)
    assert by_kind["weights"] == 400 and by_kind["snapshots"] == 80 and by_kind["served"] == 7
    assert sum(by_kind.values()) == 487


def test_footprint_keeps_the_round_peak_and_starts_again():
    held = {"weights": [torch.zeros(10)]}
    footprint = Footprint(SimpleNamespace(held=lambda: {}), [SimpleNamespace(held=lambda: held)])
    held["snapshots"] = [torch.zeros(100)]
    footprint.sample()
    held.pop("snapshots")
    row = footprint.take()  # (samples once more itself: the smaller figure does not replace the peak)
    assert row["memory_peak_bytes"] == 440 and row["memory_bytes"]["snapshots"] == 400
    assert row["rss_bytes"] > 0
    assert footprint.take()["memory_peak_bytes"] == 40


def test_the_outbox_keeps_payloads_not_tensors():
    net = MemoryNetwork(seed=0)
    transport = net.join("holder")
    weights = {"w1": torch.randn(64, 32), "w2": torch.randn(32)}
    specs = {UNIT: specs_of(weights)}
    codecs = Codecs.of(SyncConfig())
    outbox = Outbox(transport, specs, codecs, Versions(codecs["int8"], Chains.experts_only(specs)))
    outbox.serve_weights(3, UNIT, weights)
    outbox.post_update(3, UNIT, Posted(b"update", b"end", 100, "base"))
    held = outbox.held()

    def leaves(obj):
        return [x for v in obj for x in leaves(v)] if isinstance(obj, list) else [obj]

    assert all(isinstance(x, bytes) for x in leaves(held))
    exact = outbox.rpc_weights("asker", WeightsRequest(unit=UNIT, round=3, codec="none").encode())
    assert exact in leaves(held)  # served as kept: no copy per request
    got = decode(exact, specs[UNIT], CODECS["none"], meta={"unit": UNIT, "round": "3", "kind": "weights"})
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    coded = outbox.rpc_weights("asker", WeightsRequest(unit=UNIT, round=3, codec="int8").encode())
    got = decode(coded, specs[UNIT], CODECS["int8"], meta={"unit": UNIT, "round": "3", "kind": "weights"})
    assert all((got[n] - weights[n]).abs().max() <= 0.02 * weights[n].abs().max() for n in weights)
    assert outbox.rpc_update("asker", UpdateRequest(unit=UNIT, round=3, kind="end").encode()) == b"end"
    outbox.forget_before(3 + 2)  # end weights go first
    with pytest.raises(Unavailable):
        outbox.rpc_update("asker", UpdateRequest(unit=UNIT, round=3, kind="end").encode())
    assert outbox.rpc_update("asker", UpdateRequest(unit=UNIT, round=3).encode()) == b"update"
    outbox.forget_before(3 + 3)
    assert leaves(outbox.held()) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_peers_measured_while_they_train_hold_what_they_train_and_less_than_diloco_peers(cache_dir):
    s = Settings().override(
        {
            "model.preset": "tiny",
            "model.shards": 2,
            "model.dense_blocks": 1,
            "data.max_corpus_mb": 1.0,
            "train.batch_size": 4,
            "train.seq_len": 64,
        }
    )
    result = report(s, running=True)
    running, trained = result["running"], 4 * result["trainable_params"]
    held = running["memory_bytes"]
    assert running["peers"] == 4 and running["rounds"] == 5
    assert held["weights"] == trained  # dense/0 and one shard, measured in the running peer
    assert held["frozen"] == result["weights_bytes"] - trained  # the other shard, in int8
    assert 0 < held["gradients"] <= trained and held["optimizer"] > 0 and held["served"] > 0
    assert running["peak_bytes"] == sum(held.values())
    diloco = running["diloco"]["memory_bytes"]
    assert diloco["weights"] == 4 * result["total_params"] and diloco["frozen"] == diloco["versions"] == 0
    assert diloco["outer"] >= 2 * diloco["weights"]  # error feedback and Nesterov momentum
    assert running["ratio_vs_diloco"] == running["peak_bytes"] / running["diloco"]["peak_bytes"] < 1
