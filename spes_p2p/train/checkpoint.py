"""Checkpoints: tensors in safetensors, everything else in JSON, written atomically.

Layout of a run folder::

    RUN/checkpoints/step-000200/   model.safetensors  optimizer.safetensors  meta.json  tokenizer.json
    RUN/checkpoints/step-000100/   (the previous one, kept until a newer one is complete)

A checkpoint is written into a hidden temporary folder and renamed into place only when complete, so a
crash mid-write never touches the previous checkpoint. ``meta.json`` records a SHA-256 of every other file;
loading verifies them, so a truncated or damaged file is reported instead of half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from spes_p2p.errors import CheckpointError

FORMAT = 1
_PREFIX = "step-"


@dataclass
class Checkpoint:
    path: Path
    meta: dict
    model: dict[str, torch.Tensor]
    optimizer: dict  # a torch optimizer state_dict


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    extra_files: dict[str, bytes] | None = None,
    keep: int = 2,
) -> Path:
    """Writes checkpoint ``step`` under ``run_dir/checkpoints`` and prunes all but the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    tmp.chmod(0o755)
    try:
        save_file(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors"
        )
        opt_tensors, opt_rest = flatten_state(optimizer.state_dict())
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        full_meta = {**meta, "format": FORMAT, "step": step, "optimizer_rest": opt_rest, "files": files}
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1))
        _fsync_dir_contents(tmp)
        if final.exists():  # rewriting the same step (e.g. after resuming at it): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder itself, or the newest checkpoint of a run folder."""
    path = Path(path)
    if (path / "meta.json").exists() or path.name.startswith(_PREFIX):
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"no checkpoint found in {path}")
    return found[-1]


def load_checkpoint(path: Path) -> Checkpoint:
    """Loads and verifies a checkpoint; raises CheckpointError naming what is wrong."""
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    for name, digest in meta["files"].items():
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing{_fallback_hint(path)}")
        if _sha256(path / name) != digest:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} fails its checksum{_fallback_hint(path)}"
            )
    try:
        model = load_file(path / "model.safetensors")
        opt_tensors = load_file(path / "optimizer.safetensors")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}{_fallback_hint(path)}") from None
    return Checkpoint(path, meta, model, unflatten_state(opt_tensors, meta["optimizer_rest"]))


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: meta.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: meta.json is not valid JSON{_fallback_hint(path)}"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"checkpoint {path} has an unknown format (expected format {FORMAT})")
    return meta


def _fallback_hint(path: Path) -> str:
    """Where to resume from instead: the newest older checkpoint that passes its checks, if any."""
    older = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    for candidate in reversed(older):
        if _intact(candidate):
            return f"; the previous checkpoint {candidate} is intact: remove {path.name} to resume from it"
    if older:
        return "; the older checkpoints are damaged too: start over without --resume, or restore a backup"
    return ""


def _intact(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text())
        return meta.get("format") == FORMAT and all(
            (path / name).is_file() and _sha256(path / name) == digest
            for name, digest in meta["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir_contents(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


# ------------------------------------------------------------------ optimizer state <-> safetensors + JSON


def flatten_state(obj, prefix: str = "", _seen: dict | None = None) -> tuple[dict[str, torch.Tensor], object]:
    """Splits a nested state into dotted-name tensors and a JSON-able skeleton that refers to them.

    A tensor shared between entries (bitsandbytes shares its quantization maps) is stored once.
    """
    seen = {} if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        if obj.data_ptr() in seen:
            return {}, {"__tensor__": seen[obj.data_ptr()]}
        seen[obj.data_ptr()] = prefix
        return {prefix: obj.detach().contiguous().cpu()}, {"__tensor__": prefix}
    if isinstance(obj, dict):
        tensors, skeleton = {}, {}
        for key, value in obj.items():
            sub_t, sub_s = flatten_state(value, f"{prefix}.{key}" if prefix else str(key), seen)
            tensors.update(sub_t)
            skeleton[str(key)] = sub_s
        # torch keys optimizer state by integer parameter index; JSON keys are strings, so record the types
        return tensors, {"__dict__": skeleton, "__int_keys__": [str(k) for k in obj if isinstance(k, int)]}
    if isinstance(obj, (list, tuple)):
        tensors, items = {}, []
        for i, value in enumerate(obj):
            sub_t, sub_s = flatten_state(value, f"{prefix}.{i}", seen)
            tensors.update(sub_t)
            items.append(sub_s)
        return tensors, {"__tuple__" if isinstance(obj, tuple) else "__list__": items}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {}, obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix!r} in a checkpoint")


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton):
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton:
            int_keys = set(skeleton["__int_keys__"])
            return {
                int(k) if k in int_keys else k: unflatten_state(tensors, v)
                for k, v in skeleton["__dict__"].items()
            }
        if "__tuple__" in skeleton:
            return tuple(unflatten_state(tensors, v) for v in skeleton["__tuple__"])
        if "__list__" in skeleton:
            return [unflatten_state(tensors, v) for v in skeleton["__list__"]]
    return skeleton
