"""Checkpoints: tensors in safetensors, everything else in JSON, written atomically.

Layout of a run folder::

    RUN/checkpoints/step-000200/   model.safetensors  optimizer.safetensors  meta.json  tokenizer.json
    RUN/checkpoints/step-000100/   (the previous one, kept until a newer one is complete)

A checkpoint is written into a hidden temporary folder, fsynced, and renamed into place only when complete;
rewriting a step first sets the old folder aside (``.replaced-step-...``) and removes it only once the new
one is in place, so a process killed at any moment leaves a loadable checkpoint. ``recover`` (run by the
writer) removes what a killed write left and puts a set-aside checkpoint back. ``meta.json`` records a
SHA-256 of every other file; loading verifies them, and loading a run folder falls back to the newest
checkpoint that passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from spes_p2p.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = 1
_PREFIX = "step-"
_TMP = ".tmp-"  # a write in progress, or a pruned checkpoint being deleted
_ASIDE = ".replaced-"  # a checkpoint whose step is being rewritten, until the new one is in place


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
    optimizer: torch.optim.Optimizer | None,
    meta: dict,
    extra_files: dict[str, bytes] | None = None,
    keep: int = 2,
) -> Path:
    """Writes checkpoint ``step`` under ``run_dir/checkpoints`` and prunes all but the newest ``keep``.
    Without an ``optimizer`` (a peer with virtual compute has none) its state is empty."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    recover(run_dir)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{_TMP}{final.name}-"))
    tmp.chmod(0o755)
    try:
        save_file(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors"
        )
        opt_tensors, opt_rest = flatten_state(optimizer.state_dict() if optimizer is not None else {})
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        full_meta = {**meta, "format": FORMAT, "step": step, "optimizer_rest": opt_rest, "files": files}
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1))
        _fsync_folder(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aside = root / f"{_ASIDE}{final.name}"
    if final.exists():  # rewriting the same step (e.g. after resuming at it): the old one stays until then
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_folder(root, files=False)
    shutil.rmtree(aside, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        _remove(old)
    return final


def recover(run_dir: Path) -> None:
    """Undoes what a writer killed mid-write left in ``run_dir/checkpoints``: its temporary folders, and a
    checkpoint set aside for a replacement that never arrived (put back). Only the run's writer calls this."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.name.startswith(_TMP):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(_ASIDE):
            final = root / path.name.removeprefix(_ASIDE)
            if final.exists():  # the replacement is in place: the old one was being deleted
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
    _fsync_folder(root, files=False)


def _remove(checkpoint: Path) -> None:
    """Deletes a checkpoint so that no half-deleted one is ever listed: hidden first, then removed."""
    hidden = checkpoint.with_name(f"{_TMP}pruned-{checkpoint.name}")
    os.rename(checkpoint, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first. A checkpoint set aside for a rewrite that a kill cut short
    stands for its step until the writer puts it back (``recover``): reading never changes the folder."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = {p.name: p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)}
    for path in root.iterdir():
        name = path.name.removeprefix(_ASIDE)
        if path.is_dir() and path.name.startswith(_ASIDE) and name not in found:
            found[name] = path
    return [found[name] for name in sorted(found)]


def load_checkpoint(path: Path) -> Checkpoint:
    """Loads and verifies a checkpoint folder, or the newest checkpoint of a run folder that passes its
    checks (a damaged newer one is skipped with a warning); raises CheckpointError naming what is wrong."""
    path = Path(path)
    if (path / "meta.json").exists() or path.name.startswith(_PREFIX):
        try:
            return _load(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}{_fallback_hint(path)}") from None
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"no checkpoint found in {path}")
    problems = []
    for candidate in reversed(found):
        try:
            checkpoint = _load(candidate)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            logger.warning("%s; using the previous checkpoint %s", problem, candidate)
        return checkpoint
    more = "; the older checkpoints are damaged too" if len(found) > 1 else ""
    raise CheckpointError(f"{problems[0]}{more}: start over without --resume, or restore a backup")


def _load(path: Path) -> Checkpoint:
    meta = read_meta(path)
    for name, digest in meta["files"].items():
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if _sha256(path / name) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its checksum")
    try:
        model = load_file(path / "model.safetensors")
        opt_tensors = load_file(path / "optimizer.safetensors")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None
    return Checkpoint(path, meta, model, unflatten_state(opt_tensors, meta["optimizer_rest"]))


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: meta.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path} is corrupt: meta.json is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"checkpoint {path} has an unknown format (expected format {FORMAT})")
    return meta


def _fallback_hint(path: Path) -> str:
    """For a damaged checkpoint named by its folder: the newest older one that passes its checks, if any."""
    found = list_checkpoints(path.parent.parent)
    older = found[: found.index(path)] if path in found else []
    for candidate in reversed(older):
        if _intact(candidate):
            return f"; the previous checkpoint {candidate} is intact (resuming from the run folder uses it)"
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


def _fsync_folder(folder: Path, files: bool = True) -> None:
    """Flushes a folder's entries (and, with ``files``, every file in it) to disk."""
    for p in folder.iterdir() if files else []:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
