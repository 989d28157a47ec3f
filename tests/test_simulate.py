"""`spes simulate`: late joins, crashes of sole holders, network faults, and resume after a kill."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from spes_cli.main import spes

from spes_p2p.errors import ConfigError
from spes_p2p.sim import run, simulation
from spes_p2p.sim.config import SOLE, Event, SimConfig
from spes_p2p.sim.fleets import ProcessFleet
from spes_p2p.sim.processes import stop_process_groups
from spes_p2p.sim.summary import read_rows

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
SMALL = {
    "method.steps_per_round": 5,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "data.max_corpus_mb": 1.0,
}


def test_event_parsing():
    cfg = SimConfig(kills=("1@3", "sole@2"), joins=("2@1",), partitions=("0,1/2,3@2-4",))
    assert cfg.kill_events == [Event(SOLE, 2), Event(1, 3)] and cfg.join_events == [Event(2, 1)]
    (p,) = cfg.partition_events
    assert p.groups == ((0, 1), (2, 3)) and (p.start, p.end) == (2, 4)
    with pytest.raises(ConfigError, match="NUMBER@ROUND"):
        SimConfig(joins=("1-3",))
    with pytest.raises(ConfigError, match="backend must be memory"):
        simulation({"swarm.backend": "hivemind", "sim.drop": 0.1})
    with pytest.raises(ConfigError, match="backend must be hivemind or libp2p for --netns"):
        simulation({"swarm.backend": "memory", "sim.netns": True})
    with pytest.raises(ConfigError, match="netns is needed for bandwidth and nat"):
        simulation({"swarm.backend": "libp2p", "sim.nat": 1})
    assert SimConfig(netns=True, bandwidth="50mbit/500mbit").bandwidth == "50mbit/500mbit"
    with pytest.raises(ConfigError, match="UP/DOWN"):
        SimConfig(netns=True, bandwidth="50mbit/fast")


def test_late_join_and_a_killed_sole_holder_on_the_memory_backend(tmp_path):
    summary = run(
        simulation(
            {
                "sim.peers": 3,
                "model.shards": 2,
                "run.rounds": 8,
                "swarm.backend": "memory",
                "sim.kills": ("sole@2",),
                "sim.joins": ("1@4",),
                "run.out": str(tmp_path),
                **SMALL,
            }
        )
    )
    assert not summary["failures"]
    kinds = [e["type"] for e in summary["events"]]
    assert kinds.count("kill") == 1 and kinds.count("join") == 1
    assert summary["rounds_completed"] == 8
    assert summary["final_loss"] < summary["initial_loss"]
    newcomer = next(p for p in summary["peers"] if p["name"] == "peer3")
    assert newcomer["final_round"] == 8 and newcomer["rounds"] >= 2  # it trains soon after round 4
    for unit, info in summary["units"].items():  # every holder, the newcomer included, ends bit-identical
        assert info["max_holder_difference"] in (0.0, None), unit
        assert info["holders"]["7"], f"{unit} uncovered at the end"
    # the killed shard is re-claimed once the dead peer's records expire (8 s here, a few fast rounds)
    assert summary["uncovered_unit_rounds"] <= 4
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["rounds_completed"] == 8


def test_a_peer_that_fails_stops_the_simulation_and_is_reported(tmp_path, monkeypatch):
    """The others would wait for it (min_peers) up to wait_seconds; the run stops at once instead."""
    from spes_p2p.peer import life

    real_live = life.live

    def live(settings, stop, ui=None, transport=None):
        if transport.peer_id == "peer1":
            raise RuntimeError("its disk is full")
        return real_live(settings, stop, ui, transport)

    monkeypatch.setattr(life, "live", live)
    summary = run(simulation({"sim.peers": 3, "swarm.backend": "memory", "run.out": str(tmp_path), **SMALL}))
    assert summary["failures"] == ["peer1: its disk is full"]
    assert summary["rounds_completed"] == 0


def simulate_cli(args: str, out: Path) -> tuple[dict, str]:
    """``spes simulate ARGS --out OUT`` with real peer processes: it exits 0; its summary and output."""
    result = CliRunner().invoke(spes, ["simulate", *args.split(), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text()), result.output


def test_network_faults_are_survived_and_corrupt_payloads_counted(tmp_path):
    summary = run(
        simulation(
            {
                "sim.peers": 4,
                "model.shards": 2,
                "run.rounds": 4,
                "swarm.backend": "memory",
                "sim.drop": 0.05,
                "sim.delay_ms": 5.0,
                "sim.corrupt": 0.1,
                "sim.gossip_drop": 0.5,
                "sim.partitions": ("0,1/2,3@1-1",),
                "run.out": str(tmp_path),
                **SMALL,
            }
        )
    )
    assert not summary["failures"]
    assert summary["rounds_completed"] == 4
    assert all(p["final_round"] == 4 for p in summary["peers"])
    assert summary["rejected_payloads"] > 0
    faults = {e["kind"]: e["count"] for e in summary["events"] if e["type"] == "fault"}
    assert faults.get("corrupted", 0) >= summary["rejected_payloads"] and faults.get("dropped", 0) > 0
    assert faults.get("gossip dropped", 0) > 0
    assert {"partition", "heal"} <= {e["type"] for e in summary["events"]}
    assert summary["final_loss"] < summary["initial_loss"]


def test_a_peer_cut_off_for_a_round_is_back_on_the_swarms_weights_bit_for_bit(tmp_path):
    """peer0 trains round 1 alone (a partition), so its start weights are then outnumbered: it takes the
    others' result, exactly, and counts again; every unit's holders end bit-identical. (Averaging the
    others' end weights instead lands near their result, never on it: the peer re-synchronized every round
    and its training was lost.) Which round it re-synchronizes in (2, or 3 for a unit whose round-2
    exchange began before the heal reached it) depends on when the heal falls in each peer's exchange."""
    summary = run(
        simulation(
            {
                "sim.peers": 3,
                "model.shards": 1,
                "model.dense_blocks": 1,
                "run.rounds": 6,
                "swarm.backend": "memory",
                "sim.partitions": ("0/1,2@1-1",),
                # (a round's exchange after its compute, not during the next: the partition then starts
                # while every peer computes round 1, after all have finished round 0's exchange)
                "method.overlap": False,
                "sync.deadline_min": 30.0,
                "sync.deadline_max": 60.0,
                "run.out": str(tmp_path),
                **SMALL,
            }
        )
    )
    assert not summary["failures"] and summary["rounds_completed"] == 6
    for unit, info in summary["units"].items():
        assert info["max_holder_difference"] == 0.0, unit
    assert summary["holders_apart"] == {}
    rows = {r["round"]: r for r in read_rows(tmp_path / "peers" / "peer0")}
    assert rows[1]["participants"]["dense/0"] == [rows[1]["peer"]]  # alone
    assert {u for round_ in (2, 3) for u in rows[round_]["resynced"]} == {"dense/0", "experts/0"}
    assert all(p["resynced_rounds"] <= 2 for p in summary["peers"])  # not every round
    for round_ in (4, 5):  # back: on the swarm's weights, and counted by everyone
        assert not rows[round_]["resynced"], rows[round_]
        assert all(rows[round_]["peer"] in met for met in rows[round_]["participants"].values())


def test_spes_simulate_with_real_processes(tmp_path):
    out = tmp_path / "sim"
    args = "--num-peers 3 --shards 2 --rounds 6 --steps-per-round 5 --batch-size 4 --seq-len 64"
    summary, output = simulate_cli(args + " --max-corpus-mb 1 --kill sole@1", out)
    assert not summary["failures"], summary["failures"]
    assert [e["type"] for e in summary["events"] if e["type"] == "kill"] == ["kill"]
    assert summary["rounds_completed"] == 6 and summary["final_loss"] < summary["initial_loss"]
    # the killed peer's records expire (8 s in simulations), then its shard is re-claimed at a boundary
    units = summary["units"]
    assert all(units[u]["holders"]["5"] for u in units), "a unit was still uncovered in the last round"
    assert summary["uncovered_unit_rounds"] <= 8  # its shard and, when it was alone on it, its dense block
    flat = "".join(output.split())  # (the console wraps long paths wherever it likes)
    assert "summary:" in flat and "loss.png" in flat


def test_a_rerun_in_the_same_folder_does_not_dial_the_last_runs_addresses(tmp_path):
    """Peers join through the first peer's address file; one left by an earlier run in the same --out made
    every other peer dial a dead address ("none of the initial peers answered")."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "peer0.addr").write_text("/ip4/127.0.0.1/tcp/9/p2p/QmOldRun\n")
    (keys / "peer0.key").write_bytes(b"identity")
    ProcessFleet(simulation({"run.out": str(tmp_path)}))
    assert not (keys / "peer0.addr").exists()
    assert (keys / "peer0.key").read_bytes() == b"identity"  # the peers keep their identities


def test_resume_after_kill_keeps_the_peer_id(tmp_path):
    spes_join = str(Path(sys.executable).parent / "spes-join")
    (tmp_path / "peers.toml").write_text(
        "[method]\nsteps_per_round = 5\n[train]\nbatch_size = 4\nseq_len = 64\ncheckpoint_every = 5\n"
        "[data]\nmax_corpus_mb = 1.0\n[swarm]\nrecord_ttl_seconds = 6.0\nheartbeat_seconds = 1.0\n"
    )
    common = ["--listen", "/ip4/127.0.0.1/tcp/0", "--shards", "2", "--run-id", "resume"]
    env = {**os.environ, "HOME": str(tmp_path)}

    def start(name, *args):
        log = open(tmp_path / f"{name}.log", "a")
        return subprocess.Popen(
            [
                spes_join,
                *common,
                "--identity",
                str(tmp_path / f"{name}.key"),
                "--addr-file",
                str(tmp_path / f"{name}.addr"),
                "--out",
                str(tmp_path / name),
                *args,
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_for(predicate, timeout=120):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.5)

    procs = []
    try:
        procs.append(start("a", "--new-swarm"))
        wait_for(lambda: (tmp_path / "a.addr").exists())
        first = (tmp_path / "a.addr").read_text().split()[0]
        procs.append(start("b", "--peers", first))
        checkpoints = tmp_path / "b" / "checkpoints"
        wait_for(lambda: checkpoints.exists() and len(list(checkpoints.glob("step-*"))) >= 2)
        peer_id = (tmp_path / "b.addr").read_text().split()[0].rsplit("/", 1)[1]
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=10)
        killed_at = max(
            json.loads(x)["round"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
        )
        procs.append(start("b", "--peers", first, "--resume"))
        rows = lambda: [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
        wait_for(lambda: max(r["round"] for r in rows()) >= killed_at + 2)
        assert (tmp_path / "b.addr").read_text().split()[0].endswith(peer_id)  # the same peer id
        assert "resumed from" in (tmp_path / "b.log").read_text()
    finally:
        stop_process_groups(procs)


# hivemind only: the scenario is the simulator's and the peer's, not the backend's; libp2p's newcomers join
# and catch up in test_join_processes, test_netns and the churn test below
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["hivemind"])
def test_late_joins_reach_the_main_swarm(tmp_path, backend):
    """A scenario that used to lose newcomers (they started a swarm of their own, or arrived after the
    end): the founder, the swarm's first DHT node, is killed at round 1; two newcomers join at round 2.
    Every newcomer must count in the main swarm within 2 rounds of its join round (so by round 4 of 6), and
    nothing may split. Virtual compute: joins are under test, not training."""
    args = "--num-peers 3 --shards 2 --rounds 6 --steps-per-round 10 --compute virtual=0.1"
    events = f" --max-corpus-mb 1 --kill 0@1 --join 2@2 --backend {backend}"
    summary, _ = simulate_cli(args + events, tmp_path)
    assert not summary["failures"] and summary["rounds_completed"] == 6, summary["failures"]
    assert len(summary["newcomers"]) == 2
    for newcomer in summary["newcomers"]:
        assert newcomer["join_round"] == 2 and newcomer["first_counted_round"] is not None, newcomer
        assert newcomer["rounds_late"] <= 2, newcomer


def test_churn_on_the_memory_backend_brings_every_killed_peer_back_with_its_id(tmp_path):
    """Seed 163 draws kills of peer1 at round 2 and peer0 at round 3. With one shard and one dense block
    every peer trains every unit, and churn never takes the last peer in the swarm: no unit-round can go
    uncovered. Virtual compute: the peers' ids and claims are under test, not their training."""
    summary = run(
        simulation(
            {
                "sim.compute": "virtual=0.1",
                "sim.peers": 4,
                "model.shards": 1,
                "model.dense_blocks": 1,
                "run.rounds": 10,
                "swarm.backend": "memory",
                "sim.churn": 0.2,
                "train.seed": 163,
                "run.out": str(tmp_path),
                **SMALL,
            }
        )
    )
    assert not summary["failures"] and not summary["leftovers"], summary["failures"]
    churn = summary["churn"]
    assert churn["kills"] >= 2 and churn["restarts"] == churn["kills"] == churn["back_with_id"], churn
    restarted = {e["peer"] for e in summary["events"] if e["type"] == "restart"}
    for name in restarted:  # one peer id in all its rows, before and after its restart
        assert len({r["peer"] for r in read_rows(tmp_path / "peers" / name)}) == 1
    assert summary["uncovered_unit_rounds"] == 0 and summary["rounds_completed"] == 10
    assert all(not p["killed"] for p in summary["peers"])  # everyone is back at the end


# libp2p only: the churn driver is the same on both backends, and on hivemind a peer killed and resumed
# with its key is test_resume_after_kill_keeps_the_peer_id, a killed run's processes (p2pd daemons too)
# test_a_killed_simulator_leaves_no_process_running
@pytest.mark.parametrize("backend", ["libp2p"])
def test_churn_with_real_processes_restarts_peers_with_their_ids_and_leaves_no_process(tmp_path, backend):
    """Seed 8 draws one kill, of peer2 in round 1: its whole process tree dies, and a new process with
    --resume (its run folder, its identity key) comes back with the same peer id. Nothing of the run is
    left running afterwards. Rounds of 20 steps: with fewer, the two others finish the run before a restart
    is back. Virtual compute: the processes and their ids are under test, not the training (rounds take 1 s
    of compute and leave the cores to the processes' start-ups)."""
    out = tmp_path / "sim"
    args = "--num-peers 3 --shards 1 --rounds 11 --steps-per-round 20 --compute virtual=0.05"
    summary, _ = simulate_cli(args + f" --max-corpus-mb 1 --churn 0.15 --seed 8 --backend {backend}", out)
    assert not summary["failures"] and not summary["leftovers"], summary["failures"]
    assert summary["churn"]["restarts"] == summary["churn"]["back_with_id"] >= 1, summary["churn"]
    name = next(e["peer"] for e in summary["events"] if e["type"] == "restart")
    log = (out / "logs" / f"{name}.log").read_text()
    assert "restarted with --resume" in log and "resumed from" in log
    rows = read_rows(out / "peers" / name)
    assert len({r["peer"] for r in rows}) == 1  # its id before and after
    assert (out / "keys" / f"{name}.addr").read_text().split()[0].endswith("/p2p/" + rows[0]["peer"])
    # every process of the run (peers, DHT processes, p2pd daemons) names a file of OUT in its command line
    left = [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if str(out) in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, left


@pytest.mark.parametrize("backend", ["hivemind", "libp2p"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_simulator_leaves_no_process_running(tmp_path, signum, backend):
    """SIGTERM stops a simulation as Ctrl-C does (it stops its peers, exit status 130); after a SIGKILL, the
    kernel sends each peer process SIGTERM (they die with their parent) and they leave in order."""
    out = tmp_path / "sim"
    args = "--num-peers 2 --shards 1 --rounds 100 --steps-per-round 5 --compute virtual=0.2 --max-corpus-mb 1"
    args += f" --backend {backend}"
    spes_cli = str(Path(sys.executable).parent / "spes")
    sim = subprocess.Popen(
        [spes_cli, "simulate", *args.split(), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def of_the_run() -> list[psutil.Process]:  # (every process of the run names a file of OUT)
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if p.pid != sim.pid and str(out) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        return found

    def wait_for(predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, [p.info["cmdline"] for p in of_the_run()]
            time.sleep(0.5)

    try:
        rows = [out / "peers" / name / "metrics.jsonl" for name in ("peer0", "peer1")]
        wait_for(lambda: all(r.exists() for r in rows), timeout=180)  # both peers train
        sim.send_signal(signum)
        assert sim.wait(timeout=60) == (130 if signum == signal.SIGTERM else -signal.SIGKILL)
        wait_for(lambda: not of_the_run(), timeout=60)
    finally:
        sim.kill()
        for p in of_the_run():
            with contextlib.suppress(psutil.Error):
                p.kill()
