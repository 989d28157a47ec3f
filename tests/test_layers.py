"""The layers (docs/architecture.md), checked on the source: model, trainer, interop and datasets never
import networking, datasets know nothing of models, an export needs no transformers, the swarm layer knows
nothing of optimizers or models (of data, only the plan's value types), and the library never reaches for
the command line."""

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


@pytest.mark.parametrize("folder", ["model", "train", "interop", "data"])
def test_model_trainer_interop_and_data_never_import_networking(folder):
    for path, names in imports_of(folder).items():
        bad = sorted(n for n in names if n.startswith(NETWORKING))
        assert not bad, f"{path} imports {bad}"


def test_datasets_know_nothing_of_models_and_training():
    for path, names in imports_of("data").items():
        bad = sorted(n for n in names if n.startswith(("spes_p2p.train", "spes_p2p.model", "torch")))
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


def module_graph() -> dict[str, set[str]]:
    """File -> the files of spes_p2p it imports (at any depth of the code: lazy imports count too)."""
    modules = {
        ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PKG.rglob("*.py")
    }

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = {owner(t) for t in targets if t.startswith("spes_p2p")}
        graph[module] = {t for t in found if t and t != module and t != package}
    return graph


def test_no_two_files_import_each_other_even_through_others():
    graph = module_graph()
    reach: dict[str, set[str]] = {}

    def reachable(start: str) -> set[str]:
        if start not in reach:
            seen, todo = set(), [start]
            while todo:
                for nxt in graph[todo.pop()] - seen:
                    seen.add(nxt)
                    todo.append(nxt)
            reach[start] = seen
        return reach[start]

    circles = sorted(m for m in graph if m in reachable(m))
    assert not circles, f"import circles through: {circles}"


def test_no_two_modules_share_a_file_name_and_no_two_classes_a_name():
    shared = {"__init__.py", "__main__.py", "config.py"}
    names = [p.name for p in PKG.rglob("*.py") if p.name not in shared]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    classes = [
        node.name
        for p in PKG.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    assert sorted({c for c in classes if classes.count(c) > 1}) == []


@pytest.mark.parametrize("package", ["net", "swarm", "sync", "peer", "sim", "train", "model"])
def test_no_package_grows_past_twenty_modules(package):
    assert len(list((PKG / package).glob("*.py"))) <= 20
