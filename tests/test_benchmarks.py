"""The benchmark script's own accounting (the runs themselves are too long for CI: see docs/benchmarks.md)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from spes_p2p.model import MoETransformer, get_preset
from spes_p2p.model.config import ModelSettings
from spes_p2p.model.units import layout_of

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "run.py"
sys.path.insert(0, str(SCRIPT.parent))  # (as running the script does: its own folder first)
SPEC = importlib.util.spec_from_file_location("bench_run", SCRIPT)
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


@pytest.mark.timeout(120)
def test_memory_accounting_of_diloco_and_spes_peers():
    params = MoETransformer(get_preset("tiny")).num_params()
    diloco, spes = bench.memory_child("tiny", "diloco"), bench.memory_child("tiny", "spes")
    assert diloco["trainable_params"] == params
    assert diloco["outer_bytes"] == 2 * 4 * params  # start weights and Nesterov momentum, fp32
    # the start weights of what it trains, and the last version of its expert shard (others' frozen copies)
    layout = layout_of(ModelSettings(preset="tiny", shards=4))
    named = MoETransformer(get_preset("tiny")).named_parameters()
    shard = sum(p.numel() for n, p in named if layout.unit_of(n) == "experts/0")
    assert spes["outer_bytes"] == 4 * spes["trainable_params"] + 4 * shard < 4 * params
    parts = ("weights_bytes", "grads_bytes", "optimizer_bytes", "outer_bytes")
    assert spes["total_bytes"] == sum(spes[k] for k in parts)
    assert spes["total_bytes"] < diloco["total_bytes"]


def test_a_section_that_cannot_run_or_fails_costs_only_itself_and_each_result_is_saved_at_once(tmp_path):
    saved = []

    def broken():
        raise RuntimeError("the swarm fell over")

    sections = {
        "scale": lambda: [],
        "wan": lambda: pytest.fail("a skipped section must not run"),
        "loss": broken,
        "backends": lambda: {},  # (an empty result: no table)
    }
    lacks = {"wan": "--netns needs the 'nft' command: install nftables"}.get
    results = {"loss": "from an earlier run"}
    ok = bench.run_sections(sections, results, lambda r: saved.append(json.loads(json.dumps(r))), lacks)
    assert not ok
    # saved after each section; an earlier run's result stays until its section runs again
    after_each = [set(s) & set(sections) for s in saved]
    assert after_each == [{"scale", "loss"}, {"scale", "loss"}, {"scale"}, {"scale", "backends"}]
    assert results["backends"] == {} and "loss" not in results and "wan" not in results
    assert results["skipped"] == {"wan": "--netns needs the 'nft' command: install nftables"}
    assert results["failed"] == {"loss": "RuntimeError: the swarm fell over"}
    bench.save(results, tmp_path)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["skipped"] == results["skipped"] and on_disk["backends"] == {}
    table = (tmp_path / "tables.md").read_text()
    assert "| wan | --netns needs the 'nft' command" in table and "| loss | failed: RuntimeError" in table


def test_the_wan_section_names_what_the_machine_lacks(monkeypatch):
    import spes_p2p.sim.netns as netns

    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    assert "install nftables" in bench.missing("wan")
    assert bench.missing("memory") is None


def test_training_flops_count_what_each_method_trains_and_equal_compute_reads_the_curves():
    from spes_p2p.settings import Settings

    compression = bench.compression
    everything = Settings().override({"model.shards": 1, "model.dense_blocks": 1})
    # a SPES peer that trains every unit pays what DiLoCo pays; one that trains a part, less
    assert compression.flops_per_token(everything, "spes") == compression.flops_per_token(
        everything, "diloco"
    )
    default = Settings().override({"model.shards": 4})
    assert compression.flops_per_token(default, "spes") < 0.85 * compression.flops_per_token(
        default, "diloco"
    )
    curve = [(100, 4.0), (200, 3.0), (400, 2.0)]
    assert compression._at(curve, 150) == pytest.approx(3.5) and compression._at(curve, 300) == pytest.approx(
        2.5
    )
    short = {"diloco fp32": [[(100, 5.0), (200, 4.0)]]}
    long = {"diloco fp32": [curve], "spes int8": [[(100, 4.0), (1000, 1.0)]]}
    at = compression.equal_compute({"short": short, "long": long}, default)
    assert at["diloco fp32"] == [pytest.approx(3.0)]  # its own budget: its short run's last point
    assert at["spes int8"][0] < 3.7  # more tokens for the same FLOPs: further down its curve


def test_the_fit_over_shapes_gives_back_a_figure_that_is_a_sum_over_tensors_anywhere():
    figure = lambda layers, vocab, experts: 1000 + 3 * vocab + layers * (77 + 5 * experts)  # noqa: E731
    points = [(*p, figure(*p)) for p in bench.compression.SHAPE_POINTS]
    assert bench.compression.extend(points, 3, (12, 151_665, 16)) == pytest.approx(figure(12, 151_665, 16))


def test_the_loss_table_reports_what_went_wrong_in_honest_swarms(tmp_path):
    """An honest swarm's refusals and bans are false alarms: counted once per (round, unit, peer) however
    many co-holders refused it (or left it out), and shown beside the loss they may have moved, with the
    re-synchronizations and the participants gone without."""
    rows = {
        "peer0": [
            {"round": 3, "refused": {"dense/0": ["peer2"], "experts/0": ["peer2"]}, "banned": ["peer2"]}
        ],
        "peer1": [
            {"round": 3, "refused": {"dense/0": ["peer2"]}, "left_out": {"experts/1": ["peer3"]}},
            {"round": 4, "refused": {}, "resynced": ["dense/0"], "missing": {"dense/0": ["peer2", "peer3"]}},
        ],
    }
    for peer, lines in rows.items():
        (tmp_path / "peers" / peer).mkdir(parents=True)
        text = "".join(json.dumps({"peer": peer, **r}) + "\n" for r in lines)
        (tmp_path / "peers" / peer / "metrics.jsonl").write_text(text)
    seen = bench.screening_of(tmp_path)
    assert seen == {"refused": 2, "left_out": 1, "banned": ["peer2"], "resynced": 1, "missing": 2}
    curves = {"spes int8": [[(100, 4.0), (200, 3.5)]]}
    results = {"codec_loss": {"short": curves, "screening": {"short/spes int8/0": seen}}}
    table = "\n".join(bench.compression.codec_tables(results, lambda *c: "| " + " | ".join(c) + " |", str))
    assert "| spes int8 | 200 | 3.500 (3.500 to 3.500) | 2, 1, 1, 1, 2 |" in table


def test_the_records_table_compares_each_swarm_with_sixteen_peers_and_names_a_failed_one():
    def row(peers, per_round, failures=()):
        return {
            "peers": peers,
            "round_seconds": 2.0,
            "dht_ops_per_peer_round": 10,
            "dht_bytes_per_peer_round": per_round,
            "dht_bytes_per_peer_second": per_round / 2,
            "busiest_key": "sim/peers",
            "busiest_key_bytes_per_round": peers * per_round,
            "cpu_seconds_per_peer_round": 0.5,
            "failures": list(failures),
        }

    stuck = {**row(128, 0, ["peer3: its sync is stuck"]), "round_seconds": None}
    results = {"records": [row(16, 2048), row(64, 6144), row(256, 8192, ["split: ..."]), stuck]}
    table = bench.tables(results)
    assert "| 64 | 2.0 | 10 | 6.0 | 3.00 | sim/peers | 0.38 | 0.50 | 3.00x | 0 |" in table
    assert (
        "| 256 | 2.0 | 10 | 8.0 | 4.00 | sim/peers | 2.00 | 0.50 | 4.00x | 1 |" in table
    )  # shown, and failed
    assert "| 128 | failed: | peer3: its sync is stuck |" in table
    assert bench.headline(results)["dht_bytes_ratio_64_vs_16_peers"] == 3.0  # (from swarms that worked)
