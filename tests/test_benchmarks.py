"""The benchmark script's own accounting (the runs themselves are too long for CI: see docs/benchmarks.md)."""

import importlib.util
from pathlib import Path

import pytest

from spes_p2p.model import MoETransformer, get_preset
from spes_p2p.model.config import ModelSettings
from spes_p2p.model.units import layout_of

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "run.py"
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
