import math

import pytest
import torch

from spes_p2p.swarm.codecs import (
    CODECS,
    PayloadError,
    TensorSpec,
    TopKFeedback,
    decode,
    encode,
    max_payload_bytes,
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


@pytest.mark.parametrize(("codec", "bound"), [("none", 0.0), ("fp16", 1e-3), ("int8", 0.02)])
def test_round_trip_error_is_bounded(codec, bound):
    tensors = sample()
    payload = encode(tensors, codec)
    back = decode(payload, specs_of(tensors), codec)
    assert rel_error(back, tensors) <= bound
    assert len(payload) <= max_payload_bytes(specs_of(tensors), codec)


def test_sizes_shrink_with_the_codec():
    tensors = sample()
    sizes = {c: len(encode(tensors, c)) for c in CODECS}
    body = sum(t.numel() for t in tensors.values())
    assert (
        sizes["none"] >= 4 * body
        and sizes["fp16"] < 0.55 * sizes["none"]
        and sizes["int8"] < 0.3 * sizes["none"]
    )
    assert sizes["topk"] < 0.1 * sizes["none"]


def test_topk_sends_the_largest_entries_and_error_feedback_catches_up():
    update = {"w": torch.zeros(1000)}
    update["w"][[3, 500, 999]] = torch.tensor([5.0, -7.0, 0.5])
    back = decode(encode(update, "topk", 0.002), specs_of(update), "topk")["w"]
    assert back.nonzero().flatten().tolist() == [3, 500]
    # with error feedback, what was held back is sent later: the sums converge
    feedback, sent_total = TopKFeedback(), torch.zeros(1000)
    g = torch.Generator().manual_seed(1)
    true_total = torch.zeros(1000)
    for _ in range(200):
        u = {"w": torch.randn(1000, generator=g)}
        true_total += u["w"]
        sent_total += decode(feedback.encode(u, 0.05), specs_of(u), "topk")["w"]
    assert (sent_total + feedback.residual["w"] - true_total).abs().max() < 1e-2
    assert (sent_total - true_total).norm() / true_total.norm() < 0.5


@pytest.mark.parametrize("codec", CODECS)
def test_corrupt_payloads_are_rejected(codec):
    tensors = sample()
    specs = specs_of(tensors)
    payload = bytearray(encode(tensors, codec))
    flipped = bytes(payload[:-3]) + bytes([payload[-3] ^ 0xFF]) + bytes(payload[-2:])
    with pytest.raises(PayloadError, match="checksum"):
        decode(flipped, specs, codec)
    with pytest.raises(PayloadError):
        decode(bytes(payload[: len(payload) // 2]), specs, codec)
    with pytest.raises(PayloadError, match="magic"):
        decode(b"PKL" + bytes(payload[3:]), specs, codec)
    with pytest.raises(PayloadError, match="names"):
        decode(bytes(payload), {**specs, "extra": TensorSpec((1,))}, codec)
    with pytest.raises(PayloadError, match="shape"):
        decode(bytes(payload), {**specs, "bias": TensorSpec((6,))}, codec)


def test_non_finite_values_are_rejected():
    bad = {"w": torch.tensor([1.0, math.nan, 2.0])}
    with pytest.raises(PayloadError, match="not finite"):
        decode(encode(bad, "none"), specs_of(bad), "none")


def test_header_cannot_point_outside_the_body():
    import hashlib
    import json

    tensors = {"w": torch.ones(4)}
    payload = encode(tensors, "none")
    size = int.from_bytes(payload[5:9], "big")
    header = json.loads(payload[9 : 9 + size])
    header["tensors"][0]["parts"] = [[8, 10_000]]
    body = payload[9 + size :]
    header["sha256"] = hashlib.sha256(body).hexdigest()
    raw = json.dumps(header).encode()
    forged = payload[:5] + len(raw).to_bytes(4, "big") + raw + body
    with pytest.raises(PayloadError, match="outside the body"):
        decode(forged, specs_of(tensors), "none")
