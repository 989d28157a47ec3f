"""`spes simulate --byzantine`: one malicious peer among four, in each mode, on the memory backend. No honest
peer fails, and the honest peers end within noise of a clean run with the same seed."""

import functools

import pytest

from spes_p2p.errors import ConfigError
from spes_p2p.sim import run, simulation
from spes_p2p.sim.config import BYZANTINE_MODES, SIGNED_MODES, SimConfig
from spes_p2p.sim.summary import read_rows

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
SWARM = {
    "swarm.backend": "memory",
    "sim.peers": 4,
    "model.shards": 2,
    "model.dense_blocks": 1,  # every peer holds the dense part: the attacker is one of 4 in its exchange
    "run.rounds": 4,
    "method.steps_per_round": 10,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "train.eval_every": 20,
    "data.max_corpus_mb": 1.0,
    "sync.deadline_min": 0.5,
    "sync.deadline_max": 1.5,
    "sync.request_timeout": 1.5,
    # torch's AdamW: the defences do not depend on the optimizer, and bitsandbytes' 8-bit step on CPU was a
    # sixth of these runs' CPU time (peers in one process take turns at it)
    "train.optimizer": "adamw",
}
# The honest peers' final validation loss may differ from a clean run's by the noise of this swarm: its
# clean final loss over seeds 0-3 ranged from 6.533 to 6.538 (at 6 rounds: 6.130 to 6.133, and 6.115 to
# 6.157 with the 8-bit optimizer); which updates arrive in time varies more from run to run. (The
# attacker's own training, one peer in four, is missing from the honest peers' too.)
# Deadlines are short next to a round's training, as in a real swarm: a peer held up for seconds here
# would otherwise fall rounds behind and download the model instead of training.
NOISE = 0.06
# What the honest peers must have refused, per mode (the others are not refusals: a token count looks
# honest, the late updates are not even fetched, a silent or slow peer is only not waited for). A sign flip
# looks honest as an update, but not as the dense part the attacker combines for its group: that points
# against the honest members' own pieces. overclaim's claims are not refused either: peers that refresh a
# shard it claims and does not serve stop counting it as a holder (test_versions, test_claims; here one
# honest peer refreshes such a shard, in a few rounds only; what it serves may be refused: EITHER).
REFUSED = {
    "garbage",
    "nan",
    "scale",
    "signflip",
    "subtle",
    "zero",
    "noise",  # (as the combined parts it serves: its updates are only left out, below)
    "copy",
    "ownerflip",
}
REFUSED |= {"resync", "claimall"}
# frozenscale is refused only when a peer asks the attacker for a frozen copy before the honest holder (the
# order is shuffled): refusals or none, both are right. So is overclaim: a peer that refreshes a shard the
# attacker claims and does not train may ask it first; what it serves then is its own old copy, which the
# holders' confirmations outvote ("two other holders serve other weights", not toward a ban: seen in CI)
EITHER = {"frozenscale", "overclaim"}
# Free-riders and poison inside the bounds pass every payload check; their co-holders refuse them, and an
# honest peer bans them at its second refusal in a row (their score falls below the ban: docs/security.md).
EXCLUDED = {"signflip", "subtle", "zero", "copy"}
# Noise agrees with no honest update; neither does an honest peer's update on data that differs from the
# others', later in a run: it is no evidence against its peer, and is only left out (never counted).
LEFT_OUT = {"noise"}
# What a mode costs beyond the noise: claimall's fake holders keep one shard from being trained until its
# refreshes have failed 3 times and the claims have moved: 3 of its run's 6 rounds (ROUNDS: the others' 4
# rounds end before the move), measured at +0.01 to +0.05 (a long run dilutes it). (signflip cost +0.13
# before co-holders screened each other's updates; +0.005 on average since, over seeds 0-3.)
COST = {"claimall": 0.1}
ROUNDS = {"claimall": 6}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean run's final validation loss, by its rounds (each run once)."""

    @functools.cache
    def loss(rounds: int) -> float:
        out = tmp_path_factory.mktemp(f"clean{rounds}")
        summary = run(simulation({"run.out": str(out), **SWARM, "run.rounds": rounds}))
        assert not summary["failures"] and summary["final_val_loss"] < summary["initial_loss"]
        return summary["final_val_loss"]

    return loss


@pytest.mark.parametrize("mode", [m for m in BYZANTINE_MODES if m not in SIGNED_MODES])
def test_one_malicious_peer_neither_stops_nor_steers_the_honest_ones(mode, clean, tmp_path):
    # (claimall: the founder, so that its fake holders are in place before the others claim)
    attacker = 0 if mode == "claimall" else 3
    rounds = ROUNDS.get(mode, SWARM["run.rounds"])
    attack = {"run.out": str(tmp_path), "sim.byzantine": (f"{attacker}:{mode}",), "run.rounds": rounds}
    summary = run(simulation({**SWARM, **attack}))
    assert not summary["failures"]
    report, name = summary["byzantine"], f"peer{attacker}"
    honest = {f"peer{i}" for i in range(4)} - {name}
    assert report["attackers"][name]["mode"] == mode
    bound = NOISE + COST.get(mode, 0.0)
    assert abs(report["honest_final_val_loss"] - clean(rounds)) <= bound, (report, clean(rounds))
    if mode not in EITHER:
        assert (report["honest_rejected"] > 0) == (mode in REFUSED), report
    if mode == "garbage":  # malformed requests, again and again: every honest peer bans it
        assert report["attackers"][name]["banned_by"] == sorted(honest)
    if mode in EXCLUDED:  # banned by an honest peer within the first three rounds it screened the attacker's
        # updates in (a round in which the attacker started from other weights, or came late, screens none:
        # more of them on a busy machine)
        assert report["attackers"][name]["banned_by"], report
        attacker_id = next(r["peer"] for r in read_rows(tmp_path / "peers" / name) if "peer" in r)
        assert any(_banned_within(read_rows(tmp_path / "peers" / p), attacker_id, 3) for p in honest)
    if mode in LEFT_OUT:
        assert report["attackers"][name]["left_out_by"], report
    if mode == "claimall":  # the shard its fakes claimed went unserved, so honest peers took it over
        last = str(rounds - 1)
        assert honest & set(summary["units"]["experts/1"]["holders"][last])


def _banned_within(rows: list[dict], attacker: str, rounds: int) -> bool:
    """Whether a peer (its metrics ``rows``) banned ``attacker`` by the ``rounds``-th round in which it
    combined or refused the attacker's updates."""
    met = [
        r["round"]
        for r in rows
        if any(attacker in p for p in (*r.get("participants", {}).values(), *r.get("refused", {}).values()))
    ]
    banned = [r["round"] for r in rows if attacker in r.get("banned", ())]
    return bool(met and banned) and banned[0] <= met[:rounds][-1]


@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
def test_records_forged_under_the_others_ids_move_nobody(tmp_path, backend):
    """forge needs signatures to attack: real peer processes. Its tombstones, were they read, would remove
    every honest peer from the others' views and release their claims: each would train alone. What the
    attack aims at is membership, so that is what is checked (no clean run to compare losses with)."""
    swarm = {**SWARM, "swarm.backend": backend, "sim.peers": 3, "run.rounds": 4}
    summary = run(simulation({"run.out": str(tmp_path), "sim.byzantine": ("2:forge",), **swarm}))
    assert not summary["failures"]
    assert summary["byzantine"]["honest_final_val_loss"] < summary["initial_loss"], summary
    assert all(p["final_round"] == 4 for p in summary["peers"] if p["name"] != "peer2")
    # Every peer holds the dense part: in the last round, long after the tombstones were stored (at the
    # attacker's join, to expire in an hour), each honest peer still expected the other in its exchange (met
    # it, waited for it in vain, or set its update aside as started from other weights) where the other
    # would have vanished from its view. Whether they met is up to the machine's load: a peer held up may
    # skip rounds, or see its updates come after the others' short deadlines (seen in CI: apart by round 3).
    rows = {name: read_rows(tmp_path / "peers" / name) for name in ("peer0", "peer1")}
    ids = {name: next(row["peer"] for row in rs if "peer" in row) for name, rs in rows.items()}
    for name, other in (("peer0", "peer1"), ("peer1", "peer0")):
        last = rows[name][-1]
        expected = [*last["participants"].get("dense/0", ())]
        expected += [p for kind in ("missing", "apart") for p in last.get(kind, {}).get("dense/0", ())]
        assert ids[other] in expected, (name, last["round"], expected)


def test_byzantine_settings_are_checked():
    assert SimConfig(byzantine=("1:nan", "2:late")).byzantine_peers == {1: "nan", 2: "late"}
    with pytest.raises(ConfigError, match="write I:MODE"):
        SimConfig(byzantine=("1:evil",))
    with pytest.raises(ConfigError, match="must be memory for claimall"):
        simulation({"sim.byzantine": ("1:claimall",), "swarm.backend": "hivemind"})
    with pytest.raises(ConfigError, match="must be hivemind or libp2p for forge"):
        simulation({"sim.byzantine": ("1:forge",), "swarm.backend": "memory"})
    assert simulation({"sim.byzantine": ("1:nan",), "swarm.backend": "libp2p"}).sim.byzantine_peers == {
        1: "nan"
    }
    with pytest.raises(ConfigError, match="names no peer 9"):
        SimConfig(byzantine=("9:nan",))
