"""An OLMoE-style decoder-only transformer in plain single-device torch.

RMSNorm (pre-norm), rotary position embeddings, QK-norm, causal attention through
``scaled_dot_product_attention``, an MoE feed-forward in every layer, untied embedding and lm_head. A model
upcycled from a dense one keeps that one's attention: without QK-norm (Llama, Qwen2), with query, key and
value biases (Qwen2), with heads of their own width (Qwen3). The large
weights of a frozen copy (an expert, a dense block this peer does not train) may be held quantized
(``quant.py``).

Shape letters: B batch, S sequence, D model dim, H heads, G kv heads, Hd head dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spes_p2p.model.config import ModelConfig
from spes_p2p.model.moe import MoE
from spes_p2p.model.quant import QuantizedWeights, frozen_matmul, quantized_numel


class Linear(QuantizedWeights, nn.Linear):
    """A bias-free linear layer whose weight may be held quantized in a frozen dense block."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized.get("weight")
        return super().forward(x) if q is None else frozen_matmul(x, q, transposed=True)


class Embedding(QuantizedWeights, nn.Embedding):
    """A token embedding whose table may be held quantized in a frozen dense block: a lookup then decodes
    only the rows it reads."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # (see MoETransformer.reset_parameters)
            super().reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q = self.quantized.get("weight")
        return super().forward(tokens) if q is None else q.rows(tokens)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_len, head_dim / 2); on the CPU, where a model is built (and on the meta
    device too, where a model built for its shapes alone would import torch's compiler to compute them)."""
    cpu = torch.device("cpu")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64, device=cpu), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_BHSHd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the two halves of each head dim (GPT-NeoX layout)."""
    x1, x2 = x_BHSHd.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_BHSHd.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.k_proj = Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
        self.v_proj = Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model)
        if cfg.attention_bias:  # (parameters of their own: a frozen projection's weight may be quantized)
            self.q_bias = nn.Parameter(torch.zeros(cfg.n_heads * cfg.head_dim))
            self.k_bias = nn.Parameter(torch.zeros(cfg.kv_heads * cfg.head_dim))
            self.v_bias = nn.Parameter(torch.zeros(cfg.kv_heads * cfg.head_dim))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        # QK-norm keeps attention logits bounded, which OLMoE found stabilizes MoE training
        norm = (lambda: RMSNorm(cfg.head_dim, cfg.norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BSHHd = _biased(self.q_proj(x_BSD), self.q_bias).view(B, S, self.n_heads, self.head_dim)
        k_BSGHd = _biased(self.k_proj(x_BSD), self.k_bias).view(B, S, self.n_kv, self.head_dim)
        v_BSGHd = _biased(self.v_proj(x_BSD), self.v_bias).view(B, S, self.n_kv, self.head_dim)
        q_BHSHd, k_BGSHd = self.q_norm(q_BSHHd).transpose(1, 2), self.k_norm(k_BSGHd).transpose(1, 2)
        v_BGSHd = v_BSGHd.transpose(1, 2)
        q_BHSHd, k_BGSHd = apply_rope(q_BHSHd, cos, sin), apply_rope(k_BGSHd, cos, sin)
        out_BHSHd = F.scaled_dot_product_attention(
            q_BHSHd, k_BGSHd, v_BGSHd, is_causal=True, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(out_BHSHd.transpose(1, 2).reshape(B, S, -1))


def _biased(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos, sin)
        y_TD, aux = self.moe(self.moe_norm(x_BSD).flatten(0, 1))
        return x_BSD + y_TD.view_as(x_BSD), aux


@dataclass
class LMOutput:
    logits: torch.Tensor  # (B, S, V)
    loss: torch.Tensor | None = None  # the training objective: ce + weighted auxiliary losses
    parts: dict[str, torch.Tensor] | None = None  # unweighted: ce, load_balance, router_z, logit_z


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        # residual-branch outputs are scaled down with depth, as in GPT-2 and OLMo
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.is_meta:  # shapes only: normal_ on the meta device would import torch's compiler (~70 MB)
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("_bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", ".w2")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None) -> LMOutput:
        S = tokens_BS.shape[1]
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        x_BSD = self.embed(tokens_BS)
        aux_sums: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            x_BSD, aux = layer(x_BSD, cos, sin)
            for key, value in aux.items():
                aux_sums[key] = aux_sums.get(key, 0.0) + value
        logits_BSV = self.lm_head(self.norm(x_BSD))
        if targets_BS is None:
            return LMOutput(logits_BSV)
        parts = {key: value / len(self.layers) for key, value in aux_sums.items()}
        logits_NV = logits_BSV.flatten(0, 1).float()
        parts["ce"] = F.cross_entropy(logits_NV, targets_BS.flatten())
        parts["logit_z"] = torch.logsumexp(logits_NV, dim=-1).square().mean()
        loss = (
            parts["ce"]
            + self.cfg.load_balance_coef * parts["load_balance"]
            + self.cfg.router_z_coef * parts["router_z"]
            + self.cfg.logit_z_coef * parts["logit_z"]
        )
        return LMOutput(logits_BSV, loss, parts)

    def num_params(self) -> int:
        """Every weight, quantized frozen copies included."""
        return sum(p.numel() for p in self.parameters()) + quantized_numel(self)

    def num_active_params(self) -> int:
        """Parameters used per token: everything but the experts a token is not routed to."""
        expert = self.layers[0].moe.experts[0]
        per_expert = sum(expert.weight_shape(name).numel() for name in expert.WEIGHTS)
        unused = self.cfg.n_layers * (self.cfg.n_experts - self.cfg.top_k) * per_expert
        return self.num_params() - unused
