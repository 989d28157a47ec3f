"""Files and folders: the folders the user names (``--out``, the identity's folder), checked before any work
is done, and files written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from spes_p2p.errors import ConfigError


def writable_folder(path: Path, flag: str) -> Path:
    """``path`` as a folder this process can write (created if missing); one clear ConfigError otherwise."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder: name a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot write there ({exc.strerror}); name a folder you can write"
        ) from None
    return path


def new_folder(path: Path, what: str) -> Path:
    """``path``, which must not exist or be an empty folder (nothing of the user's is overwritten)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"{path} exists and is not an empty folder: name a new folder for {what}")
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to a temporary file beside ``path`` and renames it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
