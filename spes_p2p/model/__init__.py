"""The MoE transformer in plain single-device torch, its presets, and the map from units to parameters.

No networking and no file I/O live here. The names below are imported on first use, so that reading a
preset or a setting (``spes_p2p.model.config``) does not import torch.
"""

from spes_p2p.compat import lazy_exports

_EXPORTS = {
    "PRESETS": "config",
    "ModelConfig": "config",
    "get_preset": "config",
    "LMOutput": "transformer",
    "MoETransformer": "transformer",
    "UnitLayout": "units",
    "hold_frozen": "units",
    "quantized_bytes": "quant",
    "read_unit": "units",
    "set_trainable": "units",
    "unit_parameters": "units",
    "write_unit": "units",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
