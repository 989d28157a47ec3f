"""docs/architecture.md names files, modules, classes and their members in backticks: each must exist in the
code, so the map cannot drift from the territory (it once named ``RoundSync.landed`` long after the method
had moved)."""

import ast
import dataclasses
import re
from pathlib import Path

from spes_p2p.settings import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
CODE = [*sorted((ROOT / "spes_p2p").rglob("*.py")), *sorted((ROOT / "cli").rglob("*.py"))]
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
DATA = (".json", ".jsonl", ".toml", ".png", ".md", ".pb")


@dataclasses.dataclass
class Index:
    """What the code defines: each module's top-level names, each class's members, every name at all."""

    modules: dict[Path, set[str]] = dataclasses.field(default_factory=dict)
    classes: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    names: set[str] = dataclasses.field(default_factory=set)


def index() -> Index:
    found = Index()
    for path in CODE:
        tree = ast.parse(path.read_text())
        found.modules[path] = {n for node in tree.body for n in _defined(node)}
        for node in ast.walk(tree):
            found.names |= set(_defined(node))
            if isinstance(node, ast.ClassDef):
                members = {n for item in node.body for n in _defined(item)}
                members |= {
                    a.attr
                    for a in ast.walk(node)
                    if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"
                }
                found.classes.setdefault(node.name, set()).update(members)
            if isinstance(node, ast.Attribute):
                found.names.add(node.attr)
    return found


def _defined(node: ast.AST) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def module_files(name: str) -> list[Path]:
    """The files a module path names: 'peer/setup', 'cli/render', or a bare stem like 'aggregate'."""
    candidates = [ROOT / "spes_p2p" / f"{name}.py", ROOT / f"{name}.py"]
    if "/" not in name:
        candidates += [p for p in CODE if p.stem == name]
    return [p for p in candidates if p.is_file()]


def problem(token: str, code: Index) -> str | None:
    """What is wrong with one backticked name (None: it exists, or it names nothing in the code)."""
    token = re.sub(r"\(.*\)$", "", token)  # RoundJob(r): the class
    if " " in token or not re.fullmatch(r"[\w./]+", token) or token.endswith(DATA):
        return None  # a command, a flag, a message, a data file
    if token.startswith("spes_p2p."):  # a dotted module path, and maybe a name in it
        token = token.replace(".", "/", token.count(".") - 1).removeprefix("spes_p2p/")
    if token == "spes_cli":  # (the command line's import name: cli/)
        return None
    if token.endswith((".py", "/")):
        bare = token.rstrip("/")
        where = [ROOT / bare, ROOT / "spes_p2p" / bare]
        if "/" not in bare:
            where += [p for p in [*CODE, *(ROOT / "spes_p2p").rglob("*")] if p.name == bare]
        return None if any(p.exists() for p in where) else f"no file {token}"
    head, _, tail = token.rpartition(".")
    if head in SECTIONS:
        fields = {f.name for f in dataclasses.fields(SECTIONS[head])}
        return None if tail in fields else f"no setting {token}"
    if head and head[0].isupper() and IDENTIFIER.fullmatch(head):
        if head not in code.classes:
            return f"no class {head}"
        return None if tail in code.classes[head] else f"{head} has no {tail}"
    if head:
        files = module_files(head)
        if not files:
            return None if head.split("/")[0] in ("OUT", "tests") else f"no module {head}"
        return None if any(tail in code.modules[f] for f in files) else f"{head} defines no {tail}"
    if IDENTIFIER.fullmatch(token):
        return None if token in code.names or token in code.classes else f"nothing named {token}"
    return None


def test_every_name_in_the_architecture_page_exists_in_the_code():
    code = index()
    tokens = sorted(set(re.findall(r"`([^`\n]+)`", DOC.read_text())))
    problems = [f"`{t}`: {p}" for t in tokens if (p := problem(t, code))]
    assert not problems, "docs/architecture.md names what the code lacks:\n" + "\n".join(problems)


def test_the_check_catches_a_name_that_moved():
    code = index()
    assert problem("RoundSync.landed", code) == "RoundSync has no landed"
    assert problem("swarm/sync.py", code) == "no file swarm/sync.py"
    assert problem("sync/engine.Exchange", code) == "sync/engine defines no Exchange"
    assert problem("UnitRound", code) == "nothing named UnitRound"
    assert problem("sync.topk", code) == "no setting sync.topk"
    assert problem("FrozenCopies.landed", code) is None and problem("peer/setup.backend_class", code) is None
