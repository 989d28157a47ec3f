"""The layers (docs/architecture.md), checked on the source: model, trainer and interop never import
networking, an export needs no transformers, the swarm layer knows nothing of optimizers or data, and the
library never reaches for the command line."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "spes_p2p"
NETWORKING = (
    "hivemind",
    "libp2p",
    "spes_p2p.net",
    "spes_p2p.swarm",
    "spes_p2p.sync",
    "spes_p2p.peer",
    "socket",
    "asyncio",
    "trio",
)
BACKENDS = (
    "hivemind",
    "libp2p",
    "trio",
    "spes_p2p.net.hivemind",
    "spes_p2p.net.libp2p",
    "spes_p2p.net.memory",
)


def imports_of(folder: str) -> dict[str, set[str]]:
    found = {}
    for path in (PKG / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(PKG))] = names
    return found


@pytest.mark.parametrize("folder", ["model", "train", "interop"])
def test_model_trainer_and_interop_never_import_networking(folder):
    for path, names in imports_of(folder).items():
        bad = sorted(n for n in names if n.startswith(NETWORKING))
        assert not bad, f"{path} imports {bad}"


def test_an_export_needs_no_transformers():
    for path, names in imports_of("interop").items():
        assert not any(n.startswith("transformers") for n in names), path


@pytest.mark.parametrize("folder", ["net", "swarm", "sync"])
def test_the_peer_to_peer_layers_know_nothing_of_training(folder):
    for path, names in imports_of(folder).items():
        bad = sorted(n for n in names if n.startswith(("spes_p2p.train", "spes_p2p.model", "spes_p2p.peer")))
        assert not bad, f"{path} imports {bad}"


@pytest.mark.parametrize("folder", ["swarm", "sync"])
def test_the_sync_and_the_swarm_never_import_a_backend(folder):
    for path, names in imports_of(folder).items():
        bad = sorted(n for n in names if n.startswith(BACKENDS))
        assert not bad, f"{path} imports {bad}"


def test_the_transport_seam_imports_no_backend_and_the_network_no_protocol():
    for path, names in imports_of("net").items():
        above = sorted(n for n in names if n.startswith(("spes_p2p.swarm", "spes_p2p.sync", "spes_p2p.peer")))
        assert not above, f"{path} imports {above}"
    seam = [f"net/{name}.py" for name in ("transport", "wire", "guard", "waiting", "config")]
    for path in seam:
        bad = sorted(n for n in imports_of("net")[path] if n.startswith(BACKENDS))
        assert not bad, f"{path} imports {bad}"


def test_the_library_never_imports_the_command_line_nor_runs_its_scripts():
    for path, names in imports_of(".").items():
        assert not any(n.startswith("spes_cli") for n in names), path
    for path in PKG.rglob("*.py"):  # a console script's name as a whole string: something launches it
        constants = {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}
        assert "spes-join" not in constants, path
