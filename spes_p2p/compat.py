"""Imports that need taming (third-party modules with side effects, lazy re-exports of our own), and the two
Linux calls we make."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys


def bitsandbytes():
    """bitsandbytes, imported without its CPU notice about the optional ``kernels`` package, and without
    torch's compiler.

    The notice is harmless (the CPU backend works without that package) but alarms users. At import,
    bitsandbytes wraps its device-generic fallback kernels in ``torch.compile``, which imports torch's
    dynamo and inductor (its import took 3.2 to 3.8 s, 1.7 to 2.3 s more than it takes now, torch's
    optimizers importing dynamo anyway) for kernels that CPU and CUDA replace with their own. bitsandbytes
    keeps a kernel uncompiled when ``torch.compile`` fails, so for the length of its import it fails. Its
    kernels are also registered as not to be compiled, through a wrapper that imports dynamo on a kernel's
    first call; for the length of the import that mark is left off (nothing compiles them)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    import torch

    def no_compiler(*args, **kwargs):
        raise RuntimeError("torch.compile is off while bitsandbytes is imported")

    compile_, torch.compile = torch.compile, no_compiler
    disable_, torch._disable_dynamo = torch._disable_dynamo, lambda fn=None, recursive=True: fn
    try:
        import bitsandbytes as bnb
    finally:
        torch.compile, torch._disable_dynamo = compile_, disable_
    return bnb


def optimizers_without_compiler() -> None:
    """torch's optimizers, without importing torch's compiler on their first use.

    torch marks ``Optimizer.add_param_group``, ``state_dict``, ``load_state_dict`` and ``zero_grad`` as not
    to be compiled with a wrapper that imports dynamo on its first call (2.0 to 2.5 s of every training
    peer's start, the largest import after torch itself) only to build that mark. Nothing here compiles an
    optimizer, so each wrapper is given what it would build, the method itself; a method wrapped otherwise
    (another torch) is left as it is."""
    import torch

    for method in vars(torch.optim.Optimizer).values():
        code = getattr(method, "__code__", None)
        if code is not None and code.co_qualname == "_disable_dynamo.<locals>.inner":
            original = method.__wrapped__
            if not hasattr(original, "__dynamo_disable"):
                original.__dynamo_disable = original


def lazy_exports(package: str, exports: dict[str, str]):
    """A module ``__getattr__`` that imports ``name`` from ``package.<exports[name]>`` on first use, so that a
    package can re-export heavy names (torch, hivemind) while its light modules stay cheap to import."""
    import importlib

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__


def setup_logging(level: str) -> None:
    """Our logs and hivemind's through one handler, at ``level`` (debug, info, warning or error)."""
    import os

    os.environ.setdefault("HIVEMIND_LOGLEVEL", level.upper())
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def die_with_parent(signum: int) -> None:
    """Linux: ask the kernel to send this process ``signum`` when its parent dies (elsewhere: nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG


def enter_netns(name: str) -> None:
    """Linux: moves this process (one thread) into the network namespace ``name`` made by ``ip netns add``,
    as ``ip netns exec NAME`` does for the command it runs."""
    import os

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot enter network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)
