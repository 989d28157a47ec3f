"""A trained model as a Hugging Face transformers folder: ``config.json``, ``model.safetensors``, the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and ``generation_config.json``.

Our architecture is exactly transformers' **Qwen3-MoE** (``Qwen3MoeForCausalLM``): pre-norm RMSNorm, RoPE
rotating the two halves of each head, QK-norm over each head, a softmax router over all experts whose top-k
probabilities are used as they are (``norm_topk_prob`` false; ``renormalize_topk`` sets it), SwiGLU experts
in every layer, no biases, untied embedding and head. OLMoE (``OlmoeForCausalLM``), whose recipe we train
by, differs in one place: its QK-norm normalizes all heads' queries (and keys) together, one RMSNorm over
``n_heads x head_dim``, where ours normalizes each head alone; so OLMoE's class would compute another
function with our weights.

A model upcycled from Llama or Qwen2 has no QK-norm: Qwen3-MoE cannot leave it out, so such a model is
written as **Qwen2-MoE** (``Qwen2MoeForCausalLM``), the same but for QK-norm, with query, key and value
biases when the model has them, and a shared expert that Qwen2-MoE always adds: written as zeros, it adds
exactly nothing. The weights are written in the per-expert layout of the checkpoints on the Hugging Face
hub (``mlp.experts.<e>.gate_proj.weight``), which every transformers version since 4.51 reads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from spes_p2p.data.corpus import EOS
from spes_p2p.errors import ConfigError
from spes_p2p.files import new_folder
from spes_p2p.interop.saved import SavedModel
from spes_p2p.model.config import ModelConfig

QWEN3_MOE = ("Qwen3MoeForCausalLM", "qwen3_moe")  # (architecture, model type): a model with QK-norm
QWEN2_MOE = ("Qwen2MoeForCausalLM", "qwen2_moe")  # without
# our parameter name -> transformers', and whether the matrix is stored the other way round
_NAMES = [
    (r"embed\.weight", r"model.embed_tokens.weight", False),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight", False),
    (
        r"layers\.(\d+)\.attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight",
        r"model.layers.\1.self_attn.\2.weight",
        False,
    ),
    (r"layers\.(\d+)\.attn\.(q|k|v)_bias", r"model.layers.\1.self_attn.\2_proj.bias", False),
    (r"layers\.(\d+)\.moe_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight", False),
    (r"layers\.(\d+)\.moe\.router\.weight", r"model.layers.\1.mlp.gate.weight", False),
    (r"layers\.(\d+)\.moe\.experts\.(\d+)\.w1", r"model.layers.\1.mlp.experts.\2.gate_proj.weight", True),
    (r"layers\.(\d+)\.moe\.experts\.(\d+)\.w3", r"model.layers.\1.mlp.experts.\2.up_proj.weight", True),
    (r"layers\.(\d+)\.moe\.experts\.(\d+)\.w2", r"model.layers.\1.mlp.experts.\2.down_proj.weight", True),
    (r"norm\.weight", r"model.norm.weight", False),
    (r"lm_head\.weight", r"lm_head.weight", False),
]


def hf_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under transformers' names and layouts, with the zeros the class adds (see above)."""
    out = {}
    for name, tensor in weights.items():
        for pattern, replacement, transposed in _NAMES:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, replacement, name)] = (tensor.T if transposed else tensor).contiguous()
                break
        else:
            raise ConfigError(f"no transformers name for parameter {name!r}")
    d = config.d_model
    for i in range(config.n_layers):
        layer = f"model.layers.{i}"
        if config.qk_norm and config.attention_bias:  # (Qwen3-MoE's biases include the output's)
            out[f"{layer}.self_attn.o_proj.bias"] = torch.zeros(d)
        if not config.qk_norm:  # Qwen2-MoE's shared expert, of width 1, whose output is zero
            for name, shape in (("gate_proj", (1, d)), ("up_proj", (1, d)), ("down_proj", (d, 1))):
                out[f"{layer}.mlp.shared_expert.{name}.weight"] = torch.zeros(shape)
            out[f"{layer}.mlp.shared_expert_gate.weight"] = torch.zeros(1, d)
    return out


def hf_config(config: ModelConfig, eos_id: int) -> dict:
    if config.qk_norm:
        architecture, model_type = QWEN3_MOE
        differs = {"attention_bias": config.attention_bias}
    else:
        architecture, model_type = QWEN2_MOE
        differs = {"qkv_bias": config.attention_bias, "shared_expert_intermediate_size": 1}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "num_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "moe_intermediate_size": config.expert_dim,
        "intermediate_size": config.expert_dim,  # (a dense MLP's, which no layer has)
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": config.renormalize_topk,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_seq_len,
        **differs,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": config.init_std,
        "router_aux_loss_coef": config.load_balance_coef,
        "output_router_logits": False,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def export_hf(saved: SavedModel, out: Path) -> tuple[Path, str]:
    """Writes ``saved`` as a transformers folder at ``out``, which must not exist or be empty; the files
    are written beside it first and moved into place whole. Returns the folder and its transformers class."""
    out = new_folder(out, "the export")
    eos_id = saved.tokenizer.token_to_id(EOS)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": saved.config.max_seq_len,
    }
    files = {
        "config.json": hf_config(saved.config, eos_id),
        "generation_config.json": {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False},
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": {"eos_token": EOS, "pad_token": EOS},
    }
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    (tmp / "tokenizer.json").write_text(saved.tokenizer.to_str())
    metadata = {"format": "pt", "spes_checkpoint": str(saved.path)}
    save_file(hf_weights(saved.weights, saved.config), tmp / "model.safetensors", metadata=metadata)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out, files["config.json"]["architectures"][0]
