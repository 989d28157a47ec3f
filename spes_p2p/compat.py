"""Imports of third-party modules that need taming on our machines (see FACTS.md)."""

from __future__ import annotations

import logging


def bitsandbytes():
    """bitsandbytes, imported without its CPU notice about the optional ``kernels`` package."""
    # The notice is harmless (FACTS.md) but alarms users; it is logged once at import time.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes as bnb

    return bnb
