"""``spes simulate --netns``: the peer processes of ``ProcessFleet``, each in a network namespace of its own
(``sim/netns.py``): a public peer listens and announces ``<its address>/tcp/31337`` on the run's bridge; a
peer behind NAT (``--nat K``: the last K of the first peers) listens on its LAN address and joins with
``--use-relay`` through up to two public peers, its relays."""

from __future__ import annotations

from spes_p2p.settings import Settings
from spes_p2p.sim.fleets import ProcessFleet
from spes_p2p.sim.netns import Layout, Namespaces, NetnsError, existing, missing_tools, new_tag

PORT = 31337  # every peer has an address of its own: one port for all
RELAYS = 2  # public peers a NATed peer reserves a relay slot on


class NetnsFleet(ProcessFleet):
    @staticmethod
    def check_machine(settings: Settings) -> None:
        problem = missing_tools(nat=settings.sim.nat > 0)
        if problem:
            raise NetnsError(problem)

    def __init__(self, settings: Settings) -> None:
        sim = settings.sim
        self.check_machine(settings)
        super().__init__(settings)
        natted = frozenset(range(sim.peers - sim.nat, sim.peers))
        self.namespaces = Namespaces(Layout(new_tag(), sim.total_peers, natted, sim.bandwidth))
        self.namespaces.create()

    def _netns(self, index: int) -> str | None:
        return self.namespaces.layout.peer(index)

    def _network(self, index: int) -> dict:
        layout = self.namespaces.layout
        if index in layout.nat:
            return {
                "network.listen": (layout.listen(index),),
                "network.use_relay": True,
                "swarm.initial_peers": self._public_addresses()[:RELAYS],
            }
        address = f"/ip4/{layout.address(index)}/tcp/{PORT}"
        return {
            "network.listen": (address,),
            "network.announce": (address,),
            "swarm.initial_peers": self._public_addresses() if self.started else (),
        }

    def _public_addresses(self) -> tuple[str, ...]:
        """Live public peers' addresses (a relayed peer's circuit address needs its relay up as well)."""
        public = [a for a in self._live_addresses() if "/p2p-circuit/" not in a]
        if not public:
            raise NetnsError("no live public peer: a peer behind NAT needs one as its relay")
        return tuple(public)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.namespaces.remove()

    def leftovers(self) -> list[str]:
        return super().leftovers() + existing().get(self.namespaces.layout.tag, [])
