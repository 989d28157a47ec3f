"""``[dashboard]``: where the swarm's web page is served (``spes dashboard``, ``spes-join --dashboard``)."""

from __future__ import annotations

from dataclasses import dataclass

from spes_p2p.fields import Section, check, setting


@dataclass(frozen=True, kw_only=True)
class DashboardConfig(Section):
    """[dashboard]: the page that shows the swarm: peers, coverage, loss, traffic and events."""

    port: int = setting(
        0,
        "Serve the swarm's web page (and /api/status, /metrics) on this port; 0: none (spes dashboard: "
        "a free one).",
        flag="--dashboard",
    )
    host: str = setting(
        "127.0.0.1",
        "The address the page listens on; 0.0.0.0 shares it with every network this machine is on.",
        flag="--dashboard-host",
    )

    def validate(self) -> None:
        check(0 <= self.port <= 65535, "port", "must be a TCP port, 0 to 65535")
        check(bool(self.host), "host", "must be an address to listen on, e.g. 127.0.0.1")
