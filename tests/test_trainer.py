import itertools
import threading

import pytest
import torch

from spes_p2p.model import MoETransformer, UnitLayout, get_preset, unit_parameters
from spes_p2p.model.config import ModelSettings
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.optim import build_optimizer, lr_at, optimizer_step
from spes_p2p.train.run import TrainingRun
from spes_p2p.train.trainer import Trainer

TINY = get_preset("tiny")
LAYOUT = UnitLayout(TINY.n_experts, 4)
OWNED = ["dense/0", "experts/1"]


def random_batch(seed: int, batch: int = 4, seq: int = 32):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw"])
def test_frozen_experts_stay_bit_identical(optimizer):
    torch.manual_seed(0)
    model = MoETransformer(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, LAYOUT, OWNED, TrainConfig(optimizer=optimizer, warmup_steps=0, lr=1e-2))
    for step in range(3):
        trainer.train_step(*random_batch(step))
    params = dict(model.named_parameters())
    state_params = {id(p) for p in trainer.optimizer.state}
    for unit in LAYOUT.units:
        for name in unit_parameters(model, LAYOUT, unit):
            p = params[name]
            if unit in OWNED:
                assert p.requires_grad and id(p) in state_params, name
                assert not torch.equal(p, before[name]), f"owned {name} did not change"
            else:
                assert torch.equal(p, before[name]), f"frozen {name} changed"
                assert p.grad is None and not p.requires_grad, name
                assert id(p) not in state_params, f"frozen {name} has optimizer state"


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw"])
def test_optimizer_state_only_for_trainable(optimizer):
    model = MoETransformer(TINY)
    trainer = Trainer(model, LAYOUT, OWNED, TrainConfig(optimizer=optimizer))
    trainer.train_step(*random_batch(0))
    owned_ids = {id(p) for u in OWNED for p in unit_parameters(model, LAYOUT, u).values()}
    assert {id(p) for p in trainer.optimizer.state} == owned_ids
    grouped = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert grouped == owned_ids


def test_freezing_does_not_change_gradients_of_trainable_parameters():
    """Routing is not masked: gradients flow through frozen experts to the router and attention."""
    torch.manual_seed(0)
    full = MoETransformer(TINY)
    part = MoETransformer(TINY)
    part.load_state_dict(full.state_dict())
    Trainer(part, LAYOUT, OWNED, TrainConfig(optimizer="adamw", frozen_experts="full"))
    batch = random_batch(3)
    full(*batch).loss.backward()
    part(*batch).loss.backward()
    full_params = dict(full.named_parameters())
    for name, p in part.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, full_params[name].grad, rtol=0, atol=0)
    assert part.layers[0].moe.router.weight.grad.abs().sum() > 0


def test_lr_schedule_warmup_then_cosine_to_ten_percent():
    kw = {"peak": 1.0, "warmup_steps": 10, "total_steps": 110, "min_ratio": 0.1}
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_loss_falls_on_the_stdlib_corpus(tmp_path, stdlib_data):
    run = TrainingRun(
        ModelSettings(),
        TrainConfig(
            total_steps=80,
            warmup_steps=10,
            lr=3e-3,
            batch_size=8,
            seq_len=64,
            log_every=10,
            eval_every=40,
            checkpoint_every=80,
        ),
        stdlib_data,
        tmp_path,
    )
    initial_val = run.evaluate()
    records = []
    run.run(on_log=records.append)
    assert records[0]["loss"] > records[-1]["loss"] + 1.0, [r["loss"] for r in records]
    assert records[-1]["val_loss"] < initial_val - 1.0
    assert records[-1]["tokens"] == 80 * 8 * 64


def test_8bit_steps_of_peers_sharing_a_process_do_not_corrupt_each_other():
    """bitsandbytes' CPU 8-bit step is not thread-safe; simulated peers step at once on threads."""
    start = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    grads = [torch.randn(2048, 64, generator=torch.Generator().manual_seed(i)) for i in range(1, 16)]

    def train(out: list) -> None:
        w = torch.nn.Parameter(start.clone())
        opt = build_optimizer([("w", w)], kind="adamw8bit", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
        for g in grads:
            w.grad = g.clone()
            optimizer_step(opt)
        out.append(w.detach().clone())

    alone: list = []
    train(alone)
    together: list = []
    threads = [threading.Thread(target=train, args=(together,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(together) == 6 and all(torch.equal(w, alone[0]) for w in together)
