"""What a peer trains with: the model, its trainer and its data, behind one lock.

The training thread steps, writes synced weights and switches the trained units; the transport's handler
threads read a unit (newcomers may ask for a peer's own copy of any unit). Every touch of the model goes
through ``step``, ``read``, ``write`` or ``retarget``, which hold the lock.

``LocalModel`` is the part every peer has: the swarm's seeded initial model and those accessors.
``LocalTraining`` trains it; ``spes_p2p.peer.virtual.VirtualTraining`` stands in for it in simulations with
virtual compute (``sim.compute``). ``peer.setup.local_training`` picks the one the settings ask for.

The model trains on ``train.device``; the sync sees CPU tensors only: ``read`` copies a unit to the CPU and
``write`` copies one back. So the sync's arithmetic (updates, aggregation, versions and their hashes) is
the same on a GPU peer as on a CPU peer, and the device's memory holds nothing but the model and its training.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from spes_p2p.data.plan import DataPlan
from spes_p2p.errors import CheckpointError
from spes_p2p.model import MoETransformer, read_unit, write_unit
from spes_p2p.model.units import UnitLayout
from spes_p2p.settings import Settings
from spes_p2p.train.checkpoint import Checkpoint, load_checkpoint
from spes_p2p.train.dataset import PreparedData, ShardSampler, validation_batches
from spes_p2p.train.device import place, resolve_device
from spes_p2p.train.trainer import Trainer, evaluate

Tensors = dict[str, torch.Tensor]
_SEEDING = threading.Lock()  # simulated peers share torch's global generator
# Peers in one process (simulations on the memory backend) take turns at their training steps. Run at once,
# their threads hand the interpreter back and forth at every small op of a small model: a byzantine test's
# swarm (4 peers, 60 steps each) took 51 to 55 CPU-s with them concurrent, 37 to 41 taking turns. A process
# with one peer never waits on it.
_STEPPING = threading.Lock()


@dataclass
class Steps:
    """What H local steps did."""

    loss: float | None  # None: no model ran (virtual compute)
    tokens: int
    seconds: float


class LocalModel:
    """The swarm's initial model (every peer of a swarm builds the same one from its seed), behind one lock;
    ``read``, ``write`` and ``restore`` are all a sync needs of it."""

    compute = "real"  # what a metrics row says ran the steps

    def __init__(
        self, settings: Settings, layout: UnitLayout, seed: int, device: torch.device, data: PreparedData
    ) -> None:
        self.settings, self.layout, self.device, self.data = settings, layout, device, data
        self.sampler: ShardSampler | None = None  # (plan_with)
        with _SEEDING:  # every peer of a swarm starts from one model: the seed derives from the swarm
            torch.manual_seed(seed)
            model = MoETransformer(settings.model.architecture())  # on the CPU: the seed gives it anywhere
        if settings.model.init:  # a founder's model of its own (a newcomer downloads it when it joins)
            model.load_state_dict(load_checkpoint(Path(settings.model.init)).model)
        self.model = place(model, device)
        self._lock = threading.RLock()
        self._probing = 0.0  # seconds spent in probes since the last ``probing_seconds``

    def read(self, unit: str) -> Tensors:
        """A CPU copy of the unit's weights."""
        with self._lock:
            return {name: t.cpu() for name, t in read_unit(self.model, self.layout, unit).items()}

    def write(self, unit: str, tensors: Tensors) -> None:
        with self._lock:
            write_unit(self.model, self.layout, unit, tensors)

    def restore(self, checkpoint: Checkpoint) -> None:
        with self._lock:
            self.model.load_state_dict(checkpoint.model)
            if checkpoint.meta.get("data_position"):
                self.sampler.load_state_dict(checkpoint.meta["data_position"])

    def plan_with(self, plan: DataPlan) -> None:
        """Trains on the shards ``plan`` hands out (in a window order every peer of the swarm draws alike);
        a peer with virtual compute only moves through them."""
        t = self.settings.train
        self.sampler = ShardSampler(
            self.data, t.seq_len, t.batch_size, self.settings.swarm.run_id, plan, self.compute == "real"
        )

    def data_read(self) -> dict:
        """Where it is in the dataset (the epoch, the shard it reads and how far), and the windows it read
        since the last call (``ShardSampler.trained``)."""
        work = self.sampler.work
        return {
            "trained": self.sampler.trained(),
            "epoch": self.sampler.epoch,
            "shard": work.shard if work else None,
            "window": work.position if work else 0,
        }

    def probing_seconds(self) -> float:
        """Seconds the probes of screening took (training paused) since the last call."""
        with self._lock:
            seconds, self._probing = self._probing, 0.0
        return seconds

    def frozen_experts(self, trained: list[str]) -> Tensors:
        """Every expert weight outside ``trained`` (the merge's neighbours)."""
        weights: Tensors = {}
        for unit in self.layout.expert_units:
            if unit not in trained:
                weights.update(self.read(unit))
        return weights


class LocalTraining(LocalModel):
    def __init__(
        self, settings: Settings, layout: UnitLayout, seed: int, peer_id: str, data: PreparedData
    ) -> None:
        super().__init__(settings, layout, seed, resolve_device(settings.train.device), data)
        t = settings.train
        self.val_batches = validation_batches(self.data, t.seq_len, t.batch_size, t.eval_batches)
        self.trainer: Trainer | None = None

    def start(
        self,
        units: list[str],
        round_: int,
        checkpoint: Checkpoint | None = None,
        sample: Callable[[], None] = lambda: None,
    ) -> None:
        """The trainer for ``units``, at ``round_``; from a checkpoint's optimizer state when resuming.
        ``sample`` runs after each backward pass, while the step's gradients are live."""
        if checkpoint and checkpoint.meta.get("compute") == "virtual":
            raise CheckpointError(
                f"{checkpoint.path} was written by a peer with virtual compute (no optimizer state): "
                "start without --resume"
            )
        with self._lock:
            trained = checkpoint.meta["units"] if checkpoint else units
            self.trainer = Trainer(self.model, self.layout, trained, self.settings.train)
            self.trainer.after_backward = sample
            self.trainer.step = round_ * self.settings.method.steps_per_round
            if checkpoint:
                self.trainer.optimizer.load_state_dict(checkpoint.optimizer)
                self.trainer.tokens = checkpoint.meta["tokens"]
                self.trainer.retarget(units)  # keeps the state of what it still trains

    @property
    def started(self) -> bool:
        return self.trainer is not None

    @property
    def units(self) -> list[str]:
        return self.trainer.units

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def tokens(self) -> int:
        return self.trainer.tokens

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    def lr(self) -> float:
        return self.trainer.lr()

    def retarget(self, units: list[str]) -> None:
        with self._lock:
            self.trainer.retarget(units)

    def reset_state(self, unit: str) -> None:
        with self._lock:
            self.trainer.reset_state(unit)

    def at_round(self, round_: int) -> None:
        self.trainer.step = round_ * self.settings.method.steps_per_round

    def steps(self, stop: threading.Event, between: Callable[[], None]) -> Steps | None:
        """H local steps (``between`` runs after each); None when ``stop`` was set first."""
        started, losses, tokens = time.perf_counter(), [], 0
        for _ in range(self.settings.method.steps_per_round):
            if stop.is_set():
                return None
            inputs, targets = self.sampler.next_batch()
            with _STEPPING, self._lock:
                result = self.trainer.train_step(inputs, targets)
            losses.append(result.loss)
            tokens += result.tokens
            between()
        return Steps(statistics.fmean(losses), tokens, time.perf_counter() - started)

    def held(self) -> dict[str, list]:
        return self.trainer.held() if self.trainer is not None else {}

    def position(self) -> dict:
        """Where training stands: the units trained last (and synced), tokens, the data position."""
        return {
            "units": self.trainer.units,
            "tokens": self.trainer.tokens,
            "data_position": self.sampler.state_dict(),
            "model_config": self.model.cfg.to_dict(),
        }

    def evaluate(self) -> float | None:
        with self._lock:
            return evaluate(self.model, self.val_batches)

    def probe(
        self, round_: int, unit: str, start: dict[str, Tensors], candidates: list[Tensors]
    ) -> list[float]:
        """The validation loss on round ``round_``'s probe batch (every peer of the swarm picks the same
        one) with the units of ``start`` at those weights: first as they are, then with ``unit`` at each of
        ``candidates``. Training pauses meanwhile; its weights are put back (``unit`` must be held in full
        precision: a quantized one would be quantized again)."""
        pick = hashlib.sha256(f"{self.settings.swarm.run_id}:{round_}".encode()).digest()
        batch = [self.val_batches[int.from_bytes(pick[:8], "big") % len(self.val_batches)]]
        with self._lock:
            began = time.perf_counter()
            training = {u: read_unit(self.model, self.layout, u) for u in {*start, unit}}
            try:
                for u, weights in start.items():
                    write_unit(self.model, self.layout, u, weights)
                losses = [evaluate(self.model, batch)]
                for weights in candidates:
                    write_unit(self.model, self.layout, unit, weights)
                    losses.append(evaluate(self.model, batch))
            finally:
                for u, weights in training.items():
                    write_unit(self.model, self.layout, u, weights)
                self.model.train()
                self._probing += time.perf_counter() - began
        return losses
