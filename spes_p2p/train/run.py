"""A single-process training run: the centralized baseline, or one peer's units trained alone.

Owns the run folder: ``metrics.jsonl`` (one JSON object per logged step) and ``checkpoints/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from spes_p2p.data.plan import LocalPlan
from spes_p2p.errors import CheckpointError, ConfigError
from spes_p2p.files import writable_folder
from spes_p2p.model import ModelConfig, MoETransformer
from spes_p2p.model.config import ModelSettings
from spes_p2p.model.units import layout_of
from spes_p2p.train.checkpoint import list_checkpoints, load_checkpoint, recover, save_checkpoint
from spes_p2p.train.config import DataConfig, TrainConfig
from spes_p2p.train.dataset import ShardSampler, prepare_data, validation_batches
from spes_p2p.train.device import place, resolve_device
from spes_p2p.train.fit import Plan, check_fits
from spes_p2p.train.trainer import StepResult, Trainer, evaluate

logger = logging.getLogger(__name__)


class TrainingRun:
    """Prepares data, model and trainer (restoring the newest checkpoint when resuming), then trains the
    ``owned_shards`` and the dense part, or every unit when None (the centralized baseline)."""

    def __init__(
        self,
        model: ModelSettings,
        train: TrainConfig,
        data: DataConfig,
        out_dir: Path,
        *,
        owned_shards: tuple[int, ...] | None = None,
        resume: bool = False,
    ) -> None:
        self.model_settings, self.train_cfg, self.data_cfg = model, train, data
        self.out_dir = Path(out_dir)
        recover(self.out_dir)  # what a run killed mid-checkpoint left
        has_checkpoints = bool(list_checkpoints(self.out_dir))
        if resume and not has_checkpoints:
            raise CheckpointError(f"nothing to resume: {self.out_dir} holds no checkpoint")
        if not resume and has_checkpoints:
            raise ConfigError(
                f"{self.out_dir} already holds checkpoints: pass --resume to continue, or pick another --out"
            )
        model_cfg = model.architecture()
        if train.seq_len > model_cfg.max_seq_len:
            raise ConfigError(
                f"seq_len ({train.seq_len}) exceeds the model's max_seq_len ({model_cfg.max_seq_len})"
            )
        layout = layout_of(model)
        # SPES trains the dense part on every peer: a peer's view is its shards plus the dense part
        units = (
            layout.units
            if owned_shards is None
            else [*layout.dense_units, *layout.shard_units(list(owned_shards))]
        )
        self.device = resolve_device(train.device)
        check_fits(
            model.preset,
            model_cfg,
            _plan(model, train, owned_shards),
            self.device,
            knobs=("frozen_experts", "shards"),  # spes train has no --dense-blocks
            capacity_flag="--owned-shards 0",
        )
        writable_folder(self.out_dir, "--out")
        self.data = prepare_data(data, model_cfg.vocab_size)
        torch.manual_seed(train.seed)
        self.model = place(MoETransformer(model_cfg), self.device)  # built on the CPU: same seed, same model
        self.trainer = Trainer(self.model, layout, units, train)
        plan = LocalPlan(len(self.data.index.train), train.seed)
        self.sampler = ShardSampler(self.data, train.seq_len, train.batch_size, train.seed, plan)
        self.val_batches = validation_batches(self.data, train.seq_len, train.batch_size, train.eval_batches)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self._restore()

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def meta(self) -> dict:
        return {
            "model_settings": self.model_settings.to_dict(),
            "model_config": self.model.cfg.to_dict(),
            "train_config": self.train_cfg.to_dict(),
            "data_config": self.data_cfg.to_dict(),
            "units": self.trainer.units,
            "tokens": self.trainer.tokens,
            "data_position": self.sampler.state_dict(),
            "dataset_hash": self.data.dataset_hash,
            "tokenizer_hash": self.data.tokenizer_hash,
        }

    def save(self) -> Path:
        return save_checkpoint(
            self.out_dir,
            self.trainer.step,
            self.model,
            self.trainer.optimizer,
            self.meta(),
            extra_files={"tokenizer.json": self.data.tokenizer.to_str().encode()},
            keep=self.train_cfg.keep_checkpoints,
        )

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.out_dir)
        expected = self.meta()
        for key in ("model_settings", "model_config", "units", "dataset_hash", "tokenizer_hash"):
            if ckpt.meta.get(key) != expected[key]:
                raise CheckpointError(
                    f"cannot resume from {ckpt.path}: its {key} differs from this run's settings"
                )
        if ckpt.meta["train_config"]["optimizer"] != self.train_cfg.optimizer:
            raise CheckpointError(
                f"cannot resume from {ckpt.path}: it was trained with optimizer "
                f"{ckpt.meta['train_config']['optimizer']!r}"
            )
        self.model.load_state_dict(ckpt.model)
        self.trainer.optimizer.load_state_dict(ckpt.optimizer)
        self.trainer.step, self.trainer.tokens = ckpt.meta["step"], ckpt.meta["tokens"]
        self.sampler.load_state_dict(ckpt.meta["data_position"])
        self._truncate_metrics(self.trainer.step)

    def _truncate_metrics(self, step: int) -> None:
        """Drops metric rows logged after the checkpoint we resume from, so the file tells one history."""
        if not self.metrics_path.exists():
            return
        rows = []
        for number, line in enumerate(self.metrics_path.read_text().splitlines(), start=1):
            try:
                logged = json.loads(line)["step"] if line.strip() else None
            except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill while writing it
                logger.warning("%s:%d: dropping a line that is not a whole row", self.metrics_path, number)
                continue
            if logged is not None and logged <= step:
                rows.append(line)
        self.metrics_path.write_text("".join(row + "\n" for row in rows))

    def evaluate(self) -> float:
        return self.trainer.evaluate(self.val_batches)

    def run(self, *, stop_after: int = 0, on_log: Callable[[dict], None] | None = None) -> dict:
        """Trains until ``total_steps`` (or ``stop_after`` more steps), logging, evaluating, checkpointing.

        On KeyboardInterrupt a checkpoint is written before the interrupt propagates.
        """
        cfg = self.train_cfg
        last = min(cfg.total_steps, self.trainer.step + stop_after) if stop_after else cfg.total_steps
        window: list[StepResult] = []
        record: dict = {}
        try:
            while self.trainer.step < last:
                window.append(self.trainer.train_step(*self.sampler.next_batch()))
                step = self.trainer.step
                evaluating = step % cfg.eval_every == 0 or step == cfg.total_steps
                if step % cfg.log_every == 0 or evaluating or step == last:
                    record = self._record(window, self.evaluate() if evaluating else None)
                    self._append_metrics(record)
                    if on_log:
                        on_log(record)
                    window = []
                if step % cfg.checkpoint_every == 0 or step == last:
                    self.save()
        except KeyboardInterrupt:
            self.save()
            raise
        return record

    def _record(self, window: list[StepResult], val_loss: float | None) -> dict:
        record = {
            "step": self.trainer.step,
            "tokens": self.trainer.tokens,
            "loss": sum(r.loss for r in window) / len(window),
            "ce": sum(r.ce for r in window) / len(window),
            "lr": window[-1].lr,
            "grad_norm": window[-1].grad_norm,
            # training throughput: the steps' own time, without data loading, evaluation or checkpoints
            "tokens_per_s": sum(r.tokens for r in window) / max(sum(r.seconds for r in window), 1e-9),
        }
        if val_loss is not None:
            record["val_loss"] = val_loss
        return record

    def _append_metrics(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _plan(model: ModelSettings, train: TrainConfig, owned_shards: tuple[int, ...] | None) -> Plan:
    """What ``spes train`` trains: every unit, or the dense part and ``owned_shards``."""
    return Plan(
        shards=model.shards,
        dense_blocks=model.dense_blocks,
        active_blocks=model.dense_blocks,
        capacity=len(set(owned_shards or ())),
        frozen_experts=train.frozen_experts,
        frozen_dense=train.frozen_dense,
        optimizer=train.optimizer,
        everything=owned_shards is None,
    )


def evaluate_checkpoint(path: Path, corpus: str | None = None, eval_batches: int | None = None) -> dict:
    """Validation loss and perplexity of a checkpoint on its run's validation split (or another corpus)."""
    ckpt = load_checkpoint(path)
    meta = ckpt.meta
    model_cfg = ModelConfig.from_dict(meta["model_config"])
    data_cfg = DataConfig(**{**meta["data_config"], **({"corpus": corpus, "dataset": ""} if corpus else {})})
    train_cfg = TrainConfig(
        **{**meta["train_config"], **({"eval_batches": eval_batches} if eval_batches else {})}
    )
    tok_file = ckpt.path / "tokenizer.json"
    data = prepare_data(dataclasses.replace(data_cfg, tokenizer=str(tok_file)), model_cfg.vocab_size)
    model = place(MoETransformer(model_cfg), resolve_device("auto"))
    model.load_state_dict(ckpt.model)
    batches = validation_batches(data, train_cfg.seq_len, train_cfg.batch_size, train_cfg.eval_batches)
    val_loss = evaluate(model, batches)
    return {
        "checkpoint": str(ckpt.path),
        "step": meta["step"],
        "tokens": meta["tokens"],
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "val_tokens": sum(t.numel() for _, t in batches),
    }
