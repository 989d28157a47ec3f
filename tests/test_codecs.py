"""Payloads: codecs in a safetensors container, and everything a receiver refuses before using a byte."""

import json
import math

import pytest
import torch
from safetensors.torch import save

from spes_p2p.sync.codecs import CODECS, PayloadError, TensorSpec, TopK
from spes_p2p.sync.payload import (
    FORMAT,
    ErrorFeedback,
    buffers_digest,
    decode,
    encode,
    specs_of,
)


def sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.w": torch.randn(300, 70, generator=g) * 0.01,
        "bias": torch.randn(5, generator=g),
        "empty": torch.empty(0, 4),
    }


def rel_error(a, b):
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b if b[n].numel())


@pytest.mark.parametrize(("codec", "bound"), [("none", 0.0), ("fp16", 1e-3), ("int8", 0.02), ("nf4", 0.12)])
def test_round_trip_error_is_bounded(codec, bound):
    tensors = sample()
    payload = encode(tensors, CODECS[codec], meta={"unit": "dense/0"})
    back = decode(payload, specs_of(tensors), CODECS[codec], meta={"unit": "dense/0"})
    assert rel_error(back, tensors) <= bound
    assert len(payload) <= CODECS[codec].max_bytes(specs_of(tensors))


def test_an_uncompressed_payload_is_a_plain_safetensors_file():
    tensors = sample()
    from safetensors.torch import load

    loaded = load(encode(tensors, CODECS["none"]))
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_sizes_shrink_with_the_codec():
    tensors = sample()
    sizes = {name: len(encode(tensors, codec)) for name, codec in CODECS.items()}
    body = sum(t.numel() for t in tensors.values())
    assert sizes["none"] >= 4 * body
    assert sizes["fp16"] < 0.55 * sizes["none"] and sizes["int8"] < 0.3 * sizes["none"]
    assert sizes["nf4"] < 0.6 * sizes["int8"] and sizes["topk"] < 0.1 * sizes["none"]


def test_topk_sends_the_largest_entries_and_error_feedback_catches_up():
    update = {"w": torch.zeros(1000)}
    update["w"][[3, 500, 999]] = torch.tensor([5.0, -7.0, 0.5])
    back = decode(encode(update, TopK(0.002)), specs_of(update), TopK(0.002))
    assert back["w"].nonzero().flatten().tolist() == [3, 500]
    # with error feedback, what was held back is sent later: the sums converge
    feedback, sent_total = ErrorFeedback(TopK(0.05)), torch.zeros(1000)
    g = torch.Generator().manual_seed(1)
    true_total = torch.zeros(1000)
    for _ in range(200):
        u = {"w": torch.randn(1000, generator=g)}
        true_total += u["w"]
        sent_total += feedback.encode(u)[1]["w"]
    assert (sent_total + feedback.residual["w"] - true_total).abs().max() < 1e-2
    assert (sent_total - true_total).norm() / true_total.norm() < 0.5


@pytest.mark.parametrize("codec", ["fp16", "int8", "nf4", "topk"])
def test_error_feedback_keeps_a_lossy_codecs_sum_within_one_rounds_loss(codec):
    """Small updates with a steady drift, as a lone holder's are: coded alone, each round's rounding adds up;
    with error feedback, the sum of what was sent stays within one round's residual of the true sum."""
    g = torch.Generator().manual_seed(0)
    coding = TopK(0.05) if codec == "topk" else CODECS[codec]
    feedback, true_total, fed, plain = ErrorFeedback(coding), torch.zeros(5000), 0, 0
    drift = torch.randn(5000, generator=g) * 1e-3
    for round_ in range(100):
        u = {"w": drift + torch.randn(5000, generator=g) * 1e-4}
        true_total += u["w"]
        fed = fed + feedback.encode(u, round_=round_)[1]["w"]
        plain = plain + decode(encode(u, coding), specs_of(u), coding)["w"]
    fed_error, plain_error = (fed - true_total).norm(), (plain - true_total).norm()
    assert fed_error <= feedback.residual["w"].norm() * 1.05  # (up to float32 summation)
    if codec != "topk":  # (top-k alone never sends most entries: its plain error is the whole sum)
        assert fed_error < 0.2 * plain_error, (fed_error, plain_error)


def test_error_feedback_drops_a_residual_after_a_gap():
    feedback = ErrorFeedback(CODECS["int8"])
    feedback.encode({"w": torch.randn(100)}, round_=3)
    assert feedback.residual
    _, sent = feedback.encode({"w": torch.zeros(100)}, round_=5)  # round 4 was missed: nothing carried
    assert torch.equal(sent["w"], torch.zeros(100))


@pytest.mark.parametrize("codec", list(CODECS))
def test_damaged_or_mismatched_payloads_are_rejected(codec):
    tensors = sample()
    specs = specs_of(tensors)
    payload = encode(tensors, CODECS[codec], meta={"unit": "experts/1", "round": "3"})
    with pytest.raises(PayloadError):
        decode(payload[: len(payload) // 2], specs, CODECS[codec])  # cut short
    with pytest.raises(PayloadError, match="not a safetensors payload"):
        decode(b"\x80\x04PKL" + payload[5:], specs, CODECS[codec])  # a pickle is never read
    with pytest.raises(PayloadError, match="differ from the expected"):
        decode(payload, {**specs, "extra": TensorSpec((1,))}, CODECS[codec])
    with pytest.raises(PayloadError, match="expected"):
        decode(payload, {**specs, "layers.0.w": TensorSpec((300, 71))}, CODECS[codec])
    with pytest.raises(PayloadError, match="round is '3', expected '4'"):
        decode(payload, specs, CODECS[codec], meta={"round": "4"})  # an old round's payload
    other = next(c for c in CODECS if c != codec)
    with pytest.raises(PayloadError):
        decode(payload, specs, CODECS[other])  # the sender does not choose the codec


def test_oversized_payloads_are_refused_before_parsing():
    tensors = {"w": torch.ones(64)}
    huge = encode({"w": torch.ones(10_000)}, CODECS["none"])
    with pytest.raises(PayloadError, match="over the"):
        decode(huge, specs_of(tensors), CODECS["none"])


def forged(buffers: dict, codec: str, **meta) -> bytes:
    """A payload a dishonest sender builds by hand: well formed, with its hash right."""
    return save(
        buffers, metadata={"format": FORMAT, "codec": codec, "sha256": buffers_digest(buffers), **meta}
    )


def test_values_that_are_not_finite_are_rejected_in_every_codec():
    spec = {"w": TensorSpec((4,))}
    nan = torch.tensor([1.0, math.nan, 2.0, 0.0])
    with pytest.raises(PayloadError, match="not finite"):
        decode(encode({"w": nan}, CODECS["none"]), spec, CODECS["none"])
    with pytest.raises(PayloadError, match="not finite"):
        decode(forged({"w": nan.half()}, "fp16"), spec, CODECS["fp16"])
    inf_scale = {"w#codes": torch.zeros(4, dtype=torch.uint8), "w#absmax": torch.tensor([math.inf])}
    with pytest.raises(PayloadError, match="scales are not finite"):
        decode(forged(inf_scale, "int8"), spec, CODECS["int8"])


def test_topk_indices_must_be_in_range_and_distinct():
    spec = {"w": TensorSpec((100,))}
    values = torch.ones(2, dtype=torch.float16)
    for indices in ([5, 500], [7, 7], [9, 3]):
        payload = forged({"w#indices": torch.tensor(indices, dtype=torch.int32), "w#values": values}, "topk")
        with pytest.raises(PayloadError, match="indices"):
            decode(payload, spec, CODECS["topk"])


def test_buffers_of_the_wrong_dtype_or_a_forged_header_are_rejected():
    spec = {"w": TensorSpec((4,))}
    with pytest.raises(PayloadError, match="expected F32"):
        decode(forged({"w": torch.ones(4, dtype=torch.float64)}, "none"), spec, CODECS["none"])
    good = encode({"w": torch.ones(4)}, CODECS["none"])
    size = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + size])
    header["w"]["data_offsets"] = [0, 10_000]  # pointing outside the data
    raw = json.dumps(header).encode()
    with pytest.raises(PayloadError, match="not a safetensors payload"):
        decode(len(raw).to_bytes(8, "little") + raw + good[8 + size :], spec, CODECS["none"])


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_bit_flipped_in_transit_is_caught_by_the_payload_hash(codec):
    tensors = sample()
    payload = encode(tensors, CODECS[codec])
    caught = 0
    for position in range(len(payload) - 1, len(payload) - 301, -1):  # bytes of the buffers, from the end
        flipped = payload[:position] + bytes([payload[position] ^ 0x10]) + payload[position + 1 :]
        with pytest.raises(PayloadError):
            decode(flipped, specs_of(tensors), CODECS[codec])
        caught += 1
    assert caught == 300
