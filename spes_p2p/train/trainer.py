"""The local trainer: trains only the units a peer owns, with every other parameter frozen.

Frozen experts still take part in the forward pass (routing is not masked), so gradients flow through them to
the router and attention; they simply get no gradient buffers and no optimizer state of their own, and may be
held quantized (``frozen_experts``). When the trained units change (a claim moved, a dense block rotated), the
optimizer is rebuilt for the new set; the state of a unit given up is freed, or parked in CPU memory until the
unit comes back (``switch_state``).

A trainer trains wherever its model lives (``device.place``); each batch is moved there, and on CUDA the
forward pass runs under bf16 autocast (``device.autocast``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spes_p2p.model import MoETransformer, UnitLayout, set_trainable
from spes_p2p.model.quant import quantized_tensors
from spes_p2p.model.units import hold_frozen, unit_parameters
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.device import autocast, model_device
from spes_p2p.train.optim import build_optimizer, optimizer_step, scheduled_lr, tensor_bytes


@dataclass
class StepResult:
    loss: float  # the full objective
    ce: float  # cross-entropy alone
    lr: float
    grad_norm: float
    tokens: int
    seconds: float  # wall time of the step


class Trainer:
    """Owns the optimizer for one peer's trainable units and counts steps and tokens."""

    def __init__(self, model: MoETransformer, layout: UnitLayout, units: list[str], cfg: TrainConfig) -> None:
        self.model, self.layout, self.cfg = model, layout, cfg
        self.step = 0
        self.tokens = 0
        self.parked: dict[str, dict] = {}  # switch_state "cpu": parameter name -> its optimizer state
        self.optimizer: torch.optim.Optimizer | None = None
        self.after_backward: Callable[[], None] = lambda: None  # runs while the step's gradients are live
        self.retarget(units)

    def retarget(self, units: list[str]) -> None:
        """Trains ``units`` from now on. The optimizer is rebuilt for the new trainable set (toggling
        ``requires_grad`` alone would leave stale state and leak memory); parameters that stay trainable
        keep their optimizer state, the others' state is freed or parked (``switch_state``)."""
        old, old_names = self.optimizer, getattr(self, "_names", {})
        self.units = sorted(set(units))
        hold_frozen(
            self.model, self.layout, self.units, experts=self.cfg.frozen_experts, dense=self.cfg.frozen_dense
        )
        self.trainable = set_trainable(self.model, self.layout, self.units)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        c = self.cfg
        self.optimizer = build_optimizer(
            named, kind=c.optimizer, lr=c.lr, betas=(c.beta1, c.beta2), weight_decay=c.weight_decay
        )
        self._names = {p: n for n, p in named}
        kept = old.state if old is not None else {}
        for name, p in named:
            if p in kept:
                self.optimizer.state[p] = kept[p]
            elif name in self.parked:
                self.optimizer.state[p] = _moved(self.parked.pop(name), p.device)
        if c.switch_state == "cpu":
            for p, state in kept.items():
                if p not in self._names:
                    self.parked[old_names[p]] = _moved(state, torch.device("cpu"))

    def reset_state(self, unit: str) -> None:
        """Frees a unit's optimizer state (its update diverged: it restarts from the swarm's weights)."""
        for p in unit_parameters(self.model, self.layout, unit).values():
            self.optimizer.state.pop(p, None)

    def held(self) -> dict[str, list]:
        """What the trainer holds, by kind (``peer.footprint``): the trained weights, every other weight,
        the gradients of a step in progress, the optimizer state."""
        return {
            "weights": list(self.trainable),
            "frozen": [list(self.model.parameters()), quantized_tensors(self.model)],
            "gradients": [p.grad for p in self.trainable if p.grad is not None],
            "optimizer": [list(self.optimizer.state.values()), list(self.parked.values())],
        }

    def parked_bytes(self) -> int:
        return tensor_bytes(list(self.parked.values()))

    def lr(self) -> float:
        return scheduled_lr(self.cfg, self.step)

    def train_step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> StepResult:
        started = time.perf_counter()
        self.model.train()
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        device = model_device(self.model)
        inputs_BS, targets_BS = inputs_BS.to(device), targets_BS.to(device)
        with autocast(device):
            out = self.model(inputs_BS, targets_BS)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        self.after_backward()
        optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += inputs_BS.numel()
        return StepResult(
            out.loss.item(),
            out.parts["ce"].item(),
            lr,
            grad_norm.item(),
            inputs_BS.numel(),
            time.perf_counter() - started,
        )

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return evaluate(self.model, batches)


def _moved(state: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@torch.no_grad()
def evaluate(model: MoETransformer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy over the given batches, weighted by tokens."""
    model.eval()
    total, count, device = 0.0, 0, model_device(model)
    for inputs_BS, targets_BS in batches:
        with autocast(device):
            ce = model(inputs_BS.to(device), targets_BS.to(device)).parts["ce"]
        total += ce.item() * targets_BS.numel()
        count += targets_BS.numel()
    return total / count
