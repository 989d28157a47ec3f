"""Expert-merging warm-up (SPES): early on, pull each expert toward its most similar peers.

At sync steps where ``step % interval == 0`` and while ``step < T``: per MoE layer, cosine similarity between
the experts' flattened gate projections (w1); for each expert its K most similar other experts;
``theta_e <- (1 - a_t) * theta_e + a_t * mean(theta of the K neighbours)``, every update computed from the
pre-merge weights, with ``a_t = a_0 * (1 - min(t / T, 1))`` (settings: ``MergeConfig``, ``[merge]``).
"""

from __future__ import annotations

import re

import torch


def merge_layer(
    experts: list[dict[str, torch.Tensor]], alpha: float, k: int
) -> list[dict[str, torch.Tensor]]:
    """One layer's experts (each a dict with at least 'w1') after a merge step; inputs are not modified."""
    n = len(experts)
    k = min(k, n - 1)
    if k <= 0 or alpha <= 0:
        return [{name: t.clone() for name, t in e.items()} for e in experts]
    gates = torch.stack([e["w1"].flatten().float() for e in experts])  # (E, D*F)
    gates = gates / gates.norm(dim=1, keepdim=True).clamp_min(1e-12)
    similarity = gates @ gates.t()
    similarity.fill_diagonal_(-float("inf"))  # an expert is not its own neighbour
    neighbours = similarity.topk(k, dim=1).indices  # (E, K)
    merged = []
    for e in range(n):
        out = {}
        for name, theta in experts[e].items():
            mean = torch.stack([experts[j][name] for j in neighbours[e].tolist()]).mean(dim=0)
            out[name] = (1 - alpha) * theta + alpha * mean
        merged.append(out)
    return merged


_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.(\w+)$")


@torch.no_grad()
def merge_experts(
    weights: dict[str, torch.Tensor],
    alpha: float,
    k: int,
    only: set[int] | None = None,
) -> dict[str, torch.Tensor]:
    """``merge_layer`` over every MoE layer of a flat ``name -> tensor`` dict holding every expert's weights.

    Returns the merged tensors of the experts in ``only`` (all when None): a peer merges the experts it holds,
    while their neighbours are found among all experts (its frozen copies included).
    """
    layers: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        match = _EXPERT.match(name)
        if match:
            layer, expert, param = int(match.group(1)), int(match.group(2)), match.group(3)
            layers.setdefault(layer, {}).setdefault(expert, {})[param] = tensor
    merged = {}
    for layer, experts in layers.items():
        order = sorted(experts)
        for index, new in zip(order, merge_layer([experts[e] for e in order], alpha, k), strict=True):
            if only is None or index in only:
                merged.update({f"layers.{layer}.moe.experts.{index}.{p}": t for p, t in new.items()})
    return merged
