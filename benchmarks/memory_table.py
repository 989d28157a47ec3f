"""Memory per preset and role, for volunteers choosing hardware (docs/memory.md).

After one step: computed exactly from the model's shapes (``train.fit.held_bytes``: weights as held,
gradients and optimizer state of what is trained; it matches ``spes memory``'s measured bytes). While
training: those weights, plus what a running peer holds per byte it trains, measured on ``small`` by
``benchmarks/blocks.py`` (the running peers' steady-state peak, less their weights, over the bytes they
train) and applied to each preset. Activations and the runtime come on top of both.

    python benchmarks/memory_table.py --measured runs/bench-blocks/blocks.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spes_p2p.model import get_preset
from spes_p2p.model.config import PRESETS
from spes_p2p.train.fit import Plan, held_bytes

# role -> (plan of a 4-shard swarm peer, the blocks.py row whose running peers give its overhead per
# trained byte: (dense blocks, frozen experts, frozen dense), or "diloco")
ROLES = {
    "DiLoCo peer": (Plan(shards=4, everything=True), "diloco"),
    "SPES as published (B 1, full)": (Plan(shards=4), (1, "full", "full")),
    "default peer (B 2, int8)": (
        Plan(shards=4, dense_blocks=2, frozen_experts="int8", frozen_dense="int8"),
        (2, "int8", "int8"),
    ),
    "smallest peer (B 4, nf4)": (
        Plan(shards=4, dense_blocks=4, frozen_experts="nf4", frozen_dense="nf4"),
        (4, "nf4", "nf4"),
    ),
}


def overheads(measured: dict) -> dict:
    """Per role: what a running peer holds beyond its weights, per byte it trains (from blocks.json)."""
    out = {}
    for row in measured["memory"]:
        key = (row["dense_blocks"], row["frozen_experts"], row["frozen_dense"])
        run = row["running"]
        weights = run["memory_bytes"]["weights"] + run["memory_bytes"]["frozen"]
        out[key] = (run["peak_bytes"] - weights) / run["memory_bytes"]["weights"]
        everything = 4 * row["total_params"]  # a DiLoCo peer trains every weight, in float32
        out["diloco"] = (row["running_diloco_peak_bytes"] - everything) / everything
    return out


def table(measured: dict) -> str:
    per_byte = overheads(measured)
    lines = [
        "| preset | parameters | role | after one step | while training |",
        "|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        cfg = get_preset(preset)
        if cfg.n_experts % 4:
            continue
        for role, (plan, key) in ROLES.items():
            held = held_bytes(cfg, plan)
            step = sum(held.values())
            running = held["trained"] + held["frozen"] + per_byte[key] * held["trained"]
            params = held_bytes(cfg, Plan(shards=4, everything=True))["trained"] // 4
            lines.append(f"| {preset} | {_count(params)} | {role} | {_size(step)} | {_size(running)} |")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--measured", type=Path, default=Path("runs/bench-blocks/blocks.json"))
    args = parser.parse_args()
    print(table(json.loads(args.measured.read_text())))


if __name__ == "__main__":
    main()
