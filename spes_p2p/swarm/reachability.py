"""Whether other peers can dial this one, judged from the addresses it announces, and what fixes it."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Reachability:
    reachable: bool
    message: str


def assess(addresses: list[str], *, client_mode: bool, announced: bool, relay: bool) -> Reachability:
    if client_mode:
        return Reachability(
            False,
            "client mode: this peer dials out only; nobody can dial it, so it holds no shard of its own",
        )
    ips = [_ip(a) for a in addresses]
    public = [a for a, ip in zip(addresses, ips, strict=True) if ip is not None and ip.is_global]
    if public:
        return Reachability(True, f"reachable at {public[0]} if your firewall lets TCP in on that port")
    if relay:
        return Reachability(
            True, "no public address, but relays are on: peers reach this one through a relay"
        )
    if ips and all(ip is not None and ip.is_loopback for ip in ips):
        return Reachability(
            False,
            "listening on loopback only: peers on other machines cannot dial this one "
            "(fine for a local simulation); use --listen /ip4/0.0.0.0/tcp/PORT to open it",
        )
    fix = (
        "forward a TCP port on your router and pass --listen /ip4/0.0.0.0/tcp/PORT --announce "
        "/ip4/<your public IP>/tcp/PORT, or pass --use-relay, or join with --client-mode"
    )
    if announced:
        fix = "check that the --announce address is your public IP and that its port is forwarded"
    return Reachability(
        False,
        f"this peer announces only private addresses; peers outside your network "
        f"cannot dial it. To fix: {fix}",
    )


def _ip(multiaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    match = re.match(r"^/ip[46]/([^/]+)/", multiaddr)
    try:
        return ipaddress.ip_address(match.group(1)) if match else None
    except ValueError:
        return None
