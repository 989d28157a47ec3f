"""What a robust aggregation rule costs in a clean run: each `method.aggregate` next to `mean`.

    python benchmarks/robust.py --out runs/bench-robust            # about 15 minutes on 2 cores
    python benchmarks/robust.py --out runs/bench-robust --seeds 1  # one seed: a quick look

Every rule trains the same swarm (memory backend, 4 peers, 2 shards, the embedded corpus) from the same seeds;
the figure is the peers' final validation loss. The spread of ``mean`` across seeds is the noise a rule's
cost is measured against. Writes OUT/robust.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from spes_p2p.sim import run, simulation
from spes_p2p.sync.config import AGGREGATES

SWARM = {
    "swarm.backend": "memory",
    "sim.peers": 4,
    "model.shards": 2,
    "run.rounds": 12,
    "method.steps_per_round": 10,
    "train.batch_size": 8,
    "train.seq_len": 64,
    "train.eval_every": 40,
    "data.max_corpus_mb": 2.0,
}


def final_val_loss(aggregate: str, seed: int, out: Path) -> float:
    summary = run(
        simulation(
            {
                "method.aggregate": aggregate,
                "train.seed": seed,
                "run.out": str(out / f"{aggregate}-{seed}"),
                **SWARM,
            }
        )
    )
    if summary["failures"]:
        raise SystemExit(f"{aggregate}, seed {seed}: the run failed: {summary['failures']}")
    if summary["final_val_loss"] is None:
        raise SystemExit(f"{aggregate}, seed {seed}: no validation loss at the last round (see eval_every)")
    return summary["final_val_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    losses = {a: [final_val_loss(a, s, args.out) for s in seeds] for a in AGGREGATES}
    base = statistics.median(losses["mean"])
    noise = max(losses["mean"]) - min(losses["mean"])
    table = {
        a: {"losses": v, "median": statistics.median(v), "vs_mean": statistics.median(v) / base}
        for a, v in losses.items()
    }
    print(f"final validation loss, {len(seeds)} seeds; spread of mean across seeds: {noise:.4f}")
    print("| aggregate | median | vs mean | per seed |\n|---|---|---|---|")
    for a, row in table.items():
        per_seed = ", ".join(f"{x:.4f}" for x in row["losses"])
        print(f"| {a} | {row['median']:.4f} | {row['vs_mean']:.4f} | {per_seed} |")
    (args.out / "robust.json").write_text(
        json.dumps({"swarm": SWARM, "noise": noise, "rules": table}, indent=1)
    )


if __name__ == "__main__":
    main()
