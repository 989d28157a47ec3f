"""Network namespaces of ``spes simulate --netns``: who can reach whom, the bandwidth cap, that nothing
outlives a run (its removal, the watchdog after a killed simulator, ``--cleanup``), and peers behind NAT on
both network backends. Needs root, iproute2 and nftables (``.ci/run`` installs them); skipped elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from spes_cli.main import spes

from spes_p2p.sim.netns import OWNERS, Layout, Namespaces, address_of, cleanup, existing, missing_tools

pytestmark = pytest.mark.skipif(bool(missing_tools(nat=True)), reason=str(missing_tools(nat=True)))

SERVER = """
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", 5000)); s.listen(); s.settimeout(20)
print("ready", flush=True)
while True:
    c, (host, _) = s.accept()
    total = 0
    while chunk := c.recv(1 << 20):
        total += len(chunk)
    print(host, total, flush=True)
"""


def send(ns: Namespaces, index: int, host: str, nbytes: int = 1) -> bool:
    code = f"import socket; socket.create_connection(({host!r}, 5000), timeout=3).sendall(b'x' * {nbytes})"
    done = subprocess.run(
        [*ns.exec_prefix(index), sys.executable, "-c", code], capture_output=True, timeout=60
    )
    return done.returncode == 0


@pytest.fixture
def swarm_net():
    ns = Namespaces(Layout(f"t{os.getpid():x}", 4, frozenset({2, 3}), "40mbit/20mbit"))  # (upload/download)
    ns.create()
    servers = [
        subprocess.Popen(
            [*ns.exec_prefix(i), sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True
        )
        for i in range(4)
    ]
    for server in servers:
        assert server.stdout.readline().strip() == "ready"
    yield ns, servers
    ns.remove()
    for server in servers:
        server.wait(timeout=10)


def test_public_peers_reach_each_other_and_nobody_reaches_a_natted_peer(swarm_net):
    ns, servers = swarm_net
    lay = ns.layout
    assert send(ns, 0, lay.address(1)) and send(ns, 1, lay.address(0))
    assert send(ns, 2, lay.address(0)), "a NATed peer dials out"
    assert not send(ns, 0, lay.address(2)), "its LAN address is not routed from the bridge"
    assert not send(ns, 0, address_of(2, router=True)), "its router drops what it did not ask for"
    assert not send(ns, 3, address_of(2, router=True)), "nor can another NATed peer get in"
    ns.remove()
    first = servers[0].stdout.read().split()
    assert address_of(2, router=True) in first, "the NATed peer's packets leave masqueraded as its router"


def test_both_ends_of_a_link_shape_to_the_rate(swarm_net):
    ns, servers = swarm_net
    lay = ns.layout
    assert send(ns, 0, lay.address(1), nbytes=5_000_000)
    assert servers[1].stdout.readline().split() == [lay.address(0), "5000000"]  # all of it has arrived
    upload = qdisc(lay.peer(0), "eth0")  # peer 0's upload
    download = qdisc(lay.hub, "p1")  # peer 1's download
    behind_nat = qdisc(lay.router(2), "lan")  # a NATed peer's download, on its router
    assert "tbf" in upload and "rate 40Mbit" in upload
    for shown in (download, behind_nat):
        assert "tbf" in shown and "rate 20Mbit" in shown
    for shown in (upload, download):
        sent = int(shown.split("Sent ")[1].split()[0])
        overlimits = int(shown.split("overlimits ")[1].split()[0])
        assert sent >= 5_000_000 and overlimits > 0, "the 5 MB went through the bucket, which held it back"


def qdisc(namespace: str, device: str) -> str:
    done = subprocess.run(["tc", "-n", namespace, "-s", "qdisc", "show", "dev", device], capture_output=True)
    return done.stdout.decode()


def test_a_run_leaves_nothing_and_a_killed_simulator_is_cleaned_up_after(tmp_path):
    tag = f"k{os.getpid():x}"
    # a "simulator" that builds its namespaces, starts a process in one, and is then SIGKILLed
    code = (
        "import subprocess, sys, time\n"
        "from spes_p2p.sim.netns import Layout, Namespaces\n"
        f"ns = Namespaces(Layout({tag!r}, 2, frozenset({{1}})))\n"
        "ns.create()\n"
        "subprocess.Popen([*ns.exec_prefix(1), 'sleep', '300'])\n"
        "print('up', flush=True)\n"
        "time.sleep(300)\n"
    )
    sim = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert sim.stdout.readline().strip() == "up"
    assert len(existing()[tag]) == 4  # hub, two peers, one router
    os.kill(sim.pid, signal.SIGKILL)
    sim.wait(timeout=10)
    deadline = time.monotonic() + 30
    while tag in existing() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tag not in existing(), "the watchdog removed the dead run's namespaces"
    assert not (OWNERS / f"{tag}.pid").exists()


def test_cleanup_removes_only_runs_whose_simulator_is_gone():
    mine, dead = Namespaces(Layout(f"m{os.getpid():x}", 1)), Layout(f"d{os.getpid():x}", 1)
    mine.create()
    try:
        for name in dead.namespaces():  # a run whose owner and watchdog are gone
            subprocess.run(["ip", "netns", "add", name], check=True)
        removed = cleanup()
        assert set(dead.namespaces()) <= set(removed)
        assert mine.layout.tag in existing() and dead.tag not in existing()
    finally:
        mine.remove()
    assert mine.layout.tag not in existing()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_natted_peers_announce_only_their_relay_and_every_pair_moves_a_megabyte(tmp_path, backend):
    """Peers 0 and 1 public, peers 2 and 3 behind NAT (relayed through peer 0): they announce only their
    circuit addresses, and every pair moves a 1 MB answer both ways, the two NATed peers included (their
    requests forwarded whole by peer 0)."""
    layout = Layout(f"r{os.getpid():x}{backend[0]}", 4, frozenset({2, 3}))
    ns = Namespaces(layout)
    ns.create()
    procs = []
    try:
        public = [f"/ip4/{layout.address(i)}/tcp/31337" for i in range(2)]

        def start(index: int, listen: str, initial: str = "", relayed: bool = False) -> None:
            args = [backend, str(tmp_path), str(index), listen, "4", "1000000", initial]
            args += ["--relayed"] * relayed
            script = Path(__file__).with_name("relay_peer.py")
            procs.append(subprocess.Popen([*ns.exec_prefix(index), sys.executable, str(script), *args]))

        start(0, public[0])
        while not (tmp_path / "0.json").exists():
            assert procs[0].poll() is None
            time.sleep(0.2)
        first = json.loads((tmp_path / "0.json").read_text())["addrs"][0]
        start(1, public[1], first)
        for natted in (2, 3):
            start(natted, layout.listen(natted), first, relayed=True)
        for proc in procs:
            proc.wait(timeout=120)
        for natted in (2, 3):
            info = json.loads((tmp_path / f"{natted}.json").read_text())
            assert info["addrs"] == [f"{first}/p2p-circuit/p2p/{info['id']}"]
        for index in range(4):
            got = json.loads((tmp_path / f"{index}.got").read_text())
            assert all(n == 1_000_000 for n in got.values()), (index, got)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        ns.remove()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_two_natted_peers_alone_hold_the_experts_and_a_newcomer_catches_up(tmp_path, backend):
    """``spes simulate --netns --nat 2``: peers 0 and 1 public and holding the dense part only, peers 2 and
    3 behind NATs of their own the only holders of the expert shard, a newcomer joining at round 3. Every
    unit's holders end bit-identical (virtual compute gives each peer an update of its own: the two NATed
    holders agree only if their updates crossed, forwarded by a public peer), and nothing fails."""
    out = tmp_path / "sim"
    args = ["simulate", "--netns", "--num-peers", "4", "--nat", "2", "--shards", "1", "--rounds", "6"]
    args += ["--peer-setting", "0:peer.capacity=0", "--peer-setting", "1:peer.capacity=0"]
    args += ["--join", "1@3", "--compute", "virtual", "--max-corpus-mb", "1", "--backend", backend]
    result = CliRunner().invoke(spes, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["failures"] and summary["rounds_completed"] == 6, summary["failures"]
    experts = summary["units"]["experts/0"]["holders"]
    assert all({"peer2", "peer3"} <= set(experts[str(r)]) for r in range(6)), experts
    assert not summary["holders_apart"] and summary["uncovered_unit_rounds"] == 0, summary["holders_apart"]
    (newcomer,) = summary["newcomers"]
    assert newcomer["first_counted_round"] is not None and newcomer["rounds_late"] <= 2, newcomer
