"""Model configuration, the named presets, and the ``[model]`` settings section.

Presets `1b` and `7b` follow the configs published with SPES (docs/model.md). The `2b` preset is our
reconstruction of the paper's headline model, whose config is not published.

This module imports no torch: the command line reads the presets and choices from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from spes_p2p.errors import ConfigError
from spes_p2p.fields import PEER, SWARM, FieldError, Section, check, setting

FROZEN_FORMATS = ("full", "int8", "nf4")  # how a peer may hold the units it does not train
QWEN_VOCAB = 151_665  # the vocabulary of Qwen's tokenizer, which SPES used
OLMOE_VOCAB = 50_304  # OLMoE's padded vocabulary (GPT-NeoX's tokenizer)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """An OLMoE-style decoder whose every FFN is a mixture of SwiGLU experts."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: as many as n_heads
    head_size: int = 0  # width of one attention head; 0: d_model / n_heads
    n_experts: int
    top_k: int
    expert_dim: int  # hidden width F of one SwiGLU expert
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    renormalize_topk: bool = False  # OLMoE keeps the raw softmax probabilities of the top-k experts
    qk_norm: bool = True  # RMSNorm each head's queries and keys (OLMoE, Qwen3); Llama and Qwen2 have none
    attention_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    # loss coefficients, as in SPES
    load_balance_coef: float = 0.01
    router_z_coef: float = 1e-3
    logit_z_coef: float = 1e-5

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_experts",
            "top_k",
            "expert_dim",
            "max_seq_len",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if self.head_size < 0:
            raise ConfigError(f"head_size must be 0 (d_model / n_heads) or more, got {self.head_size}")
        if not self.head_size and self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"the head dim ({self.head_dim}) must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        for name in ("load_balance_coef", "router_z_coef", "logit_z_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be non-negative, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in values and _required(f))
        if missing:
            raise ConfigError(f"the model config misses field(s): {', '.join(missing)}")
        try:
            return cls(**values)
        except TypeError:  # a value of the wrong type, compared in __post_init__
            problem = "the model config has a value of the wrong type (it holds numbers and true/false)"
            raise ConfigError(problem) from None

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            values = json.loads(text)
        except ValueError:
            raise ConfigError("is not JSON: write the model's config as a JSON object") from None
        if not isinstance(values, dict):
            raise ConfigError("is not a JSON object of the model's config fields")
        return cls.from_dict(values)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


PRESETS: dict[str, ModelConfig] = {
    # tests and the quick start: about 0.6M parameters
    "tiny": ModelConfig(
        vocab_size=1024,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_experts=8,
        top_k=2,
        expert_dim=128,
        max_seq_len=256,
    ),
    # CPU demo: about 15M parameters
    "small": ModelConfig(
        vocab_size=4096,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_experts=8,
        top_k=2,
        expert_dim=512,
        max_seq_len=512,
    ),
    # the paper's 1B config: 4 nodes x 4 experts; Qwen's vocabulary, rope theta and epsilon, as SPES used
    "1b": ModelConfig(
        vocab_size=QWEN_VOCAB,
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_experts=16,
        top_k=2,
        expert_dim=2048,
        max_seq_len=2048,
        rope_theta=5e5,
        norm_eps=1e-6,
    ),
    # our reconstruction of the paper's headline 2B model (config not published)
    "2b": ModelConfig(
        vocab_size=OLMOE_VOCAB,
        d_model=1024,
        n_layers=18,
        n_heads=16,
        n_experts=16,
        top_k=2,
        expert_dim=2048,
        max_seq_len=2048,
    ),
    # the paper's 7B config: 4 nodes x 8 experts; Qwen's vocabulary (its rope theta and epsilon are not
    # published: OLMoE's)
    "7b": ModelConfig(
        vocab_size=QWEN_VOCAB,
        d_model=2048,
        n_layers=16,
        n_heads=16,
        n_experts=32,
        top_k=4,
        expert_dim=2048,
        max_seq_len=2048,
    ),
}


# Seconds per training step of each preset (``spes simulate --compute virtual`` sleeps this long per step),
# measured by benchmarks/step_time.py on this project's machine: 2 cores of an AMD EPYC, torch 2.13.0 (CPU),
# one thread as a simulated peer runs, a peer that trains 1 of 4 expert shards and 1 of 2 dense blocks with
# the rest held in int8 and 8-bit AdamW, STEP_BATCH x STEP_SEQ_LEN tokens a step. tiny and small: medians of
# 20 steps on the idle machine (on the machine busy with other work, their CPU time was 10-15% more); 1b: 3
# steps, CPU time, on the idle machine (with Qwen's vocabulary: 2.4x what it took with 50,304); 2b: 3 steps,
# CPU time, on the busy machine. A step of another batch shape scales by its tokens. A preset
# without a figure needs virtual=SECONDS.
STEP_BATCH, STEP_SEQ_LEN = 8, 128
STEP_SECONDS: dict[str, float] = {"tiny": 0.068, "small": 0.67, "1b": 60.6, "2b": 48.1}


def measured_step_seconds(preset: str, tokens_per_step: int) -> float | None:
    """The preset's measured seconds per step, scaled to ``tokens_per_step``; None: not measured."""
    seconds = STEP_SECONDS.get(preset)
    return None if seconds is None else seconds * tokens_per_step / (STEP_BATCH * STEP_SEQ_LEN)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


@dataclass(frozen=True, kw_only=True)
class ModelSettings(Section):
    """[model]: which model the swarm trains and how it is cut into units (see docs/model.md)."""

    SCOPE = SWARM

    preset: str = setting("tiny", "Model preset.", choices=tuple(PRESETS))
    config_json: str = setting(
        "",
        "The model's config as a JSON object (every field of spes_p2p.model.config.ModelConfig), in place "
        "of the preset; --init sets it; newcomers take the swarm's.",
        flag="--model-json",
        metavar="JSON",
    )
    init: str = setting(
        "",
        "Found the swarm from this model (a checkpoint, or a run folder: its newest; spes upcycle writes "
        "one): its config, weights and tokenizer instead of the preset's and the seed's. With --new-swarm; "
        "newcomers download the model from the swarm's peers.",
        scope=PEER,
        metavar="CHECKPOINT",
    )
    shards: int = setting(4, "Expert shards: units experts/0 .. experts/<shards-1>.")
    experts: int = setting(0, "Experts per MoE layer, overriding the preset's; 0: the preset's.")
    vocab_size: int = setting(
        0, "Vocabulary: rows of the embedding and the lm_head, overriding the preset's; 0: the preset's."
    )
    rope_theta: float = setting(0.0, "RoPE base (theta), overriding the preset's; 0: the preset's.")
    norm_eps: float = setting(0.0, "RMSNorm epsilon, overriding the preset's; 0: the preset's.")
    dense_blocks: int = setting(
        2,
        "B: the dense part in blocks dense/0 .. dense/<B-1>, trained in turns (BCD); 1: every peer trains "
        "all of it, as SPES is published.",
    )

    def validate(self) -> None:
        check(self.shards >= 1, "shards", "must be at least 1")
        for name in ("experts", "vocab_size", "rope_theta", "norm_eps"):
            check(getattr(self, name) >= 0, name, "must be 0 (the preset's) or more")
            check(
                not (self.init and getattr(self, name)),
                name,
                "cannot change a model founded from --init (its weights have its shapes): leave it out",
            )
        base = self._base()
        n_experts = self.experts or base.n_experts
        divisors = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        check(
            n_experts % self.shards == 0,
            "shards",
            f"({self.shards}) must divide the number of experts ({n_experts}); try one of {divisors}",
        )
        atoms = base.n_layers + 2
        check(
            1 <= self.dense_blocks <= atoms,
            "dense_blocks",
            f"must be between 1 and {atoms} for this model (embedding, each layer, head)",
        )

    def _base(self) -> ModelConfig:
        """The preset, or the config that ``config_json`` writes out."""
        if not self.config_json:
            return PRESETS[self.preset]
        try:
            return ModelConfig.from_json(self.config_json)
        except ConfigError as exc:
            raise FieldError("config_json", str(exc)) from None

    def architecture(self) -> ModelConfig:
        """The preset (or ``config_json``), with what ``experts``, ``vocab_size``, ``rope_theta`` and
        ``norm_eps`` override."""
        overrides = {
            "n_experts": self.experts,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "norm_eps": self.norm_eps,
        }
        return self._base().replace(**{name: value for name, value in overrides.items() if value})
