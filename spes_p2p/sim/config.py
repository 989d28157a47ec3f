"""``[sim]``: what a simulated swarm does (its peers, crashes, late joins, network faults), and the defaults
of a local swarm on one machine. Plain values; the parsers of the event strings live here too."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass

from spes_p2p.fields import FieldError, Key, Section, check, setting

MEMORY_ONLY_MODES = ("claimall",)  # its fake holders are peers of the in-process network
SIGNED_MODES = ("forge",)  # the memory backend has no signatures to forge: real peer processes only
BYZANTINE_MODES = (
    "garbage",
    "nan",
    "scale",
    "signflip",
    "subtle",
    "zero",
    "noise",
    "copy",
    "frozenscale",
    "ownerflip",
    "tokens",
    "late",
    "resync",
    "claimall",
    "overclaim",
    "forge",
    "silent",
    "slow",
)
RATE = r"\d+(\.\d+)?[kmg]?bit"  # a tc rate
_COMPUTE = "takes real, virtual, or virtual=SECONDS (seconds per step, e.g. virtual=0.05)"
SOLE = -1  # --kill sole@ROUND: whichever live peer is then the only holder of a unit

# `spes simulate` runs every peer on one machine: short heartbeats and rounds, a slice of the corpus, and
# deadlines that wait for peers slowed down by sharing the CPU. A file or flag still sets any of them.
LOCAL_SWARM_DEFAULTS: dict[Key, object] = {
    "swarm.run_id": "sim",
    "swarm.heartbeat_seconds": 1.0,
    "swarm.record_ttl_seconds": 8.0,
    "sync.deadline_min": 5.0,
    "sync.deadline_max": 30.0,
    "method.steps_per_round": 20,
    "method.rotate_every_rounds": 2,
    "train.eval_every": 40,
    "train.checkpoint_every": 100,
    "data.max_corpus_mb": 4.0,
    "network.listen": ("/ip4/127.0.0.1/tcp/0",),
    "run.out": "runs/sim",
    "run.rounds": 6,
}


@dataclass(frozen=True)
class Event:
    """A kill (``count`` is a peer index, or SOLE) or a join (``count`` newcomers) at a swarm round."""

    count: int
    round: int


@dataclass(frozen=True)
class Partition:
    groups: tuple[tuple[int, ...], ...]  # peer indices that can reach each other
    start: int  # first round of the partition
    end: int  # last round; healed after it


@dataclass(frozen=True, kw_only=True)
class SimConfig(Section):
    """[sim]: a local swarm: its peers, and the crashes, late joins and faults to inflict on it."""

    peers: int = setting(4, "Peers at the start.", flag="--num-peers")
    kills: tuple[str, ...] = setting(
        (),
        "SIGKILL peer I (or 'sole': a peer that alone holds a shard) when the swarm reaches ROUND.",
        flag="--kill",
        metavar="I@ROUND",
    )
    joins: tuple[str, ...] = setting(
        (), "K newcomers when the swarm reaches ROUND.", flag="--join", metavar="K@ROUND"
    )
    partitions: tuple[str, ...] = setting(
        (),
        "Memory backend: e.g. 0,1/2,3@2-3 splits the swarm in rounds 2 to 3.",
        flag="--partition",
        metavar="G/G@START[-END]",
    )
    drop: float = setting(0.0, "Memory backend: probability that a request is lost.")
    delay_ms: float = setting(0.0, "Memory backend: milliseconds added to every request.", flag="--delay")
    corrupt: float = setting(0.0, "Memory backend: probability that an answer has a byte flipped.")
    gossip_drop: float = setting(
        0.0, "Memory backend: probability that a gossip message misses one of its subscribers."
    )
    byzantine: tuple[str, ...] = setting(
        (),
        f"Peer I turns malicious, in MODE: {', '.join(BYZANTINE_MODES)} (docs/security.md).",
        metavar="I:MODE",
    )
    netns: bool = setting(
        False, "Hivemind backend, as root: each peer in its own network namespace, on a bridge."
    )
    bandwidth: str = setting(
        "",
        "With --netns: cap each peer's upload and download (a tc rate, e.g. 50mbit), or each apart (UP/DOWN, "
        "e.g. 50mbit/500mbit: a home link).",
        metavar="RATE",
    )
    nat: int = setting(0, "With --netns: the last K peers sit behind a NAT nobody can dial.", metavar="K")
    compute: str = setting(
        "real",
        "real: peers train the model; virtual[=SECONDS]: a step sleeps (default: the preset's measured step "
        "time) and updates are synthetic, with the model's real shapes.",
        metavar="MODE",
    )
    peer_settings: tuple[str, ...] = setting(
        (),
        "Peer I's own value of a setting, e.g. 0:peer.capacity=0 (a TOML value; repeatable).",
        flag="--peer-setting",
        metavar="I:SECTION.FIELD=VALUE",
    )
    churn: float = setting(
        0.0, "Each round, kill each peer with this probability and restart it with --resume a round later."
    )

    def validate(self) -> None:
        check(self.peers >= 1, "peers", "must be at least 1")
        total = self.total_peers
        for kill in self.kill_events:
            check(kill.count == SOLE or 0 <= kill.count < total, "kills", f"name no peer {kill.count}")
        self.partition_events  # noqa: B018 - parsed here so that a bad one is refused up front
        check(
            all(0 <= p < 1 for p in (self.drop, self.corrupt, self.gossip_drop)),
            "drop",
            "drop, corrupt and gossip_drop are probabilities in [0, 1)",
        )
        check(self.delay_ms >= 0, "delay_ms", "must be at least 0")
        check(not (self.bandwidth or self.nat) or self.netns, "netns", "is needed for bandwidth and nat")
        check(
            not self.bandwidth or re.fullmatch(rf"{RATE}(/{RATE})?", self.bandwidth) is not None,
            "bandwidth",
            f"takes a tc rate such as 50mbit or 800kbit, or UP/DOWN (50mbit/500mbit); got {self.bandwidth!r}",
        )
        check(
            0 <= self.nat < self.peers,
            "nat",
            f"must be between 0 and {self.peers - 1}: the first peer founds the swarm and relays",
        )
        check(0 <= self.churn < 1, "churn", "is a probability in [0, 1)")
        for index in self.overrides:
            check(index < total, "peer_settings", f"names no peer {index}")
        self.step_seconds  # noqa: B018 - parsed here so that a bad one is refused up front
        for index in self.byzantine_peers:
            check(0 <= index < total, "byzantine", f"names no peer {index}")

    def check_backend(self, backend: str) -> None:
        """What needs which ``swarm.backend`` (a FieldError of field ``backend``)."""
        faults = self.drop or self.delay_ms or self.corrupt or self.gossip_drop or self.partitions
        needs = [(("memory",), "drop, delay, corrupt, gossip_drop, partitions")] if faults else []
        needs += [(("hivemind", "libp2p"), "--netns")] if self.netns else []
        for mode in self.byzantine_peers.values():
            needs += [(("memory",), mode)] if mode in MEMORY_ONLY_MODES else []
            needs += [(("hivemind", "libp2p"), mode)] if mode in SIGNED_MODES else []
        for allowed, what in needs:
            check(backend in allowed, "backend", f"must be {' or '.join(allowed)} for {what}")

    @property
    def virtual(self) -> bool:
        return self.compute != "real"

    @property
    def step_seconds(self) -> float | None:
        """Virtual compute's seconds per step (None: the preset's measured step time; real compute: None)."""
        mode, _, seconds = self.compute.partition("=")
        check(mode in ("real", "virtual") and not (mode == "real" and seconds), "compute", _COMPUTE)
        try:
            value = float(seconds) if seconds else None
        except ValueError:
            raise FieldError("compute", _COMPUTE) from None
        check(value is None or value >= 0, "compute", _COMPUTE)
        return value

    @property
    def byzantine_peers(self) -> dict[int, str]:
        """Peer index -> its attack."""
        peers = {}
        for text in self.byzantine:
            index, _, mode = text.partition(":")
            check(
                index.isdigit() and mode in BYZANTINE_MODES,
                "byzantine",
                f"has {text!r}; write I:MODE, as in 1:scale, with MODE one of {', '.join(BYZANTINE_MODES)}",
            )
            peers[int(index)] = mode
        return peers

    @property
    def overrides(self) -> dict[int, dict[str, object]]:
        """Peer index -> its own values, by ``section.field``."""
        found: dict[int, dict[str, object]] = {}
        for text in self.peer_settings:
            match = re.fullmatch(r"(\d+):(\w+)\.(\w+)=(.*)", text)
            check(
                match is not None,
                "peer_settings",
                f"take I:SECTION.FIELD=VALUE, e.g. 0:peer.capacity=0; got {text!r}",
            )
            index, section, name, raw = match.groups()
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw  # a bare word: a string
            found.setdefault(int(index), {})[f"{section}.{name}"] = value
        return found

    @property
    def kill_events(self) -> list[Event]:
        return sorted((_event(k, "kills", sole=True) for k in self.kills), key=lambda e: e.round)

    @property
    def total_peers(self) -> int:
        """The founders and every newcomer."""
        return self.peers + sum(j.count for j in self.join_events)

    @property
    def join_events(self) -> list[Event]:
        joins = sorted((_event(j, "joins") for j in self.joins), key=lambda e: e.round)
        check(all(j.count >= 1 for j in joins), "joins", "take at least one newcomer, as in 1@3")
        return joins

    @property
    def partition_events(self) -> list[Partition]:
        return sorted((_partition(p) for p in self.partitions), key=lambda p: p.start)


def _event(text: str, field: str, sole: bool = False) -> Event:
    """'I@ROUND' (kills; I may be 'sole') or 'K@ROUND' (joins)."""
    left, sep, right = text.partition("@")
    try:
        if not sep:
            raise ValueError
        event = Event(SOLE if sole and left == "sole" else int(left), int(right))
    except ValueError:
        raise FieldError(field, f"take NUMBER@ROUND, e.g. 1@3; got {text!r}") from None
    check(event.round >= 0, field, f"take a round of 0 or more; got {text!r}")
    return event


def _partition(text: str) -> Partition:
    """'0,1/2,3@2-4': peers 0,1 and 2,3 cannot reach each other in rounds 2 to 4 (one round: '@2')."""
    groups, sep, rounds = text.partition("@")
    try:
        if not sep:
            raise ValueError
        start, _, end = rounds.partition("-")
        parsed = tuple(tuple(int(i) for i in g.split(",")) for g in groups.split("/"))
        return Partition(parsed, int(start), int(end or start))
    except ValueError:
        raise FieldError(
            "partitions", f"take GROUP/GROUP@START[-END], e.g. 0,1/2,3@2-4; got {text!r}"
        ) from None


def name_of(index: int) -> str:
    """A simulated peer's name: its run folder, log and settings file are named after it."""
    return f"peer{index}"
