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
from spes_p2p.model.quant import QuantizedTensor, frozen_matmul


class SwiGLUExpert(nn.Module):
    """One expert: w2(silu(x w1) * (x w3)).

    A frozen expert can be held quantized (``quantize_``): its weights then leave the module's parameters and
    live in ``self.quantized``, under the same names; ``state_dict`` and ``load_state_dict`` still read and
    write them in full precision, so checkpoints do not depend on how a peer holds its frozen copies.
    """

    WEIGHTS = ("w1", "w3", "w2")

    def __init__(self, d_model: int, expert_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(d_model, expert_dim))  # gate, (D, F)
        self.w3 = nn.Parameter(torch.empty(d_model, expert_dim))  # up, (D, F)
        self.w2 = nn.Parameter(torch.empty(expert_dim, d_model))  # down, (F, D)
        self.quantized: dict[str, QuantizedTensor] = {}

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self._matmul(F.silu(self._matmul(x_ND, "w1")) * self._matmul(x_ND, "w3"), "w2")

    def _matmul(self, x: torch.Tensor, name: str) -> torch.Tensor:
        q = self.quantized.get(name)
        return x @ getattr(self, name) if q is None else frozen_matmul(x, q)

    # ------------------------------------------------------------------------ quantized frozen copies

    def quantize_(self, kind: str) -> None:
        """Holds the weights as ``kind`` (int8 or nf4) codes; they stop being parameters."""
        if self.quantized and next(iter(self.quantized.values())).kind == kind:
            return
        weights = {name: self.get_weight(name) for name in self.WEIGHTS}
        for name in self.WEIGHTS:
            if name in self._parameters:
                delattr(self, name)
            self.quantized[name] = QuantizedTensor.quantize(weights[name], kind)

    def dequantize_(self) -> None:
        """Back to full-precision (frozen) parameters, e.g. when this peer starts training the expert."""
        for name, q in list(self.quantized.items()):
            self.register_parameter(name, nn.Parameter(q.dequantize(), requires_grad=False))
        self.quantized.clear()

    def get_weight(self, name: str) -> torch.Tensor:
        q = self.quantized.get(name)
        return getattr(self, name).detach() if q is None else q.dequantize()

    @torch.no_grad()
    def set_weight(self, name: str, value: torch.Tensor) -> None:
        q = self.quantized.get(name)
        if q is None:
            getattr(self, name).copy_(value)
        else:
            self.quantized[name] = QuantizedTensor.quantize(value, q.kind)

    def weight_shape(self, name: str) -> torch.Size:
        q = self.quantized.get(name)
        return getattr(self, name).shape if q is None else q.shape

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, q in self.quantized.items():
            destination[prefix + name] = q.dequantize()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        for name in self.quantized:
            key = prefix + name
            if key not in state_dict:
                missing.append(key)
                continue
            if key in unexpected:
                unexpected.remove(key)
            if tuple(state_dict[key].shape) != tuple(self.quantized[name].shape):
                errors.append(f"size mismatch for {key}: {tuple(state_dict[key].shape)}")
                continue
            self.set_weight(name, state_dict[key])


class Router(nn.Module):
    """Softmax over expert logits, then the top-k experts per token."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))  # (E, D)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights_TK, experts_TK, probs_TE, logits_TE); probabilities are computed in fp32."""
        logits_TE = (x_TD @ self.weight.t()).float()
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
