"""The DiLoCo baseline in the same code (``mode = diloco``), and the per-round timing figures the benchmarks
read (time blocked on the sync, DHT latency)."""

import pytest

from spes_p2p.errors import ConfigError
from spes_p2p.model import MoETransformer, get_preset
from spes_p2p.settings import Settings
from spes_p2p.sim import run, simulation
from spes_p2p.sim.summary import read_rows

pytestmark = pytest.mark.timeout(300)
SLOW = pytest.mark.slow  # trains a swarm
SIM = {"sim.peers": 3, "model.shards": 2, "run.rounds": 4, "swarm.backend": "memory"}
SIM |= {
    "method.steps_per_round": 5,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "data.max_corpus_mb": 1.0,
}


def rows_of(out) -> dict[str, list[dict]]:
    return {d.name: read_rows(d) for d in sorted((out / "peers").iterdir())}


@SLOW
def test_diloco_averages_the_full_model_across_every_peer(tmp_path):
    summary = run(
        simulation({"method.mode": "diloco", "sync.codec": "none", "run.out": str(tmp_path), **SIM})
    )
    assert not summary["failures"] and summary["rounds_completed"] == 4
    assert summary["final_loss"] < summary["initial_loss"]
    names = {p["name"] for p in summary["peers"]}
    for unit, info in summary["units"].items():  # every peer trains every unit, and they all agree
        assert set(info["holders"]["3"]) == names, unit
        assert info["max_holder_difference"] == 0.0, unit
    model_bytes = 4 * MoETransformer(get_preset("tiny")).num_params()
    for name, rows in rows_of(tmp_path).items():
        last = rows[-1]
        assert set(last["units"]) == set(summary["units"])
        # a reduce-scatter of the whole model in fp32 among 3: 2 pieces of a third in, then 2 combined
        # thirds in; and nothing to refresh
        assert last["bytes_received"] == pytest.approx(4 / 3 * model_bytes, rel=0.02), name
        assert last["refreshed"] == {}
        assert last["sync_wait_seconds"] >= 0 and last["dht_ms"] >= 0


@SLOW
def test_sync_wait_is_the_blocked_time(tmp_path):
    """Without overlap the training loop waits for the whole sync; with it, for what is left of it."""
    sim = SIM | {"run.rounds": 2}  # (each round's timings are checked: two rounds are enough)
    run(simulation({"run.out": str(tmp_path / "plain"), "method.overlap": False, **sim}))
    for rows in rows_of(tmp_path / "plain").values():
        for r in rows:
            assert r["sync_wait_seconds"] == pytest.approx(r["sync_seconds"], abs=0.05)
    run(simulation({"run.out": str(tmp_path / "overlap"), **sim}))
    for rows in rows_of(tmp_path / "overlap").values():
        for r in rows:
            assert 0 <= r["sync_wait_seconds"] <= r["sync_seconds"]


def test_diloco_refuses_dense_blocks():
    with pytest.raises(ConfigError, match=r"model\.dense_blocks must be 1 with"):
        Settings().override({"method.mode": "diloco", "model.dense_blocks": 2})
