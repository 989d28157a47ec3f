"""What a training peer leaves in its run folder::

OUT/metrics.jsonl      one JSON object per round
OUT/checkpoints/       model, optimizer and data position, every few rounds (spes_p2p.train.checkpoint)
OUT/model.safetensors  on exit: every tensor as this peer holds it (frozen copies included)
OUT/state.json         on exit: peer id, round, the units it trained last
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import save_file

from spes_p2p.train.checkpoint import save_checkpoint

if TYPE_CHECKING:
    from spes_p2p.peer.node import Peer


class RunOutputs:
    def __init__(self, out_dir: Path) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def append(self, row: dict) -> None:
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def checkpoint(self, peer: Peer) -> Path:
        meta = {
            "peer_id": peer.transport.peer_id,
            "round": peer.round,
            "units": peer.trainer.units,
            "tokens": peer.trainer.tokens,
            "data_position": peer.sampler.state_dict(),
            "swarm_hash": peer.identity.hash,
            "model_config": peer.model.cfg.to_dict(),
            "n_shards": peer.layout.n_shards,
        }
        return save_checkpoint(self.dir, peer.trainer.step, peer.model, peer.trainer.optimizer, meta)

    def finish(self, peer: Peer) -> None:
        tmp = self.dir / ".model.safetensors.tmp"
        save_file({k: v.detach().contiguous() for k, v in peer.model.state_dict().items()}, tmp)
        os.replace(tmp, self.dir / "model.safetensors")
        state = {
            "peer_id": peer.transport.peer_id,
            "round": peer.round,
            "units": peer.trainer.units,  # those its weights were last trained and synced for
            "step": peer.trainer.step,
            "tokens": peer.trainer.tokens,
        }
        (self.dir / "state.json").write_text(json.dumps(state, indent=1))
