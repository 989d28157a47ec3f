"""A dense transformers checkpoint (Llama, Qwen2 or Qwen3 family) turned into our MoE: sparse upcycling.

Attention, norms, embedding and head are copied; every layer's MLP becomes ``experts`` copies of itself, and
the router picks ``top_k`` of them with weights renormalized to sum to 1, so whatever the router says (it
starts as small random numbers) a token's output is exactly the dense MLP's: at initialization the MoE
computes the dense model's function. The experts part as training routes other tokens to each.

The folder is read as it lies on disk (``config.json``, ``model.safetensors`` or its sharded index,
``tokenizer.json``), without transformers. What our model cannot compute is refused in one line: RoPE
scaling, sliding-window attention, an activation other than SiLU, biases outside the query, key and value
projections.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import AddedToken, Tokenizer

from spes_p2p.data.corpus import EOS
from spes_p2p.errors import ConfigError
from spes_p2p.files import new_folder
from spes_p2p.model.config import ModelConfig
from spes_p2p.model.transformer import MoETransformer
from spes_p2p.train.checkpoint import list_checkpoints, save_checkpoint

FAMILIES = ("llama", "qwen2", "qwen3")  # transformers' model_type of the dense models we read
# a dense model's parameter name -> ours (the MLP's become the experts', below)
_NAMES = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.attn.\2.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias", r"layers.\1.attn.\2_bias"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.moe_norm.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight")
_EXPERT_WEIGHT = {"gate": "w1", "up": "w3", "down": "w2"}  # stored transposed: (D, F) and (F, D)


@dataclass
class Dense:
    """A dense checkpoint as read from its folder."""

    folder: Path
    config: dict  # its config.json
    weights: dict[str, torch.Tensor]  # float32
    tokenizer: Tokenizer


def read_dense(folder: Path) -> Dense:
    folder = Path(folder)
    config = _read_json(folder / "config.json")
    _check_supported(folder, config)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"{folder} has no tokenizer.json: download the model's tokenizer files too")
    return Dense(folder, config, _read_weights(folder), Tokenizer.from_file(str(tokenizer_file)))


def upcycle(dense: Dense, experts: int, top_k: int, seed: int = 0) -> tuple[MoETransformer, Tokenizer]:
    """The MoE whose every expert is a copy of the dense MLP of its layer, and its tokenizer (the dense
    model's, with our end-of-text token added when it has none)."""
    weights, tokenizer = dict(dense.weights), dense.tokenizer
    vocab = dense.config.get("vocab_size", 0)
    if tokenizer.token_to_id(EOS) is None:  # documents are separated by our end-of-text token
        tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
        vocab = max(vocab, tokenizer.token_to_id(EOS) + 1)
    config = _moe_config(dense, vocab, experts, top_k)
    if "lm_head.weight" not in weights:  # tied: the head is the embedding, copied (ours are untied)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    ours = _renamed(weights, config)
    for name in ("embed.weight", "lm_head.weight"):  # rows for the added end-of-text token: the mean row
        table = ours[name]
        if table.shape[0] < vocab:
            extra = table.mean(0, keepdim=True).expand(vocab - table.shape[0], -1)
            ours[name] = torch.cat([table, extra])
    generator = torch.Generator().manual_seed(seed)
    for i in range(config.n_layers):
        noise = torch.randn(experts, config.d_model, generator=generator) * config.init_std
        ours[f"layers.{i}.moe.router.weight"] = noise
    with torch.device("meta"):
        model = MoETransformer(config)
    try:
        model.load_state_dict(ours, assign=True)
    except RuntimeError as exc:  # a weight of another shape than its config says, or one missing
        problem = str(exc).splitlines()[-1].strip()
        raise ConfigError(
            f"{dense.folder} does not hold the model its config.json describes: {problem}"
        ) from None
    return model.eval(), tokenizer


def _moe_config(dense: Dense, vocab: int, experts: int, top_k: int) -> ModelConfig:
    c, weights = dense.config, dense.weights
    try:
        return ModelConfig(
            vocab_size=vocab,
            d_model=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_size=c.get("head_dim") or 0,
            n_experts=experts,
            top_k=top_k,
            expert_dim=c["intermediate_size"],
            max_seq_len=c.get("max_position_embeddings", 2048),
            rope_theta=_rope_theta(c),
            norm_eps=c.get("rms_norm_eps", 1e-6),
            init_std=c.get("initializer_range", 0.02),
            renormalize_topk=True,  # what makes every router give the dense MLP's output
            qk_norm="model.layers.0.self_attn.q_norm.weight" in weights,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        )
    except KeyError as exc:
        raise ConfigError(f"{dense.folder / 'config.json'} has no {exc.args[0]!r}") from None


def write_upcycled(model: MoETransformer, tokenizer: Tokenizer, source: Path, out: Path) -> Path:
    """Saves the upcycled model as a run folder whose one checkpoint (step 0) spes reads anywhere a
    checkpoint is asked for: ``spes-join --new-swarm --init``, ``spes generate``, ``spes export``."""
    out = new_folder(out, "the model")
    meta = {"model_config": model.cfg.to_dict(), "upcycled_from": str(source), "tokens": 0}
    extra = {"tokenizer.json": tokenizer.to_str().encode()}
    save_checkpoint(out, 0, model, None, meta, extra_files=extra)
    return list_checkpoints(out)[-1]


def _renamed(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    ours = {}
    for name, tensor in weights.items():
        mlp = _MLP.fullmatch(name)
        if mlp:
            layer, which = mlp.groups()
            for e in range(config.n_experts):
                ours[f"layers.{layer}.moe.experts.{e}.{_EXPERT_WEIGHT[which]}"] = tensor.T.contiguous()
            continue
        for pattern, replacement in _NAMES:
            if re.fullmatch(pattern, name):
                ours[re.sub(pattern, replacement, name)] = tensor
                break
        else:
            raise ConfigError(f"cannot upcycle weight {name!r}: our model has nothing to hold it")
    return ours


def _check_supported(folder: Path, c: dict) -> None:
    family = c.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"{folder} holds a {family!r} model; spes upcycle reads {', '.join(FAMILIES)}")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{folder}: the MLP's activation is {act!r}; our experts are SwiGLU (silu)")
    scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"{folder} scales RoPE ({kind!r}), which our model does not: pick a model without")
    if c.get("use_sliding_window"):
        raise ConfigError(f"{folder} uses sliding-window attention; our model attends to the whole sequence")
    if c.get("mlp_bias"):
        raise ConfigError(f"{folder} has MLP biases; our experts have none")


def _rope_theta(c: dict) -> float:
    """RoPE's base: ``rope_theta``, or (as transformers 5 writes it) ``rope_parameters.rope_theta``."""
    return float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta") or 10_000.0)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(
            f"{folder} has no model.safetensors (nor its index): spes upcycle reads safetensors"
        )
    weights = {}
    for name in files:
        try:
            with safe_open(folder / name, framework="pt") as f:
                for key in f.keys():
                    weights[key] = f.get_tensor(key).float()
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"{folder / name} cannot be read: {exc}") from None
    return weights


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: name a transformers model folder") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not valid JSON") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return value
