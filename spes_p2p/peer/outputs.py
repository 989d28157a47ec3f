"""What a training peer leaves in its run folder::

OUT/metrics.jsonl      one JSON object per round
OUT/checkpoints/       model, optimizer, data position and the swarm's tokenizer, every few rounds
                       (spes_p2p.train.checkpoint)
OUT/model.safetensors  on exit: every tensor as this peer holds it (frozen copies included)
OUT/tokenizer.json     on exit: the swarm's tokenizer
OUT/state.json         on exit: peer id, round, the units it trained last, the model's config
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from spes_p2p.errors import CheckpointError
from spes_p2p.files import writable_folder
from spes_p2p.train.checkpoint import Checkpoint, load_checkpoint, recover, save_checkpoint


class RunOutputs:
    def __init__(self, out_dir: Path, tokenizer: bytes, keep: int = 2) -> None:
        """``tokenizer``: the swarm's, saved in every checkpoint; ``keep``: the newest checkpoints kept."""
        self.dir, self.tokenizer, self.keep = writable_folder(Path(out_dir), "--out"), tokenizer, keep
        recover(self.dir)  # what a peer killed mid-checkpoint left

    def append(self, row: dict) -> None:
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def checkpoint(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int, meta: dict
    ) -> Path:
        """Model and optimizer state at ``step`` (no optimizer: a peer with virtual compute has none)."""
        extra = {"tokenizer.json": self.tokenizer}
        return save_checkpoint(self.dir, step, model, optimizer, meta, extra_files=extra, keep=self.keep)

    def resume(self, swarm_hash: str) -> Checkpoint:
        """The newest checkpoint of this run folder, which must have been written in the swarm whose manifest
        hashes to ``swarm_hash``."""
        checkpoint = load_checkpoint(self.dir)
        if checkpoint.meta.get("swarm_hash") != swarm_hash:
            raise CheckpointError(
                f"{checkpoint.path} was written in a swarm with other settings; resume with "
                "the settings it was trained with, or start without --resume"
            )
        return checkpoint

    def finish(self, model: torch.nn.Module, state: dict) -> None:
        tmp = self.dir / ".model.safetensors.tmp"
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, self.dir / "model.safetensors")
        (self.dir / "tokenizer.json").write_bytes(self.tokenizer)
        (self.dir / "state.json").write_text(json.dumps(state, indent=1))
