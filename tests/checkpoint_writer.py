"""A process that writes checkpoints as fast as it can, for a test that SIGKILLs it at random moments.

Usage: python checkpoint_writer.py RUN_DIR. It resumes from RUN_DIR's newest checkpoint, prints
"ready <step>", then writes checkpoints forever: each step twice (so rewrites of a step are cut short
too), with every weight set to the step, and prints "done <step>" once a write has returned.
"""

import sys
from pathlib import Path

import torch

from spes_p2p.errors import CheckpointError
from spes_p2p.train.checkpoint import load_checkpoint, recover, save_checkpoint
from spes_p2p.train.optim import build_optimizer

OPTIMIZER = {"kind": "adamw8bit", "lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.0}


def main(run_dir: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))
    # the peers' 8-bit optimizer (torch's imports torch's compiler at its first step: seconds of each start)
    optimizer = build_optimizer(list(model.named_parameters()), **OPTIMIZER)
    model(torch.ones(1, 1024)).sum().backward()
    optimizer.step()  # optimizer state to write
    recover(run_dir)
    try:
        step = load_checkpoint(run_dir).meta["step"]
    except CheckpointError:
        step = 0
    print(f"ready {step}", flush=True)
    for n in range(2 * step, 10**9):
        step = n // 2
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        save_checkpoint(run_dir, step, model, optimizer, {"written": n}, keep=2)
        print(f"done {step}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
