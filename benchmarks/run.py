"""spes-p2p against training alone and against DiLoCo, measured side by side in one run on one machine.

    python benchmarks/run.py --quick --out runs/bench-quick   # a few minutes on 2 cores
    python benchmarks/run.py --out runs/bench                 # the full run, under an hour on 2 cores

Sections (each a function below; all figures are measured in this run):
  memory    allocated tensor bytes per peer (weights, gradients, optimizer state, outer-step state) and peak
            process memory, for centralized, DiLoCo, SPES, SPES+BCD and SPES with quantized frozen experts
  bytes     bytes sent and received per peer per round: DiLoCo fp32, and SPES with each codec (for updates
            and frozen copies' changes alike), the dense part by all-to-all or reduce-scatter, frozen copies
            by weights or by changes
  sync      share of a peer's wall time spent waiting on the sync, with and without overlap (real processes)
  loss      validation loss against tokens: centralized, DiLoCo, SPES (merging on and off), SPES+BCD;
            4 peers, equal total tokens
  scale     round time, sync wait and DHT latency for 4 to 32 peer processes with virtual compute (a step
            sleeps; updates are synthetic, of the model's real shapes), groups of 4 holders per unit, on
            hivemind (three processes a peer: the peer, its DHT and p2pd)
  scale_libp2p  the same on libp2p (one process a peer)
  records   the swarm's DHT records as it grows, 4 to 256 peers in one process (the memory backend, which
            counts the bytes each key serves exactly; virtual compute, a model of about 100k parameters):
            reads, writes and bytes per peer and round, the busiest key's bytes served a round, CPU time
  backends  hivemind and libp2p side by side: start and join time, DHT write and read latency, stream
            throughput (benchmarks/backends.py), and the round time of the same 4-peer swarm on each
  wan       the share of wall time waiting on the sync when each peer sits in its own network namespace
            behind a 50 Mbit/s link (root), with a round's compute set to a GPU's (virtual compute), for
            public peers and for a peer behind NAT (reached through a relay)
  codec_*   the sparse codec against int8, DiLoCo and centralized (benchmarks/compression.py): bytes of the
            1b shapes, coding time, validation loss over 3 seeds at equal tokens and compute, and the
            sync-wait share on links scaled to a 1b peer's on a 20 Mbit/s uplink (root, as wan)

Writes DIR/summary.json (the headline ratios and every table), DIR/tables.md and DIR/*.png, anew after each
section: a run that stops halfway keeps what it measured. A section whose prerequisite this machine lacks
(wan: root, iproute2 and nftables) is skipped with the reason under "skipped"; one that fails is recorded
under "failed" with its error, the run goes on, and the script exits 1 at the end.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import compression
import torch

MODES = {
    "quick": {
        "memory_preset": "tiny",
        "bytes_presets": ["tiny"],
        "loss": {"rounds": 6, "steps": 10},
        "sync": {"rounds": 4, "steps": 10},
        "scale": {"peers": [4, 8], "rounds": 3, "steps": 10},
        "records": {"peers": [4, 16], "rounds": 3},
        "wan": {"peers": 4, "rounds": 3},
        "catch_up": {"rounds": 5},
        "backends": {"rounds": 4, "steps": 10},
        "codec_presets": ["tiny"],
        "codec_loss": {"seeds": (0,), "longer": 2},
        "full_only": {
            "codec_bytes": "full mode only: five swarms of 1b-wide tensors, minutes each",
            "catch_up": "full mode only: two swarms of small peers in namespaces, 7 minutes",
        },
    },
    "full": {
        "memory_preset": "small",
        "bytes_presets": ["tiny", "small"],
        "loss": {"rounds": 24, "steps": 20},
        "sync": {"rounds": 8, "steps": 20},
        "scale": {"peers": [4, 8, 16, 32], "rounds": 6, "steps": 20},
        "records": {"peers": [4, 16, 64, 256], "rounds": 3},
        "wan": {"peers": 4, "rounds": 8},
        "catch_up": {"rounds": 5},
        "backends": {"rounds": 8, "steps": 20},
        "codec_presets": ["tiny", "small", "1b"],
        "codec_loss": {"seeds": compression.LOSS_SEEDS, "longer": 4},
        "full_only": {},
    },
}
SECTIONS = (
    "memory",
    "bytes",
    "sync",
    "loss",
    "scale",
    "scale_libp2p",
    "records",
    "wan",
    "backends",
    "codec_bytes",
    "codec_time",
    "codec_loss",
    "codec_wan",
    "catch_up",
)
BACKENDS = ("hivemind", "libp2p")
SCALE_STEP_SECONDS = 0.5  # virtual compute in the scale section: 10 s of "training" a round at 20 steps
# heartbeats at a swarm's defaults; 32 peer processes starting at once on 2 cores take a while to join
SCALE_SWARM = {
    "swarm.heartbeat_seconds": 5.0,
    "swarm.record_ttl_seconds": 20.0,
    "swarm.join_timeout_seconds": 120.0,
}
SCALE_GROUP = 4  # holders of each expert shard, and peers averaging each dense block together
# records: a model's expert shards do not grow with the swarm, their holders do (8 shards, 64 experts of a
# model small enough that hundreds of peers fit in one process); rounds of 5 steps of 0.2 s
RECORDS_MODEL = {
    "vocab_size": 1024,
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "n_experts": 64,
    "top_k": 2,
    "expert_dim": 16,
    "max_seq_len": 256,
}
RECORDS_SHARDS, RECORDS_STEPS, RECORDS_STEP_SECONDS = 8, 5, 0.2
# wan: a round's compute as a GPU would take it: H = 100 steps of the tiny preset at 20 ms a step (an
# estimate: its 1,024-token step is a few GFLOPs, so kernel launches, not FLOPs, set its time on a GPU)
WAN_STEPS, WAN_STEP_SECONDS, WAN_BANDWIDTH = 100, 0.02, "50mbit"
CODECS = ["none", "fp16", "int8", "nf4", "topk", "sparseloco"]
# catch_up: a newcomer downloads a `small` model (60 MiB) from 1 peer or 4, over home links of 50 Mbit/s up
# and rounds of H = 100 steps of 0.3 s: the holders' exchanges (15 MiB to each co-holder) take their uplinks
# a quarter of the time, as a swarm that waits little on its sync does
CATCH_UP_PRESET, CATCH_UP_HOLDERS, CATCH_UP_STEP_SECONDS = "small", 4, 0.3
# Deadlines of a minute at least: with the defaults' first deadline, a holder's update (a quarter of its
# 45 MiB upload a round) comes too late, the holders part ways, and a round's tail is too short to fetch
# the end weights that would bring them together (docs/benchmarks.md); holders apart serve no agreed chunks
CATCH_UP_BANDWIDTH, CATCH_UP_DEADLINE = "50mbit/500mbit", 120.0


# ---------------------------------------------------------------------------------------------- memory

# name -> (trains every unit, dense blocks, frozen experts and dense blocks, method)
MEMORY_CONFIGS = {
    "centralized": (True, 1, "full", "centralized"),
    "diloco": (True, 1, "full", "diloco"),
    "spes": (False, 1, "full", "spes"),
    "spes+bcd": (False, 4, "full", "spes"),
    "spes+int8": (False, 1, "int8", "spes"),
    "spes+bcd+nf4": (False, 4, "nf4", "spes"),
}


def memory_child(preset: str, name: str) -> dict:
    """Runs in a fresh process, so its peak RSS belongs to this configuration alone. The outer state is
    what the sync keeps per trained weight (``train.accounting.outer_copies``), allocated as a peer holds
    it."""
    from spes_p2p.model.config import ModelSettings
    from spes_p2p.model.units import layout_of
    from spes_p2p.train.accounting import measure, outer_copies
    from spes_p2p.train.config import TrainConfig

    everything, blocks, frozen, method = MEMORY_CONFIGS[name]
    model = ModelSettings(preset=preset, shards=4, dense_blocks=blocks)
    layout = layout_of(model)
    trained = layout.units if everything else [*layout.dense_units[-1:], "experts/0"]
    train = TrainConfig(frozen_experts=frozen, frozen_dense=frozen, batch_size=4)
    report = measure(model.architecture(), layout, trained, train, outer_copies(method, layout))
    outer = torch.empty(report["outer_bytes"] // 4)  # held, as a peer does
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del outer
    return report


def bench_memory(preset: str) -> dict:
    rows = {}
    for name in MEMORY_CONFIGS:
        rows[name] = _in_child("memory_child", preset, name)  # (its peak RSS is its own)
        print(f"memory {name}: {rows[name]['total_bytes'] / 2**20:.1f} MiB", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- bytes


EXCHANGES = {  # the columns of the bytes table: how the dense part and the frozen copies travel
    "all-to-all, weights": {"sync.dense_exchange": "all_to_all", "sync.frozen_refresh": "weights"},
    "reduce-scatter, weights": {"sync.frozen_refresh": "weights"},
    "all-to-all, changes": {"sync.dense_exchange": "all_to_all"},
    "reduce-scatter, changes": {},  # the defaults
    "reduce-scatter, changes every 2": {"method.refresh_every_rounds": 2},
}
DEFAULT_EXCHANGE = "reduce-scatter, changes"


def swarm_bytes(
    preset: str, codec: str, mode: str, exchange: str, rounds: int = 4, changes: dict | None = None
) -> dict:
    """Bytes per round of 4 in-process peers (2 shards), ``codec`` coding both the updates and the frozen
    copies' changes: each peer's total over the run divided by the rounds, median over peers (one round's
    window is noisy: a peer's bytes land in whichever round it was in when another peer fetched from it).
    ``changes``: more settings (``section.field``)."""
    from spes_p2p.net.memory import MemoryNetwork
    from spes_p2p.peer import Peer
    from spes_p2p.settings import Settings

    s = Settings().override(
        {
            "model.preset": preset,
            "model.shards": 2,
            "method.mode": mode,
            "sync.codec": codec,
            "sync.refresh_codec": codec,
            "method.steps_per_round": 2,
            "merge.enabled": False,
            "method.overlap": False,
            "data.max_corpus_mb": 2.0,
            "train.batch_size": 2,
            "train.seq_len": 64,
            "sync.deadline_min": 0.5,
            **EXCHANGES[exchange],
            **(changes or {}),
        }
    )
    net = MemoryNetwork(seed=0)
    swarm = [Peer(s, net.join(f"p{i}")) for i in range(4)]
    for p in swarm:
        p.join()
    stop = threading.Event()
    threads = [threading.Thread(target=p.run, args=(stop, None, rounds)) for p in swarm]  # (stop, ui, rounds)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model_bytes = 4 * swarm[0].local.model.num_params()
    sent = statistics.median(p.transport.stats.bytes_sent / rounds for p in swarm)
    received = statistics.median(p.transport.stats.bytes_received / rounds for p in swarm)
    for p in swarm:
        p.close()
    return {
        "preset": preset,
        "mode": mode,
        "codec": codec,
        "exchange": exchange,
        "sent": sent,
        "received": received,
        "model_fp32_bytes": model_bytes,
    }


def bench_bytes(presets: list[str]) -> list[dict]:
    """DiLoCo in fp32 (all-to-all, as before, and reduce-scatter), then SPES with each codec: on the largest
    preset in every exchange, on the others in the default one."""
    rows = []
    for preset in presets:
        baselines = [
            swarm_bytes(preset, "none", "diloco", e) for e in ("all-to-all, weights", DEFAULT_EXCHANGE)
        ]
        exchanges = list(EXCHANGES) if preset == presets[-1] else [DEFAULT_EXCHANGE]
        spes = [swarm_bytes(preset, codec, "spes", e) for codec in CODECS for e in exchanges]
        before, after = (b["sent"] + b["received"] for b in baselines)
        for r in baselines + spes:
            total = r["sent"] + r["received"]
            r["ratio_vs_diloco_fp32"] = total / before  # DiLoCo as this project ran it before: all-to-all
            r["ratio_vs_diloco_rs_fp32"] = total / after
            r["ratio_vs_allreduce_fp32"] = total / (2 * r["model_fp32_bytes"])
            print(
                f"bytes {preset} {r['mode']} {r['codec']} {r['exchange']}: {total / 2**20:.2f} MiB",
                flush=True,
            )
        rows += baselines + spes
    return rows


# the codec sections' swarms for bytes: virtual compute (real shapes), and coding these tensors takes seconds
# on 2 cores: no peer is cut off for being slow (its copies would part, and re-synchronizing moves whole
# weights: another measurement)
CODEC_SWARM = {"sim.compute": "virtual=0.01", "sync.deadline_min": 30.0}


def bench_codec_bytes(codecs: list[str], results: dict) -> list[dict]:
    """What a default SPES peer sends and receives per round with each codec (for updates and frozen copies'
    changes), with virtual compute, in the default exchange (4 peers, 2 expert shards, as the ``bytes``
    section), against a DiLoCo peer's fp32 all-to-all of the full model: measured for `tiny` and `small`;
    for `1b`, 2 x 3 x 4 bytes a parameter a round, the formula those two measurements check.

    Four 1b peers in one process do not fit this machine's memory (its 151,665-token vocabulary alone is
    233M parameters a copy). A peer's bytes are a sum over its tensors, each coded in a size linear in its
    elements: so the swarm runs with 1b's width and expert size at ``compression.SHAPE_POINTS`` (layers,
    vocabulary, experts), and 1b's figure is ``compression.extend`` of the first four, checked on the
    fifth."""
    rows = []
    for preset in ("tiny", "small"):
        baseline = _in_child("swarm_bytes", preset, "none", "diloco", "all-to-all, weights", 4, CODEC_SWARM)
        diloco = baseline["sent"] + baseline["received"]
        formula = 2 * 3 * baseline["model_fp32_bytes"]
        for codec in codecs:
            r = _in_child("swarm_bytes", preset, codec, "spes", DEFAULT_EXCHANGE, 4, CODEC_SWARM)
            ratio = (r["sent"] + r["received"]) / diloco
            rows.append(
                {
                    **r,
                    "diloco_fp32_bytes": diloco,
                    "ratio_vs_diloco_fp32": ratio,
                    "formula_check": diloco / formula,
                }
            )
            print(f"codec bytes {preset}, {codec}: {ratio:.4f} of DiLoCo fp32", flush=True)
    return rows + [_one_b_bytes(codec) for codec in codecs]


def _one_b_bytes(codec: str) -> dict:
    import dataclasses

    from spes_p2p.model import MoETransformer
    from spes_p2p.model.config import PRESETS

    full = PRESETS["1b"]
    with torch.device("meta"):
        params = sum(p.numel() for p in MoETransformer(full).parameters())
    diloco = 2 * 3 * 4 * params
    points = []
    for layers, vocab, experts in compression.SHAPE_POINTS:
        shape = {"n_layers": layers, "vocab_size": vocab, "n_experts": experts}
        changes = {"model.config_json": dataclasses.replace(full, **shape).to_json(), **CODEC_SWARM}
        r = _in_child("swarm_bytes", "1b", codec, "spes", DEFAULT_EXCHANGE, 4, changes)
        points.append((layers, vocab, experts, r["sent"], r["received"]))
        print(f"codec bytes 1b at {shape}, {codec}: {r['sent']:,.0f} B sent", flush=True)
    at = (full.n_layers, full.vocab_size, full.n_experts)
    sent, received = (compression.extend(points, i, at) for i in (3, 4))
    return {
        "preset": "1b",
        "codec": codec,
        "params": params,
        "sent": sent,
        "received": received,
        "diloco_fp32_bytes": diloco,
        "ratio_vs_diloco_fp32": (sent + received) / diloco,
        "points": points,
        "check_point_error": compression.extend(points, 3, points[4][:3]) / points[4][3] - 1,
    }


def _in_child(function: str, *args) -> dict:
    """``function(*args)`` of this script in a fresh process: its peak memory is its own, and a swarm of
    large tensors leaves memory that the next one in the same process could not use."""
    child = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps([function, *args])],
        capture_output=True,
        text=True,
    )
    if child.returncode:
        raise RuntimeError(f"{function}{tuple(args)[:3]} failed:\n{child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ swarms


def simulate(
    out: Path, name: str, backend: str, peers: int, rounds: int, steps: int, changes: dict | None = None
) -> dict:
    """A simulation with ``{'section.field': value}`` changes."""
    from spes_p2p.sim import run, simulation

    folder = out / name
    cfg = simulation(
        {
            "sim.peers": peers,
            "model.shards": 2,
            "run.rounds": rounds,
            "method.steps_per_round": steps,
            "swarm.backend": backend,
            "run.out": str(folder),
            **(changes or {}),
        }
    )
    started = time.perf_counter()
    summary = run(cfg)
    return {
        "summary": summary,
        "rows": _peer_rows(folder),
        "seconds": time.perf_counter() - started,
        "tokens_per_peer_round": steps * cfg.train.batch_size * cfg.train.seq_len,
    }


def bench_sync(out: Path, rounds: int, steps: int) -> dict:
    """Real spes-join processes: the share of wall time the training loop was blocked on the sync."""
    result = {}
    for overlap in (True, False):
        sim = simulate(
            out, f"sync-overlap-{overlap}", "hivemind", 4, rounds, steps, {"method.overlap": overlap}
        )
        rows = sim["rows"].values()
        steady = [r for rs in rows for r in rs[1:-1]]
        result["overlap" if overlap else "no_overlap"] = {
            "sync_wait_fraction": _wait_fraction(rows),
            "sync_wait_fraction_with_last": _wait_fraction(rows, with_last=True),
            "wait_seconds_per_round": sum(r["sync_wait_seconds"] for r in steady) / max(1, len(steady)),
        }
        print(f"sync overlap={overlap}: {result['overlap' if overlap else 'no_overlap']}", flush=True)
    return result


LOSS_METHODS = {  # settings changes, section.field
    "diloco": {"method.mode": "diloco"},  # Nesterov outer step (lr 0.7, momentum 0.9), no merging
    "spes": {},
    "spes, all-to-all, weights": EXCHANGES["all-to-all, weights"],  # the exchange before reduce-scatter
    "spes-no-merge": {"merge.enabled": False},
    "spes+bcd": {"model.dense_blocks": 4, "peer.active_blocks": 1, "method.rotate_every_rounds": 2},
}


def bench_loss(out: Path, rounds: int, steps: int) -> dict:
    curves = {"centralized": centralized(out, rounds, steps)}
    for name, settings in LOSS_METHODS.items():
        sim = simulate(
            out, f"loss-{name}", "memory", 4, rounds, steps, {**_loss_settings(rounds, steps), **settings}
        )
        curves[name] = loss_curve(sim)
        print(f"loss {name}: {curves[name][-1]}", flush=True)
    return curves


def bench_codec_loss(out: Path, rounds: int, steps: int, seeds: tuple[int, ...], longer: int) -> dict:
    """``compression.CODEC_METHODS`` and centralized, each over ``seeds``, on the loss section's setting
    ("short") and on one ``longer`` times as long ("long"): every curve, by method. Each
    run's curve is kept in DIR/codec_loss_runs.json as it ends, and a run already there is not run again: a
    section stopped halfway (it takes hours on 2 cores) goes on where it stopped."""
    done_path = out / "codec_loss_runs.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    result: dict[str, dict] = {"screening": {}}
    for length, n in (("short", rounds), ("long", longer * rounds)):
        for seed in seeds:
            for name in ("centralized", *compression.CODEC_METHODS):
                key = f"{length}/{name}/{seed}"
                folder = f"codec-{key}".replace(" ", "-").replace("/", "-")
                if key not in done:
                    if name == "centralized":
                        done[key] = centralized(out, n, steps, seed)
                    else:
                        changes = {
                            **_loss_settings(n, steps),
                            **compression.CODEC_METHODS[name],
                            "train.seed": seed,
                            **UNCUT,
                        }
                        done[key] = loss_curve(simulate(out, folder, "memory", 4, n, steps, changes))
                    done_path.write_text(json.dumps(done))
                    print(f"codec loss {key}: {done[key][-1]}", flush=True)
                result.setdefault(length, {}).setdefault(name, []).append(done[key])
                if name != "centralized":
                    result["screening"][key] = screening_of(out / folder)
    return result


def screening_of(folder: Path) -> dict:
    """What went wrong in an honest swarm: the contributions (round, unit, peer) any peer's screening refused
    or left out, the peers banned (refusals and bans are false alarms here), and the units peers
    re-synchronized and the participants they went without (each peer's count: a slow peer cut off, whose
    weights part from its co-holders')."""
    from spes_p2p.sim.summary import read_rows

    refused, left_out, banned, resynced, missing = set(), set(), set(), 0, 0
    for peer in sorted((folder / "peers").iterdir()):
        for row in read_rows(peer):
            refused |= {(row["round"], u, p) for u, peers in row.get("refused", {}).items() for p in peers}
            left_out |= {(row["round"], u, p) for u, peers in row.get("left_out", {}).items() for p in peers}
            banned |= set(row.get("banned", []))
            resynced += len(row.get("resynced", []))
            missing += sum(len(peers) for peers in row.get("missing", {}).values())
    return {
        "refused": len(refused),
        "left_out": len(left_out),
        "banned": sorted(banned),
        "resynced": resynced,
        "missing": missing,
    }


# codec_loss: a round waits for every participant (up to a minute), so that no peer is cut off for being
# slow on a busy machine and the loss depends on the codec, not on the machine's load
UNCUT = {"sync.deadline_min": 60.0, "sync.deadline_max": 120.0}


def _loss_settings(rounds: int, steps: int) -> dict:
    """Merging every 2 rounds while the step is below the run's last; validation every 2 rounds."""
    return {"merge.interval": 2 * steps, "merge.horizon": rounds * steps, "train.eval_every": 2 * steps}


def loss_curve(sim: dict) -> list[tuple[int, float]]:
    """(tokens of the swarm, mean validation loss over its peers) at each round that validated."""
    by_round: dict[int, list[float]] = {}
    for rows in sim["rows"].values():
        for r in rows:
            if "val_loss" in r:
                by_round.setdefault(r["round"], []).append(r["val_loss"])
    per_round = 4 * sim["tokens_per_peer_round"]
    return [((k + 1) * per_round, statistics.fmean(v)) for k, v in sorted(by_round.items())]


def centralized(out: Path, rounds: int, steps: int, seed: int = 0) -> list[tuple[int, float]]:
    """One trainer on 4 peers' batches at once (4 x 8 sequences a step), for as many steps as a peer."""
    from spes_p2p.model.config import ModelSettings
    from spes_p2p.sim.summary import read_rows
    from spes_p2p.train.config import DataConfig, TrainConfig
    from spes_p2p.train.run import TrainingRun

    # the peers' schedule (10,000 steps, warmup 50); the same 32 validation sequences as a peer's 4 x 8
    train = TrainConfig(
        batch_size=32, total_steps=10_000, warmup_steps=50, eval_every=2 * steps, eval_batches=1, seed=seed
    )
    folder = out / ("loss-centralized" if not seed else f"loss-centralized-{seed}")
    shutil.rmtree(folder, ignore_errors=True)
    TrainingRun(ModelSettings(), train, DataConfig(max_corpus_mb=4.0), folder).run(stop_after=rounds * steps)
    rows = read_rows(folder)
    return [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]


def bench_scale(
    out: Path, peers: list[int], rounds: int, steps: int, backend: str = "hivemind"
) -> list[dict]:
    """Virtual compute, so that 32 processes fit on 2 cores; the groups stay at ``SCALE_GROUP`` peers: one
    expert shard per 4 peers, dense blocks averaged in groups of 4. Heartbeats at a swarm's default (5 s),
    not a local simulation's (1 s): 32 DHT nodes refreshing every second would measure the CPU of 2 cores."""
    from spes_p2p.errors import SpesError

    rows = []
    for n in peers:
        name = f"scale-{n}" if backend == "hivemind" else f"scale-{backend}-{n}"
        changes = {
            "sim.compute": f"virtual={SCALE_STEP_SECONDS}",
            "model.shards": max(1, n // SCALE_GROUP),
            "sync.dense_group_size": SCALE_GROUP,
            **SCALE_SWARM,
        }
        try:
            sim = simulate(out, name, backend, n, rounds, steps, changes)
        except SpesError as exc:  # (out of its time budget: the rounds it ran, and why it stopped)
            done = _peer_rows(out / name)
            fewest = min((len(r) for r in done.values()), default=0)
            failed = {"rounds_completed": fewest, "uncovered_unit_rounds": None, "failures": [str(exc)]}
            sim = {"summary": failed, "rows": done}
        summary = sim["summary"]
        rows.append(
            {
                "peers": n,
                **_round_times(sim),
                "rounds": summary["rounds_completed"],
                "uncovered": summary["uncovered_unit_rounds"],
                "failures": summary["failures"],
            }
        )
        print(f"scale ({backend}) {rows[-1]}", flush=True)
    return rows


def bench_records(out: Path, peers: list[int], rounds: int) -> list[dict]:
    """Every peer on a thread of this process: the memory backend counts what each key serves. Heartbeats
    at a swarm's default (5 s). A round's records cost grows with its length (heartbeats), and the rounds
    here grow with the swarm, as its peers share two cores: per second is given beside per round."""
    rows = []
    for n in peers:
        before = resource.getrusage(resource.RUSAGE_SELF)
        sim = simulate(
            out,
            f"records-{n}",
            "memory",
            n,
            rounds,
            RECORDS_STEPS,
            {
                "sim.compute": f"virtual={RECORDS_STEP_SECONDS}",
                "model.config_json": json.dumps(RECORDS_MODEL),
                "model.shards": RECORDS_SHARDS,
                "sync.dense_group_size": SCALE_GROUP,
                **SCALE_SWARM,
            },
        )
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        summary, dht = sim["summary"], sim["summary"]["dht"]
        times = _round_times(sim)
        served = dht["served_bytes_per_round"]
        busiest = max(served, key=served.get) if served else None
        rows.append(
            {
                "peers": n,
                **times,
                "dht_ops_per_peer_round": dht["ops_per_peer_round"],
                "dht_bytes_per_peer_round": dht["bytes_per_peer_round"],
                "dht_bytes_per_peer_second": dht["bytes_per_peer_round"] / times["round_seconds"]
                if times["round_seconds"]
                else None,
                "busiest_key": busiest,
                "busiest_key_bytes_per_round": served.get(busiest),
                "by_kind": dht["by_kind"],
                "cpu_seconds_per_peer_round": cpu / max(1, n * summary["rounds_completed"]),
                "rss_bytes": max(r.get("rss_bytes", 0) for rs in sim["rows"].values() for r in rs),
                "seconds": sim["seconds"],
                "rounds": summary["rounds_completed"],
                "uncovered": summary["uncovered_unit_rounds"],
                "resynced_peer_rounds": sum(p["resynced_rounds"] for p in summary["peers"]),
                "rejected_payloads": summary["rejected_payloads"],
                "failures": summary["failures"],
            }
        )
        print(f"records {rows[-1]}", flush=True)
    return rows


def bench_wan(out: Path, peers: int, rounds: int) -> dict:
    """Each peer in its own namespace behind a ``WAN_BANDWIDTH`` link; the last peer of the second run
    behind NAT. Rounds of ``WAN_STEPS`` steps with a GPU's compute (virtual)."""
    result = {"bandwidth": WAN_BANDWIDTH, "steps": WAN_STEPS, "step_seconds": WAN_STEP_SECONDS}
    for name, nat in (("public", 0), ("nat", 1)):
        sim = simulate(
            out,
            f"wan-{name}",
            "hivemind",
            peers,
            rounds,
            WAN_STEPS,
            {
                "sim.netns": True,
                "sim.bandwidth": WAN_BANDWIDTH,
                "sim.nat": nat,
                "sim.compute": f"virtual={WAN_STEP_SECONDS}",
            },
        )
        natted = f"peer{peers - 1}"
        result[name] = {
            "all": {
                **_round_times(sim),
                "sync_wait_fraction": _wait_fraction(sim["rows"].values()),
                "sync_wait_fraction_with_last": _wait_fraction(sim["rows"].values(), with_last=True),
            },
            "uncovered": sim["summary"]["uncovered_unit_rounds"],
        }
        if nat:
            rows = sim["rows"][natted]
            me = rows[0]["peer"]
            others = [r for n, rs in sim["rows"].items() if n != natted for r in rs]
            result[name]["natted"] = {
                "peer": natted,
                "sync_wait_fraction": _wait_fraction([rows]),
                "sync_wait_fraction_with_last": _wait_fraction([rows], with_last=True),
                "experts": sorted({u for r in rows for u in r["units"] if u.startswith("experts/")}),
                "rounds": len(rows),
                # rounds in which another peer averaged this one's update into a unit
                "rounds_counted_by_others": len(
                    {r["round"] for r in others if any(me in p for p in r["participants"].values())}
                ),
            }
        print(f"wan {name}: {result[name]}", flush=True)
    return result


def bench_catch_up(out: Path, rounds: int) -> dict:
    """A newcomer downloading the swarm's model, each peer in its own namespace behind a home link
    (``CATCH_UP_BANDWIDTH``: its uplink a tenth of its downlink): from the one peer of a swarm, and from a
    swarm of ``CATCH_UP_HOLDERS`` peers that all hold every unit (one expert shard, one dense block), which
    meanwhile exchange their updates over the same uplinks. Its seconds from the round boundary it joins
    at to the model downloaded (``startup.json``), with every unit downloaded (its log says which)."""
    result: dict = {"bandwidth": CATCH_UP_BANDWIDTH, "preset": CATCH_UP_PRESET}
    for holders in (1, CATCH_UP_HOLDERS):
        name = f"catch-up-{holders}"
        sim = simulate(
            out,
            name,
            "hivemind",
            holders,
            rounds,
            WAN_STEPS,
            {
                "sim.netns": True,
                "sim.bandwidth": CATCH_UP_BANDWIDTH,
                "sim.compute": f"virtual={CATCH_UP_STEP_SECONDS}",
                "sim.joins": ("1@2",),
                "model.preset": CATCH_UP_PRESET,
                "model.shards": 1,
                "model.dense_blocks": 1,
                "sync.deadline_min": CATCH_UP_DEADLINE / 2,
                "sync.deadline_max": CATCH_UP_DEADLINE,
            },
        )
        (newcomer,) = sim["summary"]["newcomers"]
        marks = newcomer["startup_seconds"]
        log = (out / name / "logs" / f"{newcomer['name']}.log").read_text()
        downloaded = re.findall(r"caught up at round \d+: downloaded (\{.*?\})", log)
        units = sorted(ast.literal_eval(downloaded[0])) if downloaded else []
        if "caught_up" not in marks or units != sorted(sim["summary"]["units"]):
            raise RuntimeError(f"the newcomer downloaded {units} only: {sim['summary']['failures']}")
        result[f"holders_{holders}"] = {
            "seconds": marks["caught_up"] - marks["boundary"],
            "failures": sim["summary"]["failures"],
        }
        print(f"catch_up from {holders}: {result[f'holders_{holders}']}", flush=True)
    result["ratio"] = result[f"holders_{CATCH_UP_HOLDERS}"]["seconds"] / result["holders_1"]["seconds"]
    return result


def bench_codec_wan(out: Path, results: dict, peers: int, rounds: int, uplink_mbit: float = 20.0) -> dict:
    """The sparse codec's sync-wait share on a `small` swarm scaled to a `1b` peer on an ``uplink_mbit``
    uplink: a round's transfer over its compute is what a 1b peer's would be (its bytes a round, from the
    ``codec_bytes`` section, over that uplink; its compute at H = 100 on a GPU, ``compression.GPU_*``, an
    estimate). A round's compute is the ``wan`` section's (H = 100 steps of ``WAN_STEP_SECONDS``), and the
    link is set so that a small peer's bytes a round take that share of it. (Scaling the link alone, to make
    a small peer's transfer as long as a 1b peer's, left 280 kbit/s: the DHT's own messages, which do not
    shrink with the model, then starved and the peers lost sight of each other.) A run whose peers did not
    all exchange is a failure, not a share."""
    from spes_p2p.settings import Settings

    if "codec_bytes" not in results:
        raise RuntimeError("codec_wan scales its links by the codec_bytes section's figures: run that first")
    one_b = next(
        r for r in results["codec_bytes"] if (r.get("preset", "1b"), r["codec"]) == ("1b", "sparseloco")
    )
    small = swarm_bytes("small", "sparseloco", "spes", DEFAULT_EXCHANGE, 4, CODEC_SWARM)
    one_b_compute = (
        compression.H
        * compression.GPU_STEP_TOKENS
        * compression.flops_per_token(Settings().override({"model.preset": "1b"}), "spes")
        / compression.GPU_FLOPS
    )
    one_b_transfer = one_b["sent"] * 8 / (uplink_mbit * 1e6)
    compute = WAN_STEPS * WAN_STEP_SECONDS
    rate_kbit = small["sent"] * 8 / (compute * one_b_transfer / one_b_compute) / 1000
    settings = {
        "model.preset": "small",
        "sync.codec": "sparseloco",
        "sync.refresh_codec": "sparseloco",
        "sim.netns": True,
        "sim.bandwidth": f"{max(1, round(rate_kbit))}kbit",
        "sim.compute": f"virtual={WAN_STEP_SECONDS}",
    }
    sim = simulate(out, "codec-wan", "hivemind", peers, rounds, WAN_STEPS, settings)
    result = {
        "bandwidth_kbit": rate_kbit,
        "small_sent_per_round": small["sent"],
        "one_b_sent_per_round": one_b["sent"],
        "one_b_round_compute_seconds": one_b_compute,
        "one_b_transfer_seconds_per_round": one_b_transfer,
        "round_compute_seconds": compute,
        **_round_times(sim),
        "sync_wait_fraction": _wait_fraction(sim["rows"].values()),
        "sync_wait_fraction_with_last": _wait_fraction(sim["rows"].values(), with_last=True),
        "uncovered": sim["summary"]["uncovered_unit_rounds"],
        "failures": sim["summary"]["failures"],
    }
    print(f"codec wan: {result}", flush=True)
    if result["failures"]:
        raise RuntimeError(f"the scaled swarm did not work as one: {'; '.join(result['failures'])}")
    return result


def bench_backends(out: Path, rounds: int, steps: int) -> dict:
    """Each backend's network figures (in a process of its own), and the round time of one swarm on each."""
    result = {}
    for backend in BACKENDS:
        child = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("backends.py")), backend],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if child.returncode:
            raise RuntimeError(f"benchmarks/backends.py {backend} failed:\n{child.stderr[-2000:]}")
        sim = simulate(out, f"backend-{backend}", backend, 4, rounds, steps)
        result[backend] = {
            **json.loads(child.stdout.splitlines()[-1]),
            **_round_times(sim),
            "failures": sim["summary"]["failures"],
            "final_loss": sim["summary"]["final_loss"],
        }
        print(f"backend {backend}: {result[backend]}", flush=True)
    return result


def _peer_rows(folder: Path) -> dict[str, list[dict]]:
    """Each peer's metrics rows of the simulation in ``folder``."""
    from spes_p2p.sim.summary import read_rows

    peers = sorted((folder / "peers").iterdir())
    return {d.name: read_rows(d) for d in peers if (d / "metrics.jsonl").exists()}


def _round_times(sim: dict) -> dict:
    later = [r for rs in sim["rows"].values() for r in rs[1:]]  # the first round includes the start-up
    if not later:  # the swarm did not get past its first round: its failures say why
        return dict.fromkeys(("round_seconds", "compute_seconds", "sync_wait_seconds", "dht_ms"))
    return {
        "round_seconds": statistics.median(r["compute_seconds"] + r["sync_wait_seconds"] for r in later),
        "compute_seconds": statistics.median(r["compute_seconds"] for r in later),
        "sync_wait_seconds": statistics.median(r["sync_wait_seconds"] for r in later),
        "dht_ms": statistics.median(r["dht_ms"] for r in later),
    }


def _wait_fraction(peers_rows, with_last: bool = False) -> float:
    """The share of wall time the training loop waited on the sync, over rounds 2 to n - 1: the first
    includes the start-up, and the last has no next round's compute to overlap its sync with (a run's drain,
    once per run, not once per round); ``with_last`` counts it too."""
    later = [r for rows in peers_rows for r in rows[1 : None if with_last else -1]]
    waited = sum(r["sync_wait_seconds"] for r in later)
    return waited / max(waited + sum(r["compute_seconds"] for r in later), 1e-9)


# ------------------------------------------------------------------------------------------- outputs


def headline(results: dict) -> dict:
    """The headline ratios of the sections that were measured."""
    figures = {}
    if _measured(results, "memory"):
        memory = results["memory"]
        diloco = memory["diloco"]["total_bytes"]
        figures["memory_ratio_vs_diloco"] = memory["spes"]["total_bytes"] / diloco
        figures["memory_ratio_vs_diloco_best"] = (
            min(r["total_bytes"] for k, r in memory.items() if k.startswith("spes")) / diloco
        )
    if _measured(results, "bytes"):
        preset = results["bytes"][-1]["preset"]
        wanted = (preset, "spes", "int8", DEFAULT_EXCHANGE)
        spes_int8 = next(
            r for r in results["bytes"] if (r["preset"], r["mode"], r["codec"], r["exchange"]) == wanted
        )
        for baseline in ("diloco_fp32", "diloco_rs_fp32", "allreduce_fp32"):
            figures[f"bytes_ratio_vs_{baseline}"] = spes_int8[f"ratio_vs_{baseline}"]
    if _measured(results, "loss"):
        final = {name: curve[-1][1] for name, curve in results["loss"].items()}
        figures["val_loss_ratio_vs_centralized"] = final["spes"] / final["centralized"]
        figures["val_loss_ratio_vs_diloco"] = final["spes"] / final["diloco"]
    if _measured(results, "sync"):
        figures["sync_wait_fraction"] = results["sync"]["overlap"]["sync_wait_fraction"]
    if _measured(results, "catch_up"):
        figures["catch_up_ratio_4_holders_vs_1"] = results["catch_up"]["ratio"]
    records = {r["peers"]: r for r in results.get("records", []) if not r["failures"]}
    if 16 in records and max(records) > 16:
        largest, base = records[max(records)], records[16]
        figures[f"dht_bytes_ratio_{largest['peers']}_vs_16_peers"] = (
            largest["dht_bytes_per_peer_round"] / base["dht_bytes_per_peer_round"]
        )
    figures.update(compression.headline(results, _measured))
    return figures


def _measured(results: dict, section: str) -> bool:
    return section in results and section not in results.get("failed", {})


def tables(results: dict) -> str:
    def row(*cells) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    def mib(n: float) -> str:
        return f"{n / 2**20:.2f}"

    out = []
    if "memory" in results:
        out += [
            row("configuration", "weights", "gradients", "optimizer", "outer state", "total", "peak RSS"),
            row(*["---"] * 7),
        ]
        parts = ("weights_bytes", "grads_bytes", "optimizer_bytes", "outer_bytes")
        for name, r in results["memory"].items():
            total = f"**{mib(r['total_bytes'])}**"
            out.append(row(name, *(mib(r[k]) for k in parts), total, mib(r["peak_rss_bytes"])))
    if "bytes" in results:
        out += bytes_tables(results["bytes"], row, mib)
    if "sync" in results:
        heads = ("share of wall time waiting", "with the last round", "seconds waited per round")
        out += ["", row("sync", *heads), row(*["---"] * 4)]
        for name, r in results["sync"].items():
            out.append(row(name, *_shares(r), f"{r['wait_seconds_per_round']:.2f}"))
    if "loss" in results:
        out += ["", row("method", "tokens", "final val loss"), row(*["---"] * 3)]
        for name, curve in results["loss"].items():
            out.append(row(name, f"{curve[-1][0]:,}", f"{curve[-1][1]:.3f}"))
    for section, backend in (("scale", "hivemind"), ("scale_libp2p", "libp2p")):
        scale = results.get(section, [])
        header = row(f"peers ({backend})", "round s", "compute s", "sync wait s", "DHT op ms", "vs 4 peers")
        out += ["", header, row(*["---"] * 6)] if scale else []
        for r in scale:
            if r["round_seconds"] is None:
                out.append(row(r["peers"], "failed:", "; ".join(r.get("failures", [])), "", "", ""))
                continue
            times = (f"{r[k]:.2f}" for k in ("round_seconds", "compute_seconds", "sync_wait_seconds"))
            ratio = f"{r['round_seconds'] / scale[0]['round_seconds']:.2f}x"
            stopped = f" ({r['rounds']} rounds; failed: {'; '.join(r['failures'])})" if r["failures"] else ""
            out.append(row(r["peers"], *times, f"{r['dht_ms']:.1f}", ratio + stopped))
    records = results.get("records", [])
    heads = (
        "round s",
        "DHT ops",
        "DHT KiB",
        "KiB/s",
        "busiest key",
        "its MiB/round",
        "CPU s",
        "vs 16",
        "failures",
    )
    out += ["", row("records: peers", *heads), row(*["---"] * 10)] if records else []
    base = next((r for r in records if r["peers"] == 16 and not r["failures"]), None)
    for r in records:
        if r["round_seconds"] is None:
            out.append(row(r["peers"], "failed:", "; ".join(r["failures"]).replace("|", "/"), *[""] * 7))
            continue
        ratio = f"{r['dht_bytes_per_peer_round'] / base['dht_bytes_per_peer_round']:.2f}x" if base else ""
        out.append(
            row(
                r["peers"],
                f"{r['round_seconds']:.1f}",
                f"{r['dht_ops_per_peer_round']:.0f}",
                f"{r['dht_bytes_per_peer_round'] / 1024:.1f}",
                f"{r['dht_bytes_per_peer_second'] / 1024:.2f}",
                r["busiest_key"],
                f"{r['busiest_key_bytes_per_round'] / 2**20:.2f}",
                f"{r['cpu_seconds_per_peer_round']:.2f}",
                ratio,
                len(r["failures"]),  # (a swarm that failed measured all the same: its figures are shown)
            )
        )
    wan = results.get("wan")
    if wan:
        heads = ("sync-wait share", "with the last round", "round s", "sync wait s")
        out += ["", row("wan", *heads), row(*["---"] * 5)]
        for name in ("public", "nat"):
            r = wan[name]["all"]
            times = f"{r['round_seconds']:.2f}", f"{r['sync_wait_seconds']:.2f}"
            out.append(row(f"{name}: all peers", *_shares(r), *times))
        natted = wan["nat"]["natted"]
        out.append(row(f"nat: {natted['peer']} (behind NAT)", *_shares(natted), "", ""))
    catch_up = results.get("catch_up")
    if catch_up:
        out += ["", row("catch_up: holders of each unit", "seconds to download the model"), row("---", "---")]
        for holders in (1, CATCH_UP_HOLDERS):
            out.append(row(holders, f"{catch_up[f'holders_{holders}']['seconds']:.2f}"))
    backends = results.get("backends")
    if backends:
        heads = ("start s", "join s", "DHT write ms", "DHT read ms", "stream MiB/s", "round s", "vs hivemind")
        out += ["", row("backend", *heads), row(*["---"] * 8)]
        for name, r in backends.items():
            ratio = r["round_seconds"] / backends["hivemind"]["round_seconds"] if r["round_seconds"] else None
            cells = (r["start_seconds"], r["join_seconds"], r["dht_write_ms"], r["dht_read_ms"])
            out.append(
                row(
                    name,
                    *(f"{c:.2f}" if c < 10 else f"{c:.1f}" for c in cells),
                    f"{r['stream_mib_per_s']:.0f}",
                    f"{r['round_seconds']:.2f}" if r["round_seconds"] else "failed",
                    f"{ratio:.2f}x" if ratio else "",
                )
            )
    out += compression.codec_tables(results, row, mib)
    missed = {
        **results.get("skipped", {}),
        **{k: f"failed: {v}" for k, v in results.get("failed", {}).items()},
    }
    if missed:
        out += ["", row("section not measured", "why"), row("---", "---")]
        out += [row(name, why.replace("|", "/")) for name, why in missed.items()]
    return "\n".join(out)


def _shares(r: dict) -> tuple[str, str]:
    """The sync-wait share of rounds 2 to n - 1, and of rounds 2 to n."""
    return f"{r['sync_wait_fraction']:.3f}", f"{r['sync_wait_fraction_with_last']:.3f}"


def bytes_tables(rows: list[dict], row, mib) -> list[str]:
    """Every run (MiB sent and received, ratios), then per preset and codec: the ratio against DiLoCo's fp32
    all-to-all in each exchange, a column per change."""
    heads = (
        "sent MiB",
        "received MiB",
        "vs DiLoCo fp32",
        "vs DiLoCo fp32 reduce-scatter",
        "vs fp32 all-reduce",
    )
    out = ["", row("preset", "method", "codec", "exchange", *heads), row(*["---"] * (4 + len(heads)))]
    for r in rows:
        ratios = (
            f"{r[k]:.3f}"
            for k in ("ratio_vs_diloco_fp32", "ratio_vs_diloco_rs_fp32", "ratio_vs_allreduce_fp32")
        )
        out.append(
            row(
                r["preset"], r["mode"], r["codec"], r["exchange"], mib(r["sent"]), mib(r["received"]), *ratios
            )
        )
    spes = [r for r in rows if r["mode"] == "spes"]
    exchanges = [e for e in EXCHANGES if any(r["exchange"] == e for r in spes)]
    out += ["", row("preset", "codec", *exchanges), row(*["---"] * (2 + len(exchanges)))]
    for preset, codec in dict.fromkeys((r["preset"], r["codec"]) for r in spes):
        cells = {
            r["exchange"]: f"{r['ratio_vs_diloco_fp32']:.3f}"
            for r in spes
            if (r["preset"], r["codec"]) == (preset, codec)
        }
        out.append(row(preset, codec, *(cells.get(e, "") for e in exchanges)))
    return out


def plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "loss" in results:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, curve in results["loss"].items():
            ax.plot([t for t, _ in curve], [v for _, v in curve], marker="o", label=name)
        ax.set(xlabel="tokens (all peers)", ylabel="validation loss", title="Validation loss at equal tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=120)
    if "memory" in results:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        names = list(results["memory"])
        ax.bar(names, [results["memory"][n]["total_bytes"] / 2**20 for n in names])
        ax.set(ylabel="MiB", title="Allocated training state per peer")
        ax.tick_params(axis="x", rotation=20)
        fig.tight_layout()
        fig.savefig(out / "memory.png", dpi=120)
    plt.close("all")


def _section(name: str) -> str:
    if name not in SECTIONS:
        raise argparse.ArgumentTypeError(f"no section {name!r}; choose from {', '.join(SECTIONS)}")
    return name


def missing(name: str) -> str | None:
    """What this machine lacks to run section ``name`` (one line), or None."""
    if name in ("wan", "codec_wan", "catch_up"):
        from spes_p2p.sim.netns import missing_tools

        return missing_tools(nat=True)
    return None


def run_sections(
    sections: dict[str, Callable[[], object]],
    results: dict,
    save: Callable[[dict], None],
    lacks: Callable[[str], str | None] = missing,
) -> bool:
    """Runs each section and saves the results after each one; a section this machine cannot run is skipped
    with its reason, one that fails is recorded with its error, and the others run all the same. Returns
    whether every section that ran succeeded."""
    timings = results.setdefault("section_seconds", {})
    skipped, failed = results.setdefault("skipped", {}), results.setdefault("failed", {})
    for name, measure in sections.items():
        skipped.pop(name, None)
        failed.pop(name, None)
        reason = lacks(name)
        if reason:
            print(f"{name}: skipped: {reason}", flush=True)
            skipped[name] = reason
            results.pop(name, None)
        else:
            began = time.perf_counter()
            try:
                results[name] = measure()
            except Exception as exc:
                traceback.print_exc()
                failed[name] = f"{type(exc).__name__}: {exc}"
                results.pop(name, None)
            timings[name] = time.perf_counter() - began
        save(results)
    return not failed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="A few minutes instead of the full run.")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument(
        "--only",
        type=lambda text: [_section(name) for name in text.split(",")],
        help=f"Run only these sections (comma-separated: {', '.join(SECTIONS)}), updating DIR/summary.json.",
    )
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        function, *arguments = json.loads(args.child)
        print(json.dumps({"memory_child": memory_child, "swarm_bytes": swarm_bytes}[function](*arguments)))
        return 0
    mode = MODES["quick" if args.quick else "full"]
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    results = json.loads(summary_path.read_text()) if args.only and summary_path.exists() else {}
    started = time.perf_counter()
    results.update(
        {
            "mode": "quick" if args.quick else "full",
            "machine": {
                "platform": platform.platform(),
                "cpus": torch.get_num_threads(),
                "torch": torch.__version__,
            },
        }
    )
    sections = {
        "memory": lambda: bench_memory(mode["memory_preset"]),
        "bytes": lambda: bench_bytes(mode["bytes_presets"]),
        "sync": lambda: bench_sync(args.out, **mode["sync"]),
        "loss": lambda: bench_loss(args.out, **mode["loss"]),
        "scale": lambda: bench_scale(args.out, **mode["scale"]),
        "scale_libp2p": lambda: bench_scale(args.out, **mode["scale"], backend="libp2p"),
        "records": lambda: bench_records(args.out, **mode["records"]),
        "wan": lambda: bench_wan(args.out, **mode["wan"]),
        "backends": lambda: bench_backends(args.out, **mode["backends"]),
        "codec_bytes": lambda: bench_codec_bytes(["int8", "sparseloco"], results),
        "codec_time": lambda: compression.bench_codec_time(mode["codec_presets"], ["int8", "sparseloco"]),
        "codec_loss": lambda: bench_codec_loss(args.out, **mode["loss"], **mode["codec_loss"]),
        "codec_wan": lambda: bench_codec_wan(args.out, results, **mode["wan"]),
        "catch_up": lambda: bench_catch_up(args.out, **mode["catch_up"]),
    }
    chosen = {name: sections[name] for name in args.only or SECTIONS}
    lacks = lambda name: mode["full_only"].get(name) or missing(name)  # noqa: E731
    ok = run_sections(chosen, results, lambda r: save(r, args.out), lacks)
    if not args.only:
        results["seconds"] = time.perf_counter() - started
    save(results, args.out)
    plots(results, args.out)
    print(tables(results))
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, (dict, list))}, indent=1))
    for name, why in {**results["skipped"], **results["failed"]}.items():
        print(f"{name}: {'FAILED' if name in results['failed'] else 'skipped'}: {why}", file=sys.stderr)
    return 0 if ok else 1


def save(results: dict, out: Path) -> None:
    """summary.json (with the headline ratios of what was measured) and tables.md, each replaced whole."""
    results.update(headline(results))
    files = {"summary.json": json.dumps(results, indent=1), "tables.md": tables(results) + "\n"}
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


if __name__ == "__main__":
    sys.exit(main())
