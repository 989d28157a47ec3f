"""The peer layer's settings section: ``[method]`` (how the swarm trains: SPES or the DiLoCo baseline, the
round length, overlap, dense-block rotation). Plain values."""

from __future__ import annotations

from dataclasses import dataclass

from spes_p2p.fields import SWARM, Key, Section, check, setting
from spes_p2p.swarm.claims import BLOCK_ORDERS
from spes_p2p.sync.config import AGGREGATES

MODES = ("spes", "diloco")

# A method's own defaults, applied wherever it is chosen unless a file or flag sets the field: DiLoCo as
# published averages every parameter (the dense part in one block) with a Nesterov outer step (lr 0.7,
# momentum 0.9) and does not merge.
METHOD_DEFAULTS: dict[str, dict[Key, object]] = {
    "diloco": {
        "sync.outer": "nesterov",
        "sync.outer_lr": 0.7,
        "merge.enabled": False,
        "model.dense_blocks": 1,
    },
}


@dataclass(frozen=True, kw_only=True)
class MethodConfig(Section):
    """[method]: SPES, or the DiLoCo baseline where every peer trains and averages the full model."""

    SCOPE = SWARM

    mode: str = setting(
        "spes",
        "spes, or diloco: every peer trains and averages the full model (Nesterov outer step, no merging).",
        choices=MODES,
        flag="--method",
    )
    aggregate: str = setting(
        "clipped_mean",
        "How a round combines updates; under every rule, outliers by norm are rejected (docs/security.md).",
        choices=AGGREGATES,
    )
    steps_per_round: int = setting(100, "H: local optimizer steps between synchronizations.")
    overlap: bool = setting(True, "Exchange round k in the background while round k+1 trains.")
    rotate_every_rounds: int = setting(
        10, "Dense blocks (B > 1): rounds between rotations; 0: never rotate.", flag="--rotate-every"
    )
    refresh_every_rounds: int = setting(
        1,
        "k: frozen copies of other units are brought up to date every k rounds, by the change since the "
        "copy's version (fewer bytes for staler copies; merges wait for such a round).",
        flag="--refresh-every",
    )
    block_order: str = setting(
        "cyclic",
        "At a rotation, holders of block b move to b+1 (cyclic) or a random block.",
        choices=BLOCK_ORDERS,
    )

    def validate(self) -> None:
        check(self.steps_per_round >= 1, "steps_per_round", "must be at least 1")
        check(self.rotate_every_rounds >= 0, "rotate_every_rounds", "must be at least 0")
        check(self.refresh_every_rounds >= 1, "refresh_every_rounds", "must be at least 1")
