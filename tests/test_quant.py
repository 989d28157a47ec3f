"""Frozen experts held quantized (int8, nf4): accuracy, gradients, storage, and the unit interface."""

import pytest
import torch

from spes_p2p.model import MoETransformer, UnitLayout, get_preset, read_unit, write_unit
from spes_p2p.model.moe import SwiGLUExpert
from spes_p2p.model.units import hold_frozen_experts
from spes_p2p.swarm.payload import decode, encode, specs_of
from spes_p2p.train.memory import weights_bytes

TINY = get_preset("tiny")
LAYOUT = UnitLayout(TINY.n_experts, 4)
# relative error of the model's logits with every expert but shard 0's quantized
TOLERANCE = {"int8": 0.02, "nf4": 0.15}


def models(kind: str):
    torch.manual_seed(0)
    full = MoETransformer(TINY)
    quantized = MoETransformer(TINY)
    quantized.load_state_dict(full.state_dict())
    hold_frozen_experts(quantized, LAYOUT, ["dense/0", "experts/0"], kind)
    return full, quantized


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_frozen_experts_stay_close_and_pass_gradients_to_the_router(kind):
    full, quantized = models(kind)
    tokens = torch.randint(0, TINY.vocab_size, (2, 65))
    outs = [m(tokens[:, :-1], tokens[:, 1:]) for m in (full, quantized)]
    error = (outs[0].logits - outs[1].logits).norm() / outs[0].logits.norm()
    assert error < TOLERANCE[kind]
    for out in outs:
        out.loss.backward()
    router = [m.layers[0].moe.router.weight.grad for m in (full, quantized)]
    assert router[1] is not None and router[1].abs().sum() > 0
    assert torch.nn.functional.cosine_similarity(router[0].flatten(), router[1].flatten(), dim=0) > 0.9
    frozen = quantized.layers[0].moe.experts[7]
    assert frozen.quantized and not list(frozen.parameters())  # no parameter, so no gradient to hold
    trained = quantized.layers[0].moe.experts[0]
    assert trained.w1.grad is not None


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_experts_are_smaller_and_read_write_like_the_others(kind):
    full, quantized = models(kind)
    expert_bytes = sum(4 * p.numel() for n, p in full.named_parameters() if ".experts." in n)
    saved = weights_bytes(full) - weights_bytes(quantized)
    quantized_share = 3 / 4  # shards 1-3 of 4
    per_weight = {"int8": 1 + 4 / 4096, "nf4": 0.5 + 4 / 64}[kind]
    assert saved == pytest.approx(expert_bytes * quantized_share * (1 - per_weight / 4), rel=0.01)
    assert quantized.num_params() == full.num_params()
    # a refresh that arrives in the peer's own format is stored with little or no further error (int8:
    # bitsandbytes' map reaches 1.0 but only -0.993, so a block whose largest value is negative shrinks a bit)
    exact = read_unit(full, LAYOUT, "experts/2")
    refresh = decode(encode(exact, kind), specs_of(exact), kind)
    write_unit(quantized, LAYOUT, "experts/2", refresh)
    held = read_unit(quantized, LAYOUT, "experts/2")
    assert set(held) == set(exact)
    for name in exact:
        codec_error = (refresh[name] - exact[name]).norm()
        assert (held[name] - refresh[name]).norm() <= (0.6 if kind == "int8" else 0.0) * codec_error
    # state_dict stays full precision, with the same keys, so checkpoints do not depend on the format
    state = quantized.state_dict()
    assert list(state) == list(full.state_dict())
    restored = MoETransformer(TINY)
    restored.load_state_dict(state)
    hold_frozen_experts(restored, LAYOUT, ["dense/0", "experts/0"], kind)
    quantized.load_state_dict(state)  # loading into quantized experts re-quantizes
    assert torch.equal(
        read_unit(restored, LAYOUT, "experts/3")["layers.1.moe.experts.7.w2"],
        read_unit(quantized, LAYOUT, "experts/3")["layers.1.moe.experts.7.w2"],
    )


def test_claiming_a_quantized_shard_brings_back_full_precision_parameters():
    _, model = models("nf4")
    hold_frozen_experts(model, LAYOUT, ["dense/0", "experts/1"], "nf4")
    expert = model.layers[1].moe.experts[2]  # shard 1
    assert isinstance(expert, SwiGLUExpert) and not expert.quantized
    assert {n for n, _ in expert.named_parameters()} == {"w1", "w3", "w2"}
    assert model.layers[1].moe.experts[0].quantized  # shard 0 is frozen now
    hold_frozen_experts(model, LAYOUT, ["dense/0"], "full")
    assert not any(isinstance(m, SwiGLUExpert) and m.quantized for m in model.modules())


def test_blockwise_codes_are_the_nearest_table_entries_and_the_same_from_any_thread():
    import threading

    from spes_p2p.quantize import _dynamic_map, dequantize_int8, quantize_int8

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)) * 0.1
    codes, absmax = quantize_int8(x)
    blocks = torch.nn.functional.pad(x, (0, -len(x) % 4096)).view(-1, 4096)
    assert torch.equal(absmax, blocks.abs().amax(dim=1))
    normed = (blocks / absmax[:, None]).flatten()[: len(x)]
    table = _dynamic_map(torch.device("cpu"))
    nearest = (normed[:, None] - table[None, :]).abs().argmin(dim=1)  # ties: the lower entry
    assert torch.equal(codes.long(), nearest)
    assert (dequantize_int8(codes, absmax) - x).abs().max() <= absmax.max() * 0.02
    results = []
    threads = [threading.Thread(target=lambda: results.append(quantize_int8(x))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(c, codes) and torch.equal(a, absmax) for c, a in results)
