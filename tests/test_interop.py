"""The model outside spes: a checkpoint exported as a transformers folder loads with AutoModelForCausalLM and
AutoTokenizer and computes the same logits as spes (fp32), and text sampled from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from spes_cli.main import spes

from spes_p2p.data.corpus import EOS, Document
from spes_p2p.data.tokenizer import train_tokenizer
from spes_p2p.errors import CheckpointError, ConfigError
from spes_p2p.interop.hf_export import export_hf
from spes_p2p.interop.saved import load_saved
from spes_p2p.model.config import get_preset
from spes_p2p.model.sampling import Sampling, generate
from spes_p2p.model.transformer import MoETransformer
from spes_p2p.train.checkpoint import save_checkpoint

transformers = pytest.importorskip("transformers")

TEXT = (
    "the swarm trains experts; each peer holds a shard and syncs with the holders of the same experts. " * 40
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([Document("a", TEXT), Document("b", TEXT.upper())], 300)


def checkpoint(tmp_path, tokenizer, with_tokenizer=True, **changes):
    """A tiny model's checkpoint, its weights drawn at random (every norm and router too, not just ones)."""
    config = get_preset("tiny").replace(vocab_size=tokenizer.get_vocab_size(), **changes)
    torch.manual_seed(0)
    model = MoETransformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("_bias"):
                p.normal_(0.0, 0.1)
    meta = {"model_config": config.to_dict(), "tokens": 0}
    extra = {"tokenizer.json": tokenizer.to_str().encode()} if with_tokenizer else {}
    return save_checkpoint(tmp_path / "run", 7, model, None, meta, extra_files=extra), model


@pytest.mark.parametrize(
    ("changes", "architecture"),
    [
        ({}, "Qwen3MoeForCausalLM"),
        (
            {"n_kv_heads": 2, "renormalize_topk": True, "rope_theta": 5e5, "norm_eps": 1e-6},
            "Qwen3MoeForCausalLM",
        ),
        ({"head_size": 24, "attention_bias": True}, "Qwen3MoeForCausalLM"),  # (as upcycled from Qwen3)
        ({"qk_norm": False, "renormalize_topk": True}, "Qwen2MoeForCausalLM"),  # (from Llama)
        ({"qk_norm": False, "attention_bias": True, "n_kv_heads": 2}, "Qwen2MoeForCausalLM"),  # (Qwen2)
    ],
    ids=["tiny", "gqa-renormalized-rope5e5", "wide-heads-biases", "no-qk-norm", "no-qk-norm-biases"],
)
def test_an_exported_checkpoint_computes_the_same_logits_in_transformers(
    tmp_path, tokenizer, changes, architecture
):
    path, model = checkpoint(tmp_path, tokenizer, **changes)
    out, written = export_hf(load_saved(path), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == written == architecture
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "each peer holds a shard"
    ids = hf_tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.encode(text).ids
    tokens = torch.cat([ids, torch.randint(0, tokenizer.get_vocab_size(), (1, 40))], dim=1)
    with torch.no_grad():
        ours, theirs = model.eval()(tokens).logits, hf(tokens).logits
    relative = ((ours - theirs).abs().max() / ours.abs().max()).item()
    assert relative <= 1e-4, relative
    assert hf_tokenizer.decode(ids[0]) == text


def test_export_refuses_a_folder_that_holds_files_and_a_checkpoint_without_a_tokenizer(tmp_path, tokenizer):
    path, _ = checkpoint(tmp_path, tokenizer)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_hf(load_saved(path), taken)
    assert (taken / "notes.txt").read_text() == "mine"
    bare, _ = checkpoint(
        tmp_path / "bare", tokenizer, with_tokenizer=False
    )  # (as swarm peers wrote before they kept the tokenizer)
    with pytest.raises(ConfigError, match="pass --tokenizer FILE"):
        load_saved(bare)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_saved(bare, tmp_path / "tokenizer.json").tokenizer.to_str() == tokenizer.to_str()


def test_greedy_generation_is_what_transformers_generates_and_sampling_follows_its_seed(tmp_path, tokenizer):
    path, _ = checkpoint(tmp_path, tokenizer)
    saved = load_saved(path)
    model = saved.model()
    prompt = tokenizer.encode("each peer holds").ids
    greedy = list(generate(model, prompt, Sampling(max_tokens=12, temperature=0), stop=None))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(saved, tmp_path / "hf")[0]).eval()
    expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
    assert greedy == expected[0, len(prompt) :].tolist()
    assert list(generate(model, prompt, Sampling(12, temperature=1.0, top_p=1e-6), None)) == greedy
    sampled = [list(generate(model, prompt, Sampling(12, temperature=1.5, seed=s), None)) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_spes_export_and_generate_on_the_command_line(tmp_path, tokenizer):
    path, _ = checkpoint(tmp_path, tokenizer)
    result = CliRunner().invoke(
        spes, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "Qwen3MoeForCausalLM" in result.output
    assert "spes-p2p[hf]" in " ".join(result.output.split())  # (the extra's name, not eaten as markup)
    again = CliRunner().invoke(spes, ["export", "--checkpoint", str(path), "--out", str(tmp_path / "hf")])
    assert again.exit_code == 1 and "not an empty folder" in again.output
    args = ["generate", "--checkpoint", str(path), "--prompt", "each peer", "--max-tokens", "8", "--greedy"]
    result = CliRunner().invoke(spes, args)
    assert result.exit_code == 0, result.output
    eos = tokenizer.token_to_id(EOS)
    prompt = [eos, *tokenizer.encode("each peer").ids]
    continuation = tokenizer.decode(list(generate(load_saved(path).model(), prompt, Sampling(8, 0.0), eos)))
    assert result.output.endswith("each peer" + continuation + "\n")
    bad = CliRunner().invoke(spes, [*args, "--top-p", "0"])
    assert bad.exit_code == 2 and "top-p" in bad.output


def test_a_peer_run_folder_gives_its_newest_model_the_one_written_on_leaving_or_a_later_checkpoint(
    tmp_path, tokenizer
):
    from spes_p2p.peer.outputs import RunOutputs

    config = get_preset("tiny").replace(vocab_size=tokenizer.get_vocab_size())
    models = [MoETransformer(config) for _ in range(3)]
    outputs = RunOutputs(tmp_path / "peer", tokenizer.to_str().encode())
    position = {"model_config": config.to_dict()}
    outputs.checkpoint(models[0], None, 40, {**position, "round": 2})
    outputs.finish(models[1], {**position, "round": 5, "step": 100})
    saved = load_saved(tmp_path / "peer")
    assert saved.round == 5 and saved.path == tmp_path / "peer"
    assert torch.equal(saved.weights["lm_head.weight"], models[1].lm_head.weight)
    outputs.checkpoint(models[2], None, 120, {**position, "round": 6})  # (it came back, and went on)
    saved = load_saved(tmp_path / "peer")
    assert saved.round == 6 and torch.equal(saved.weights["lm_head.weight"], models[2].lm_head.weight)


def test_weights_that_do_not_fit_their_config_are_refused_in_one_line(tmp_path, tokenizer):
    path, _ = checkpoint(tmp_path, tokenizer)
    saved = load_saved(path)
    saved.weights["lm_head.weight"] = saved.weights["lm_head.weight"][:-1]
    with pytest.raises(CheckpointError, match="does not hold the model its config describes") as refused:
        saved.model()
    assert "\n" not in str(refused.value)
