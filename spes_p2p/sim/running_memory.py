"""The memory of peers measured while they train: a swarm on the memory backend runs a few rounds, every peer
records each round's peak of what it holds (``peer.footprint``), and the steady state is read from the rounds
after the first ``WARMUP_ROUNDS`` (joining, first versions, the first exchange)."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from spes_p2p.errors import SpesError
from spes_p2p.peer.footprint import KINDS
from spes_p2p.settings import Settings
from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS, name_of
from spes_p2p.sim.runner import run
from spes_p2p.sim.summary import read_rows
from spes_p2p.train.accounting import compare
from spes_p2p.train.fit import preflight

WARMUP_ROUNDS = 2
ROUNDS = 5
STEPS_PER_ROUND = 5
REPLICATION = 2  # holders per expert shard in the measured swarm
# every peer of the measured swarm shares this machine's cores: rounds wait for all of them (the round ends
# when every update has come, so a long deadline costs nothing unless one is lost)
DEADLINES = {"sync.deadline_min": 20.0, "sync.deadline_max": 120.0}


def running(settings: Settings, rounds: int = ROUNDS, peers: int | None = None) -> dict:
    """Runs a memory-backend swarm of ``settings`` (its model, method, what each peer takes on) for
    ``rounds`` rounds, ``peers`` peers (default: enough for every expert shard to have ``REPLICATION``
    holders); returns the median peer's steady-state peak, with its breakdown by kind and every peer's."""
    if rounds <= WARMUP_ROUNDS:
        raise SpesError(f"measure at least {WARMUP_ROUNDS + 1} rounds: the first {WARMUP_ROUNDS} are warm-up")
    n = peers or max(2, -(-REPLICATION * settings.model.shards // max(1, settings.peer.capacity)))
    defaults = {**LOCAL_SWARM_DEFAULTS, **DEADLINES}
    local = {key: v for key, v in defaults.items() if key not in settings.given}
    if "method.steps_per_round" not in settings.given:
        local["method.steps_per_round"] = STEPS_PER_ROUND
    with tempfile.TemporaryDirectory(prefix="spes-memory-") as out:
        changes = {**local, "swarm.backend": "memory", "sim.peers": n, "run.rounds": rounds}
        changes["run.out"] = out
        s = settings.override({**changes, "sim.kills": (), "sim.joins": ()})
        summary = run(s)
        if summary["failures"]:
            raise SpesError(f"the measured swarm failed: {'; '.join(summary['failures'])}")
        peaks = {name_of(i): steady_peak(read_rows(Path(out) / "peers" / name_of(i))) for i in range(n)}
    median = sorted(peaks.values(), key=lambda p: p["memory_peak_bytes"])[(n - 1) // 2]
    return {
        "method": settings.method.mode,
        "peers": n,
        "rounds": rounds,
        "steps_per_round": s.method.steps_per_round,
        "peak_bytes": median["memory_peak_bytes"],
        "memory_bytes": median["memory_bytes"],
        "rss_bytes": max(p["rss_bytes"] for p in peaks.values()),  # the process: every peer together
        "per_peer": {name: p["memory_peak_bytes"] for name, p in sorted(peaks.items())},
    }


def steady_peak(rows: list[dict]) -> dict:
    """The largest round peak after warm-up (rows of a peer's ``metrics.jsonl``)."""
    steady = [r for r in rows if r["round"] >= WARMUP_ROUNDS and "memory_peak_bytes" in r]
    if not steady:
        raise SpesError(f"no round after the first {WARMUP_ROUNDS} was measured: run more rounds")
    peak = max(steady, key=lambda r: r["memory_peak_bytes"])
    return {
        "memory_peak_bytes": peak["memory_peak_bytes"],
        "memory_bytes": {k: peak["memory_bytes"].get(k, 0) for k in KINDS},
        "rss_bytes": max(r["rss_bytes"] for r in steady),
        "median_bytes": statistics.median(r["memory_peak_bytes"] for r in steady),
    }


def compare_running(settings: Settings, rounds: int = ROUNDS) -> dict:
    """A swarm of ``settings`` and a DiLoCo swarm of the same model and peers, measured alike; the ratio
    of their steady-state peaks."""
    spes = running(settings, rounds)
    diloco_settings = settings.override(
        {"method.mode": "diloco", "model.dense_blocks": 1, "peer.active_blocks": 1}
    )
    diloco = running(diloco_settings, rounds, peers=spes["peers"])
    return {**spes, "diloco": diloco, "ratio_vs_diloco": spes["peak_bytes"] / diloco["peak_bytes"]}


def report(settings: Settings, running: bool = False) -> dict:
    """``spes memory``: a peer of ``settings`` after one step next to a DiLoCo peer and a centralized
    trainer (``train.memory.compare``), whether it fits its device now, and, with ``running``, the
    peers measured while they train (``compare_running``: minutes, and the memory of a whole swarm)."""
    s = settings
    out = compare(s.model, s.peer.capacity, s.peer.active_blocks, s.train)
    out["preflight"] = preflight(s)
    if running:
        out["running"] = compare_running(s)
    return out
