"""What a simulation does, as plain values, and the parsers for its command-line events."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from spes_p2p.errors import ConfigError
from spes_p2p.settings import Settings


@dataclass(frozen=True)
class Partition:
    groups: tuple[tuple[int, ...], ...]  # peer indices that can reach each other
    start: int  # first round of the partition
    end: int  # last round; healed after it


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    peers: int = 4
    shards: int = 2
    preset: str = "tiny"
    experts: int = 0  # experts per layer; 0: the preset's (tiny has 8, so shards must divide 8)
    rounds: int = 6
    steps_per_round: int = 20
    backend: str = "hivemind"  # or "memory"
    kills: tuple[tuple[int, int], ...] = ()  # (peer index or SOLE, round): SIGKILL when the swarm reaches it
    joins: tuple[tuple[int, int], ...] = ()  # (count, round): that many newcomers when the swarm reaches it
    drop: float = 0.0  # memory backend: probability that a request is lost
    delay_ms: float = 0.0  # memory backend: added to every request
    corrupt: float = 0.0  # memory backend: probability that an answer has a byte flipped
    partitions: tuple[Partition, ...] = ()
    out: Path = Path("runs/sim")
    codec: str = "int8"
    batch_size: int = 8
    seq_len: int = 128
    max_corpus_mb: float = 4.0
    seed: int = 0
    dense_blocks: int = 1  # B; 1: every peer trains the whole dense part
    active_blocks: int = 1
    rotate_every: int = 2  # rounds between dense-block rotations (short, as simulations are)
    frozen_experts: str = "full"
    method: str = "spes"  # or diloco: every peer trains the full model, Nesterov outer step (the baseline)
    extra: dict = field(default_factory=dict)  # more Settings overrides, section__field=value

    def __post_init__(self) -> None:
        if self.backend not in ("hivemind", "memory"):
            raise ConfigError(f"backend must be hivemind or memory, got {self.backend!r}")
        if self.peers < 1 or self.rounds < 1 or self.steps_per_round < 1:
            raise ConfigError("peers, rounds and steps-per-round must be at least 1")
        for index, round_ in self.kills:
            if index != SOLE and not 0 <= index < self.peers + sum(c for c, _ in self.joins):
                raise ConfigError(f"--kill {index}@{round_}: there is no peer {index}")
        faults = self.drop or self.delay_ms or self.corrupt or self.partitions
        if faults and self.backend != "memory":
            raise ConfigError("--drop, --delay, --corrupt and --partition need --backend memory")
        if not (0 <= self.drop < 1 and 0 <= self.corrupt < 1):
            raise ConfigError("--drop and --corrupt are probabilities in [0, 1)")
        self.settings()  # the peers' settings are checked before anything starts

    def settings(self) -> Settings:
        """The peers' settings: short heartbeats and deadlines, as suits one machine."""
        diloco = {"method__outer": "nesterov", "method__outer_lr": 0.7, "method__merge": False}
        return Settings().override(
            method__mode=self.method,
            **(diloco if self.method == "diloco" else {}),
            swarm__run_id="sim",
            model__preset=self.preset,
            model__experts=self.experts,
            model__shards=self.shards,
            method__steps_per_round=self.steps_per_round,
            method__codec=self.codec,
            model__dense_blocks=self.dense_blocks,
            peer__active_blocks=self.active_blocks,
            method__rotate_every_rounds=self.rotate_every,
            train__frozen_experts=self.frozen_experts,
            train__batch_size=self.batch_size,
            train__seq_len=self.seq_len,
            train__eval_every_rounds=2,
            data__max_corpus_mb=self.max_corpus_mb,
            swarm__heartbeat_seconds=1.0,
            swarm__record_ttl_seconds=8.0,
            swarm__sync_deadline_min=5.0,  # late peers are waited for
            swarm__sync_deadline_max=30.0,
            network__listen=("/ip4/127.0.0.1/tcp/0",),
            **self.extra,
        )


SOLE = -1  # --kill sole@ROUND: whichever live peer is then the only holder of a unit


def parse_event(text: str, what: str) -> tuple[int, int]:
    """'I@ROUND' (kill; I may be 'sole') or 'K@ROUND' (join) -> (int, round)."""
    left, sep, right = text.partition("@")
    try:
        if not sep:
            raise ValueError
        if left == "sole" and what == "--kill":
            return SOLE, int(right)
        return int(left), int(right)
    except ValueError:
        raise ConfigError(f"{what} takes NUMBER@ROUND, e.g. 1@3; got {text!r}") from None


def parse_partition(text: str) -> Partition:
    """'0,1/2,3@2-4': peers 0,1 and 2,3 cannot reach each other in rounds 2 to 4 (one round: '@2')."""
    groups, sep, rounds = text.partition("@")
    try:
        if not sep:
            raise ValueError
        start, _, end = rounds.partition("-")
        parsed = tuple(tuple(int(i) for i in g.split(",")) for g in groups.split("/"))
        return Partition(parsed, int(start), int(end or start))
    except ValueError:
        raise ConfigError(
            f"--partition takes GROUP/GROUP@START[-END], e.g. 0,1/2,3@2-4; got {text!r}"
        ) from None
