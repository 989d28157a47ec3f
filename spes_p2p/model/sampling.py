"""Text from the model, one token at a time: greedy, or sampled with a temperature and nucleus (top-p).

There is no key-value cache: each new token runs the model over the whole window again (at most
``max_seq_len`` tokens, the newest), which costs O(window) forward passes of the window. That is fine for the
models a CPU trains, and keeps the model one code path for training and sampling.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model.transformer import MoETransformer


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 200
    temperature: float = 0.8  # 0: greedy (always the likeliest token)
    top_p: float = 0.95  # sample from the smallest set of tokens whose probabilities add up to top_p
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


@torch.no_grad()
def generate(model: MoETransformer, prompt: list[int], sampling: Sampling, stop: int | None) -> Iterator[int]:
    """The tokens that follow ``prompt`` (at least one token), up to ``sampling.max_tokens`` or ``stop``
    (not yielded)."""
    if not prompt:
        raise ValueError("a prompt of at least one token is needed")
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    for _ in range(sampling.max_tokens):
        logits = model(tokens[:, -model.cfg.max_seq_len :]).logits[0, -1].float().cpu()
        token = pick(logits, sampling.temperature, sampling.top_p, generator)
        if token == stop:
            return
        yield token
        tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from a vector of logits."""
    if temperature == 0:
        return int(logits.argmax())
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the likelier tokens
    sorted_probs[before >= top_p] = 0.0  # (the likeliest token always stays)
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])
