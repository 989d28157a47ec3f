"""Typed wire messages: DHT records and RPC requests decode strictly, and a bad one is one rejection, never an
exception that escapes a server."""

import msgspec
import pytest
import torch

from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.transport import Entry, RemoteError
from spes_p2p.net.wire import RecordError
from spes_p2p.settings import Settings
from spes_p2p.swarm.manifest import Manifest, ManifestError, ManifestRecord
from spes_p2p.swarm.records import Announcement, Holding, PeerRecord, Progress, ProgressRecord, parse_peers
from spes_p2p.sync.codecs import CODECS
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.messages import MAX_REQUEST_BYTES, RPC_UPDATE, RPC_WEIGHTS, UpdateRequest, WeightsRequest
from spes_p2p.sync.payload import decode, specs_of

HEX = "ab" * 8


def peer(**changes) -> dict:
    return {"peer_id": "p", "addresses": [], "holds": {"experts/0": {"since": 2}}, **changes}


@pytest.mark.parametrize(
    ("cls", "value", "problem"),
    [
        (PeerRecord, peer(holds=["experts/0"]), "Expected `object`"),
        (PeerRecord, peer(holds={"experts/x": {}}), "matching regex"),
        (PeerRecord, peer(holds={"experts/0": {"since": 0, "until": "later"}}), "Expected `int | null`"),
        (PeerRecord, peer(round=-1), ">= 0"),
        (ProgressRecord, {"peer_id": "p", "progress": {"loss": float("nan")}}, "finite"),
        (ProgressRecord, {"peer_id": "p", "progress": {"sent": -1}}, ">= 0"),
        (ProgressRecord, {"peer_id": "p", "scores": {"q": 1.5}}, "<= 1"),
        (PeerRecord, peer(progress={"loss": 2.5}), "unknown field"),  # (progress has a key of its own)
        (PeerRecord, peer(admin=True), "unknown field"),
        (PeerRecord, {"addresses": [], "holds": {}}, "missing required field `peer_id`"),
        (PeerRecord, peer(addresses=["a"] * 17), "length <= 16"),
        (PeerRecord, peer(state="owner"), "Invalid enum value"),
        (
            Announcement,
            {"round": 1, "tokens": -5, "bytes": 9, "codec": "none", "sha256": HEX, "base": HEX},
            ">= 0",
        ),
        (ManifestRecord, {"hash": HEX, "protocol": 2, "bytes": 10**9}, "<= 262144"),
    ],
)
def test_records_of_the_wrong_schema_are_refused(cls, value, problem):
    with pytest.raises(RecordError, match=problem):
        cls.decode(msgspec.msgpack.encode(value))


def test_records_round_trip_and_oversized_or_foreign_bytes_are_refused(manifest_of):
    record = PeerRecord(
        peer_id="p",
        addresses=["/ip4/1.2.3.4/tcp/5/p2p/p"],
        holds={"dense/0": Holding(since=1), "experts/1": Holding(since=0, until=2)},
        round=3,
        trained=True,
        data_epoch=1,
    )
    assert PeerRecord.decode(record.encode()) == record and record.units == ["dense/0"]
    progress = Progress(loss=2.5, val_loss=2.75, tokens=4096, sent=10, received=20, rejected=1)
    shown = ProgressRecord(peer_id="p", round=3, progress=progress, scores={"q": 0.25})
    assert ProgressRecord.decode(shown.encode()) == shown
    manifest = manifest_of(Settings())
    assert Manifest.decode(manifest.encode()) == manifest and manifest.record().hash == manifest.hash
    with pytest.raises(ManifestError, match="unknown field"):
        Manifest.decode(msgspec.msgpack.encode({**msgspec.to_builtins(manifest), "backdoor": 1}))
    with pytest.raises(RecordError, match="20000-byte PeerRecord, over 16384"):
        PeerRecord.decode(b"\x90" * 20_000)
    with pytest.raises(RecordError):
        PeerRecord.decode(b"\x80\x04\x95 a pickle")


def test_a_peer_record_must_name_the_peer_that_wrote_it():
    mine = PeerRecord(peer_id="a", addresses=[]).encode()
    assert set(parse_peers({"a": Entry(mine, 0.0), "b": Entry(mine, 0.0)})) == {"a"}


@pytest.mark.parametrize(
    ("request_bytes", "problem"),
    [
        (b"\x00" * (MAX_REQUEST_BYTES + 1), "1025-byte"),
        (b"not msgpack at all", "malformed"),
        (msgspec.msgpack.encode({"round": 0, "unit": "experts/0", "kind": "all"}), "malformed"),
        (msgspec.msgpack.encode({"round": 0, "unit": "../etc/passwd"}), "malformed"),
        (msgspec.msgpack.encode({"round": 0, "unit": "experts/0", "sudo": 1}), "malformed"),
        (msgspec.msgpack.encode({"unit": "experts/0", "codec": "pickle"}), "malformed"),
        (
            msgspec.msgpack.encode({"round": 0, "unit": "dense/0", "kind": "piece", "part": 4, "parts": 4}),
            "malformed",
        ),
        (msgspec.msgpack.encode({"round": 0, "unit": "dense/0", "kind": "delta", "parts": 4}), "malformed"),
        (msgspec.msgpack.encode({"round": 0, "unit": "dense/0", "kind": "reduced", "part": 99}), "malformed"),
        (msgspec.msgpack.encode({"unit": "experts/0", "codec": "none", "kind": "everything"}), "malformed"),
    ],
)
def test_a_server_answers_malformed_requests_with_a_failure(request_bytes, problem):
    net = MemoryNetwork()
    specs = {"experts/0": specs_of({"w": torch.zeros(4)})}
    SyncEngine(net.join("server"), "t", SyncConfig(), specs)
    client = net.join("client")
    for name in (RPC_UPDATE, RPC_WEIGHTS):
        with pytest.raises(RemoteError, match=problem):
            client.request("server", name, request_bytes, timeout=1)


def test_requests_round_trip_and_weights_carry_their_round():
    assert UpdateRequest.decode(UpdateRequest(round=2, unit="dense/1").encode()).kind == "delta"
    net = MemoryNetwork()
    weights = {"w": torch.arange(4.0)}
    engine = SyncEngine(net.join("server"), "t", SyncConfig(), {"dense/0": specs_of(weights)})
    engine.serve_weights(7, "dense/0", weights)
    request = WeightsRequest(unit="dense/0", codec="none", round=7).encode()
    payload = net.join("client").request("server", RPC_WEIGHTS, request, timeout=1)
    got = decode(
        payload, specs_of(weights), CODECS["none"], meta={"unit": "dense/0", "round": "7", "kind": "weights"}
    )
    assert torch.equal(got["w"], weights["w"])
