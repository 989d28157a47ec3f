"""The mixture-of-experts feed-forward layer: top-k softmax router, SwiGLU experts, grouped dispatch.

Shape letters used in tensor names:
    T tokens (batch x sequence, flattened)   D model dim   F expert hidden dim
    E experts   K experts per token (top-k)   N routed (token, expert) pairs = T * K

Each expert owns its own parameters, so a peer can freeze any subset of experts (SPES trains a shard of
experts per peer) and pay gradients and optimizer state only for the experts it owns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spes_p2p.model.config import ModelConfig
from spes_p2p.model.quant import QuantizedWeights


class SwiGLUExpert(QuantizedWeights):
    """One expert: w2(silu(x w1) * (x w3)). A frozen expert can be held quantized (``quantize_``)."""

    WEIGHTS = ("w1", "w3", "w2")

    def __init__(self, d_model: int, expert_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(d_model, expert_dim))  # gate, (D, F)
        self.w3 = nn.Parameter(torch.empty(d_model, expert_dim))  # up, (D, F)
        self.w2 = nn.Parameter(torch.empty(expert_dim, d_model))  # down, (F, D)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.matmul(F.silu(self.matmul(x_ND, "w1")) * self.matmul(x_ND, "w3"), "w2")


class Router(QuantizedWeights):
    """Softmax over expert logits, then the top-k experts per token. In a frozen dense block its weight may
    be held quantized (``quantize_``) when it is large enough."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))  # (E, D)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights_TK, experts_TK, probs_TE, logits_TE); probabilities are computed in fp32."""
        logits_TE = self.matmul(x_TD, "weight", transposed=True).float()
        probs_TE = logits_TE.softmax(dim=-1)
        weights_TK, experts_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, experts_TK, probs_TE, logits_TE


class MoE(nn.Module):
    """Routes every token to its top-k experts and sums their outputs weighted by the router."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.router = Router(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.renormalize_topk)
        self.experts = nn.ModuleList(SwiGLUExpert(cfg.d_model, cfg.expert_dim) for _ in range(cfg.n_experts))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns the layer output and its auxiliary losses (load balance, router z-loss)."""
        weights_TK, experts_TK, probs_TE, logits_TE = self.router(x_TD)
        y_TD = self.dispatch(x_TD, weights_TK, experts_TK)
        return y_TD, self.aux_losses(experts_TK, probs_TE, logits_TE)

    def dispatch(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
    ) -> torch.Tensor:
        """Groups the routed (token, expert) pairs by expert, runs each expert once on its group."""
        top_k = experts_TK.shape[1]
        expert_N = experts_TK.reshape(-1)
        order_N = expert_N.argsort(stable=True)
        token_N = order_N // top_k  # the token behind each expert-sorted pair
        counts = torch.bincount(expert_N, minlength=self.n_experts).tolist()
        groups = x_TD[token_N].split(counts)
        outputs = [self.experts[e](group) for e, group in enumerate(groups) if counts[e]]
        y_ND = torch.cat(outputs) * weights_TK.reshape(-1)[order_N, None].to(x_TD.dtype)
        return torch.zeros_like(x_TD).index_add_(0, token_N, y_ND)

    def aux_losses(
        self, experts_TK: torch.Tensor, probs_TE: torch.Tensor, logits_TE: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        # Switch-style balance loss over all experts: E * sum_e (share of routed pairs) * (mean router prob).
        share_E = (
            torch.bincount(experts_TK.reshape(-1), minlength=self.n_experts).float() / experts_TK.numel()
        )
        load_balance = self.n_experts * (share_E * probs_TE.mean(dim=0)).sum()
        router_z = torch.logsumexp(logits_TE, dim=-1).square().mean()
        return {"load_balance": load_balance, "router_z": router_z}
