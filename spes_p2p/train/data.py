"""Corpora, the tokenizer, the train/validation split and per-peer data sharding.

A corpus is a list of documents. Sources:
    "stdlib"           the Python standard library sources of this machine (the embedded default, no download)
    a path             a text/.jsonl file, or a directory of them (read recursively, in sorted order)
    "hf:NAME[:SPLIT]"  a Hugging Face dataset with a "text" column (needs the optional ``hf`` extra)

Everything derived from a corpus (the tokenizer, the token ids) is cached under ``cache_dir`` keyed by a hash
of the corpus content, so a second run starts at once and two machines with the same corpus agree exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from spes_p2p.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
EOS = "<|endoftext|>"
SPLIT_SEED = 0  # the validation split is a hash of document names: every machine splits a corpus alike


@dataclass(frozen=True)
class Document:
    name: str
    text: str


# ------------------------------------------------------------------------------------------ corpus sources


def load_documents(corpus: str, max_bytes: int | None = None) -> list[Document]:
    """Reads a corpus as documents; raises DataError when it is missing or has no text."""
    if corpus == "stdlib":
        docs = _read_files(_stdlib_files(), root=Path(sysconfig.get_paths()["stdlib"]), max_bytes=max_bytes)
    elif corpus.startswith("hf:"):
        docs = _read_hf(corpus[3:], max_bytes)
    else:
        path = Path(corpus).expanduser()
        if not path.exists():
            raise DataError(f"corpus path {corpus!r} does not exist; give a text/.jsonl file or a directory")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        docs = _read_files(files, root=path if path.is_dir() else path.parent, max_bytes=max_bytes)
    if not docs:
        raise DataError(
            f"corpus {corpus!r} has no text: expected non-empty files ending in {', '.join(TEXT_SUFFIXES)}"
        )
    return docs


def _stdlib_files() -> list[Path]:
    """The stdlib's .py files, in order. site-packages lives inside the stdlib folder but depends on what is
    installed: it is left out, unwalked (walking it took 17 times as long as the stdlib itself)."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


def _read_files(files: list[Path], root: Path, max_bytes: int | None) -> list[Document]:
    docs, total = [], 0
    for path in files:
        try:
            raw = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise DataError(f"cannot read corpus file {path}: {exc.strerror}") from None
        name = str(path.relative_to(root)) if path != root else path.name
        texts = _jsonl_texts(raw, path) if path.suffix == ".jsonl" else [raw]
        for i, text in enumerate(texts):
            if text.strip():
                docs.append(Document(f"{name}#{i}" if len(texts) > 1 else name, text))
                total += len(text.encode("utf-8"))
            if max_bytes is not None and total >= max_bytes:
                return docs
    return docs


def _jsonl_texts(raw: str, path: Path) -> list[str]:
    texts = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno}: expected an object with a string field "text"')
        texts.append(record["text"])
    return texts


def _read_hf(spec: str, max_bytes: int | None) -> list[Document]:
    name, _, split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise DataError("hf: corpora need the optional extra: pip install 'spes-p2p[hf]'") from None
    try:
        dataset = datasets.load_dataset(name, split=split or "train", streaming=True)
    except Exception as exc:  # datasets raises many unrelated types for a bad name or no network
        raise DataError(f"cannot load Hugging Face dataset {name!r}: {exc}") from None
    docs, total = [], 0
    for i, row in enumerate(dataset):
        text = row.get("text") or ""
        if text.strip():
            docs.append(Document(f"{name}/{i}", text))
            total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            break
    return docs


def split_documents(
    docs: list[Document], val_percent: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """A deterministic split by document: the same document always lands on the same side."""

    def bucket(doc: Document) -> float:
        digest = hashlib.sha256(f"{seed}:{doc.name}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 * 100

    train = [d for d in docs if bucket(d) >= val_percent]
    val = [d for d in docs if bucket(d) < val_percent]
    if not val:  # tiny corpora: hold out the last document rather than nothing
        train, val = train[:-1], train[-1:]
    if not train:
        raise DataError("corpus too small: it needs at least two documents (one for validation)")
    return train, val


def fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.name.encode())
        h.update(b"\0")
        h.update(doc.text.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()
