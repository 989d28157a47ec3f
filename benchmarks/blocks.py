"""Memory and validation loss of a peer with dense blocks (BCD) and quantized frozen copies, side by side.

Memory: a peer of a preset with 4 shards and 1 owned, after one step (``spes memory``) and measured while it
trains in a local swarm (``spes memory --running``: the steady-state peak of the median peer), each next to
a DiLoCo peer measured the same way. Loss: the same settings in a simulated 4-peer swarm (memory backend,
every peer in this process) on an equal token budget; the validation loss is the mean over peers of the
last evaluation.

    python benchmarks/blocks.py --memory-preset small --sim-preset tiny --rounds 12 --out runs/bench-blocks
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from spes_p2p.settings import Settings
from spes_p2p.sim import run, simulation
from spes_p2p.sim.running_memory import running
from spes_p2p.sim.summary import read_rows
from spes_p2p.train.accounting import compare

# (dense blocks, frozen experts, frozen dense blocks): SPES as published, the defaults, the smallest peer
SETTINGS = [(1, "full", "full"), (2, "int8", "int8"), (4, "nf4", "nf4")]


def settings_of(preset: str, blocks: int, experts: str, dense: str) -> Settings:
    return Settings().override(
        {
            "model.preset": preset,
            "model.shards": 4,
            "model.dense_blocks": blocks,
            "peer.capacity": 1,
            "peer.active_blocks": 1,
            "train.frozen_experts": experts,
            "train.frozen_dense": dense,
        }
    )


def memory_table(preset: str, measure_running: bool) -> list[dict]:
    rows, diloco = [], None
    for blocks, experts, dense in SETTINGS:
        s = settings_of(preset, blocks, experts, dense)
        r = compare(s.model, 1, 1, s.train)
        row = {"dense_blocks": blocks, "frozen_experts": experts, "frozen_dense": dense}
        row.update({k: v for k, v in r.items() if k not in ("full", "diloco")})
        row["diloco_total_bytes"] = r["diloco"]["total_bytes"]
        if measure_running:
            if diloco is None:  # one DiLoCo swarm, the same peers as every SPES one
                diloco = running(s.override({"method.mode": "diloco", "model.dense_blocks": 1}))
            row["running"] = running(s)
            row["running_diloco"] = diloco
            row["running_diloco_peak_bytes"] = diloco["peak_bytes"]
            row["running_ratio_vs_diloco"] = row["running"]["peak_bytes"] / diloco["peak_bytes"]
        rows.append(row)
        print({k: v for k, v in row.items() if "ratio" in k}, flush=True)
    return rows


def loss_table(preset: str, rounds: int, steps: int, out: Path) -> list[dict]:
    rows = []
    for blocks, experts, dense in SETTINGS:
        folder = out / f"sim-B{blocks}-{experts}-{dense}"
        started = time.perf_counter()
        cfg = simulation(
            {
                "sim.peers": 4,
                "model.shards": 2,
                "model.preset": preset,
                "run.rounds": rounds,
                "method.steps_per_round": steps,
                "swarm.backend": "memory",
                "model.dense_blocks": blocks,
                "peer.active_blocks": 1,
                "method.rotate_every_rounds": 2,
                "train.frozen_experts": experts,
                "train.frozen_dense": dense,
                "run.out": str(folder),
            }
        )
        summary = run(cfg)
        val = []
        for peer in sorted((folder / "peers").iterdir()):
            evals = [row for row in read_rows(peer) if "val_loss" in row]
            if evals:
                val.append(evals[-1]["val_loss"])
        rows.append(
            {
                "dense_blocks": blocks,
                "frozen_experts": experts,
                "frozen_dense": dense,
                "tokens_per_peer": rounds * steps * cfg.train.batch_size * cfg.train.seq_len,
                "val_loss": statistics.fmean(val),
                "final_train_loss": summary["final_loss"],
                "uncovered_unit_rounds": summary["uncovered_unit_rounds"],
                "seconds": time.perf_counter() - started,
            }
        )
        print(rows[-1], flush=True)
    return rows


def markdown(memory: list[dict], loss: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| dense blocks (active) | frozen experts, dense | weights | gradients | optimizer | outer | total "
        "| vs DiLoCo | running | vs DiLoCo |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in memory:
        run_ = r.get("running") or {}
        measured = run_ and f"{run_['peak_bytes'] / mib:.1f} MiB | **{r['running_ratio_vs_diloco']:.2f}x** |"
        lines.append(
            f"| {r['dense_blocks']} (1) | {r['frozen_experts']}, {r['frozen_dense']} | "
            f"{r['weights_bytes'] / mib:.1f} MiB | {r['grads_bytes'] / mib:.1f} MiB | "
            f"{r['optimizer_bytes'] / mib:.1f} MiB | {r['outer_bytes'] / mib:.1f} MiB | "
            f"{r['total_bytes'] / mib:.1f} MiB | {r['ratio_vs_diloco']:.2f}x | " + (measured or "- | - |")
        )
    lines += [
        "",
        "| dense blocks (active) | frozen experts, dense | tokens per peer | val loss | train loss "
        "| uncovered |",
        "|---|---|---|---|---|---|",
    ]
    for r in loss:
        lines.append(
            f"| {r['dense_blocks']} (1) | {r['frozen_experts']}, {r['frozen_dense']} | "
            f"{r['tokens_per_peer']:,} | {r['val_loss']:.3f} | {r['final_train_loss']:.3f} | "
            f"{r['uncovered_unit_rounds']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--memory-preset", default="small")
    parser.add_argument("--sim-preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-blocks"))
    parser.add_argument("--no-running", action="store_true", help="Skip the memory measured while training.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    memory = memory_table(args.memory_preset, not args.no_running)
    loss = loss_table(args.sim_preset, args.rounds, args.steps_per_round, args.out)
    (args.out / "blocks.json").write_text(json.dumps({"memory": memory, "loss": loss}, indent=1))
    print(markdown(memory, loss))


if __name__ == "__main__":
    main()
