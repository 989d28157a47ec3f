"""The processes of a simulation's peers: stopping them, killing them, and finding what is left of them.

Each peer process starts a session of its own; its DHT process (and that one's p2pd) run in a process group
of their own inside that session. The DHT process dies with the peer (``PR_SET_PDEATHSIG``), and p2pd within
seconds of it (hivemind starts it with an idle timeout; ``tests/test_hivemind.py`` checks both).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


def tree_of(pid: int) -> list[psutil.Process]:
    """A process and its descendants (none when it is gone)."""
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_all(tree: list[psutil.Process]) -> None:
    """SIGKILL to the first process's group, then to every process of ``tree`` left."""
    if tree:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(tree[0].pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()


def stop_process_groups(procs, grace: float = 20.0) -> None:
    """SIGTERM to each still-running process group (a peer leaves in order), SIGKILL after ``grace`` s."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def still_running(seen: list[psutil.Process], sessions: set[int]) -> list[str]:
    """Processes, as ``pid command``, of ``seen`` or of the ``sessions`` that still run."""
    found = {p.pid: p for p in seen if _lives(p)}
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions and _lives(p):
                found[p.pid] = p
        except (ProcessLookupError, psutil.Error):
            continue
    return [f"{pid} {_name(p)}" for pid, p in sorted(found.items())]


def _lives(p: psutil.Process) -> bool:
    try:  # (is_running also tells a reused pid from the process we saw)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()[:3]) or p.name()
    except psutil.Error:
        return "?"
