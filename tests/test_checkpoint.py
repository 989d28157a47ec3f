import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spes_p2p.errors import CheckpointError
from spes_p2p.model.config import ModelSettings
from spes_p2p.train import checkpoint as ckpt_mod
from spes_p2p.train.checkpoint import (
    flatten_state,
    list_checkpoints,
    load_checkpoint,
    recover,
    unflatten_state,
)
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.run import TrainingRun, evaluate_checkpoint


def training(stdlib_data, out, resume=False, **train) -> TrainingRun:
    base = {
        "total_steps": 24,
        "warmup_steps": 4,
        "batch_size": 4,
        "seq_len": 32,
        "log_every": 1,
        "eval_every": 12,
        "eval_batches": 2,
        "checkpoint_every": 6,
        "lr": 3e-3,
    }
    train_cfg = TrainConfig(**{**base, **train})
    return TrainingRun(ModelSettings(), train_cfg, stdlib_data, out, owned_shards=(1,), resume=resume)


def losses(path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"]) for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
    ]


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw"])
def test_resume_equals_continue(tmp_path, stdlib_data, optimizer):
    straight = training(stdlib_data, tmp_path / "straight", optimizer=optimizer)
    straight.run()

    first = training(stdlib_data, tmp_path / "resumed", optimizer=optimizer)
    first.run(stop_after=12)
    del first
    resumed = training(stdlib_data, tmp_path / "resumed", resume=True, optimizer=optimizer)
    assert resumed.trainer.step == 12
    resumed.run()

    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert len(losses(tmp_path / "straight")) == 24
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_metrics_line_torn_by_a_kill_is_dropped_on_resume(tmp_path, stdlib_data, caplog):
    first = training(stdlib_data, tmp_path, optimizer="adamw")
    first.run(stop_after=12)
    kept = losses(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "lo')  # the kill came while the next row was being written
    resumed = training(stdlib_data, tmp_path, resume=True, optimizer="adamw")
    assert resumed.trainer.step == 12 and losses(tmp_path) == kept
    assert "metrics.jsonl:" in caplog.text and "not a whole row" in caplog.text


def test_state_flattening_round_trip_keeps_sharing():
    shared = torch.arange(4.0)
    state = {
        "state": {0: {"step": 3, "m": torch.ones(2), "q": shared}, 1: {"q": shared}},
        "param_groups": [{"betas": (0.9, 0.95), "params": [0, 1], "name": None}],
    }
    tensors, skeleton = flatten_state(state)
    assert len(tensors) == 2  # the shared tensor is stored once
    back = unflatten_state(tensors, json.loads(json.dumps(skeleton)))
    assert back["state"][0]["step"] == 3 and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["state"][1]["q"] is back["state"][0]["q"] and torch.equal(back["state"][1]["q"], shared)
    assert set(back["state"]) == {0, 1}


def test_crash_mid_checkpoint_leaves_the_previous_one(tmp_path, stdlib_data, monkeypatch):
    run = training(stdlib_data, tmp_path, total_steps=12)
    run.run(stop_after=6)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006"]

    real_save = ckpt_mod.save_file

    def crash_after_model(tensors, path):
        real_save(tensors, path)
        if path.name == "optimizer.safetensors":
            raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", crash_after_model)
    with pytest.raises(OSError, match="disk full"):
        run.run(stop_after=6)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000006"]  # no temp folder left
    assert load_checkpoint(tmp_path).meta["step"] == 6


def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, stdlib_data, caplog):
    training(stdlib_data, tmp_path, total_steps=12).run()
    newest = list_checkpoints(tmp_path)[-1]
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    assert load_checkpoint(tmp_path).meta["step"] == 6  # the run folder: the newest that passes
    assert "step-000012 is corrupt: model.safetensors fails its checksum; using the previous" in caplog.text
    with pytest.raises(CheckpointError, match=r"step-000012 is corrupt: .* the previous checkpoint .*intact"):
        load_checkpoint(newest)  # that folder itself


def test_when_every_checkpoint_is_damaged_none_is_called_intact(tmp_path, stdlib_data):
    training(stdlib_data, tmp_path, total_steps=12).run()
    older, newest = list_checkpoints(tmp_path)
    for checkpoint in (older, newest):
        data = (checkpoint / "model.safetensors").read_bytes()
        (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="older checkpoints are damaged too") as error:
        load_checkpoint(tmp_path)
    assert "intact" not in str(error.value)


def spes(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spes_cli", *args], capture_output=True, text=True, cwd=cwd, timeout=240
    )


@pytest.mark.slow
def test_cli_train_resume_corrupt_and_eval(tmp_path, cache_dir):
    common = [
        "--preset",
        "tiny",
        "--total-steps",
        "12",
        "--checkpoint-every",
        "6",
        "--eval-every",
        "6",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--max-corpus-mb",
        "2",
        "--cache-dir",
        cache_dir,
        "--out",
        str(tmp_path / "run"),
    ]
    first = spes("train", *common, "--stop-after", "6")
    assert first.returncode == 0, first.stderr
    second = spes("train", *common, "--resume")
    assert second.returncode == 0, second.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [6, 12]

    result = spes("eval", "--checkpoint", str(tmp_path / "run"), "--json")
    assert result.returncode == 0, result.stderr
    evaluation = json.loads(result.stdout)
    assert evaluation["step"] == 12 and evaluation["val_loss"] == pytest.approx(
        rows[-1]["val_loss"], rel=1e-5
    )

    newest = tmp_path / "run" / "checkpoints" / "step-000012"
    (newest / "meta.json").write_text("{ truncated")
    failed = spes("eval", "--checkpoint", str(newest))  # that checkpoint itself: an error, with the way out
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "step-000012 is corrupt" in failed.stderr and "step-000006 is intact" in failed.stderr
    resumed = spes("train", *common, "--resume")  # the run folder: resumes from step 6, and says so
    assert resumed.returncode == 0, resumed.stderr
    assert "step-000012 is corrupt" in resumed.stderr and "using the previous checkpoint" in resumed.stderr
    assert load_checkpoint(tmp_path / "run").meta["step"] == 12  # written anew
    assert sorted(p.name for p in newest.parent.iterdir()) == ["step-000006", "step-000012"]


def test_evaluate_checkpoint_matches_the_run(tmp_path, stdlib_data):
    run = training(stdlib_data, tmp_path, total_steps=6)
    final = run.run()
    result = evaluate_checkpoint(tmp_path)
    assert result["step"] == 6
    assert result["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_writer_killed_at_random_moments_always_leaves_a_checkpoint_to_resume_from(tmp_path):
    """8 SIGKILLs of a process that writes (and rewrites) checkpoints without pause: after each, the run
    folder loads, its model is the one written for its step, and no step that was reported written is lost."""
    rng = random.Random(0)
    writer = Path(__file__).with_name("checkpoint_writer.py")
    reported = 0  # the newest step whose write returned
    for _ in range(8):
        proc = subprocess.Popen(
            [sys.executable, str(writer), str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        try:
            ready = proc.stdout.readline().split()
            assert ready[:1] == ["ready"] and int(ready[1]) >= reported, ready
            time.sleep(rng.uniform(0.0, 1.0))  # mid-write, mostly: writes follow each other without pause
        finally:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
        done = [int(line.split()[1]) for line in out.splitlines() if line.startswith("done")]
        reported = max([reported, *done])
        if not list_checkpoints(tmp_path):  # killed before its first write completed
            assert reported == 0
            continue
        checkpoint = load_checkpoint(tmp_path)
        step = checkpoint.meta["step"]
        assert step >= reported
        assert all(torch.equal(t, torch.full_like(t, float(step))) for t in checkpoint.model.values())
    recover(tmp_path)
    assert all(p.name.startswith("step-") for p in (tmp_path / "checkpoints").iterdir())
    assert reported >= 3  # the writer made progress between kills
