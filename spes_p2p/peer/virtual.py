"""Virtual compute (``spes simulate --compute virtual[=SECONDS]``): a peer that does not run its model.

It holds what a training peer holds of the model: the swarm's seeded initial model, its trained units in full
precision and every other unit as ``train.frozen_experts`` / ``frozen_dense`` say, so the sync reads and
writes the same tensors. What it does not have is a trainer: no batches read (it moves through its data
shards as a real peer would, so the swarm splits its dataset alike), no forward or backward pass, no
gradients, no optimizer state. A step sleeps ``step_seconds`` instead (interrupted by a stop), and at the
end of a round's H steps each trained unit takes a synthetic change, seeded by the unit, the tensor and the
step (a part every holder draws alike, as holders' real updates share a direction) and by this peer (its own
part), with the size of H Adam steps at the scheduled learning rate in random directions. Its update then
goes through everything a real one does: encoding, bytes on the wire, claims, the exchange and its checks,
aggregation, refresh of frozen copies, deadlines.

What it reports: rows say ``compute: "virtual"``; the loss is None and no validation loss is computed (no
model ran); tokens are those the steps stand for (``batch_size x seq_len`` a step), which weigh its updates
in the swarm's token-weighted mean as a real peer's would.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable

import torch

from spes_p2p.model.config import measured_step_seconds
from spes_p2p.model.quant import quantized_tensors
from spes_p2p.model.units import UnitLayout, hold_frozen, unit_parameters
from spes_p2p.peer.local import LocalModel, Steps
from spes_p2p.settings import Settings
from spes_p2p.train.checkpoint import Checkpoint
from spes_p2p.train.dataset import PreparedData
from spes_p2p.train.optim import scheduled_lr


def step_seconds(settings: Settings) -> float:
    """Seconds a virtual step sleeps: ``virtual=SECONDS``, or the preset's measured step time scaled to the
    batch's tokens (settings without either are refused when they are read)."""
    given = settings.sim.step_seconds
    if given is not None:
        return given
    return measured_step_seconds(settings.model.preset, settings.train.batch_size * settings.train.seq_len)


class VirtualTraining(LocalModel):
    """``LocalTraining``'s interface, without a trainer."""

    compute = "virtual"

    def __init__(
        self, settings: Settings, layout: UnitLayout, seed: int, peer_id: str, data: PreparedData
    ) -> None:
        super().__init__(
            settings, layout, seed, torch.device("cpu"), data
        )  # nothing to compute: no accelerator
        self.model.requires_grad_(False)
        self.peer_id = peer_id
        self.step_seconds = step_seconds(settings)
        self.units: list[str] = []
        self.step = self.tokens = 0
        self.started = False
        self.optimizer = None
        self.sample: Callable[[], None] = lambda: None
        self.slept = 0  # steps slept through, for tests and the curious

    def start(
        self,
        units: list[str],
        round_: int,
        checkpoint: Checkpoint | None = None,
        sample: Callable[[], None] = lambda: None,
    ) -> None:
        """Trains ``units`` from ``round_``; a checkpoint brings its token count (it has no other state)."""
        self.sample, self.started = sample, True
        self.retarget(units)
        self.at_round(round_)
        if checkpoint:
            self.tokens = checkpoint.meta["tokens"]

    def retarget(self, units: list[str]) -> None:
        """Holds ``units`` in full precision and the others as frozen copies, as a trainer would."""
        with self._lock:
            self.units = sorted(set(units))
            t = self.settings.train
            hold_frozen(self.model, self.layout, self.units, experts=t.frozen_experts, dense=t.frozen_dense)
            self.model.requires_grad_(False)

    def reset_state(self, unit: str) -> None:
        """Nothing to reset: there is no optimizer state."""

    def at_round(self, round_: int) -> None:
        self.step = round_ * self.settings.method.steps_per_round

    def lr(self) -> float:
        return scheduled_lr(self.settings.train, self.step)

    def steps(self, stop: threading.Event, between: Callable[[], None]) -> Steps | None:
        """H steps of ``step_seconds`` each (``between`` runs after each), then the round's synthetic change;
        None when ``stop`` was set first."""
        started, tokens = time.perf_counter(), 0
        per_step = self.settings.train.batch_size * self.settings.train.seq_len
        for _ in range(self.settings.method.steps_per_round):
            if stop.wait(self.step_seconds):
                return None
            self.sampler.skip_batch()  # (the data it stands for: its shards are split as a real peer's)
            self.slept += 1
            self.step += 1
            self.tokens += per_step
            tokens += per_step
            between()
        self._change()
        self.sample()
        return Steps(None, tokens, time.perf_counter() - started)

    @torch.no_grad()
    def _change(self) -> None:
        """Adds the round's synthetic change to every trained unit."""
        steps = self.settings.method.steps_per_round
        scale = self.lr() * math.sqrt(
            steps / 2
        )  # shared + own: variance 2, so each element's sd is lr sqrt(H)
        with self._lock:
            for unit in self.units:
                for name, p in unit_parameters(self.model, self.layout, unit).items():
                    shared = _normal(p.shape, f"{self.settings.swarm.run_id}/{name}/{self.step}")
                    own = _normal(p.shape, f"{self.peer_id}/{name}/{self.step}")
                    p.add_(shared.add_(own), alpha=scale)

    def held(self) -> dict[str, list]:
        """The trained weights and every other weight (no gradients, no optimizer state)."""
        if not self.started:
            return {}
        trained = [unit_parameters(self.model, self.layout, u) for u in self.units]
        return {"weights": trained, "frozen": [list(self.model.parameters()), quantized_tensors(self.model)]}

    def position(self) -> dict:
        """What a checkpoint records: the units, tokens, the data position, and that the compute was
        virtual."""
        return {
            "units": self.units,
            "tokens": self.tokens,
            "data_position": self.sampler.state_dict(),
            "model_config": self.model.cfg.to_dict(),
            "compute": self.compute,
        }

    def evaluate(self) -> None:
        """No model runs: no validation loss."""
        return None


def _normal(shape: torch.Size, key: str) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))
