"""Network namespaces for a simulated swarm: each peer on its own address, with a bandwidth cap, and some
behind a NAT that nobody can dial (``spes simulate --netns [--bandwidth UP[/DOWN]] [--nat K]``; Linux, root).

The layout of one run (``T`` is the run's tag)::

    spes-T-hub        a bridge, and nothing else: the run's "internet"; no address, no route out
    spes-T-p<i>       peer i: eth0, 10.77.<i // 200>.<i % 200 + 2>/16 on the bridge (a public peer)
    spes-T-nat<i>     peer i's home router: wan on the bridge (10.77.<128 + i // 200>.<i % 200 + 2>/16),
                      lan 192.168.1.1/24; nftables masquerades what leaves by wan, drops what comes in
                      unasked. Peer i sits behind it at 192.168.1.2, its default route through the router.

Every peer behind a NAT has a router of its own (as volunteers at different homes do), so two NATed peers
cannot reach each other directly either. ``--bandwidth`` puts a token bucket (``tc tbf``) on both ends of
each peer's link: its upload on its own eth0, its download on the other end (the same rate, or UP/DOWN: a
home link's uplink is a fraction of its downlink).

Nothing of a run touches the host's network: the bridge lives in the hub namespace, and the simulator
itself (in the host's namespace) talks to its peers through files only. A run's namespaces, and the
processes in them, are removed when the run ends; when the simulator was killed, its watchdog (a small
process that outlives it) removes them, and ``spes simulate --cleanup`` removes whatever a dead run left.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from spes_p2p.errors import SpesError

logger = logging.getLogger(__name__)

PREFIX = "spes-"
OWNERS = Path("/run/spes-netns")  # <tag>.pid: the simulator that owns the run's namespaces
BRIDGE_NET = ipaddress.ip_network("10.77.0.0/16")  # peers from 10.77.0.2 up, routers from 10.77.128.2 up
LAN_ROUTER, LAN_PEER = "192.168.1.1", "192.168.1.2"
MAX_PEERS = 200 * 128  # addresses of the bridge's lower half (routers take the upper)
COMMAND_SECONDS = 10.0


class NetnsError(SpesError):
    """A namespace, link or rule that could not be set up; the message names the command."""


def missing_tools(nat: bool) -> str | None:
    """One line on what ``--netns`` lacks here (root, iproute2, nftables), or None."""
    if sys.platform != "linux":
        return "--netns needs Linux network namespaces; run without --netns"
    if os.geteuid() != 0:
        return "--netns creates network namespaces and needs root: run it as root (or with sudo)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if (tool != "nft" or nat) and shutil.which(tool) is None:
            return f"--netns needs the {tool!r} command: install {package} (apt-get install {package})"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_SECONDS)
    if check and done.returncode:
        raise NetnsError(f"{' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")
    return done


def address_of(index: int, router: bool = False) -> str:
    """Public peer ``index``'s address on the bridge, or the wan address of its router."""
    offset = (128 * 256 if router else 0) + (index // 200) * 256 + index % 200 + 2
    return str(BRIDGE_NET.network_address + offset)


def tbf(rate: str) -> list[str]:
    """A token bucket at ``rate`` (tc units), with a 10 ms burst (at least a few full frames)."""
    bits = _bits_per_second(rate)
    burst = max(16 * 1514, int(bits / 8 / 100))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "200ms"]


def _bits_per_second(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    if match is None:
        raise NetnsError(f"not a tc rate: {rate!r} (write e.g. 50mbit)")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


@dataclass(frozen=True)
class Layout:
    """Who is where: ``nat`` holds the indices of the peers behind a NAT."""

    tag: str
    peers: int
    nat: frozenset[int] = frozenset()
    bandwidth: str = ""

    def __post_init__(self) -> None:
        if self.peers > MAX_PEERS:
            raise NetnsError(f"--netns places at most {MAX_PEERS} peers on its bridge; got {self.peers}")

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}-hub"

    def peer(self, index: int) -> str:
        return f"{PREFIX}{self.tag}-p{index}"

    def router(self, index: int) -> str:
        return f"{PREFIX}{self.tag}-nat{index}"

    def address(self, index: int) -> str:
        """Peer ``index``'s own address (a LAN address behind its router when it is NATed)."""
        return LAN_PEER if index in self.nat else address_of(index)

    def listen(self, index: int) -> str:
        return f"/ip4/{self.address(index)}/tcp/0"

    def namespaces(self) -> list[str]:
        return [self.hub, *(self.peer(i) for i in range(self.peers)), *(self.router(i) for i in self.nat)]


class Namespaces:
    """A run's namespaces: ``create`` builds them (and starts the watchdog), ``exec_prefix`` runs a command
    in a peer's, ``remove`` kills what runs in them and deletes them. Removing twice is harmless."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.watchdog: subprocess.Popen | None = None

    def create(self) -> None:
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / f"{self.layout.tag}.pid").write_text(str(os.getpid()))
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "spes_p2p.sim.netns", "watch", self.layout.tag, str(os.getpid())],
            start_new_session=True,  # a Ctrl-C or kill of the simulator's group leaves it to clean up
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _build(self) -> None:
        lay = self.layout
        for name in lay.namespaces():
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", lay.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", lay.hub, "link", "set", "br0", "up")
        for index in range(lay.peers):
            if index in lay.nat:
                self._nat_link(index)
            else:
                self._link(lay.hub, f"p{index}", lay.peer(index), "eth0", lay.address(index) + "/16")
                _run("ip", "-n", lay.hub, "link", "set", f"p{index}", "master", "br0")
                self._cap(lay.hub, f"p{index}", lay.peer(index), "eth0")

    def _nat_link(self, index: int) -> None:
        lay, router = self.layout, self.layout.router(index)
        self._link(lay.hub, f"n{index}", router, "wan", address_of(index, router=True) + "/16")
        _run("ip", "-n", lay.hub, "link", "set", f"n{index}", "master", "br0")
        self._link(router, "lan", lay.peer(index), "eth0", f"{LAN_PEER}/24", f"{LAN_ROUTER}/24")
        _run("ip", "-n", lay.peer(index), "route", "add", "default", "via", LAN_ROUTER)
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = (
            "table ip nat {\n"
            " chain postrouting { type nat hook postrouting priority 100; oifname wan masquerade; }\n"
            "}\n"
            "table ip filter {\n"
            " chain forward { type filter hook forward priority 0; policy drop;\n"
            "  ct state established,related accept; iifname lan oifname wan accept; }\n"
            " chain input { type filter hook input priority 0; policy drop;\n"
            "  ct state established,related accept; iifname lo accept; iifname lan accept; }\n"
            "}\n"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=COMMAND_SECONDS,
        )
        if done.returncode:
            raise NetnsError(f"nft in {router} failed: {done.stderr.strip()}")
        self._cap(router, "lan", lay.peer(index), "eth0")

    @staticmethod
    def _link(near_ns: str, near: str, far_ns: str, far: str, address: str, near_address: str = "") -> None:
        """A veth pair from ``near_ns`` (end ``near``) to ``far_ns`` (end ``far``, at ``address``)."""
        _run("ip", "-n", near_ns, "link", "add", near, "type", "veth", "peer", "name", far, "netns", far_ns)
        _run("ip", "-n", far_ns, "addr", "add", address, "dev", far)
        _run("ip", "-n", far_ns, "link", "set", far, "up")
        if near_address:
            _run("ip", "-n", near_ns, "addr", "add", near_address, "dev", near)
        _run("ip", "-n", near_ns, "link", "set", near, "up")

    def _cap(self, near_ns: str, near: str, far_ns: str, far: str) -> None:
        """The peer's upload (its own end) and download (the other end) at ``--bandwidth`` (UP[/DOWN])."""
        if self.layout.bandwidth:
            up, _, down = self.layout.bandwidth.partition("/")
            _run("tc", "-n", far_ns, "qdisc", "add", "dev", far, "root", *tbf(up))
            _run("tc", "-n", near_ns, "qdisc", "add", "dev", near, "root", *tbf(down or up))

    def exec_prefix(self, index: int) -> list[str]:
        """What runs a command in peer ``index``'s namespace."""
        return ["ip", "netns", "exec", self.layout.peer(index)]

    def remove(self) -> None:
        remove_run(self.layout.tag, self.layout.namespaces())
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.terminate()
            self.watchdog.wait(timeout=COMMAND_SECONDS)


def existing() -> dict[str, list[str]]:
    """The namespaces of simulated swarms on this machine, by run tag."""
    names = _run("ip", "netns", "list", check=False).stdout.split()
    runs: dict[str, list[str]] = {}
    for name in names:
        match = re.fullmatch(rf"{PREFIX}([0-9a-z]+)-(hub|p\d+|nat\d+)", name)
        if match:
            runs.setdefault(match.group(1), []).append(name)
    return runs


def remove_run(tag: str, names: list[str]) -> None:
    """Kills every process in the run's namespaces, then deletes them (and the run's owner file)."""
    for name in names:
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for name in names:
        _run("ip", "netns", "delete", name, check=False)
    (OWNERS / f"{tag}.pid").unlink(missing_ok=True)


def owner_alive(tag: str) -> bool:
    try:
        os.kill(int((OWNERS / f"{tag}.pid").read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def cleanup() -> list[str]:
    """Removes the namespaces of every simulated swarm whose simulator is gone; returns their names."""
    problem = missing_tools(nat=False)
    if problem:
        raise NetnsError(problem.replace("--netns creates", "--cleanup removes"))
    removed = []
    for tag, names in existing().items():
        if not owner_alive(tag):
            remove_run(tag, names)
            removed += names
    return removed


def new_tag() -> str:
    return f"{os.getpid():x}{int(time.time()) % 4096:03x}"


def _watch(tag: str, owner: int) -> None:
    """The watchdog: waits for the simulator to exit, then removes what its run left behind."""
    while True:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            break
        time.sleep(1.0)
    names = existing().get(tag, [])
    if names:
        remove_run(tag, names)


if __name__ == "__main__" and sys.argv[1:2] == ["watch"]:
    _watch(sys.argv[2], int(sys.argv[3]))
