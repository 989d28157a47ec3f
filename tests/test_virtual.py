"""Virtual compute (``spes simulate --compute virtual[=SECONDS]``): peers sleep instead of training, and their
synthetic updates go through the real sync."""

import statistics
import subprocess
import sys
import threading

import pytest
import torch

from spes_p2p.errors import CheckpointError, ConfigError
from spes_p2p.model.config import STEP_SECONDS
from spes_p2p.model.units import layout_of
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.peer import Peer, local
from spes_p2p.peer.virtual import VirtualTraining, step_seconds
from spes_p2p.sim import run, simulation
from spes_p2p.sim.summary import read_rows
from spes_p2p.train.checkpoint import load_checkpoint
from spes_p2p.train.dataset import prepare_data

pytestmark = pytest.mark.timeout(180)
H = 5  # steps per round
SMALL = {
    "method.steps_per_round": H,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "data.max_corpus_mb": 1.0,
}


@pytest.fixture(scope="module", autouse=True)
def prepared_data(cache_dir):
    """The corpus slice tokenized once, before any swarm's founder needs it within its start-up time."""
    s = simulation(SMALL)
    prepare_data(s.data, s.model.architecture().vocab_size)


@pytest.fixture
def virtual_peers(monkeypatch) -> list[VirtualTraining]:
    """Every VirtualTraining built in the test; building a Trainer fails it."""
    made = []
    built = VirtualTraining.__init__

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        made.append(self)

    def no_trainer(*args, **kwargs):
        raise AssertionError("a peer with virtual compute built a trainer")

    monkeypatch.setattr(VirtualTraining, "__init__", init)
    monkeypatch.setattr(local, "Trainer", no_trainer)
    return made


def rows_of(out) -> dict[str, list[dict]]:
    return {p.name: read_rows(p) for p in sorted((out / "peers").iterdir())}


def test_a_virtual_swarm_syncs_for_real_without_training(tmp_path, virtual_peers):
    rounds = 4
    summary = run(
        simulation(
            {
                "sim.peers": 4,
                "swarm.backend": "memory",
                "sim.compute": "virtual=0.01",
                "run.rounds": rounds,
                "run.out": str(tmp_path),
                "train.eval_every": H,
                **SMALL,
            }
        )
    )
    assert not summary["failures"]
    assert summary["rounds_completed"] == rounds and summary["config"]["compute"] == "virtual=0.01"
    assert summary["initial_loss"] is None and summary["final_loss"] is None and not summary["loss_by_round"]
    for unit, info in summary["units"].items():  # holders end bit-identical
        assert info["max_holder_difference"] in (0.0, None), unit
    assert any(info["max_holder_difference"] == 0.0 for info in summary["units"].values())
    rows = [r for rs in rows_of(tmp_path).values() for r in rs]
    assert len(rows) == 4 * rounds
    assert any(len(p) > 1 for r in rows for p in r["participants"].values())  # updates were exchanged
    for r in rows:
        assert r["compute"] == "virtual" and r["loss"] is None and "val_loss" not in r
        assert r["step"] >= (r["round"] + 1) * H and r["round_tokens"] == H * 4 * 64  # (landed later)
        assert r["bytes_sent"] > 0 and r["memory_bytes"]["gradients"] == r["memory_bytes"]["optimizer"] == 0
    # every step slept, and only those: no round was cut short or trained twice
    assert len(virtual_peers) == 4 and all(v.step_seconds == 0.01 for v in virtual_peers)
    assert sum(v.slept for v in virtual_peers) == 4 * rounds * H


def test_more_holders_of_the_dense_part_than_a_row_holds_end_every_round_identical(tmp_path):
    """Seven peers in rows of at most 3 (3, 2 and 2): the rows merge, so every holder of the dense part ends
    every round on the same weights and counts every other's update; nobody re-synchronizes or refuses.
    (With rows that averaged on their own, the holders parted every round.)"""
    peers, rounds = 7, 3
    summary = run(
        simulation(
            {
                "sim.peers": peers,
                "swarm.backend": "memory",
                "sim.compute": "virtual=0.01",
                "model.dense_blocks": 1,
                "sync.dense_group_size": 3,
                "run.rounds": rounds,
                "run.out": str(tmp_path),
                **SMALL,
            }
        )
    )
    assert not summary["failures"] and summary["rounds_completed"] == rounds
    assert summary["units"]["dense/0"]["max_holder_difference"] == 0.0
    assert summary["rejected_payloads"] == 0
    assert sum(p["resynced_rounds"] for p in summary["peers"]) == 0
    rows = [r for rs in rows_of(tmp_path).values() for r in rs]
    assert all(len(r["participants"]["dense/0"]) == peers for r in rows), "a row left out of the merge"


def test_a_virtual_update_costs_the_bytes_of_a_real_one(tmp_path):
    """Every peer trains every unit (one shard, one dense block), so each round's traffic is the same
    exchange; its bytes depend on the shapes and the codec, not on what the update holds."""

    def round_bytes(compute: str) -> float:
        out = tmp_path / compute
        summary = run(
            simulation(
                {
                    "sim.peers": 3,
                    "swarm.backend": "memory",
                    "sim.compute": compute,
                    "model.shards": 1,
                    "model.dense_blocks": 1,
                    "run.rounds": 3,
                    "run.out": str(out),
                    **SMALL,
                }
            )
        )
        assert not summary["failures"]
        rows = [r for rs in rows_of(out).values() for r in rs]
        assert all(len(p) == 3 for r in rows for p in r["participants"].values())
        return statistics.median(r["bytes_sent"] for r in rows)

    real, virtual = round_bytes("real"), round_bytes("virtual=0")
    assert real > 500_000
    assert abs(virtual - real) <= 1e-3 * real  # (metadata in a payload's header may differ by a few bytes)


def test_a_virtual_peer_checkpoints_and_resumes(tmp_path, virtual_peers):
    s = simulation(
        {
            "swarm.backend": "memory",
            "sim.compute": "virtual=0",
            "train.checkpoint_every": H,
            "model.shards": 2,
            "model.dense_blocks": 1,
            "run.out": str(tmp_path),
            **SMALL,
        }
    )
    net, stop = MemoryNetwork(seed=0), threading.Event()
    peer = Peer(s, net.join("p0"), out_dir=tmp_path)
    peer.join()
    peer.run(stop, rounds=2)
    peer.close()
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.meta["compute"] == "virtual" and checkpoint.meta["round"] == 2
    assert checkpoint.optimizer == {}

    again = Peer(s, MemoryNetwork(seed=0).join("p0"), out_dir=tmp_path)
    again.join(resume=True)
    assert again.round == 2 and again.local.tokens == 2 * H * 4 * 64
    for unit in layout_of(s.model).units:
        before, after = peer.local.read(unit), again.local.read(unit)
        assert all(torch.equal(before[n], after[n]) for n in before), unit
    again.run(stop, rounds=3)
    again.close()
    assert [r["round"] for r in read_rows(tmp_path)] == [0, 1, 2]

    real = local.LocalTraining(
        s.override({"sim.compute": "real"}), layout_of(s.model), 0, "p0", peer.local.data
    )
    with pytest.raises(CheckpointError, match="virtual compute"):
        real.start(["experts/0"], 2, checkpoint)


def test_a_stopped_peer_lands_its_last_sync_without_catching_up_or_claiming(monkeypatch):
    """Asked to stop (SIGTERM), a peer lands the sync in flight and leaves: it does not read the swarm to
    catch up or to re-run its claims first (a DHT read each, seconds on a slow DHT; a download of the whole
    model if it found itself behind)."""
    s = simulation({"swarm.backend": "memory", "sim.compute": "virtual=0", "model.dense_blocks": 1, **SMALL})
    peer = Peer(s, MemoryNetwork(seed=0).join("p0"))
    peer.join()
    stop, after_stop = threading.Event(), []

    def stop_after_the_first_round(status) -> None:
        stop.set()
        monkeypatch.setattr(peer, "_catch_up_if_behind", lambda: after_stop.append("catch up"))
        monkeypatch.setattr(peer.member, "rebalance", lambda **kw: after_stop.append("rebalance"))

    peer.run(stop, on_update=stop_after_the_first_round)
    assert peer.round == 1 and peer.status().last["round"] == 0  # the first round landed, row and all
    assert after_stop == []
    peer.close()


def test_the_step_time_is_given_or_the_presets_measured_one():
    assert step_seconds(simulation({"sim.compute": "virtual=0.25"})) == 0.25
    tokens = 4 * 64
    s = simulation({"sim.compute": "virtual", "train.batch_size": 4, "train.seq_len": 64})
    assert step_seconds(s) == pytest.approx(STEP_SECONDS["tiny"] * tokens / (8 * 128))
    unmeasured = next(p for p in ("1b", "2b", "7b") if p not in STEP_SECONDS)
    with pytest.raises(ConfigError, match="virtual=SECONDS"):
        simulation({"sim.compute": "virtual", "model.preset": unmeasured})
    simulation({"sim.compute": "virtual=30", "model.preset": unmeasured})  # a given step time needs no figure
    with pytest.raises(ConfigError, match="virtual=SECONDS"):
        simulation({"sim.compute": "virtual=fast"})


LONE_PEER = """
import sys, threading
from spes_p2p.peer import Peer
from spes_p2p.sim import simulation
from spes_p2p.net.memory import MemoryNetwork

own = {"sim.compute": "virtual=0", "model.dense_blocks": 1, "run.out": sys.argv[1]}
s = simulation({**own, **eval(sys.argv[2])})
peer = Peer(s, MemoryNetwork(seed=0).join("p0"), out_dir=sys.argv[1])
peer.join()
peer.run(threading.Event(), rounds=2)
peer.close()
print(sorted(m for m in ("bitsandbytes", "torch._dynamo", "sympy") if m in sys.modules))
"""


def test_a_virtual_peer_does_not_import_what_only_training_needs(tmp_path):
    """bitsandbytes (the 8-bit optimizer) brings torch's compiler stack: over 100 MB a process."""
    args = [sys.executable, "-c", LONE_PEER, str(tmp_path), repr(SMALL)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "[]"


@pytest.mark.slow
def test_a_virtual_swarm_of_peer_processes(tmp_path):
    """The hivemind backend: each peer its own process, lighter than a training one (docs/simulate.md)."""
    summary = run(
        simulation(
            {
                "sim.peers": 3,
                "sim.compute": "virtual=0.02",
                "run.rounds": 3,
                "run.out": str(tmp_path),
                **SMALL,
            }
        )
    )
    assert not summary["failures"] and summary["rounds_completed"] == 3
    for unit, info in summary["units"].items():
        assert info["max_holder_difference"] in (0.0, None), unit
    rows = [r for rs in rows_of(tmp_path).values() for r in rs]
    assert len(rows) == 9 and all(r["compute"] == "virtual" and r["loss"] is None for r in rows)
    assert any(len(p) > 1 for r in rows for p in r["participants"].values())
    assert max(r["rss_bytes"] for r in rows) < 400 * 2**20  # a training peer of tiny holds about 500 MB
