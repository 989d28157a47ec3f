"""--device, and what must hold on any device, checked on the CPU (CI has no GPU): resolving the setting, a
trainer on the device it is given, payloads decoded onto a device, the pre-flight fit check, and
benchmarks/gpu.py refusing to run without CUDA."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model import MoETransformer, UnitLayout, get_preset
from spes_p2p.settings import Settings
from spes_p2p.sync.codecs import CODECS, PayloadError
from spes_p2p.sync.payload import ErrorFeedback, decode, encode, specs_of
from spes_p2p.train.accounting import measure
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.device import autocast, model_device, place, resolve_device
from spes_p2p.train.fit import Plan, check_fits, estimate_bytes, flags, suggest
from spes_p2p.train.trainer import Trainer, evaluate

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
TINY = get_preset("tiny")
ROOT = Path(__file__).resolve().parents[1]


@NO_CUDA
def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_in_one_line():
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError) as refused:
        resolve_device("cuda")
    message = str(refused.value)
    assert "\n" not in message and "no CUDA device" in message and "--device cpu" in message
    with pytest.raises(ConfigError, match="one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_the_setting_is_checked_and_reaches_every_command_that_trains():
    assert Settings().train.device == "auto"
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda"):
        Settings().override({"train.device": "gpu"})
    from spes_cli.join import spes_join
    from spes_cli.main import spes

    for command in (spes.commands["train"], spes.commands["simulate"], spes.commands["memory"], spes_join):
        assert "--device" in {o for p in command.params for o in p.opts}, command.name


def test_autocast_is_bf16_on_cuda_and_nothing_on_the_cpu():
    assert isinstance(autocast(torch.device("cpu")), contextlib.nullcontext)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU-only torch warns that it would disable it
        on_cuda = autocast(torch.device("cuda"))
    assert isinstance(on_cuda, torch.autocast) and on_cuda.fast_dtype == torch.bfloat16


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, TINY.vocab_size, (4, 33), generator=g) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def test_a_trainer_on_the_cpu_device_trains_with_frozen_experts_quantized():
    device = resolve_device("cpu")
    torch.manual_seed(0)
    model = place(MoETransformer(TINY), device)
    layout = UnitLayout.for_model(TINY, 4)
    cfg = TrainConfig(device="cpu", frozen_experts="nf4", warmup_steps=0, lr=3e-3)
    trainer = Trainer(model, layout, ["dense/0", "experts/0"], cfg)
    data = batches(2)
    losses = [trainer.train_step(*data[step % 2]).loss for step in range(8)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert model_device(model) == device
    codes = [q.codes for m in model.modules() for q in getattr(m, "quantized", {}).values()]
    assert codes and all(c.device == device for c in codes)
    assert torch.isfinite(torch.tensor(evaluate(model, data)))


def test_the_model_trains_under_bf16_autocast_with_quantized_frozen_experts():
    """What CUDA's autocast does to the model, on the CPU's autocast: the loss and every gradient stay fp32,
    and the quantized experts' backward hands back gradients the graph accepts."""
    torch.manual_seed(0)
    model = MoETransformer(TINY)
    trainer = Trainer(
        model, UnitLayout.for_model(TINY, 4), ["dense/0", "experts/0"], TrainConfig(frozen_experts="int8")
    )
    inputs, targets = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(inputs, targets)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    grads = [p.grad for p in trainer.trainable]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_payloads_round_trip_onto_a_device(codec):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 96), "b.norm": torch.randn(64)}
    payload = encode(tensors, CODECS[codec], meta={"unit": "dense/0"})
    here = decode(payload, specs_of(tensors), CODECS[codec], meta={"unit": "dense/0"}, device="cpu")
    default = decode(payload, specs_of(tensors), CODECS[codec], meta={"unit": "dense/0"})
    for name, t in tensors.items():
        assert here[name].device == torch.device("cpu") and here[name].dtype == torch.float32
        assert torch.equal(here[name], default[name])
        if codec == "none":
            assert torch.equal(here[name], t)
        elif codec not in ("topk", "sparseloco"):  # (the sparse codecs send a few entries only)
            assert (here[name] - t).norm() < 0.2 * t.norm()
    flipped = bytearray(payload)
    flipped[-3] ^= 0x10
    with pytest.raises(PayloadError):
        decode(bytes(flipped), specs_of(tensors), CODECS[codec], device="cpu")


def test_error_feedback_decodes_where_the_update_lives():
    update = {"w": torch.randn(4096)}
    feedback = ErrorFeedback(CODECS["int8"])
    _, sent = feedback.encode(update, round_=1)
    assert sent["w"].device == update["w"].device
    assert torch.allclose(feedback.residual["w"], update["w"] - sent["w"])


# ------------------------------------------------------------------------------------------- pre-flight

ONE_B = get_preset("1b")
PEER = Plan(shards=4)  # 1 of 4 expert shards and the whole dense part, experts full, 8-bit AdamW
FORMATS = ("full", "int8", "nf4")


def refusal(plan: Plan, free: int, **kwargs) -> str:
    with pytest.raises(ConfigError) as refused:
        check_fits("1b", ONE_B, plan, torch.device("cpu"), free=free, **kwargs)
    return str(refused.value)


@pytest.mark.parametrize("gib", [7, 6, 4])  # nf4 alone; and more dense blocks; and more shards
def test_a_refusal_names_the_bytes_and_a_configuration_that_fits(gib):
    free = gib * 2**30
    need = estimate_bytes(ONE_B, PEER)
    message = refusal(PEER, free)
    assert "\n" not in message
    assert f"{need:,} bytes" in message and f"{free:,} bytes" in message and "on cpu" in message
    fitting = suggest(ONE_B, PEER, free)
    assert fitting is not None and estimate_bytes(ONE_B, fitting) <= free
    advice = " ".join(flags(PEER, fitting))
    assert f"try {advice} (" in message and advice.startswith("--frozen-experts nf4")
    # the flags in the message, applied to the plan, give a plan that fits by the same estimate
    given = dict(re.findall(r"--([a-z-]+) (\S+)", message.split("try ", 1)[1]))
    applied = dataclasses.replace(
        PEER,
        frozen_experts=given.get("frozen-experts", PEER.frozen_experts),
        dense_blocks=int(given.get("dense-blocks", PEER.dense_blocks)),
        shards=int(given.get("shards", PEER.shards)),
    )
    assert applied == fitting and estimate_bytes(ONE_B, applied) <= free


def test_the_nearest_configuration_comes_first():
    nf4 = dataclasses.replace(PEER, frozen_experts="nf4")
    assert suggest(ONE_B, PEER, estimate_bytes(ONE_B, nf4)) == nf4  # nf4 alone is enough: nothing else
    blocks = dataclasses.replace(nf4, dense_blocks=4)
    assert estimate_bytes(ONE_B, blocks) < estimate_bytes(ONE_B, nf4)
    found = suggest(ONE_B, PEER, estimate_bytes(ONE_B, blocks))
    assert found.shards == 4 and found.dense_blocks <= 4 and found.active_blocks == 1  # no more shards
    assert "--shards" not in refusal(PEER, estimate_bytes(ONE_B, blocks))
    joiner = refusal(PEER, estimate_bytes(ONE_B, blocks), knobs=("frozen_experts",))
    assert "no configuration of 1b fits" in joiner and "Presets that fit: tiny, small" in joiner


def test_a_plan_that_fits_passes_and_nothing_fits_in_too_little():
    check_fits("1b", ONE_B, PEER, torch.device("cpu"), free=estimate_bytes(ONE_B, PEER))
    message = refusal(PEER, 2**20)
    assert "no configuration of 1b fits. Presets that fit: none" in message
    everything = refusal(Plan(shards=4, everything=True), 2 * 2**30)
    assert "every unit" in everything and "Presets that fit: tiny, small" in everything


def test_the_estimate_counts_frozen_formats_trained_blocks_and_the_optimizer():
    full, int8, nf4 = (estimate_bytes(ONE_B, dataclasses.replace(PEER, frozen_experts=k)) for k in FORMATS)
    assert nf4 < int8 < full
    assert estimate_bytes(ONE_B, dataclasses.replace(PEER, dense_blocks=4)) < full  # 1 of 4 blocks trained
    assert estimate_bytes(ONE_B, dataclasses.replace(PEER, optimizer="adamw")) > full
    assert estimate_bytes(ONE_B, Plan(shards=4, everything=True)) > full


@pytest.mark.parametrize(
    "plan",
    [
        Plan(shards=4, everything=True),
        Plan(shards=4),
        Plan(shards=4, frozen_experts="int8"),
        Plan(shards=4, dense_blocks=4, frozen_experts="nf4"),
        Plan(shards=4, optimizer="adamw"),
    ],
    ids=lambda plan: plan.describe() + " " + plan.optimizer,
)
def test_the_estimate_is_what_a_real_step_allocates_plus_the_margin(plan):
    layout = UnitLayout.for_model(TINY, plan.shards, plan.dense_blocks)
    sizes = dict.fromkeys(layout.dense_units, 0)
    for name, p in MoETransformer(TINY).named_parameters():
        sizes[layout.unit_of(name)] = sizes.get(layout.unit_of(name), 0) + p.numel()
    largest = max(layout.dense_units, key=sizes.get)  # the block the estimate assumes trained: the worst case
    units = layout.units if plan.everything else [largest, "experts/0"]
    train = TrainConfig(
        frozen_experts=plan.frozen_experts,
        frozen_dense=plan.frozen_dense,
        optimizer=plan.optimizer,
        batch_size=4,
        seq_len=64,
    )
    report = measure(TINY, layout, units, train)
    measured = report["weights_bytes"] + report["grads_bytes"] + report["optimizer_bytes"]
    assert measured * 1.2 < estimate_bytes(TINY, plan) < measured * 1.3


def test_a_joiner_is_only_told_what_it_may_change(tmp_path, monkeypatch):
    from spes_p2p.peer.life import preflight
    from spes_p2p.train import fit

    settings = Settings().override(
        {
            "model.preset": "1b",
            "model.dense_blocks": 1,
            "train.frozen_experts": "full",
            "train.frozen_dense": "full",
            "run.out": str(tmp_path / "peer"),
            "train.device": "cpu",
        }
    )  # PEER
    free = estimate_bytes(ONE_B, dataclasses.replace(PEER, frozen_experts="nf4", dense_blocks=4))
    monkeypatch.setattr(fit, "free_bytes", lambda device: free)
    with pytest.raises(ConfigError, match="no configuration of 1b fits"):
        preflight(settings, identity=False)
    with pytest.raises(ConfigError, match="try --frozen-experts nf4 --dense-blocks"):
        preflight(settings.override({"run.new_swarm": True}), identity=False)


@NO_CUDA
def test_the_gpu_benchmark_refuses_to_run_without_cuda(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "no CUDA device" in last and "benchmarks/gpu.py" in last
    assert not (tmp_path / "out").exists()
