"""The launcher of a simulation's peer processes (``sim/launcher.py``): peers forked from one process that
imported the peer's stack once, each the process ``python -m`` would have started."""

import os
import signal
from pathlib import Path

import pytest

from spes_p2p.sim.launcher import GONE, Launcher

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher("libp2p", {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}, str(tmp_path))
    yield launcher
    launcher.close()


def lines(log: Path) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in log.read_text().splitlines())


def test_forked_peers_start_preloaded_and_exit_as_processes_do(launcher, tmp_path):
    logs = {name: tmp_path / f"{name}.log" for name in ("ok", "error", "killed")}
    ok = launcher.spawn("launch_probe", ["0"], logs["ok"], False, None)
    error = launcher.spawn("launch_probe", ["3"], logs["error"], False, None)
    killed = launcher.spawn("launch_probe", ["sleep"], logs["killed"], False, None)
    assert ok.wait(60) == 0 and error.wait(60) == 3
    os.killpg(killed.pid, signal.SIGKILL)  # (its own session: its process group is its pid)
    assert killed.wait(60) == -signal.SIGKILL
    seen = {name: lines(log) for name, log in logs.items()}
    assert all(s["preloaded"] == "True" and s["own_session"] == "True" for s in seen.values()), seen
    assert len({s["random"] for s in seen.values()}) == 3  # each draws its own sequence
    again = launcher.spawn("launch_probe", ["0"], logs["ok"], True, None)  # a restart appends to its log
    assert again.wait(60) == 0 and logs["ok"].read_text().count("preloaded") == 2
    launcher.close()
    assert launcher.proc.returncode == 0


def test_a_peer_whose_launcher_died_is_reported_gone(launcher, tmp_path):
    sleeper = launcher.spawn("launch_probe", ["sleep"], tmp_path / "sleeper.log", False, None)
    launcher.proc.kill()
    try:
        assert sleeper.wait(60) == GONE
        with pytest.raises(RuntimeError, match="launcher has exited"):  # and no peer waits for it
            launcher.spawn("launch_probe", ["0"], tmp_path / "late.log", False, None)
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
