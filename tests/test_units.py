import pytest
import torch

from spes_p2p.errors import ConfigError
from spes_p2p.model import MoETransformer, UnitLayout, get_preset, read_unit, unit_parameters, write_unit

TINY = get_preset("tiny")  # 8 experts, 2 layers


def test_units_partition_the_parameters():
    model = MoETransformer(TINY)
    layout = UnitLayout(TINY.n_experts, 4)
    seen: dict[str, str] = {}
    for unit in layout.units:
        for name in unit_parameters(model, layout, unit):
            assert name not in seen, f"{name} in {seen.get(name)} and {unit}"
            seen[name] = unit
    assert set(seen) == {n for n, _ in model.named_parameters()}


def test_expert_shard_spans_every_layer():
    model = MoETransformer(TINY)
    layout = UnitLayout(TINY.n_experts, 4)  # 2 experts per shard
    names = set(unit_parameters(model, layout, "experts/1"))
    expected = {
        f"layers.{layer}.moe.experts.{e}.{w}"
        for layer in range(2)
        for e in (2, 3)
        for w in ("w1", "w2", "w3")
    }
    assert names == expected
    dense = unit_parameters(model, layout, "dense/0")
    assert "layers.0.moe.router.weight" in dense and "embed.weight" in dense and "lm_head.weight" in dense
    assert not any(".experts." in n for n in dense)


def test_read_write_round_trip():
    torch.manual_seed(0)
    a, b = MoETransformer(TINY), MoETransformer(TINY)
    layout = UnitLayout(TINY.n_experts, 2)
    write_unit(b, layout, "experts/1", read_unit(a, layout, "experts/1"))
    for name, p in unit_parameters(b, layout, "experts/1").items():
        assert torch.equal(p, dict(a.named_parameters())[name])
    # other units untouched
    assert not torch.equal(b.layers[0].moe.experts[0].w1, a.layers[0].moe.experts[0].w1)


def test_write_unit_rejects_mismatches():
    model = MoETransformer(TINY)
    layout = UnitLayout(TINY.n_experts, 2)
    tensors = read_unit(model, layout, "experts/0")
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="expected"):
        write_unit(model, layout, "experts/0", {**tensors, name: tensors[name].half()})
    with pytest.raises(ValueError, match="missing"):
        write_unit(model, layout, "experts/0", dict(list(tensors.items())[1:]))


def test_layout_errors_name_the_problem():
    with pytest.raises(ConfigError, match=r"shards \(3\) must divide the number of experts \(8\)"):
        UnitLayout(8, 3)
    layout = UnitLayout(8, 4)
    with pytest.raises(ConfigError, match="owned shard 4 is out of range"):
        layout.shard_units([4])
    with pytest.raises(ConfigError, match="bad unit name"):
        layout.check_unit("expert/1")
    with pytest.raises(ConfigError, match="out of range"):
        layout.check_unit("experts/9")
