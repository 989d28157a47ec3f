"""Three real `spes-join` processes on 127.0.0.1: claims cover every shard, a SIGKILLed sole holder's shard
is taken over once its records expire, and SIGTERM releases claims at once."""

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spes_p2p.model import UnitLayout
from spes_p2p.sim.processes import stop_process_groups

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

BIN = Path(sys.executable).parent
COMMON = "--listen /ip4/127.0.0.1/tcp/0 --shards 2 --heartbeat 0.5 --record-ttl 5 --run-id test-swarm".split()
# short rounds, so that sync boundaries (where claims are re-evaluated) come often
QUICK_ROUNDS = (
    "[method]\nsteps_per_round = 5\n[train]\nbatch_size = 4\nseq_len = 64\n[data]\nmax_corpus_mb = 1.0\n"
)
# where membership is under test, not training: peers that sleep through their steps (virtual compute) leave
# the machine's cores to the processes under test
VIRTUAL_ROUNDS = QUICK_ROUNDS + '[sim]\ncompute = "virtual=0.1"\n'


class Watch:
    """One ``spes status --watch --json`` process: the swarm as a peer's view shows it, every half second (one
    process for a wait, instead of one ``spes status`` process per look)."""

    def __init__(self, command: list[str], root: Path, env: dict) -> None:
        self.proc = subprocess.Popen(
            [*command, "--watch", "--every", "0.5"],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(root / "watch.log", "a"),
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def next(self, timeout: float) -> dict | None:
        """The next status (None: none came in ``timeout`` seconds)."""
        try:
            return json.loads(self.lines.get(timeout=max(timeout, 0.1)))
        except queue.Empty:
            return None


class Swarm:
    def __init__(self, root: Path, backend: str = "hivemind") -> None:
        self.root, self.procs, self.backend = root, {}, backend
        self.env = {**os.environ, "HOME": str(root), "PYTHONUNBUFFERED": "1"}

    @property
    def swarm_flags(self) -> list[str]:
        return ["--run-id", "test-swarm", "--backend", self.backend]

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(
            [
                str(BIN / "spes-join"),
                *COMMON,
                "--backend",
                self.backend,
                "--identity",
                str(self.root / f"{name}.key"),
                "--addr-file",
                str(self.root / f"{name}.addr"),
                *args,
            ],
            cwd=self.root,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def address(self, name: str, timeout: float = 60) -> str:
        path = self.root / f"{name}.addr"
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.procs[name].poll() is None, (self.root / f"{name}.log").read_text()
            assert time.monotonic() < deadline, f"{name} did not come up"
            time.sleep(0.2)
        return path.read_text().split()[0]

    def peer_id(self, name: str) -> str:
        return self.address(name).rsplit("/p2p/", 1)[1]

    def status_command(self, via: str) -> list[str]:
        return [str(BIN / "spes"), "status", "--peers", self.address(via), "--json", *self.swarm_flags]

    def status(self, via: str) -> dict:
        out = subprocess.run(
            self.status_command(via), capture_output=True, text=True, timeout=60, cwd=self.root, env=self.env
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_for(self, via: str, predicate, timeout: float = 90) -> dict:
        """The first status, read through peer ``via``, that ``predicate`` accepts."""
        watch = Watch(self.status_command(via), self.root, self.env)
        deadline, summary = time.monotonic() + timeout, None
        try:
            while True:
                summary = watch.next(deadline - time.monotonic()) or summary
                if summary is not None and predicate(summary):
                    return summary
                assert time.monotonic() < deadline, f"timed out; last status: {summary}"
        finally:
            stop_process_groups([watch.proc])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signals the peer's whole process group: the peer, its DHT process and its p2pd daemon."""
        os.killpg(self.procs[name].pid, sig)

    def exit_code(self, name: str, timeout: float) -> int:
        """The peer's exit status; one still running after ``timeout`` fails the test with its log, every
        thread's stack in it (SIGUSR1)."""
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.procs[name].pid, signal.SIGUSR1)
            time.sleep(2)
            log = (self.root / f"{name}.log").read_text()
            pytest.fail(f"{name} still running after {timeout}s:\n{log[-8000:]}")

    def stop_all(self) -> None:
        stop_process_groups(self.procs.values())


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.stop_all()


def test_three_peers_cover_the_shards_survive_a_kill_and_leave_cleanly(swarm):
    (swarm.root / "peers.toml").write_text(VIRTUAL_ROUNDS)
    ttl = ["--heartbeat", "1", "--record-ttl", "8"]  # (the killed peer's records are gone 8 s after it)
    swarm.start("a", "--new-swarm", *ttl)
    first = swarm.address("a")
    swarm.start("b", "--peers", first, *ttl)
    swarm.start("c", "--peers", first, *ttl)
    ids = {n: swarm.peer_id(n) for n in "abc"}

    # every peer was dialed back at its address (the first, alone at start, once the others came)
    summary = swarm.wait_for(
        "a",
        lambda s: (
            len(s["peers"]) == 3 and not s["uncovered"] and all(p["reachable"] == "yes" for p in s["peers"])
        ),
    )
    assert summary["run_id"] == "test-swarm"
    assert {p["peer_id"] for p in summary["peers"]} == set(ids.values())
    assert set(summary["units"]) == {"dense/0", "dense/1", "experts/0", "experts/1"}  # (2 dense blocks)
    dense = [u for p in summary["peers"] for u in p["units"] if u.startswith("dense/")]
    assert len(dense) == 3 and set(dense) == {"dense/0", "dense/1"}  # one block each, both trained

    # SIGKILL the sole holder of one shard; another peer takes that shard over once the records expire
    sole_unit, (sole_id,) = next(
        (u, h) for u, h in summary["units"].items() if u.startswith("experts/") and len(h) == 1
    )
    victim = next(n for n, i in ids.items() if i == sole_id)
    alive = [n for n in "abc" if n != victim]
    swarm.kill(victim)
    after = swarm.wait_for(
        alive[0],
        lambda s: (
            sole_id not in {p["peer_id"] for p in s["peers"]} and s["units"][sole_unit] and not s["uncovered"]
        ),
    )
    assert set(after["units"][sole_unit]) <= {ids[n] for n in alive}

    # SIGTERM: the peer releases its claims and exits within a bounded time; it vanishes before its TTL
    leaver = alive[1]
    swarm.kill(leaver, signal.SIGTERM)
    assert swarm.exit_code(leaver, timeout=20) == 0
    final = swarm.status(alive[0])
    assert {p["peer_id"] for p in final["peers"]} == {ids[alive[0]]}
    assert "left the swarm" in (swarm.root / f"{leaver}.log").read_text()


def test_joining_with_other_settings_is_refused(swarm):
    (swarm.root / "peers.toml").write_text(VIRTUAL_ROUNDS)
    swarm.start("a", "--new-swarm")
    first = swarm.address("a")
    swarm.wait_for("a", lambda s: len(s["peers"]) == 1)
    out = subprocess.run(
        [
            str(BIN / "spes-join"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--run-id",
            "test-swarm",
            "--shards",
            "4",
            "--identity",
            str(swarm.root / "x.key"),
            "--peers",
            first,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=swarm.root,
        env=swarm.env,
    )
    assert out.returncode == 1
    assert "model.shards: 4 here vs 2 in the swarm" in " ".join(out.stderr.split())
    assert "Traceback" not in out.stderr
    assert len(swarm.status("a")["peers"]) == 1  # nothing half-claimed


def test_unreachable_bootstrap_is_one_clear_line(tmp_path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"
    out = subprocess.run(
        [
            str(BIN / "spes-join"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--peers",
            dead,
            "--join-timeout",  # (the message, not the wait, is under test)
            "3",
            "--identity",
            str(tmp_path / "k.key"),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "--new-swarm" in out.stderr
    bad = subprocess.run(
        [str(BIN / "spes-join"), "--peers", "/ip4/1.2.3.4/tcp/x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert bad.returncode == 1 and "malformed multiaddr" in bad.stderr and "Traceback" not in bad.stderr


def test_port_in_use_is_one_clear_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = subprocess.run(
            [
                str(BIN / "spes-join"),
                "--new-swarm",
                "--listen",
                f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}",
                "--identity",
                str(tmp_path / "k.key"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "HOME": str(tmp_path)},
        )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "already in use" in out.stderr and "--listen" in out.stderr


TRAIN_TOML = """
[method]
steps_per_round = 8
[merge]
enabled = false
[train]
batch_size = 4
seq_len = 64
lr = 0.003
warmup_steps = 4
eval_every = 24
[data]
max_corpus_mb = 1.0
[sync]
deadline_min = 1.0
deadline_max = 30.0
"""


@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_spes_join_trains_and_holders_agree(swarm, backend):
    swarm.backend = backend
    (swarm.root / "peers.toml").write_text(TRAIN_TOML)
    train = ["--rounds", "3", "--min-peers", "3", "--heartbeat", "1", "--record-ttl", "15"]
    swarm.start("a", "--new-swarm", "--out", str(swarm.root / "out-a"), *train)
    first = swarm.address("a")
    for name in "bc":
        swarm.start(name, "--peers", first, "--out", str(swarm.root / f"out-{name}"), *train)
    for name in "abc":
        assert swarm.procs[name].wait(timeout=180) == 0, (swarm.root / f"{name}.log").read_text()[-3000:]

    models = {n: load_file(swarm.root / f"out-{n}" / "model.safetensors") for n in "abc"}
    states = {n: json.loads((swarm.root / f"out-{n}" / "state.json").read_text()) for n in "abc"}
    rows = {
        n: [json.loads(x) for x in (swarm.root / f"out-{n}" / "metrics.jsonl").read_text().splitlines()]
        for n in "abc"
    }
    assert all(s["round"] == 3 for s in states.values())
    layout = UnitLayout(8, 2)
    copies = 0
    for unit in layout.units:
        holders = [n for n in "abc" if unit in states[n]["units"]]
        assert holders, unit
        names = [k for k in models["a"] if layout.unit_of(k) == unit]
        for n in "abc":
            # a frozen copy is the holders' last version, within int8 rounding, when it came in the last
            # round (a refresh that runs out of time keeps the copy of the round before, on a busy machine;
            # a peer that gave the unit up at the last boundary still has its own)
            fresh = n not in holders and unit in rows[n][-1]["refreshed"]
            copies += fresh
            for k in names:
                ref = models[holders[0]][k]
                if n in holders:
                    assert torch.equal(models[n][k], ref), (unit, n, k)
                elif fresh:
                    assert (models[n][k] - ref).abs().max() <= 0.02 * ref.abs().max(), (unit, n, k)
    assert copies, "no frozen copy came in the last round"
    for mine in rows.values():
        assert [r["round"] for r in mine] == [0, 1, 2]
        assert mine[-1]["loss"] < mine[0]["loss"]
        assert mine[-1]["bytes_sent"] > 0 and mine[-1]["bytes_received"] > 0


def test_a_volunteer_joins_with_nothing_but_the_invite(swarm, tmp_path):
    """The founder changes swarm-wide settings (two dense blocks, no overlap); the volunteer brings only the
    invite (and its own per-peer choices), adopts the swarm's manifest and trains in it."""
    (swarm.root / "peers.toml").write_text(QUICK_ROUNDS)
    invite = swarm.root / "invite.toml"
    rounds = ["--rounds", "3", "--min-peers", "2"]
    swarm.start("a", "--new-swarm", "--dense-blocks", "2", "--no-overlap", "--invite", str(invite), *rounds)
    first = swarm.address("a")
    deadline = time.monotonic() + 60
    while not invite.exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    text = invite.read_text()
    assert (
        "dense_blocks = 2" in text and "overlap = false" in text and 'manifest = "' in text and first in text
    )

    elsewhere = tmp_path / "volunteer"  # no peers.toml here: the invite is all it has of the swarm
    elsewhere.mkdir()
    mine = "--listen /ip4/127.0.0.1/tcp/0 --max-corpus-mb 1 --batch-size 4 --seq-len 64 --rounds 3".split()
    volunteer = subprocess.run(
        [str(BIN / "spes-join"), "--config", str(invite), *mine, "--identity", "v.key", "--out", "out"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=elsewhere,
        env=swarm.env,
    )
    assert volunteer.returncode == 0, volunteer.stdout[-3000:] + volunteer.stderr[-3000:]
    assert re.search(r"dial me at /ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+ +\(dialed back\)", volunteer.stdout)
    rows = [json.loads(x) for x in (elsewhere / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(any(u.startswith("dense/") for u in r["units"]) for r in rows)
    assert {u for r in rows for u in r["units"] if u.startswith("dense/")} <= {"dense/0", "dense/1"}
    assert swarm.procs["a"].wait(timeout=120) == 0


@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_invite_and_status_of_a_running_swarm(swarm, backend):
    swarm.backend = backend
    (swarm.root / "peers.toml").write_text(VIRTUAL_ROUNDS)
    swarm.start("a", "--new-swarm")
    first = swarm.address("a")
    summary = swarm.wait_for("a", lambda s: len(s["peers"]) == 1)
    assert summary["peers"][0]["reachable"] in ("unknown", "yes")  # (alone: nobody to dial it back)
    out = subprocess.run(
        [str(BIN / "spes"), "invite", "--peers", first, "--out", "inv.toml", *swarm.swarm_flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=swarm.root,
        env=swarm.env,
    )
    assert out.returncode == 0, out.stderr
    invite = (swarm.root / "inv.toml").read_text()
    assert f'manifest = "{summary["manifest"]}"' in invite and f'backend = "{backend}"' in invite
    missing = subprocess.run(
        [str(BIN / "spes"), "status", "--peers", first, "--run-id", "no-such-swarm", "--backend", backend],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=swarm.root,
        env=swarm.env,
    )
    assert missing.returncode == 1 and "no peer of swarm 'no-such-swarm'" in " ".join(missing.stderr.split())


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def dashboard_url(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The URL ``spes dashboard`` prints once it serves."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        if found:
            return found.group(0)
        assert time.monotonic() < deadline, "spes dashboard printed no URL"
    raise AssertionError(f"spes dashboard exited: {proc.wait()}")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def table_rows(dom: str, table: str) -> list[str]:
    body = re.search(rf'<table id="{table}">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert body, f"no table {table} in the page"
    return re.findall(r"<tr.*?</tr>", body.group(1), re.S)


def test_the_dashboard_shows_a_live_swarm_in_a_browser(swarm):
    """Two peers train; ``spes dashboard`` and the founder's ``--dashboard`` serve the page, and headless
    Chromium renders the peers, the units and a loss chart with data from it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    (swarm.root / "peers.toml").write_text(QUICK_ROUNDS.replace("[train]\n", "[train]\neval_every = 10\n"))
    own_port = free_port()
    swarm.start("a", "--new-swarm", "--dashboard", str(own_port))
    first = swarm.address("a")
    swarm.start("b", "--peers", first)
    board = subprocess.Popen(
        [str(BIN / "spes"), "dashboard", "--peers", first, "--port", "0", *swarm.swarm_flags],
        cwd=swarm.root,
        env=swarm.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    swarm.procs["dashboard"] = board
    url = dashboard_url(board)
    deadline = time.monotonic() + 120
    while True:  # until both peers are up and the page has losses of two rounds to draw
        page = get_json(url + "api/dashboard")
        peers = (page["status"] or {}).get("peers", [])
        if len(peers) == 2 and sum(x is not None for x in page["history"]["loss"]) >= 2:
            break
        assert time.monotonic() < deadline, f"the dashboard never showed two training peers: {page}"
        time.sleep(1.0)
    status = get_json(url + "api/status")
    assert get_json(f"http://127.0.0.1:{own_port}/api/status")["run_id"] == status["run_id"]

    shot = swarm.root / "dashboard.png"
    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    subprocess.run(
        [*browser, f"--screenshot={shot}", "--window-size=1280,1200", url], timeout=120, check=True
    )
    shown = " ".join(table_rows(dom, "peers"))
    assert len(table_rows(dom, "peers")) == 2 and all(p["peer_id"] in shown for p in status["peers"])
    units = table_rows(dom, "units")
    assert len(units) == len(status["units"]) and all(
        f"<td>{u}</td>" in " ".join(units) for u in status["units"]
    )
    chart = re.search(r'<div id="loss-chart".*?</svg>', dom, re.S)
    assert chart and '<polyline class="series"' in chart.group(0)
    assert shot.stat().st_size > 10_000
