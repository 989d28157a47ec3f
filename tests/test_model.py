import pytest
import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model import PRESETS, ModelConfig, MoETransformer, get_preset
from spes_p2p.model.moe import MoE

TINY = get_preset("tiny")


def naive_moe(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Per-token reference: every token through each of its top-k experts, one at a time."""
    weights_TK, experts_TK, _, _ = moe.router(x_TD)
    y = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(experts_TK.shape[1]):
            expert = moe.experts[int(experts_TK[t, k])]
            y[t] += weights_TK[t, k] * expert(x_TD[t : t + 1])[0]
    return y


@pytest.mark.parametrize("renormalize", [False, True])
def test_dispatch_matches_per_token_reference(renormalize):
    torch.manual_seed(0)
    moe = MoE(TINY.replace(renormalize_topk=renormalize))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x_TD = torch.randn(37, TINY.d_model)
    y_TD, _ = moe(x_TD)
    torch.testing.assert_close(y_TD, naive_moe(moe, x_TD), rtol=1e-5, atol=1e-5)


def test_dispatch_gradients_match_reference():
    torch.manual_seed(1)
    moe = MoE(TINY)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(20, TINY.d_model)
    moe(x)[0].square().sum().backward()
    fast = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    naive_moe(moe, x).square().sum().backward()
    for a, b in zip(fast, [p.grad for p in moe.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-4)  # fp32 sums in another order


def test_router_picks_the_top_k_experts():
    moe = MoE(TINY)  # 8 experts, top-2
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[5, 0] = 3.0  # dim 0 votes for expert 5
        moe.router.weight[2, 1] = 2.0  # dim 1 votes for expert 2
        moe.router.weight[7, 1] = 1.0
    x = torch.zeros(3, TINY.d_model)
    x[0, 0], x[0, 1] = 1.0, 1.0  # expert 5 (3.0) then 2 (2.0)
    x[1, 1] = 1.0  # expert 2 (2.0) then 7 (1.0)
    x[2, 0] = -1.0  # expert 5 is the worst, everyone else ties at 0
    weights, experts, probs, _ = moe.router(x)
    assert experts[0].tolist() == [5, 2]
    assert experts[1].tolist() == [2, 7]
    assert 5 not in experts[2].tolist()
    torch.testing.assert_close(weights, probs.gather(1, experts))  # OLMoE: no renormalisation by default
    assert (weights[:, 0] >= weights[:, 1]).all()


def test_losses_have_the_configured_weights():
    torch.manual_seed(0)
    cfg = TINY.replace(load_balance_coef=0.5, router_z_coef=0.25, logit_z_coef=0.125)
    model = MoETransformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(tokens[:, :-1], tokens[:, 1:])
    p = out.parts
    expected = p["ce"] + 0.5 * p["load_balance"] + 0.25 * p["router_z"] + 0.125 * p["logit_z"]
    torch.testing.assert_close(out.loss, expected)
    # balance loss is about 1 for a uniform router, and never below 1/E * E... i.e. strictly positive
    assert 0.5 < p["load_balance"].item() < 2.0
    assert abs(p["ce"].item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5


def test_attention_is_causal():
    torch.manual_seed(0)
    model = MoETransformer(TINY).eval()
    a = torch.randint(0, TINY.vocab_size, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % TINY.vocab_size
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
    torch.testing.assert_close(la[0, :8], lb[0, :8])
    assert not torch.allclose(la[0, 8:], lb[0, 8:])


def test_preset_sizes():
    sizes = {}
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            sizes[name] = MoETransformer(cfg).num_params()
    assert sizes["tiny"] < 2e6
    assert 5e6 <= sizes["small"] <= 30e6
    assert 0.9e9 < sizes["1b"] < 1.3e9
    assert 1.7e9 < sizes["2b"] < 2.3e9
    assert 6.5e9 < sizes["7b"] < 7.5e9


@pytest.mark.parametrize(("name", "total", "active"), [("1b", 1.17e9, 0.37e9), ("7b", 7.33e9, 1.70e9)])
def test_the_published_presets_count_the_papers_parameters(name, total, active):
    """With SPES's vocabulary (Qwen's, 151,665), our counts are the paper's, to its two decimals."""
    with torch.device("meta"):
        model = MoETransformer(PRESETS[name])
    assert abs(model.num_params() - total) < 0.005e9 and abs(model.num_active_params() - active) < 0.005e9


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="tiny, small, 1b, 2b, 7b"):
        get_preset("huge")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"top_k": 9}, "top_k"),
        ({"n_heads": 5}, "n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"d_model": 0}, "d_model"),
    ],
)
def test_bad_model_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        TINY.replace(**changes)


def test_gqa_runs():
    cfg = TINY.replace(n_kv_heads=2)
    model = MoETransformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    assert model(tokens).logits.shape == (2, 9, cfg.vocab_size)


def test_config_round_trip():
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ConfigError, match="bogus"):
        ModelConfig.from_dict({**TINY.to_dict(), "bogus": 1})
