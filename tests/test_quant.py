"""Frozen copies held quantized (int8, nf4), experts and dense blocks: accuracy, gradients, storage, the unit
interface, and the codec a refresh of each is fetched in."""

import subprocess
import sys

import pytest
import torch

from spes_p2p.blockwise import int8_sizes, nf4_sizes
from spes_p2p.model import MoETransformer, UnitLayout, get_preset, read_unit, write_unit
from spes_p2p.model.moe import SwiGLUExpert
from spes_p2p.model.quant import QuantizedTensor, frozen_matmul
from spes_p2p.model.units import hold_frozen, quantized_when_frozen
from spes_p2p.sync.codecs import CODECS
from spes_p2p.sync.payload import decode, encode, specs_of
from spes_p2p.train.accounting import weights_bytes
from spes_p2p.train.config import TrainConfig
from spes_p2p.train.trainer import Trainer

TINY = get_preset("tiny")
LAYOUT = UnitLayout(TINY.n_experts, 4)
# relative error of the model's logits with every expert but shard 0's quantized
TOLERANCE = {"int8": 0.02, "nf4": 0.15}


def models(kind: str):
    torch.manual_seed(0)
    full = MoETransformer(TINY)
    quantized = MoETransformer(TINY)
    quantized.load_state_dict(full.state_dict())
    hold_frozen(quantized, LAYOUT, ["dense/0", "experts/0"], experts=kind)
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
    refresh = decode(encode(exact, CODECS[kind]), specs_of(exact), CODECS[kind])
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
    hold_frozen(restored, LAYOUT, ["dense/0", "experts/0"], experts=kind)
    quantized.load_state_dict(state)  # loading into quantized experts re-quantizes
    assert torch.equal(
        read_unit(restored, LAYOUT, "experts/3")["layers.1.moe.experts.7.w2"],
        read_unit(quantized, LAYOUT, "experts/3")["layers.1.moe.experts.7.w2"],
    )


def test_claiming_a_quantized_shard_brings_back_full_precision_parameters():
    _, model = models("nf4")
    hold_frozen(model, LAYOUT, ["dense/0", "experts/1"], experts="nf4")
    expert = model.layers[1].moe.experts[2]  # shard 1
    assert isinstance(expert, SwiGLUExpert) and not expert.quantized
    assert {n for n, _ in expert.named_parameters()} == {"w1", "w3", "w2"}
    assert model.layers[1].moe.experts[0].quantized  # shard 0 is frozen now
    hold_frozen(model, LAYOUT, ["dense/0"], experts="full")
    assert not any(isinstance(m, SwiGLUExpert) and m.quantized for m in model.modules())


# ------------------------------------------------------------------------------- frozen dense blocks

BLOCKS = UnitLayout.for_model(TINY, 4, 4)  # embedding | layer 0 | layer 1 | final norm + lm_head
TRAINED = ["dense/1", "experts/0"]  # layer 0's attention, norms and router
# what a frozen dense block holds quantized: every weight of 2 dims and at least 4096 elements
QUANTIZED = {"embed.weight", "lm_head.weight"} | {f"layers.1.attn.{x}_proj.weight" for x in "qkvo"}
# relative error of the logits with dense blocks 0, 2 and 3 quantized (measured: int8 0.0196, nf4 0.137)
DENSE_TOLERANCE = {"int8": 0.03, "nf4": 0.2}


def dense_models(kind: str):
    torch.manual_seed(0)
    full = MoETransformer(TINY)
    quantized = MoETransformer(TINY)
    quantized.load_state_dict(full.state_dict())
    hold_frozen(quantized, BLOCKS, TRAINED, dense=kind)
    return full, quantized


def held_quantized(model) -> set[str]:
    return {f"{n}.{w}" for n, m in model.named_modules() for w in getattr(m, "quantized", {})}


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_frozen_dense_blocks_stay_close_and_pass_gradients_to_the_trained_block(kind):
    full, quantized = dense_models(kind)
    assert held_quantized(quantized) == QUANTIZED  # norms and the router (8 x 64) stay fp32 parameters
    dense = {u: names for u, names in quantized_when_frozen(full, BLOCKS).items() if u.startswith("dense/")}
    assert set().union(*(names for u, names in dense.items() if u not in TRAINED)) == QUANTIZED  # (as held)
    assert not {n for n, _ in quantized.named_parameters()} & QUANTIZED
    for model in (full, quantized):
        for name, p in model.named_parameters():
            p.requires_grad_(BLOCKS.unit_of(name) in TRAINED)
    tokens = torch.randint(0, TINY.vocab_size, (2, 65))
    outs = [m(tokens[:, :-1], tokens[:, 1:]) for m in (full, quantized)]
    error = (outs[0].logits - outs[1].logits).norm() / outs[0].logits.norm()
    assert error < DENSE_TOLERANCE[kind]
    for out in outs:
        out.loss.backward()
    grads = [m.layers[0].attn.q_proj.weight.grad for m in (full, quantized)]
    assert grads[1] is not None and grads[1].abs().sum() > 0
    assert torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0) > 0.9
    frozen = [p.grad for n, p in quantized.named_parameters() if BLOCKS.unit_of(n) not in TRAINED]
    assert frozen and all(g is None for g in frozen)


def test_a_frozen_linear_passes_the_exact_gradient_to_its_input():
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))  # (out, in), as nn.Linear's
    q = QuantizedTensor.quantize(weight, "nf4")
    x = torch.randn(5, 64, requires_grad=True)
    y = frozen_matmul(x, q, transposed=True)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = x_ref @ q.dequantize().t()
    grad = torch.randn_like(y)
    (y * grad).sum().backward()
    (y_ref * grad).sum().backward()
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_an_embedding_lookup_decodes_the_rows_exactly_as_the_whole_table(kind):
    table = torch.randn(37, 9, generator=torch.Generator().manual_seed(2))  # odd: nf4 rows split bytes
    q = QuantizedTensor.quantize(table, kind)
    tokens = torch.tensor([[0, 36, 5], [5, 17, 1]])
    assert torch.equal(q.rows(tokens), q.dequantize()[tokens])


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_dense_blocks_are_smaller_and_read_write_like_the_others(kind):
    full, quantized = dense_models(kind)
    sizes = {"int8": int8_sizes, "nf4": nf4_sizes}[kind]
    numels = [full.get_parameter(name).numel() for name in QUANTIZED]
    held = sum(codes + 4 * scales for codes, scales in map(sizes, numels))
    assert weights_bytes(full) - weights_bytes(quantized) == 4 * sum(numels) - held
    assert weights_bytes(full) - weights_bytes(quantized) == {"int8": 442_224, "nf4": 506_880}[kind]
    assert quantized.num_params() == full.num_params()
    exact = read_unit(full, BLOCKS, "dense/3")  # the final norm and the lm_head
    refresh = decode(encode(exact, CODECS[kind]), specs_of(exact), CODECS[kind])
    write_unit(quantized, BLOCKS, "dense/3", refresh)
    held = read_unit(quantized, BLOCKS, "dense/3")
    assert set(held) == set(exact) == {"norm.weight", "lm_head.weight"}
    assert torch.equal(held["norm.weight"], refresh["norm.weight"])  # fp32 parameter: stored as it came
    codec_error = (refresh["lm_head.weight"] - exact["lm_head.weight"]).norm()
    stored_error = (held["lm_head.weight"] - refresh["lm_head.weight"]).norm()
    assert codec_error > 0 and stored_error <= (0.6 if kind == "int8" else 0.0) * codec_error
    state = quantized.state_dict()  # full precision, the same names in the same order
    assert list(state) == list(full.state_dict())
    assert state["lm_head.weight"].dtype == torch.float32
    assert torch.equal(state["lm_head.weight"], held["lm_head.weight"])
    restored = MoETransformer(TINY)
    restored.load_state_dict(state)
    hold_frozen(restored, BLOCKS, TRAINED, dense=kind)
    quantized.load_state_dict(state)  # loading into quantized weights re-quantizes
    assert torch.equal(restored.state_dict()["embed.weight"], quantized.state_dict()["embed.weight"])


def test_a_quantized_dense_block_trained_again_is_fp32_parameters_in_the_optimizer():
    torch.manual_seed(0)
    model = MoETransformer(TINY)
    trainer = Trainer(
        model, BLOCKS, TRAINED, TrainConfig(warmup_steps=0, frozen_experts="full", frozen_dense="nf4")
    )
    assert held_quantized(model) == QUANTIZED
    frozen = read_unit(model, BLOCKS, "dense/3")
    tokens = torch.randint(0, TINY.vocab_size, (2, 33))
    trainer.train_step(tokens[:, :-1], tokens[:, 1:])
    after = read_unit(model, BLOCKS, "dense/3")
    assert all(torch.equal(after[n], t) for n, t in frozen.items())  # frozen copies stay as they were
    held = read_unit(model, BLOCKS, "dense/0")
    trainer.retarget(["dense/0", "experts/0"])
    embed = model.embed.weight
    assert isinstance(embed, torch.nn.Parameter) and embed.dtype == torch.float32 and embed.requires_grad
    assert torch.equal(embed, held["embed.weight"]) and any(p is embed for p in trainer.trainable)
    assert not model.embed.quantized and "layers.0.attn.q_proj.weight" in held_quantized(model)
    trainer.train_step(tokens[:, :-1], tokens[:, 1:])
    assert embed in trainer.optimizer.state and not torch.equal(embed, held["embed.weight"])  # it trains


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


def test_the_tables_are_bitsandbytes_ones_computed_without_importing_it():
    from spes_p2p.compat import bitsandbytes
    from spes_p2p.quantize import _dynamic_map, _nf4_table

    functional, cpu = bitsandbytes().functional, torch.device("cpu")
    dynamic = functional.create_dynamic_map(signed=True).float().sort().values
    dynamic[0] = -1.0
    assert torch.equal(_dynamic_map(cpu), dynamic)
    assert torch.equal(_nf4_table(cpu), functional.get_4bit_type("nf4", device="cpu").float().sort().values)


def test_the_8bit_optimizer_trains_without_importing_torchs_compiler():
    """bitsandbytes' import would wrap fallback kernels in torch.compile, and its kernels and torch's
    optimizer methods import torch's compiler on first call only to mark themselves as not to be compiled
    (seconds of every peer's start). The 8-bit optimizer steps (its 8-bit and its 32-bit state), saves and
    loads its state all the same, nothing imports the compiler, and torch's own functions are restored."""
    code = (
        "import sys, torch\n"
        "compile_, disable_ = torch.compile, torch._disable_dynamo\n"
        "from spes_p2p.compat import bitsandbytes\n"
        "from spes_p2p.train.optim import build_optimizer\n"
        "bnb = bitsandbytes()\n"
        "assert torch.compile is compile_ and torch._disable_dynamo is disable_ and bitsandbytes() is bnb\n"
        "big, small = torch.nn.Parameter(torch.ones(64, 64)), torch.nn.Parameter(torch.ones(64))\n"
        "kw = dict(kind='adamw8bit', lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)\n"
        "opt = build_optimizer([('w', big), ('b', small)], **kw)\n"
        "for _ in range(2):\n"
        "    big.grad, small.grad = torch.ones(64, 64), torch.ones(64)\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "assert big.detach().lt(1).all() and small.detach().lt(1).all()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
