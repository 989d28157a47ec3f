"""Corpora read as documents, and the train/validation split.

A corpus is a stream of documents. Sources:
    "stdlib"           the Python standard library sources of this machine (the embedded default, no download)
    a path             a text/.md/.py/.jsonl/.parquet file, or a folder of them (read recursively, in sorted
                       order); a .jsonl line or a Parquet row is a document in its "text" field
    "hf:NAME[:SPLIT]"  a Hugging Face dataset with a "text" column, streamed (needs the optional ``hf`` extra)

Documents are read one at a time (``iter_documents``): a corpus never has to fit in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from spes_p2p.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".parquet")
EOS = "<|endoftext|>"
SPLIT_SEED = 0  # the validation split is a hash of document names: every machine splits a corpus alike


@dataclass(frozen=True)
class Document:
    name: str
    text: str


# ------------------------------------------------------------------------------------------ corpus sources


def iter_documents(corpus: str) -> Iterator[Document]:
    """A corpus's non-empty documents, in a fixed order; raises DataError when it is missing or unreadable
    (and, once read to its end, when it held no text)."""
    docs = _hf_documents(corpus[3:]) if corpus.startswith("hf:") else _file_documents(*corpus_files(corpus))
    empty = True
    for doc in docs:
        empty = False
        yield doc
    if empty:
        raise DataError(
            f"corpus {corpus!r} has no text: expected non-empty files ending in {', '.join(TEXT_SUFFIXES)}"
        )


def corpus_files(corpus: str) -> tuple[list[Path], Path]:
    """The files of a local corpus, in reading order, and the folder their names are relative to."""
    if corpus == "stdlib":
        return _stdlib_files(), Path(sysconfig.get_paths()["stdlib"])
    path = Path(corpus).expanduser()
    if not path.exists():
        raise DataError(f"corpus path {corpus!r} does not exist; give a text/.jsonl file or a directory")
    if path.is_file():
        return [path], path.parent
    return sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()), path


def corpus_bytes(corpus: str) -> int | None:
    """The size of a local corpus's files (for progress); None for a remote one."""
    return None if corpus.startswith("hf:") else sum(p.stat().st_size for p in corpus_files(corpus)[0])


def first_bytes(docs: Iterable[Document], max_bytes: int | None) -> Iterator[Document]:
    """Documents up to the first that reaches ``max_bytes`` of text in all (None: every one)."""
    total = 0
    for doc in docs:
        yield doc
        total += len(doc.text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def _stdlib_files() -> list[Path]:
    """The stdlib's .py files, in order. site-packages lives inside the stdlib folder but depends on what is
    installed: it is left out, unwalked (walking it took 17 times as long as the stdlib itself)."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


def _file_documents(files: list[Path], root: Path) -> Iterator[Document]:
    for path in files:
        name = str(path.relative_to(root)) if path != root else path.name
        texts = _parquet_texts(path) if path.suffix == ".parquet" else _file_texts(path)
        for i, text in enumerate(texts):
            if text.strip():
                many = path.suffix in (".jsonl", ".parquet")
                yield Document(f"{name}#{i}" if many else name, text)


def _file_texts(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path}: {exc.strerror}") from None
    return _jsonl_texts(raw, path) if path.suffix == ".jsonl" else [raw]


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


def _parquet_texts(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: Parquet files need pyarrow: pip install 'spes-p2p[hf]'") from None
    try:
        table = pq.ParquetFile(path)
        if "text" not in table.schema_arrow.names:
            raise DataError(f'{path}: no "text" column (it has {", ".join(table.schema_arrow.names)})')
        for batch in table.iter_batches(columns=["text"], batch_size=1024):
            yield from (text or "" for text in batch.column(0).to_pylist())
    except (OSError, ValueError) as exc:  # pyarrow's errors for a damaged or foreign file subclass these
        raise DataError(f"cannot read Parquet file {path}: {exc}") from None


def _hf_documents(spec: str) -> Iterator[Document]:
    name, _, split = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise DataError("hf: corpora need the optional extra: pip install 'spes-p2p[hf]'") from None
    try:
        dataset = datasets.load_dataset(name, split=split or "train", streaming=True)
    except Exception as exc:  # datasets raises many unrelated types for a bad name or no network
        raise DataError(f"cannot load Hugging Face dataset {name!r}: {exc}") from None
    for i, row in enumerate(dataset):
        text = row.get("text") or ""
        if text.strip():
            yield Document(f"{name}/{i}", text)


def held_out(doc: Document, val_percent: float, seed: int = SPLIT_SEED) -> bool:
    """Whether a document is in the validation split: a hash of its name, so every machine agrees."""
    digest = hashlib.sha256(f"{seed}:{doc.name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100 < val_percent
