"""One GPU, within 10 minutes: tokens/s and peak memory of a peer for the small and 1b presets.

Configurations per preset: a peer that trains everything (a DiLoCo peer, or centralized training), a SPES peer
(1 of 4 expert shards and the whole dense part), and a SPES peer with 4 dense blocks (1 trained) and frozen
experts held in NF4. Random tokens (throughput does not depend on the text), adamw8bit, bf16 autocast.

    python benchmarks/gpu.py --out runs/bench-gpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spes_p2p.model import MoETransformer, UnitLayout, get_preset
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.memory import weights_bytes
from spes_p2p.train.trainer import Trainer

CONFIGS = {  # name -> (trains everything, dense blocks, frozen experts)
    "everything": (True, 1, "full"),
    "spes": (False, 1, "full"),
    "spes+bcd+nf4": (False, 4, "nf4"),
}


def measure(preset: str, name: str, batch: int, seq: int, steps: int) -> dict:
    everything, blocks, frozen = CONFIGS[name]
    cfg = get_preset(preset)
    layout = UnitLayout.for_model(cfg, 4, blocks)
    units = layout.units if everything else [layout.dense_units[-1], "experts/0"]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = MoETransformer(cfg).cuda()
    trainer = Trainer(
        model, layout, units, TrainConfig(optimizer="adamw8bit", warmup_steps=0, frozen_experts=frozen)
    )
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):  # warm-up: kernels, optimizer state
            trainer.train_step(tokens[:, :-1], tokens[:, 1:])
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(tokens[:, :-1], tokens[:, 1:])
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    report = {
        "preset": preset,
        "config": name,
        "units": units,
        "tokens_per_s": steps * batch * seq / seconds,
        "weights_bytes": weights_bytes(model),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
    }
    del trainer, model
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["small", "1b"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: this benchmark measures a GPU; see benchmarks/run.py for CPU figures"
        )
    rows = []
    for preset in args.presets:
        for name in CONFIGS:
            rows.append(measure(preset, name, args.batch, args.seq, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        base = next(b for b in rows if b["preset"] == r["preset"] and b["config"] == "everything")
        r["memory_ratio_vs_everything"] = r["peak_allocated_bytes"] / base["peak_allocated_bytes"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
