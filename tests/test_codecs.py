"""Payloads: codecs in a safetensors container, and everything a receiver refuses before using a byte."""

import json
import math

import pytest
import torch
from safetensors.torch import save

from spes_p2p.sparsify import pack_bits, unpack_bits
from spes_p2p.sync.codecs import CODECS, PayloadError, SparseLoCo, TensorSpec, TopK
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


@pytest.mark.parametrize("codec", ["fp16", "int8", "nf4", "topk", "sparseloco"])
def test_error_feedback_keeps_a_lossy_codecs_sum_within_one_rounds_loss(codec):
    """Small updates with a steady drift, as a lone holder's are: coded alone, each round's rounding adds up;
    with error feedback, the sum of what was sent stays within one round's residual of the true sum."""
    g = torch.Generator().manual_seed(0)
    # (sparseloco without its decay, which lets go of part of each residual on purpose)
    lossy = {"topk": TopK(0.05), "sparseloco": SparseLoCo(chunk=1000, k=50, feedback_decay=1.0)}
    coding = lossy.get(codec) or CODECS[codec]
    feedback, true_total, fed, plain = ErrorFeedback(coding), torch.zeros(5000), 0, 0
    drift = torch.randn(5000, generator=g) * 1e-3
    for round_ in range(100):
        u = {"w": drift + torch.randn(5000, generator=g) * 1e-4}
        true_total += u["w"]
        fed = fed + feedback.encode(u, round_=round_)[1]["w"]
        plain = plain + decode(encode(u, coding), specs_of(u), coding)["w"]
    fed_error, plain_error = (fed - true_total).norm(), (plain - true_total).norm()
    assert fed_error <= feedback.residual["w"].norm() * 1.05  # (up to float32 summation)
    if codec not in lossy:  # (top-k alone never sends most entries: its plain error is the whole sum)
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
        decode(
            payload, {**specs, "layers.0.w": TensorSpec((600, 71))}, CODECS[codec]
        )  # (sizes differ in all)
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


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_one_value_that_is_not_finite_among_many_is_rejected(bad):
    values = torch.randn(50_000)
    values[31_337] = bad
    with pytest.raises(PayloadError, match="not finite"):
        decode(encode({"w": values}, CODECS["none"]), {"w": TensorSpec((50_000,))}, CODECS["none"])


@pytest.mark.parametrize("width", range(1, 17))
def test_bits_are_packed_as_one_little_endian_stream(width):
    """Value i takes bits i * width to (i + 1) * width - 1 of the stream, least significant first: the wire
    format, whatever way the packing is computed."""
    g = torch.Generator().manual_seed(width)
    for count in (0, 1, 2, 3, 7, 8, 9, 1001):
        values = torch.randint(0, 2**width, (count,), generator=g)
        stream = sum(int(v) << (i * width) for i, v in enumerate(values))
        expected = stream.to_bytes(math.ceil(count * width / 8), "little")
        packed = pack_bits(values, width)
        assert packed.dtype == torch.uint8 and bytes(packed.tolist()) == expected
        assert torch.equal(unpack_bits(packed, width, count), values)


def test_error_feedback_leaves_the_callers_update_as_it_was():
    feedback = ErrorFeedback(SparseLoCo(chunk=100, k=3))
    update = sample()
    before = {n: t.clone() for n, t in update.items()}
    for round_ in range(3):
        feedback.encode(update, round_=round_)
        assert all(torch.equal(update[n], before[n]) for n in update)


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


def test_sparseloco_sends_each_chunks_largest_entries_with_their_signs_in_two_bits():
    codec = SparseLoCo(chunk=4096, k=64, bits=2)
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(3 * 4096 + 100, generator=g)
    back = decode(encode({"w": flat}, codec), {"w": TensorSpec(flat.shape)}, codec)["w"]
    for start in range(0, flat.numel(), 4096):
        chunk, sent = flat[start : start + 4096], back[start : start + 4096]
        top = chunk.abs().topk(min(64, chunk.numel())).indices
        assert sorted(sent.nonzero().flatten().tolist()) == sorted(top.tolist())
        assert torch.equal(sent[top].sign(), chunk[top].sign())
        # two magnitudes a chunk: the means of its larger and its smaller half of the entries sent
        magnitudes = chunk[top].abs().sort(descending=True).values
        half = len(magnitudes) // 2
        expected = {round(float(magnitudes[:half].mean()), 5), round(float(magnitudes[half:].mean()), 5)}
        assert {round(float(v), 5) for v in sent[top].abs()} == expected
    coded = len(encode({"w": torch.randn(1 << 20, generator=g)}, codec))
    assert coded / (4 << 20) < 0.0075  # 64 x (12 + 2) bits and two float32 levels per 4096 x 32 bits


def test_sparseloco_keeps_a_sparse_inputs_support_and_a_combination_of_pieces_keeps_every_entry():
    codec = SparseLoCo(chunk=256, k=8)
    sparse = torch.zeros(1000)
    sparse[[1, 5, 300, 999]] = torch.tensor([1.0, -2.0, 3.0, -0.5])
    spec = {"w": TensorSpec((1000,))}
    back = decode(encode({"w": sparse}, codec), spec, codec)["w"]
    assert back.nonzero().flatten().tolist() == [1, 5, 300, 999]  # zeros stay zeros, even in a short chunk
    assert torch.equal(decode(encode({"w": torch.zeros(1000)}, codec), spec, codec)["w"], torch.zeros(1000))
    # four peers' pieces, each 8 entries a chunk at other places: their mean has up to 32 a chunk
    g = torch.Generator().manual_seed(0)
    pieces = [
        decode(encode({"w": torch.randn(1000, generator=g)}, codec), spec, codec)["w"] for _ in range(4)
    ]
    mean = torch.stack(pieces).mean(dim=0)
    wide = codec.combined(4)
    again = decode(encode({"w": mean}, wide), spec, wide)["w"]
    assert torch.equal(again != 0, mean != 0)
    assert torch.equal(again.sign(), mean.sign())
    assert codec.combined(100).k == 256  # (never more slots than a chunk has)


def test_sparseloco_refuses_positions_out_of_order_or_out_of_chunk_and_bad_levels():
    codec = SparseLoCo(chunk=16, k=4, bits=2)
    spec = {"w": TensorSpec((32,))}  # two chunks of 16, 4 slots each, positions of 4 bits
    good_levels = torch.ones(2, 2)

    def payload(positions, levels=good_levels):
        buffers = {
            "w#positions": pack_bits(torch.tensor(positions), 4),
            "w#codes": pack_bits(torch.zeros(8, dtype=torch.long), 2),
            "w#levels": levels,
        }
        return forged(buffers, "sparseloco")

    assert decode(payload([0, 3, 3, 3, 1, 2, 9, 15]), spec, codec)["w"].count_nonzero() == 6  # repeats: empty
    with pytest.raises(PayloadError, match="not in order"):
        decode(payload([3, 0, 5, 6, 1, 2, 9, 15]), spec, codec)
    with pytest.raises(PayloadError, match="negative or not finite"):
        decode(payload([0, 1, 2, 3, 0, 1, 2, 3], torch.tensor([[1.0, -1.0], [1.0, 1.0]])), spec, codec)
    with pytest.raises(PayloadError, match="negative or not finite"):
        decode(payload([0, 1, 2, 3, 0, 1, 2, 3], torch.tensor([[1.0, math.inf], [1.0, 1.0]])), spec, codec)


def test_sparseloco_error_feedback_decays_what_it_carries():
    codec = SparseLoCo(chunk=100, k=1, feedback_decay=0.5)
    feedback = ErrorFeedback(codec)
    update = {"w": torch.zeros(100)}
    update["w"][0], update["w"][1] = 4.0, 1.0
    feedback.encode(update, round_=0)  # sends the 4, keeps the 1
    assert feedback.residual["w"][1] == 1.0
    _, sent = feedback.encode({"w": torch.zeros(100)}, round_=1)  # carries half of it, and sends that
    assert sent["w"][1] == 0.5 and feedback.residual["w"].abs().sum() == 0
