"""Memory and validation loss of a peer with dense blocks (BCD) and quantized frozen experts, side by side.

Memory: ``spes memory`` for a preset with 4 shards and 1 owned, for B = 1 and B = 4 (1 active) dense blocks,
each with full, int8 and nf4 frozen experts. Loss: the same six settings in a simulated 4-peer swarm
(memory backend, every peer in this process) on an equal token budget; the validation loss is the mean over
peers of the last evaluation.

    python benchmarks/blocks.py --memory-preset small --sim-preset tiny --rounds 12 --out runs/bench-blocks
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from spes_p2p.model.config import ModelSettings
from spes_p2p.sim import run, simulation
from spes_p2p.sim.summary import read_rows
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.memory import compare

SETTINGS = [(b, f) for b in (1, 4) for f in ("full", "int8", "nf4")]


def memory_table(preset: str) -> list[dict]:
    rows = []
    for blocks, frozen in SETTINGS:
        model = ModelSettings(preset=preset, shards=4, dense_blocks=blocks)
        r = compare(model, 1, 1, TrainConfig(frozen_experts=frozen, batch_size=4))
        rows.append(
            {"dense_blocks": blocks, "frozen_experts": frozen, **{k: v for k, v in r.items() if k != "full"}}
        )
        rows[-1]["full_total_bytes"] = r["full"]["total_bytes"]
    return rows


def loss_table(preset: str, rounds: int, steps: int, out: Path) -> list[dict]:
    rows = []
    for blocks, frozen in SETTINGS:
        folder = out / f"sim-B{blocks}-{frozen}"
        started = time.perf_counter()
        cfg = simulation(
            sim__peers=4,
            model__shards=2,
            model__preset=preset,
            run__rounds=rounds,
            method__steps_per_round=steps,
            sim__backend="memory",
            model__dense_blocks=blocks,
            peer__active_blocks=1,
            method__rotate_every_rounds=2,
            train__frozen_experts=frozen,
            run__out=str(folder),
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
                "frozen_experts": frozen,
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
        "| dense blocks (active) | frozen experts | weights | gradients | optimizer | total | vs all |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in memory:
        lines.append(
            f"| {r['dense_blocks']} (1) | {r['frozen_experts']} | {r['weights_bytes'] / mib:.1f} MiB | "
            f"{r['grads_bytes'] / mib:.1f} MiB | {r['optimizer_bytes'] / mib:.1f} MiB | "
            f"{r['total_bytes'] / mib:.1f} MiB | **{r['ratio_vs_full']:.2f}x** |"
        )
    lines += [
        "",
        "| dense blocks (active) | frozen experts | tokens per peer | val loss | train loss | uncovered |",
        "|---|---|---|---|---|---|",
    ]
    for r in loss:
        lines.append(
            f"| {r['dense_blocks']} (1) | {r['frozen_experts']} | {r['tokens_per_peer']:,} | "
            f"{r['val_loss']:.3f} | {r['final_train_loss']:.3f} | {r['uncovered_unit_rounds']} |"
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
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    memory = memory_table(args.memory_preset)
    loss = loss_table(args.sim_preset, args.rounds, args.steps_per_round, args.out)
    (args.out / "blocks.json").write_text(json.dumps({"memory": memory, "loss": loss}, indent=1))
    print(markdown(memory, loss))


if __name__ == "__main__":
    main()
