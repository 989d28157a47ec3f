"""The MoE transformer in plain single-device torch, its presets, and the map from units to parameters.

No networking and no file I/O live here.
"""

from spes_p2p.model.config import PRESETS, ModelConfig, get_preset
from spes_p2p.model.transformer import LMOutput, MoETransformer
from spes_p2p.model.units import UnitLayout, read_unit, set_trainable, unit_parameters, write_unit

__all__ = [
    "PRESETS",
    "LMOutput",
    "MoETransformer",
    "ModelConfig",
    "UnitLayout",
    "get_preset",
    "read_unit",
    "set_trainable",
    "unit_parameters",
    "write_unit",
]
