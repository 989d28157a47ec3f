"""The launcher of a simulation's peer processes: one process that imports what a peer runs on (torch, the
backend, the peer's life cycle) once, then forks every peer from itself.

A peer started as ``python -m spes_p2p.peer`` spends about 4 s of CPU importing torch and its backend
before it does anything (torch 2.6 s, libp2p 1.4 s, measured on 2 cores), and a simulation's peers all
start at once: 8 founders on 2 cores waited 20 s for their imports. A forked peer starts with those
modules already imported, and shares their memory with the other peers until it writes to it.

Each peer is the same process it would be with ``python -m``: a session of its own (its process group id
is its pid), its output in its log file, the same ``main`` and the same exit status. Its parent is the
launcher, which reports each exit; the launcher leaves when the simulator does (``PR_SET_PDEATHSIG``), and
its peers, which ask for SIGTERM when their parent dies, leave the swarm then as before. The launcher runs
no thread, so that nothing is held mid-way at a fork. A peer of a network namespace enters it after the
fork (``setns``), before it opens a socket.

Protocol, one JSON object a line: the simulator writes ``{module, argv, log, append, netns}``, the launcher
answers ``{pid}`` at once, and ``{exited, code}`` when that peer exits (``code`` as ``Popen.returncode``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

from spes_p2p.compat import die_with_parent, enter_netns

GONE = 255  # the exit status reported for a peer whose launcher died before it (its real one is lost)
ANSWER_SECONDS = 120.0  # for the launcher's first answer, after its imports, on a busy machine


# ------------------------------------------------------------------------------------ the simulator's side


class Launched:
    """A peer process forked by the launcher, with the parts of ``subprocess.Popen`` a fleet uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"peer process {self.pid}", timeout)
        return self.returncode

    def exited(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class Launcher:
    """Starts the launcher process for ``backend`` on first use; ``spawn`` forks a peer from it. The launcher
    leaves when the thread that started it ends (``PR_SET_PDEATHSIG``): the one that runs the simulation."""

    def __init__(self, backend: str, env: dict[str, str], title: str) -> None:
        self.backend, self.env, self.title = backend, env, title
        self.proc: subprocess.Popen | None = None
        self.launched: dict[int, Launched] = {}
        self._answers: list[int] = []
        self._answered = threading.Condition()
        self._gone = False  # the launcher has exited (its output ended)

    def spawn(self, module: str, argv: list[str], log: Path, append: bool, netns: str | None) -> Launched:
        """Forks ``module``'s ``main(argv)`` in a session of its own, its output to ``log``."""
        request = {"module": module, "argv": argv, "log": str(log), "append": append, "netns": netns}
        with self._answered:
            proc = self._started()
            if not self._gone:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.write(json.dumps(request) + "\n")
                    proc.stdin.flush()
            if not self._answered.wait_for(lambda: self._answers or self._gone, ANSWER_SECONDS):
                raise RuntimeError(f"the peer launcher did not answer in {ANSWER_SECONDS:.0f} s")
            if not self._answers:
                raise RuntimeError(f"the peer launcher has exited (status {proc.wait(timeout=10)})")
            return self.launched[self._answers.pop(0)]

    def close(self) -> None:
        """Ends the launcher (its peers ask for SIGTERM when it dies: stop them first)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spes_p2p.sim.launcher", self.backend, self.title],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=self.env,
            )
            threading.Thread(target=self._read, args=(self.proc,), name="launcher", daemon=True).start()
        return self.proc

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            message = json.loads(line)
            with self._answered:
                if "pid" in message:
                    self.launched[message["pid"]] = Launched(message["pid"])
                    self._answers.append(message["pid"])
                else:
                    self.launched[message["exited"]].exited(message["code"])
                self._answered.notify_all()
        with self._answered:  # the launcher is gone, and the exits it had not reported with it
            self._gone = True
            for peer in self.launched.values():
                if peer.returncode is None:
                    peer.exited(GONE)
            self._answered.notify_all()


# ------------------------------------------------------------------------------------- the launcher's side


def serve(backend: str) -> None:
    """Imports what a peer of ``backend`` runs on, then forks a peer for each request on stdin until it
    closes, reporting each pid and each exit on stdout."""
    from spes_p2p.peer.life import live  # noqa: F401 - imported here once, for every peer
    from spes_p2p.peer.setup import backend_class

    backend_class(backend)
    die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _peer(json.loads(line))
                _answer({"pid": pid})
        with contextlib.suppress(ChildProcessError):
            while (found := os.waitpid(-1, os.WNOHANG))[0]:
                _answer({"exited": found[0], "code": os.waitstatus_to_exitcode(found[1])})


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _peer(request: dict) -> None:
    """In the forked child: becomes the peer process, and exits as ``python -m MODULE`` would."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    log, null = os.open(request["log"], flags, 0o644), os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, to)
    os.close(log)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if request["netns"]:
        enter_netns(request["netns"])
    random.seed()  # (the launcher's sequence is every peer's otherwise)
    module = importlib.import_module(request["module"])
    raise SystemExit(module.main([request["module"], *request["argv"]]))


if __name__ == "__main__":  # python -m spes_p2p.sim.launcher BACKEND OUT (OUT: for its peers' command line)
    serve(sys.argv[1])
