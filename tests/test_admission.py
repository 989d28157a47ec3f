"""Joining a swarm by its manifest, on the memory backend: what a newcomer adopts, what refuses it, invites,
and what `spes status` reads."""

import threading
from types import SimpleNamespace

import msgspec
import pytest
import torch
from conftest import TOKENIZER

from spes_p2p.net.guard import BAN_AFTER
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.waiting import Deadline
from spes_p2p.peer import Peer, swarmdata
from spes_p2p.peer.admission import SwarmUnavailable, admit
from spes_p2p.peer.joining import swarm_round
from spes_p2p.peer.setup import member_config
from spes_p2p.peer.status import SwarmReader, invite
from spes_p2p.peer.swarmdata import serve_data
from spes_p2p.settings import Settings, load_settings
from spes_p2p.swarm import manifest as manifests
from spes_p2p.swarm import records
from spes_p2p.swarm.manifest import ManifestServer
from spes_p2p.swarm.member import SwarmMember, SwarmMismatch
from spes_p2p.train.trainer import evaluate

pytestmark = pytest.mark.timeout(120)
ADDRESS = "/ip4/127.0.0.1/tcp/1/p2p/QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon"


def founder_settings(**changes) -> Settings:
    base = {
        "model.shards": 2,
        "model.dense_blocks": 2,
        "method.overlap": False,
        "data.max_corpus_mb": 1.0,
    }
    return Settings().override({**base, **changes})


@pytest.fixture
def swarm(tmp_path):
    """A founded swarm of one peer (joined, not training), on a fresh memory network."""
    net = MemoryNetwork(seed=0)
    founder = Peer(founder_settings(), net.join("founder"))
    founder.join()
    yield net, founder
    founder.close()


def test_a_newcomer_adopts_the_manifest_and_the_founders_tokenizer(swarm):
    net, founder = swarm
    mine = Settings().override({"data.max_corpus_mb": 1.0, "train.lr": 3e-3})  # (per peer: stays its own)
    admission = admit(mine, net.join("newcomer"), threading.Event())
    adopted = admission.settings
    assert admission.manifest.hash == founder.manifest.hash
    assert (adopted.model.shards, adopted.model.dense_blocks, adopted.method.overlap) == (2, 2, False)
    assert adopted.train.lr == 3e-3
    assert adopted.swarm_wide() == founder.settings.swarm_wide()
    with open(adopted.data.tokenizer, "rb") as f:
        assert f.read() == founder.local.data.tokenizer.to_str().encode()


def test_a_setting_given_that_differs_is_refused_by_name(swarm):
    net, _ = swarm
    given = load_settings(None, {"model.shards": 4, "sync.codec": "fp16", "train.lr": 0.01})
    with pytest.raises(SwarmMismatch, match=r"model\.shards: 4 here vs 2 in the swarm; sync\.codec: 'fp16'"):
        admit(given, net.join("stranger"), threading.Event())


def test_an_invite_joins_the_swarm_it_names_and_nothing_else(swarm, tmp_path):
    net, founder = swarm
    path = tmp_path / "invite.toml"
    path.write_text(invite(founder.settings, founder.manifest, [ADDRESS]))
    invited = load_settings(path)
    assert invited.swarm.manifest == founder.manifest.hash and invited.model.dense_blocks == 2
    assert admit(invited, net.join("volunteer"), threading.Event()).manifest.hash == founder.manifest.hash
    stale = invited.override({"swarm.manifest": "ab" * 32})  # an invite to a swarm founded anew since
    with pytest.raises(SwarmMismatch, match="the invite names manifest abababababababab"):
        admit(stale, net.join("late"), threading.Event())


def test_fake_records_outnumbering_the_honest_ones_choose_no_manifest(swarm, manifest_of):
    """Three fake peers share another manifest, against two honest ones: a newcomer takes the manifest of
    the peers it dialed, and one whose dialed peers do not settle it is refused, naming what to do. (It
    used to take the most common: the fakes'.)"""
    net, founder = swarm
    honest, fake1 = (
        "QmTJxrrywQ2EdDBm8kDofL3hoo4x2TB2JY9fh5BJVN1Yon",
        "QmUM8UgrUHuRVxY5DdpkPw9jQAG4jQtrvy4tj7Y9k9Guew",
    )
    Peer(founder_settings(), net.join(honest)).join()
    fake = founder_settings(**{"model.shards": 4})
    for name in (fake1, "fake2", "fake3"):
        transport = net.join(name)
        ManifestServer(transport, manifest_of(fake), TOKENIZER)
        SwarmMember(transport, manifest_of(fake), member_config(fake)).heartbeat()

    def dialing(*peers: str) -> Settings:
        addresses = tuple(f"/ip4/127.0.0.1/tcp/1/p2p/{p}" for p in peers)
        return Settings().override({"data.max_corpus_mb": 1.0, "swarm.initial_peers": addresses})

    assert (
        admit(dialing(honest), net.join("newcomer"), threading.Event()).manifest.hash == founder.manifest.hash
    )
    split = r"share 2 manifests \(\w+ \(3 peers\), \w+ \(2 peers\)\).*--manifest HASH"
    with pytest.raises(SwarmMismatch, match=split):
        admit(dialing(fake1, honest), net.join("undecided"), threading.Event())


def test_a_swarm_whose_peers_all_left_is_reported_with_its_last_round(tmp_path):
    net = MemoryNetwork(seed=0)
    short_round = {"method.steps_per_round": 2, "train.batch_size": 2, "train.seq_len": 32}
    founder = Peer(founder_settings(**short_round), net.join("founder"))
    founder.join()
    founder.run(threading.Event(), rounds=1)
    founder.close()  # leaves: its records become "left" tombstones
    quick = Settings().override({"swarm.join_timeout_seconds": 1.0})
    with pytest.raises(SwarmUnavailable, match="has no live peer: its last peers left after round 1"):
        admit(quick, net.join("newcomer"), threading.Event())


def test_status_reads_peers_units_and_the_replication_target(swarm):
    net, founder = swarm
    with SwarmReader(founder.settings, transport=net.join("observer")) as reader:
        summary = reader.read()
    assert summary["manifest"] == founder.manifest.hash and summary["target_replication"] == 2
    assert [p["peer_id"] for p in summary["peers"]] == ["founder"]
    assert 0 <= summary["peers"][0]["seen_seconds_ago"] < 60
    held = set(founder.member.units_held)
    assert {u for u, h in summary["units"].items() if h} == held
    assert summary["under_replicated"] == [u for u in ("experts/0", "experts/1") if u in held]
    assert summary["uncovered"] == sorted(set(summary["units"]) - held)


def test_status_shows_who_banned_whom(swarm):
    from rich.console import Console
    from spes_cli.render import status_tables

    net, founder = swarm
    other = Peer(founder_settings(), net.join("other"))
    other.join()
    for _ in range(BAN_AFTER):
        founder.transport.guard.reject("other", "request", "garbage")
    founder.transport.guard.score("other", 0.5)
    founder.member.heartbeat()  # its record now lists its bans and the scores it gave
    with SwarmReader(founder.settings, transport=net.join("observer")) as reader:
        peers = {p["peer_id"]: p for p in reader.read()["peers"]}
        console = Console(record=True, width=200)
        for table in status_tables(reader.read()):
            console.print(table)
    assert peers["founder"]["banned"] == ["other"] and peers["other"]["banned_by"] == ["founder"]
    assert peers["other"]["score"] == 0.75 and peers["founder"]["score"] is None  # (nobody scored it)
    text = console.export_text()
    assert "banned by" in text and "0.75" in text
    assert founder.status().banned == ["other"]
    other.close()


def test_a_manifest_request_that_breaks_is_asked_again(swarm):
    """Streams break (the founder closed one in a late-join run): the newcomer asks again and is admitted."""
    net, founder = swarm
    calls = []

    def breaks_twice(caller, request):
        calls.append(caller)
        if len(calls) <= 2:
            raise ConnectionResetError("stream reset")
        return founder.manifest.encode()

    founder.transport.serve(manifests.RPC_MANIFEST, breaks_twice, max_request_bytes=1024)
    assert admit(Settings(), net.join("newcomer"), threading.Event()).manifest.hash == founder.manifest.hash
    assert calls == ["newcomer"] * 3


def test_a_peer_that_serves_a_wrong_manifest_is_not_asked_again(swarm):
    net, founder = swarm
    liar = net.join("liar")
    other = msgspec.structs.replace(founder.manifest, run_id="another-swarm")
    asked = []
    answer = lambda caller, request: asked.append(caller) or other.encode()  # noqa: E731
    liar.serve(manifests.RPC_MANIFEST, answer, max_request_bytes=64)
    newcomer = net.join("newcomer")
    manifest, _ = manifests.fetch(newcomer, ["liar", "founder"], founder.manifest.hash, Deadline(60))
    assert manifest == founder.manifest and asked == ["newcomer"]
    with pytest.raises(manifests.ManifestError, match=r"liar: its manifest hashes to .*, not"):
        manifests.fetch(newcomer, ["liar"], founder.manifest.hash, Deadline(60))  # at once: nobody else
    assert asked == ["newcomer"] * 2


def test_the_swarm_round_is_what_most_peers_report_not_the_furthest():
    peers = [SimpleNamespace(round=r) for r in (4, 5, 5, 10**6)]
    assert swarm_round(peers) == 5 and swarm_round(peers[:2]) == 4 and swarm_round([]) == 0


def test_a_newcomer_with_no_copy_and_no_url_trains_on_the_shards_its_peers_serve(swarm, tmp_path):
    net, founder = swarm
    mine = Settings().override({"data.max_corpus_mb": 1.0, "data.cache_dir": str(tmp_path)})  # (empty)
    transport = net.join("newcomer")
    admission = admit(mine, transport, threading.Event())
    assert admission.manifest.data.dataset == founder.local.data.dataset_hash
    assert admission.manifest.data.sources == []  # (the founder's corpus is in its own cache: peers only)
    newcomer = Peer(admission.settings, transport, admission=admission)
    try:
        store = newcomer.local.data.store
        assert store.cached and store.folder.is_relative_to(tmp_path)
        newcomer.local.sampler.next_batch()
        shard = newcomer.local.sampler.work.shard
        assert store.fetched >= 1
        served = (store.folder / store.index.train[shard].name).read_bytes()
        assert served == (founder.local.data.store.folder / store.index.train[shard].name).read_bytes()
        # one validation set: the same text, so on the same weights the same loss
        ours, theirs = newcomer.local.val_batches, founder.local.val_batches
        assert len(ours) == len(theirs) and all(
            torch.equal(a[0], b[0]) for a, b in zip(ours, theirs, strict=True)
        )
        assert evaluate(founder.local.model, ours) == founder.local.evaluate()
    finally:
        newcomer.close()


def test_a_newcomer_given_another_dataset_is_refused_naming_both(swarm, tmp_path):
    net, founder = swarm
    (tmp_path / "mine").mkdir()
    for i in range(40):
        (tmp_path / "mine" / f"{i}.txt").write_text(f"def own{i}(text):\n    return text\n" * 200)
    given = Settings().override({"data.corpus": str(tmp_path / "mine"), "data.cache_dir": str(tmp_path)})
    transport = net.join("stranger")
    admission = admit(given, transport, threading.Event())
    wanted = founder.local.data.dataset_hash[:16]
    with pytest.raises(SwarmMismatch, match=rf"is not swarm .*'s \({wanted}, prepared from stdlib"):
        Peer(admission.settings, transport, admission=admission)


def test_a_shard_a_peer_serves_wrong_is_refused_counted_and_fetched_from_another(
    swarm, tmp_path, monkeypatch
):
    net, founder = swarm
    liar = net.join("liar")

    def garbage(name: str) -> bytes | None:
        return b"not a shard" if name.endswith(".safetensors") else founder.local.data.store.file(name)

    serve_data(liar, garbage)
    liar.publish(
        records.peers_key(founder.settings.swarm.run_id),
        records.PeerRecord("liar", []).encode(),
        liar.now() + 60,
    )
    monkeypatch.setattr(swarmdata.random, "shuffle", lambda peers: peers.sort(key=lambda p: p != "liar"))
    mine = Settings().override({"data.max_corpus_mb": 1.0, "data.cache_dir": str(tmp_path)})
    transport = net.join("newcomer")
    admission = admit(mine, transport, threading.Event())
    newcomer = Peer(admission.settings, transport, admission=admission)
    try:
        newcomer.local.sampler.next_batch()  # its first shard: the liar is asked first, then the founder
        store = newcomer.local.data.store
        # (a validation shard, at the start, then the first training shard)
        assert store.refused == {"peer liar": 2} and store.fetched >= 2
        assert transport.guard.total() >= 2
    finally:
        newcomer.close()


def test_a_shard_nobody_can_serve_fails_in_one_line_naming_where_it_looked():
    from spes_p2p.data.sources import fetch
    from spes_p2p.errors import DataError

    alone = MemoryNetwork(seed=0).join("alone")
    with pytest.raises(DataError, match=r"tried the swarm's peers \(no other peer is live\)"):
        fetch(swarmdata.peer_sources(alone, "run"), "train/000000.safetensors", 1 << 20, lambda data: data)
