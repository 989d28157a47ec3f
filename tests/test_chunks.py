"""A unit's weights in chunks from several holders at once (sync/chunks.py), on the memory backend: the
download is bit-identical to the holders' weights, its chunks come from every holder, and a holder that lies
about a chunk, or serves none, costs only its chunks."""

import time
from collections import Counter

import msgspec
import pytest
import torch

from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.net.transport import Unavailable
from spes_p2p.net.wire import BadRequest
from spes_p2p.sync.chunks import CHUNK_BYTES, RACED, ChunkIndex
from spes_p2p.sync.codecs import PayloadError, TensorSpec
from spes_p2p.sync.config import SyncConfig
from spes_p2p.sync.engine import SyncEngine
from spes_p2p.sync.messages import RPC_WEIGHTS, WeightsRequest
from spes_p2p.sync.versions import EXACT_WEIGHTS

UNIT = "dense/0"
SPECS = {UNIT: {"w": TensorSpec((1536, 1024)), "norm": TensorSpec((1024,))}}  # 6 MiB: 4 chunks
HOLDERS = ["h0", "h1", "h2", "h3"]


def swarm():
    net = MemoryNetwork(seed=0)
    cfg = SyncConfig(deadline_min=0.2, deadline_max=5.0, request_timeout=2.0)
    engines = {p: SyncEngine(net.join(p), "t", cfg, SPECS) for p in [*HOLDERS, "newcomer"]}
    weights = {"w": torch.randn(1536, 1024), "norm": torch.randn(1024)}
    for holder in HOLDERS:
        engines[holder].serve_weights(3, UNIT, weights)
    return net, engines, weights


def download(engine: SyncEngine, holders=HOLDERS) -> dict:
    got = {}
    engine.refresh(3, {UNIT: holders}, 5.0, want=EXACT_WEIGHTS, on_unit=lambda u, f: got.update(f.tensors))
    return got


def chunks_served(net: MemoryNetwork) -> dict[str, list[int]]:
    served: dict[str, list[int]] = {}
    for _, target, name, request, size in net.log:
        req = WeightsRequest.decode(request)
        if name == RPC_WEIGHTS and req.chunk >= 0 and size:
            served.setdefault(target, []).append(req.chunk)
    return served


def test_a_unit_comes_in_chunks_from_every_holder_bit_for_bit():
    net, engines, weights = swarm()
    for holder in HOLDERS:  # (each busy a while with a chunk, as on a real uplink)
        liar(engines[holder], lambda chunk: time.sleep(0.3) or chunk)
    got = download(engines["newcomer"])
    assert set(got) == {"w", "norm"} and all(torch.equal(got[n], weights[n]) for n in weights)
    served = chunks_served(net)
    assert set(served) == set(HOLDERS) and {c for cs in served.values() for c in cs} == {0, 1, 2, 3}
    # nothing came whole, and no chunk from more holders than it is raced to at the end (how many chunks
    # are raced depends on when each holder's first one came: in CI under load, 3 of the 4)
    assert max(size for _, _, _, _, size in net.log) <= CHUNK_BYTES
    assert max(Counter(c for cs in served.values() for c in cs).values()) <= RACED


def test_a_unit_of_one_holder_comes_in_chunks_too():
    """(A request for the whole unit would have to fit within one request timeout, on the holder's uplink.)"""
    net, engines, weights = swarm()
    got = download(engines["newcomer"], ["h0"])
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert chunks_served(net) == {"h0": [0, 1, 2, 3]}


def liar(engine: SyncEngine, corrupt) -> None:
    """``engine`` serves chunks as ``corrupt`` makes them (of the chunks it would serve)."""
    handler = engine.transport.handlers[RPC_WEIGHTS]

    def lying(caller: str, request: bytes) -> bytes:
        answer = handler[0](caller, request)
        return corrupt(answer) if WeightsRequest.decode(request).chunk >= 0 else answer

    engine.transport.serve(RPC_WEIGHTS, lying, max_request_bytes=handler[1])


def test_a_holder_that_lies_about_its_chunks_is_refused_and_the_others_serve_them():
    net, engines, weights = swarm()
    for holder in ("h0", "h2", "h3"):  # (busy a while with a chunk: the liar, quick, is surely asked for one)
        liar(engines[holder], lambda chunk: time.sleep(0.3) or chunk)
    liar(engines["h1"], lambda chunk: bytes([chunk[0] ^ 1]) + chunk[1:])
    got = download(engines["newcomer"])
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert engines["newcomer"].transport.guard.rejections == {"h1": 1}  # (asked no more after one)
    assert chunks_served(net).get("h1", []) and len(chunks_served(net)) >= 3


def test_a_holder_that_serves_no_chunk_costs_only_its_chunks():
    _, engines, weights = swarm()

    def silent(chunk: bytes) -> bytes:
        raise Unavailable("not now")

    liar(engines["h2"], silent)
    got = download(engines["newcomer"])
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert not engines["newcomer"].transport.guard.rejections  # (not serving is no lie)


def test_a_holder_whose_index_differs_is_outvoted():
    """Whether the odd holder is asked for the index first or second, or for chunks once the other two
    agree, what comes is the weights the two others serve."""
    _, engines, weights = swarm()
    engines["h0"].serve_weights(3, UNIT, {"w": weights["w"] + 1, "norm": weights["norm"]})
    for peer in ("h1", "h2", "h3"):  # (the order holders are asked in is drawn per peer)
        got = download(engines["newcomer"], ["h0", "h1" if peer != "h1" else "h2", peer])
        assert torch.equal(got["w"], weights["w"])


def test_indexes_and_chunk_requests_are_checked():
    with pytest.raises(PayloadError, match="chunks, not"):
        ChunkIndex.decode(
            msgspec.msgpack.encode(
                {
                    "round": 3,
                    "header": (2).to_bytes(8, "little") + b"{}",
                    "size": CHUNK_BYTES + 1,
                    "sha256": ["ab" * 32],
                }
            )
        )
    with pytest.raises(BadRequest, match="one of digest, index or chunk"):
        WeightsRequest.decode(
            msgspec.msgpack.encode({"unit": UNIT, "codec": "none", "digest": True, "index": True})
        )
    with pytest.raises(BadRequest):
        WeightsRequest.decode(msgspec.msgpack.encode({"unit": UNIT, "codec": "none", "chunk": 10**6}))
    engines = swarm()[1]
    index = ChunkIndex.decode(
        engines["h0"].transport.handlers[RPC_WEIGHTS][0](
            "x", WeightsRequest(unit=UNIT, codec="none", round=3, index=True).encode()
        )
    )
    assert index.round == 3 and len(index.sha256) == 4
    with pytest.raises(Unavailable, match="not served here"):  # a chunk is of exactly the round asked
        engines["h0"].transport.handlers[RPC_WEIGHTS][0](
            "x", WeightsRequest(unit=UNIT, codec="none", round=2, chunk=0).encode()
        )
