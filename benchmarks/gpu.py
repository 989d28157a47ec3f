"""One GPU, in one command of under 10 minutes: tokens/s and peak GPU memory of a peer, small and 1b presets.

Three peers per preset, each through the library's own path (``resolve_device``, ``place``, ``Trainer``,
whose step runs the forward pass under bf16 autocast), with 8-bit AdamW:

    diloco     a DiLoCo peer: trains every unit, fp32 weights, plus the outer state DiLoCo holds on the
               device (a snapshot of the weights and the Nesterov momentum, fp32 each)
    spes       a SPES peer: 1 of 4 expert shards and the whole dense part; the other experts fp32, frozen
    spes+bcd   a SPES peer with 4 dense blocks (it trains the largest one) and its frozen experts in nf4

Random tokens (throughput does not depend on the text), moved from the CPU each step as a peer's batches
are. Figures: tokens/s over the measured steps (after warm-up), ``torch.cuda.max_memory_allocated`` over the
whole life of the peer (built, warmed up, measured), each next to DiLoCo's, and the pre-flight estimate
(``spes_p2p.train.fit``) beside the measured peak. A wall-clock budget (``--budget-s``) bounds the run: each
peer measures at most ``--steps`` steps and at most ``--peer-s`` seconds, and a peer that would start past
the budget is skipped and marked so.

    python benchmarks/gpu.py --out runs/bench-gpu      # writes results.json and results.md there
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from pathlib import Path

import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model import MoETransformer, UnitLayout, get_preset
from spes_p2p.model.units import unit_parameters
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.device import place, resolve_device
from spes_p2p.train.fit import Plan, estimate_bytes
from spes_p2p.train.trainer import Trainer

SHARDS = 4
PEERS = {  # name -> (trains every unit, dense blocks, frozen experts)
    "diloco": (True, 1, "full"),
    "spes": (False, 1, "full"),
    "spes+bcd": (False, 4, "nf4"),
}
WARMUP_STEPS = 3  # kernels, the allocator, optimizer state


def main() -> None:
    args = parse_args()
    try:
        device = resolve_device("cuda")
    except ConfigError:
        raise SystemExit(
            f"benchmarks/gpu.py measures a GPU, but torch {torch.__version__} finds no CUDA device on this "
            "machine: run it where there is one (benchmarks/run.py measures on the CPU)"
        ) from None
    deadline = time.monotonic() + args.budget_s
    rows = []
    for preset in args.presets:
        cpu_model = build(preset)
        for name in PEERS:
            if time.monotonic() + args.peer_s > deadline:
                rows.append({"preset": preset, "peer": name, "skipped": "past the wall-clock budget"})
            else:
                rows.append(measure(cpu_model, preset, name, device, args, deadline))
            print(json.dumps(rows[-1]), flush=True)
        del cpu_model
    compare_with_diloco(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
    }
    (args.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (args.out / "results.md").write_text(markdown(meta, rows))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    if any("error" in r for r in rows):
        raise SystemExit("some peers failed: see the error in their rows")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["small", "1b"])
    parser.add_argument("--batch", type=int, default=16, help="Sequences per step.")
    parser.add_argument("--seq", type=int, default=512, help="Tokens per sequence.")
    parser.add_argument("--steps", type=int, default=20, help="Measured steps per peer, at most.")
    parser.add_argument(
        "--peer-s", type=float, default=60.0, help="Seconds of measured steps per peer, at most."
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="Wall-clock budget of the whole run.")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-gpu"))
    return parser.parse_args()


def build(preset: str) -> MoETransformer:
    """The preset's initial model, on the CPU (as a peer builds it); each peer gets a copy."""
    torch.manual_seed(0)
    return MoETransformer(get_preset(preset))


def measure(
    cpu_model: MoETransformer, preset: str, name: str, device: torch.device, args, deadline: float
) -> dict:
    everything, blocks, frozen = PEERS[name]
    cfg = cpu_model.cfg
    layout = UnitLayout.for_model(cfg, SHARDS, blocks)
    units = layout.units if everything else [largest_block(cpu_model, layout), "experts/0"]
    plan = Plan(shards=SHARDS, dense_blocks=blocks, frozen_experts=frozen, everything=everything)
    row = {"preset": preset, "peer": name, "units": units, "estimate_bytes": estimate_bytes(cfg, plan)}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        row.update(train(cpu_model, layout, units, frozen, everything, device, args, deadline))
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    gc.collect()
    torch.cuda.empty_cache()
    return row


def train(cpu_model, layout, units, frozen, everything, device, args, deadline) -> dict:
    model = place(copy.deepcopy(cpu_model), device)
    trainer = Trainer(model, layout, units, TrainConfig(warmup_steps=0, frozen_experts=frozen))
    outer = []
    if everything:  # DiLoCo's outer state: the round's starting weights and the outer Nesterov momentum
        outer = [t for p in model.parameters() for t in (p.detach().clone(), torch.zeros_like(p))]
    vocab = model.cfg.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1)) for _ in range(4)]  # on the CPU
    for i in range(WARMUP_STEPS):
        trainer.train_step(batches[i % 4][:, :-1], batches[i % 4][:, 1:])
    torch.cuda.synchronize(device)
    started, steps, losses = time.perf_counter(), 0, []
    stop = min(time.monotonic() + args.peer_s, deadline)
    while steps < args.steps and (steps < 2 or time.monotonic() < stop):
        batch = batches[steps % 4]
        losses.append(trainer.train_step(batch[:, :-1], batch[:, 1:]).loss)
        steps += 1
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    del outer, trainer, model
    return {
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": steps * args.batch * args.seq / seconds,
        "last_loss": losses[-1],
    }


def largest_block(model: MoETransformer, layout: UnitLayout) -> str:
    """The dense block with the most parameters: a BCD peer's worst case."""
    return max(
        layout.dense_units, key=lambda u: sum(p.numel() for p in unit_parameters(model, layout, u).values())
    )


def compare_with_diloco(rows: list[dict]) -> None:
    for row in rows:
        base = next((r for r in rows if r["preset"] == row["preset"] and r["peer"] == "diloco"), {})
        if "tokens_per_s" in row and "tokens_per_s" in base:
            row["memory_vs_diloco"] = row["peak_allocated_bytes"] / base["peak_allocated_bytes"]
            row["speed_vs_diloco"] = row["tokens_per_s"] / base["tokens_per_s"]


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"{meta['device']}, torch {meta['torch']}, batches of {meta['batch']} x {meta['seq']} tokens, "
        "8-bit AdamW, bf16 autocast.",
        "",
        "| preset | peer | tokens/s | peak allocated | memory vs DiLoCo | tokens/s vs DiLoCo | pre-flight |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['preset']} | {r['peer']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        memory, speed = r.get("memory_vs_diloco", float("nan")), r.get("speed_vs_diloco", float("nan"))
        lines.append(
            f"| {r['preset']} | {r['peer']} | {r['tokens_per_s']:,.0f} | {gib(r['peak_allocated_bytes'])} | "
            f"{memory:.2f}x | {speed:.2f}x | {gib(r['estimate_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


if __name__ == "__main__":
    main()
