"""``spes upcycle``: a tiny dense transformers model of each family we read, built locally with random
weights, becomes an MoE that computes the dense model's logits at initialization; what our model cannot
compute is refused in one line."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from spes_cli.main import spes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spes_p2p.data.corpus import EOS
from spes_p2p.errors import CheckpointError, ConfigError
from spes_p2p.interop.saved import load_saved
from spes_p2p.interop.upcycle import read_dense, upcycle, write_upcycled
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.peer import Peer
from spes_p2p.peer.admission import admit
from spes_p2p.peer.setup import founded_from, member_config
from spes_p2p.settings import Settings
from spes_p2p.swarm.member import SwarmMember
from spes_p2p.sync.codecs import CODECS
from spes_p2p.sync.messages import RPC_WEIGHTS, WeightsRequest
from spes_p2p.sync.payload import encode, payload_meta

transformers = pytest.importorskip("transformers")

TEXT = "a dense model becomes a mixture of experts whose experts start as copies of its feed-forward. " * 30
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # (q, k, v biases)
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),  # (QK-norm)
}
# Every expert computes the dense MLP, and the renormalized router weights of a token sum to 1: the logits
# differ only by float rounding
TOLERANCE = 1e-4  # max |difference| / max |logit|


def dense_folder(tmp_path, family, tie=False, eos=EOS, **changes):
    """A dense model of ``family`` with random weights (its norms too), saved as transformers saves it, with
    a byte-level BPE tokenizer whose one special token is ``eos``."""
    config_class, model_class, extra = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=[eos], initial_alphabet=alphabet)
    tokenizer.train_from_iterator([TEXT], trainer)
    config = config_class(
        vocab_size=tokenizer.get_vocab_size(), tie_word_embeddings=tie, **SMALL, **extra, **changes
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name or "bias" in name else 0.05)
    folder = tmp_path / family
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_upcycled_model_computes_the_dense_models_logits(tmp_path, family, tie):
    folder, dense = dense_folder(tmp_path, family, tie=tie)
    moe, tokenizer = upcycle(read_dense(folder), experts=4, top_k=2)
    assert moe.cfg.n_experts == 4 and moe.cfg.top_k == 2 and moe.cfg.renormalize_topk
    assert moe.cfg.qk_norm == (family == "qwen3") and moe.cfg.attention_bias == (family == "qwen2")
    assert moe.cfg.head_dim == (24 if family == "qwen3" else 16)
    experts = moe.layers[1].moe.experts
    assert all(torch.equal(experts[0].w1, e.w1) for e in experts)  # each a copy of the dense MLP
    assert not torch.equal(moe.layers[0].moe.router.weight, moe.layers[1].moe.router.weight)
    tokens = torch.randint(0, tokenizer.get_vocab_size(), (2, 48))
    with torch.no_grad():
        ours, theirs = moe(tokens).logits, dense(tokens).logits
    relative = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert relative <= TOLERANCE, relative


def test_the_upcycled_checkpoint_loads_and_keeps_the_tokenizer(tmp_path):
    folder, _ = dense_folder(tmp_path, "qwen3")
    moe, tokenizer = upcycle(read_dense(folder), experts=2, top_k=1)
    checkpoint = write_upcycled(moe, tokenizer, folder, tmp_path / "moe")
    saved = load_saved(tmp_path / "moe")
    assert saved.path == checkpoint and saved.config == moe.cfg
    assert saved.tokenizer.to_str() == tokenizer.to_str()
    tokens = torch.randint(0, 200, (1, 32))
    with torch.no_grad():
        assert torch.equal(saved.model()(tokens).logits, moe(tokens).logits)
    with pytest.raises(ConfigError, match="not an empty folder"):
        write_upcycled(moe, tokenizer, folder, tmp_path / "moe")


def test_a_tokenizer_without_our_end_of_text_token_gets_one(tmp_path):
    """Documents are separated by <|endoftext|>: a Llama tokenizer (</s>) gains it, and the embedding and
    head a row for it; the dense model's tokens compute as before."""
    folder, dense = dense_folder(tmp_path, "llama", eos="</s>")
    moe, tokenizer = upcycle(read_dense(folder), experts=2, top_k=2)
    vocab = dense.config.vocab_size
    assert tokenizer.token_to_id(EOS) == vocab and moe.cfg.vocab_size == vocab + 1
    tokens = torch.randint(0, vocab, (1, 32))
    with torch.no_grad():
        ours, theirs = moe(tokens).logits[..., :vocab], dense(tokens).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= TOLERANCE


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("llama", {"hidden_act": "gelu"}, "activation is 'gelu'"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "scales RoPE"),
        ("llama", {"attention_bias": True}, "o_proj.bias"),
        ("llama", {"mlp_bias": True}, "MLP biases"),
    ],
)
def test_what_our_model_cannot_compute_is_refused(tmp_path, family, changes, message):
    folder, _ = dense_folder(tmp_path, family, **changes)
    with pytest.raises(ConfigError, match=message):
        upcycle(read_dense(folder), experts=2, top_k=1)


def test_spes_upcycle_then_generate(tmp_path):
    folder, _ = dense_folder(tmp_path, "qwen3")
    runner = CliRunner()
    result = runner.invoke(
        spes, ["upcycle", "--from", str(folder), "--experts", "4", "--out", str(tmp_path / "moe")]
    )
    assert result.exit_code == 0, result.output
    assert "4 experts" in result.output and "--new-swarm --init" in result.output
    meta = json.loads(next((tmp_path / "moe" / "checkpoints").iterdir()).joinpath("meta.json").read_text())
    assert meta["upcycled_from"] == str(folder) and meta["model_config"]["n_experts"] == 4
    args = ["generate", "--checkpoint", str(tmp_path / "moe"), "--prompt", "a dense", "--max-tokens", "5"]
    result = runner.invoke(spes, [*args, "--greedy"])
    assert result.exit_code == 0 and "\na dense" in result.output, result.output
    missing = runner.invoke(
        spes, ["upcycle", "--from", str(tmp_path), "--experts", "2", "--out", str(tmp_path / "x")]
    )
    assert missing.exit_code != 0 and "config.json is missing" in missing.output


def lying_holder(net: MemoryNetwork, founder: Peer) -> SwarmMember:
    """A peer of the founder's manifest that claims units and serves random weights as the initial ones."""
    transport = net.join("liar")
    member = SwarmMember(transport, founder.manifest, member_config(founder.settings))
    member.join(first_round=0)

    def weights(caller: str, request: bytes) -> bytes:
        unit = WeightsRequest.decode(request).unit
        noise = {n: torch.randn_like(t) for n, t in founder.local.read(unit).items()}
        return encode(noise, CODECS["none"], meta=payload_meta(unit, -1, "weights"))

    transport.serve(RPC_WEIGHTS, weights, max_request_bytes=1024)
    return member


def test_a_swarm_founded_from_an_upcycled_model_hands_it_to_a_newcomer(tmp_path):
    """The founder starts from the checkpoint (--init); the manifest records its config and fingerprint; a
    newcomer adopts the config, builds a model of that shape and downloads the weights from the founder."""
    folder, _ = dense_folder(tmp_path, "qwen3")
    moe, tokenizer = upcycle(read_dense(folder), experts=4, top_k=2)
    write_upcycled(moe, tokenizer, folder, tmp_path / "moe")
    net = MemoryNetwork(seed=0)
    swarm = {"model.shards": 2, "model.dense_blocks": 2, "method.overlap": False}
    mine = {"train.seq_len": 64, "data.max_corpus_mb": 0.2}
    founding = Settings().override(
        {"run.new_swarm": True, "model.init": str(tmp_path / "moe"), **swarm, **mine}
    )
    founder = Peer(founded_from(founding), net.join("founder"))
    newcomer = None
    try:
        founder.join()
        assert founder.manifest.model == moe.cfg.to_dict()
        liar = lying_holder(net, founder)
        transport = net.join("newcomer")
        admission = admit(Settings().override(mine), transport, threading.Event())
        assert Path(admission.settings.data.tokenizer).read_bytes() == tokenizer.to_str().encode()
        newcomer = Peer(admission.settings, transport, admission=admission)
        assert newcomer.initial_units != founder.manifest.initial_units  # (seeded, not --init)
        newcomer.join()  # (it checks each downloaded unit against the manifest's fingerprint)
        assert newcomer.local.model.cfg == moe.cfg
        # the liar, the only holder of some units, served its own weights first: refused, and the founder
        # asked next (it used to lock newcomers out until the swarm trained)
        assert liar.units_held and transport.guard.rejections["liar"] >= 1
        ours = moe.state_dict()
        for unit in newcomer.member.units_held:  # (the others it now holds as frozen int8 copies)
            assert all(torch.equal(ours[name], t) for name, t in newcomer.local.read(unit).items()), unit
    finally:
        for peer in (newcomer, founder):
            if peer is not None:
                peer.close()


def test_init_founds_a_swarm_and_fixes_the_models_shape(tmp_path):
    folder, _ = dense_folder(tmp_path, "llama")
    moe, tokenizer = upcycle(read_dense(folder), experts=2, top_k=1)
    write_upcycled(moe, tokenizer, folder, tmp_path / "moe")
    with pytest.raises(ConfigError, match="add --new-swarm"):
        founded_from(Settings().override({"model.init": str(tmp_path / "moe")}))
    with pytest.raises(ConfigError, match="experts cannot change a model founded from --init"):
        Settings().override({"run.new_swarm": True, "model.init": str(tmp_path / "moe"), "model.experts": 4})
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        founded_from(Settings().override({"run.new_swarm": True, "model.init": str(tmp_path)}))
