"""Whether other peers can dial this one: tested by asking them to dial it back, and what fixes it.

At start (and while the answer is unknown) a peer asks up to ``HELPERS`` live peers to open a connection to
each address it announces (``spes/dialback``). A peer dials back only addresses of the peer that asks (the
``/p2p/`` part must be the caller's id), at most ``DIALBACKS_PER_MINUTE`` times a minute per caller, with a
short timeout, and sends nothing over the connection. ``assess`` turns the answers, and what the addresses
look like, into one line with the flag that fixes it.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from spes_p2p.net.config import NetworkConfig
from spes_p2p.net.transport import RemoteError, Transport, TransportError
from spes_p2p.net.wire import Short, Strict

logger = logging.getLogger(__name__)

RPC_DIALBACK = "spes/dialback"
HELPERS = 2  # peers asked to dial back each address
DIAL_SECONDS = 3.0
DIALBACKS_PER_MINUTE = 8

YES, NO, UNKNOWN = "yes", "no", "unknown"


class DialbackRequest(Strict):
    MAX_BYTES = 1024
    ERROR = RemoteError

    address: Short


class DialbackAnswer(Strict):
    MAX_BYTES = 64
    ERROR = RemoteError

    reachable: bool


@dataclass(frozen=True)
class Reachability:
    reachable: str  # yes, no or unknown
    message: str
    addresses: dict[str, bool | None]  # address -> dialed back (None: nobody asked)


class DialbackServer:
    """Dials back the peers that ask (transport handler threads); bounded per caller."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._recent: dict[str, list[float]] = {}
        transport.serve(RPC_DIALBACK, self.rpc_dialback, max_request_bytes=DialbackRequest.MAX_BYTES)

    def rpc_dialback(self, caller: str, request: bytes) -> bytes:
        address = DialbackRequest.decode(request).address
        if address.rsplit("/p2p/", 1)[-1] != caller:
            raise RemoteError("a peer is dialed back only at its own addresses")
        now = time.monotonic()
        with self._lock:
            recent = [t for t in self._recent.get(caller, []) if now - t < 60]
            if len(recent) >= DIALBACKS_PER_MINUTE:
                raise RemoteError("too many dial-back requests; ask again in a minute")
            self._recent[caller] = [*recent, now]
        return DialbackAnswer(reachable=self.transport.probe(address, DIAL_SECONDS)).encode()


class SelfCheck:
    """This peer's own reachability: serves dial-backs to others, asks live peers to dial it back when it
    joins (``check``), asks again at heartbeats while the answer is unknown (``recheck``), and hands each
    verdict to ``on_verdict`` (which publishes it in the peer record)."""

    def __init__(
        self,
        transport: Transport,
        network: NetworkConfig,
        live_peers: Callable[[], set[str]],
        on_verdict: Callable[[str], None],
    ) -> None:
        self.transport, self.network = transport, network
        self.live_peers, self.on_verdict = live_peers, on_verdict
        self.verdict: Reachability | None = None
        DialbackServer(transport)

    def check(self) -> Reachability:
        """Asks live peers to dial this one back at each address it announces (a few seconds at most)."""
        net, addresses, me = self.network, self.transport.addresses(), self.transport.peer_id
        helpers = sorted(p for p in self.live_peers() if p != me)
        relayed = net.client_mode or net.use_relay
        dialed = {} if relayed else dial_back(self.transport, helpers, addresses)
        self.verdict = assess(
            addresses,
            relayed=relayed,
            announced=bool(net.announce),
            dialed=dialed,
        )
        self.on_verdict(self.verdict.reachable)
        return self.verdict

    def recheck(self) -> None:
        """Heartbeat thread: while nobody could be asked yet, ask again."""
        if self.verdict is not None and self.verdict.reachable == UNKNOWN:
            self.check()


def dial_back(transport: Transport, helpers: list[str], addresses: list[str]) -> dict[str, bool | None]:
    """For each address: whether one of ``helpers`` could open a connection to it (None: none answered)."""
    results: dict[str, bool | None] = {}
    for address in addresses:
        results[address] = None
        for helper in helpers[:HELPERS]:
            request = DialbackRequest(address=address).encode()
            try:
                raw = transport.request(
                    helper, RPC_DIALBACK, request, timeout=2 * DIAL_SECONDS, max_response_bytes=64
                )
                results[address] = DialbackAnswer.decode(raw).reachable or bool(results[address])
            except (TransportError, msgspec.MsgspecError) as exc:
                logger.info("dial-back of %s by %s: %s", address, helper, exc)
            if results[address]:
                break
    return results


def assess(
    addresses: list[str], *, relayed: bool, announced: bool, dialed: dict[str, bool | None]
) -> Reachability:
    """The verdict, from what the dial-backs found (``dialed``) and what the addresses look like."""
    if relayed:
        relays = ", ".join(sorted({a.split("/p2p-circuit/")[0].rsplit("/p2p/")[-1][:12] for a in addresses}))
        message = (
            "dials out only: nobody dials this peer directly, the swarm reaches it through relay(s) "
            f"{relays or '(none)'}; it holds shards like any peer"
        )
        return Reachability(NO, message, dialed)
    yes = [a for a, ok in dialed.items() if ok]
    if yes:
        return Reachability(YES, f"reachable from the swarm: a peer dialed this one back at {yes[0]}", dialed)
    fix = _fix(addresses, announced=announced)
    if any(ok is False for ok in dialed.values()):
        tried = ", ".join(a for a, ok in dialed.items() if ok is False)
        return Reachability(
            NO, f"not reachable from the swarm: no peer could dial this one at {tried}. {fix}", dialed
        )
    return Reachability(UNKNOWN, f"not checked yet (no other peer to dial this one back). {fix}", dialed)


def _fix(addresses: list[str], *, announced: bool) -> str:
    ips = [ip for ip in (_ip(a) for a in addresses) if ip is not None]
    if announced:
        return "To fix: check that the --announce address is your public IP and that its port is forwarded"
    if ips and all(ip.is_loopback for ip in ips):
        return "To fix: it listens on loopback only (fine on one machine); use --listen /ip4/0.0.0.0/tcp/PORT"
    if any(ip.is_global for ip in ips):
        return "To fix: let TCP in on that port in your firewall"
    return (
        "To fix: forward a TCP port on your router and pass --listen /ip4/0.0.0.0/tcp/PORT --announce "
        "/ip4/<your public IP>/tcp/PORT, or pass --use-relay"
    )


def _ip(multiaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    match = re.match(r"^/ip[46]/([^/]+)/", multiaddr)
    try:
        return ipaddress.ip_address(match.group(1)) if match else None
    except ValueError:
        return None
