"""Fuzzing of every parser that reads bytes from another peer: payloads of each codec, each RPC request and
answer, each DHT record. A parser may return a checked value or raise its own rejection; anything else (a
KeyError, a RecursionError, a value of the wrong shape) fails.

CI runs ``SPES_FUZZ_EXAMPLES`` (default 200) generated inputs per parser and input kind, derandomized; for a
long run: ``SPES_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz.py``.
"""

import json
import os

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spes_p2p.net.reachability import DialbackAnswer, DialbackRequest
from spes_p2p.swarm.manifest import Manifest, ManifestRecord
from spes_p2p.swarm.records import Announcement, PeerRecord
from spes_p2p.sync.codecs import CODECS, PayloadError, TensorSpec, TopK
from spes_p2p.sync.messages import UpdateRequest, WeightsRequest
from spes_p2p.sync.payload import decode, encode

EXAMPLES = int(os.environ.get("SPES_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="SPES_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SPECS = {"w": TensorSpec((7, 5)), "b": TensorSpec((3,))}
CODING = {**CODECS, "topk": TopK(0.1)}
META = {"unit": "dense/0", "round": "3", "kind": "delta"}
VALID = {
    codec: encode({"w": torch.randn(7, 5), "b": torch.randn(3)}, CODING[codec], meta=META) for codec in CODECS
}
MESSAGES = [
    UpdateRequest,
    WeightsRequest,
    DialbackRequest,
    DialbackAnswer,
    Manifest,
    ManifestRecord,
    PeerRecord,
    Announcement,
]

msgpack_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
scalars = (
    st.none() | st.booleans() | msgpack_ints | st.floats() | st.text(max_size=20) | st.binary(max_size=20)
)
nested = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)


def decoded_or_refused(payload: bytes, codec: str) -> None:
    try:
        tensors = decode(payload, SPECS, CODING[codec], meta=META)
    except PayloadError:
        return
    assert set(tensors) == set(SPECS)
    for name, spec in SPECS.items():
        assert tuple(tensors[name].shape) == spec.shape and tensors[name].dtype == torch.float32
        assert torch.isfinite(tensors[name]).all()


@pytest.mark.parametrize("codec", CODECS)
@FUZZ
@given(data=st.binary(max_size=4096))
def test_payloads_of_random_bytes(codec, data):
    decoded_or_refused(data, codec)


@pytest.mark.parametrize("codec", CODECS)
@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.sampled_from("fdit")), max_size=8)
)
def test_payloads_with_bytes_flipped_deleted_inserted_or_cut(codec, edits):
    data = bytearray(VALID[codec])
    for position, value, kind in edits:
        at = position % (len(data) + 1)
        if kind == "f" and at < len(data):
            data[at] ^= value or 1
        elif kind == "d" and at < len(data):
            del data[at]
        elif kind == "i":
            data.insert(at, value)
        elif kind == "t":
            del data[at:]
    decoded_or_refused(bytes(data), codec)


@pytest.mark.parametrize("codec", CODECS)
@FUZZ
@given(header=json_values, tail=st.binary(max_size=512), keep_buffers=st.booleans())
def test_payloads_with_any_json_header(codec, header, tail, keep_buffers):
    """A header of any JSON shape (the issue's 121-byte payload lacked the tensor table), over the valid
    payload's buffers or random bytes."""
    valid = VALID[codec]
    body = valid[8 + int.from_bytes(valid[:8], "little") :] if keep_buffers else tail
    raw = json.dumps(header).encode()
    decoded_or_refused(len(raw).to_bytes(8, "little") + raw + body, codec)


@pytest.mark.parametrize("codec", CODECS)
@FUZZ
@given(table=st.dictionaries(st.sampled_from(["w", "b", "w#codes", "w#absmax", "__metadata__"]), json_values))
def test_payloads_whose_tensor_entries_are_anything(codec, table):
    valid = VALID[codec]
    header = json.loads(valid[8 : 8 + int.from_bytes(valid[:8], "little")])
    raw = json.dumps({**header, **table}).encode()
    decoded_or_refused(len(raw).to_bytes(8, "little") + raw + valid[8 + len(raw) :], codec)


def test_a_deeply_nested_header_is_refused():
    raw = b"[" * 40_000
    for codec in CODECS:
        with pytest.raises(PayloadError):
            decode(len(raw).to_bytes(8, "little") + raw, SPECS, CODECS[codec], meta=META)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@FUZZ
@given(data=st.binary(max_size=2048))
def test_messages_and_records_of_random_bytes(cls, data):
    try:
        assert isinstance(cls.decode(data), cls)
    except cls.ERROR:
        pass


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@FUZZ
@given(value=nested)
def test_messages_and_records_of_any_msgpack_value(cls, value):
    try:
        assert isinstance(cls.decode(msgspec.msgpack.encode(value)), cls)
    except cls.ERROR:
        pass


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@FUZZ
@given(data=st.data())
def test_messages_and_records_with_their_own_field_names_and_any_values(cls, data):
    names = [f.encode_name for f in msgspec.structs.fields(cls)]
    value = data.draw(
        st.dictionaries(
            st.sampled_from(names), nested | st.sampled_from([-1, 0, 2**31, 2**63 - 1, 2**64 - 1])
        )
    )
    try:
        assert isinstance(cls.decode(msgspec.msgpack.encode(value)), cls)
    except cls.ERROR:
        pass
