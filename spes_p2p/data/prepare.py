"""Preparing a dataset: a corpus tokenized into fixed-size shards with an index (``shards.py``), resumable.

Documents are read one at a time, tokenized in batches, and sent by a hash of their names to the training or
the validation stream; each stream is cut into shards of ``shard_tokens`` tokens as it fills. After each
batch that completed a shard, the preparation writes down how far it got (``.prepare.json``: the documents
done, the shards written, the recipe; the tokens not yet in a shard are in ``.pending-<documents>``), so a
re-run of the same recipe resumes there. The index is written last, once everything is in: a folder with an
``index.json`` is a complete dataset.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from spes_p2p.data.corpus import EOS, Document, corpus_bytes, first_bytes, held_out
from spes_p2p.data.recipe import PrepareProgress, Recipe
from spes_p2p.data.shards import (
    FORMAT,
    INDEX,
    SPLITS,
    TOKENIZER,
    DatasetIndex,
    Shard,
    dtype_for,
    encode_shard,
    shard_name,
)
from spes_p2p.data.tokenizer import load_tokenizer, tokenizer_hash, train_tokenizer
from spes_p2p.errors import DataError
from spes_p2p.files import atomic_write_bytes

STATE = ".prepare.json"
BATCH_BYTES = 4 << 20  # text tokenized at once (in parallel, by the tokenizers library)
BATCH_DOCUMENTS = 4096


class _State(msgspec.Struct, forbid_unknown_fields=True):
    recipe: dict
    tokenizer_sha256: str
    documents: int  # read and tokenized, from the start of the corpus
    bytes_read: int
    train: list[Shard]
    val: list[Shard]


def prepare(
    recipe: Recipe, out: Path, progress: Callable[[PrepareProgress], None] = lambda p: None
) -> DatasetIndex:
    """Prepares ``recipe.source`` into ``out`` (a new or empty folder, or one this recipe was being prepared
    into: then it resumes); a folder that already holds the dataset is returned as it is."""
    if (out / INDEX).exists():
        return DatasetIndex.read(out)
    state = _resume(recipe, out)
    tok = _tokenizer(recipe, out, state)
    if state is None:
        state = _State(recipe.settings(), tokenizer_hash(tok), 0, 0, [], [])
    dtype = np.dtype(dtype_for(tok.get_vocab_size()))
    writers = {s: _Writer(out, s, recipe.shard_tokens, getattr(state, s), dtype) for s in SPLITS}
    _give_back_pending(out, state, writers)
    total = min(filter(None, (corpus_bytes(recipe.source), recipe.max_bytes)), default=None)
    eos = tok.token_to_id(EOS)
    docs = itertools.islice(recipe.documents(), state.documents, None)
    for batch in _batches(docs):
        for doc, encoding in zip(batch, tok.encode_batch([d.text for d in batch]), strict=True):
            writers["val" if held_out(doc, recipe.val_percent) else "train"].add([*encoding.ids, eos])
        state.documents += len(batch)
        state.bytes_read += sum(len(d.text.encode("utf-8")) for d in batch)
        if any(w.written for w in writers.values()):
            _checkpoint(out, state, writers)
        progress(PrepareProgress(state.bytes_read, total, state.documents, len(state.train) + len(state.val)))
    return _finish(recipe, out, state, writers, tok.get_vocab_size())


def prepare_cached(recipe: Recipe, cache: Path) -> Path:
    """The folder of ``recipe``'s dataset in the cache, prepared on first use. Processes that ask at once
    (a simulation's peers) wait for one another: one prepares, the others find the dataset complete."""
    given = tokenizer_hash(load_tokenizer(recipe.tokenizer, recipe.vocab_size)) if recipe.tokenizer else ""

    def folder_of(tokenizer: str) -> Path:
        key = json.dumps([FORMAT, recipe.settings(), tokenizer], sort_keys=True)
        return cache / "datasets" / hashlib.sha256(key.encode()).hexdigest()[:16]

    folder, trained = folder_of(given), folder_of("")
    if given and not (folder / INDEX).exists() and (trained / INDEX).exists():
        if DatasetIndex.read(trained).tokenizer_sha256 == given:  # (the tokenizer trained here: a swarm's)
            return trained
    if not (folder / INDEX).exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (folder / INDEX).exists():  # (prepared while we waited)
                return folder
            if not (folder / STATE).exists():  # (a preparation that died before its first shard)
                shutil.rmtree(folder, ignore_errors=True)
            prepare(recipe, folder)
    return folder


class _Writer:
    """One split's shards: tokens gathered until a shard is full, then written."""

    def __init__(self, out: Path, split: str, size: int, shards: list[Shard], dtype: np.dtype) -> None:
        self.out, self.split, self.size, self.shards, self.dtype = out, split, size, shards, dtype
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.written = False  # since the last checkpoint
        self.last = 0  # tokens of the last document added, while none of them is in a shard

    def add(self, ids: list[int]) -> None:
        self.pending.append(np.asarray(ids, dtype=self.dtype))
        self.pending_tokens += len(ids)
        self.last = len(ids)
        while self.pending_tokens >= self.size:
            tokens = np.concatenate(self.pending)
            self._write(tokens[: self.size])
            self.pending, self.pending_tokens = [tokens[self.size :]], len(tokens) - self.size
            if self.pending_tokens < self.last:  # (part of it is in a shard now)
                self.last = 0

    def take_last(self) -> list[int] | None:
        """The last document's tokens, taken out, while none of them is in a shard yet (else None)."""
        if not self.last:
            return None
        tokens = self.rest()
        self.pending, self.pending_tokens = [tokens[: -self.last]], len(tokens) - self.last
        return tokens[-self.last :].tolist()

    def rest(self) -> np.ndarray:
        return np.concatenate(self.pending) if self.pending else np.zeros(0, self.dtype)

    def flush(self) -> None:
        if self.pending_tokens:
            self._write(self.rest())
            self.pending, self.pending_tokens = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        data = encode_shard(tokens)
        shard = Shard(shard_name(self.split, len(self.shards)), len(tokens), hashlib.sha256(data).hexdigest())
        atomic_write_bytes(self.out / shard.name, data)
        self.shards.append(shard)
        self.written = True


def _give_back_pending(out: Path, state: _State, writers: dict[str, _Writer]) -> None:
    """Gives each writer the tokens a resumed preparation had read and not yet put in a shard."""
    if not state.documents:
        return
    path = out / f".pending-{state.documents}"
    try:
        pending = load(path.read_bytes())
    except (OSError, SafetensorError):
        raise DataError(f"{path} is missing or damaged; remove {out} and prepare again") from None
    for split, writer in writers.items():
        writer.pending, writer.pending_tokens = [pending[split]], len(pending[split])


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _checkpoint(out: Path, state: _State, writers: dict[str, _Writer]) -> None:
    """Writes down how far the preparation got: the unsharded tokens first, then the state that names them."""
    old = sorted(out.glob(".pending-*"))
    pending = {split: writer.rest() for split, writer in writers.items()}
    atomic_write_bytes(out / f".pending-{state.documents}", save(pending))
    atomic_write_bytes(out / STATE, msgspec.json.encode(state))
    for path in old:
        path.unlink(missing_ok=True)
    for writer in writers.values():
        writer.written = False


def _finish(recipe: Recipe, out: Path, state: _State, writers: dict[str, _Writer], vocab: int):
    train = writers["train"]
    if (
        not state.val
        and not writers["val"].pending_tokens
        and (state.train or train.pending_tokens > train.last)
    ):
        last = train.take_last()  # (a small corpus: its last document is held out)
        if last is not None:
            writers["val"].add(last)
    for writer in writers.values():
        writer.flush()
    if not state.val or not state.train:
        _remove_preparation(out)  # (it cannot complete: this recipe splits this corpus so)
        raise DataError(
            f"{recipe.source}: of its {state.documents} documents none fell in the "
            f"{'validation' if not state.val else 'training'} split; use a larger corpus"
            + (" or a larger --val-percent" if not state.val else " or a smaller --val-percent")
        )
    index = DatasetIndex(
        format=FORMAT,
        source=recipe.source[:1024],
        tokenizer_sha256=state.tokenizer_sha256,
        vocab_size=vocab,
        dtype=dtype_for(vocab),
        shard_tokens=recipe.shard_tokens,
        val_percent=float(recipe.val_percent),  # (an int would encode as another digest once read back)
        documents=state.documents,
        train=tuple(state.train),
        val=tuple(state.val),
    )
    atomic_write_bytes(out / INDEX, index.encode())
    for path in [out / STATE, *out.glob(".pending-*")]:
        path.unlink(missing_ok=True)
    return index


def _remove_preparation(out: Path) -> None:
    """Removes what a preparation wrote into ``out`` (and ``out`` itself once empty)."""
    for path in [out / STATE, out / TOKENIZER, *out.glob(".pending-*"), *out.glob("*/*.safetensors")]:
        path.unlink(missing_ok=True)
    for folder in [out / split for split in SPLITS] + [out]:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _resume(recipe: Recipe, out: Path) -> _State | None:
    """The state of this recipe's preparation in ``out``; None for a new one. A folder with other files, or
    with another recipe's preparation, is refused: nothing in it is overwritten."""
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return None
    path = out / STATE
    if not path.is_file():
        raise DataError(f"{out} is not empty and holds no preparation to resume; give a new or empty folder")
    try:
        state = msgspec.json.decode(path.read_bytes(), type=_State)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise DataError(f"{path} is damaged; remove {out} and prepare again") from None
    if state.recipe != recipe.settings():
        differ = [
            f"{k} {state.recipe.get(k)!r}" for k, v in recipe.settings().items() if state.recipe.get(k) != v
        ]
        raise DataError(
            f"{out} holds a preparation with {', '.join(differ)}; resume it with the same settings, or give "
            "another folder"
        )
    return state


def _tokenizer(recipe: Recipe, out: Path, state: _State | None):
    """The dataset's tokenizer: kept in ``out``; given, or trained on the first training documents."""
    path = out / TOKENIZER
    if state is not None:
        tok = load_tokenizer(path, recipe.vocab_size)
        if tokenizer_hash(tok) != state.tokenizer_sha256:
            raise DataError(f"{path} changed since the preparation began; remove {out} and prepare again")
        if recipe.tokenizer and tokenizer_hash(
            load_tokenizer(recipe.tokenizer, recipe.vocab_size)
        ) != tokenizer_hash(tok):
            raise DataError(f"{out} holds a preparation with another tokenizer; give another folder")
        return tok
    if recipe.tokenizer:
        tok = load_tokenizer(recipe.tokenizer, recipe.vocab_size)
    else:
        training = (d for d in recipe.documents() if not held_out(d, recipe.val_percent))
        sample = list(first_bytes(training, int(recipe.tokenizer_sample_mb * 1e6)))
        tok = train_tokenizer(sample, recipe.vocab_size)
    atomic_write_bytes(path, tok.to_str().encode())
    return tok
