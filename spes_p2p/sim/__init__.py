"""Local swarms for research and for proving the client survives what volunteers do: late joins, crashes,
lossy networks, restarts. ``run`` launches real `spes-join` processes (hivemind backend) or runs the peers
in this process (memory backend, with network faults), then writes ``summary.json`` and ``loss.png``."""

from spes_p2p.sim.config import Partition, SimConfig, parse_event, parse_partition
from spes_p2p.sim.runner import run

__all__ = ["Partition", "SimConfig", "parse_event", "parse_partition", "run"]
