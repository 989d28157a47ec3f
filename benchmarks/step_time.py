"""Seconds per training step of each preset, as a simulated peer takes them: the figures behind
``spes simulate --compute virtual`` (``model.config.STEP_SECONDS``).

A peer of the simulator's default swarm (4 expert shards, 2 dense blocks) trains one shard and one block,
holds the rest in int8, with 8-bit AdamW, on batches of 8 x 128 tokens, on one thread (simulated peers run
with ``OMP_NUM_THREADS=1``). A step is ``Trainer.train_step``: forward, backward, clip, optimizer step. The
figure is the median of the timed steps, after warm-up steps, in CPU seconds of this process: on one thread
that is the step's wall time on an idle core, and it holds on a machine busy with other work (the wall time,
which does not, is recorded beside it).

    python benchmarks/step_time.py --presets tiny small 1b --out runs/step_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from spes_p2p.model import MoETransformer
from spes_p2p.model.config import STEP_BATCH, STEP_SEQ_LEN
from spes_p2p.model.units import layout_of
from spes_p2p.settings import Settings
from spes_p2p.train.trainer import Trainer

TRAINED = ["dense/0", "experts/0"]


def step_seconds(preset: str, warmup: int, steps: int) -> dict:
    settings = Settings().override({"model.preset": preset, "model.shards": 4, "model.dense_blocks": 2})
    arch, layout = settings.model.architecture(), layout_of(settings.model)
    torch.manual_seed(0)
    model = MoETransformer(arch)
    trainer = Trainer(model, layout, TRAINED, settings.train)
    batch = torch.randint(0, arch.vocab_size, (STEP_BATCH, STEP_SEQ_LEN + 1))
    cpu, wall = [], []
    for i in range(warmup + steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        trainer.train_step(batch[:, :-1], batch[:, 1:])
        if i >= warmup:
            cpu.append(time.process_time() - started_cpu)
            wall.append(time.perf_counter() - started)
    return {"preset": preset, "seconds": statistics.median(cpu), "cpu_seconds": cpu, "wall_seconds": wall}


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/step_time.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for preset in args.presets:
        rows.append(step_seconds(preset, args.warmup, args.steps))
        print(f"{preset}: {rows[-1]['seconds']:.4f} s/step", flush=True)
    machine = {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
