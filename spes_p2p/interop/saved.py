"""A trained model as it lies on disk: its config, its weights and its tokenizer, from a checkpoint folder
or a run folder (of ``spes train``, or of a swarm peer: its newest model)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from spes_p2p.data.tokenizer import load_tokenizer
from spes_p2p.errors import CheckpointError, ConfigError
from spes_p2p.model.config import ModelConfig
from spes_p2p.model.transformer import MoETransformer
from spes_p2p.train.checkpoint import list_checkpoints, load_checkpoint, read_meta


@dataclass
class SavedModel:
    path: Path  # the checkpoint folder it came from
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    step: int | None  # optimizer steps (a swarm peer's: its own)
    round: int | None  # a swarm peer's round

    def model(self) -> MoETransformer:
        """The model with these weights (the tensors themselves, not copies), in eval mode, on the CPU."""
        with torch.device("meta"):  # (no initialization to overwrite; the rope tables are built on the CPU)
            model = MoETransformer(self.config)
        try:
            model.load_state_dict(self.weights, assign=True)
        except RuntimeError as exc:  # missing, unexpected or misshapen tensors
            problem = str(exc).splitlines()[-1].strip()
            raise CheckpointError(
                f"{self.path} does not hold the model its config describes: {problem}"
            ) from None
        return model.eval()


def load_saved(path: Path, tokenizer: Path | None = None) -> SavedModel:
    """The model of checkpoint ``path``, or the newest model of run folder ``path``: its newest checkpoint
    that passes its checks or, for a swarm peer that has left, the model it wrote on leaving when that is
    newer. Its tokenizer is the one saved beside it, or ``tokenizer``."""
    path = Path(path)
    final = _final(path)
    if final is not None and final[1] >= _newest_checkpoint_round(path):
        source, meta = path, final[0]
        try:
            weights = load_file(path / "model.safetensors")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path / 'model.safetensors'} cannot be read: {exc}") from None
    else:
        checkpoint = load_checkpoint(path)
        source, meta, weights = checkpoint.path, checkpoint.meta, checkpoint.model
    if not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{source} does not say which model it holds (no model_config)")
    beside = source / "tokenizer.json"
    if tokenizer is None and not beside.is_file():
        raise ConfigError(
            f"{source} has no tokenizer.json beside its model: pass --tokenizer FILE (a swarm "
            "peer's is swarm-tokenizer-<hash>.json in its cache folder)"
        )
    config = ModelConfig.from_dict(meta["model_config"])
    return SavedModel(
        path=source,
        config=config,
        weights=weights,
        tokenizer=load_tokenizer(tokenizer or beside, config.vocab_size),
        step=meta.get("step"),
        round=meta.get("round"),
    )


def _final(run_dir: Path) -> tuple[dict, int] | None:
    """What a swarm peer wrote on leaving (``state.json`` and ``model.safetensors``) and its round; None
    when there is none, or when it cannot be read."""
    try:
        state = json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if not (run_dir / "model.safetensors").is_file() or not isinstance(state, dict):
        return None
    return state, _round(state)


def _newest_checkpoint_round(run_dir: Path) -> int:
    found = list_checkpoints(run_dir)
    try:
        return _round(read_meta(found[-1])) if found else -1
    except CheckpointError:  # (loading it says what is wrong, and falls back to an older one)
        return -1


def _round(meta: dict) -> int:
    value = meta.get("round")
    return value if isinstance(value, int) else -1
