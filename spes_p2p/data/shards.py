"""A prepared dataset: fixed-size token shards and the index that names them.

A dataset is a folder:

    index.json              the index (``DatasetIndex``): every shard's name, token count and SHA-256, the
                            tokenizer's hash, the shard size, where the text came from
    tokenizer.json          the tokenizer the shards were encoded with
    train/000000.safetensors ...  training shards, ``shard_tokens`` tokens each (the last may be shorter)
    val/000000.safetensors  ...   the held-out validation shards (whole documents chosen by a hash of their
                                  name: every preparation of a corpus holds out the same ones)

A shard is a safetensors file with one 1-D tensor, ``tokens`` (uint16 when the vocabulary fits, else uint32):
documents follow each other, each ended by the end-of-text token, and may run on into the next shard.
safetensors rather than a format of our own (nanoGPT's raw ``.bin``) or a streaming library's (MosaicML
``streaming``, ``litdata``): it is already how peers exchange weights, its parser is safe on bytes from a
stranger (no pickle, a bounded header), it memory-maps, and a shard is one file a peer, a web server or a
Hugging Face repository can serve as it is. Those libraries assign shards to a fixed set of ranks and fetch
from object stores; a swarm's peers come and go and serve shards to each other, which is ours to do.

The dataset's identity is the SHA-256 of its index file (``DatasetIndex.digest``): it covers every shard's
hash and the tokenizer's, so a peer that holds a dataset with this digest holds exactly these tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from spes_p2p.errors import DataError

FORMAT = "spes-dataset/1"
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")
TENSOR = "tokens"
MAX_SHARDS = 1 << 20  # per split: an index of a million shards is about 100 MB of JSON
MAX_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
MAX_INDEX_BYTES = 256 << 20
_HEX64 = msgspec.Meta(pattern="^[0-9a-f]{64}$")


class Shard(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^(train|val)/[0-9]{6,7}\.safetensors$")]
    tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARD_TOKENS)]
    sha256: Annotated[str, _HEX64]


class DatasetIndex(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a dataset holds; written once, when its preparation is complete."""

    format: str
    source: Annotated[str, msgspec.Meta(max_length=1024)]  # what it was prepared from (for people)
    tokenizer_sha256: Annotated[str, _HEX64]
    vocab_size: Annotated[int, msgspec.Meta(ge=2, le=1 << 24)]
    dtype: Annotated[str, msgspec.Meta(pattern="^(uint16|uint32)$")]
    shard_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_SHARD_TOKENS)]
    val_percent: Annotated[float, msgspec.Meta(gt=0, lt=50)]
    documents: Annotated[int, msgspec.Meta(ge=0)]
    train: Annotated[tuple[Shard, ...], msgspec.Meta(min_length=1, max_length=MAX_SHARDS)]
    val: Annotated[tuple[Shard, ...], msgspec.Meta(min_length=1, max_length=MAX_SHARDS)]

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise ValueError(f"format {self.format!r} is not {FORMAT!r}")
        for split in SPLITS:
            names = [s.name for s in getattr(self, split)]
            if names != [shard_name(split, i) for i in range(len(names))]:
                raise ValueError(f"the {split} shards must be named {shard_name(split, 0)} onward, in order")
            if any(s.tokens != self.shard_tokens for s in getattr(self, split)[:-1]):
                raise ValueError(f"every {split} shard but the last must hold {self.shard_tokens} tokens")

    def encode(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=1) + b"\n"

    @property
    def digest(self) -> str:
        """The dataset's identity: the SHA-256 of its index file."""
        return hashlib.sha256(self.encode()).hexdigest()

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in getattr(self, split))

    @classmethod
    def decode(cls, data: bytes, where: str) -> DatasetIndex:
        if len(data) > MAX_INDEX_BYTES:
            raise DataError(f"{where}: an index of {len(data)} bytes is larger than {MAX_INDEX_BYTES}")
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise DataError(f"{where}: not a dataset index ({exc}); prepare it again") from None

    @classmethod
    def read(cls, folder: Path) -> DatasetIndex:
        path = folder / INDEX
        if not path.is_file():
            raise DataError(f"{folder} is not a prepared dataset (no {INDEX}); make one: spes data prepare")
        return cls.decode(path.read_bytes(), str(path))


def shard_name(split: str, number: int) -> str:
    return f"{split}/{number:06d}.safetensors"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode_shard(tokens: np.ndarray) -> bytes:
    return save({TENSOR: np.ascontiguousarray(tokens)})


def decode_shard(data: bytes, shard: Shard, index: DatasetIndex) -> np.ndarray:
    """A shard's tokens, from bytes of any origin: its hash, schema, dtype, length and token range are
    checked against the index before anything is returned."""
    if hashlib.sha256(data).hexdigest() != shard.sha256:
        raise DataError(f"{shard.name}: its SHA-256 is not the index's")
    try:
        tensors = load(data)
    except SafetensorError as exc:  # (a hash that matches makes this our own writer's fault)
        raise DataError(f"{shard.name}: not a safetensors file ({exc})") from None
    tokens = tensors.get(TENSOR)
    if set(tensors) != {TENSOR} or tokens.ndim != 1 or str(tokens.dtype) != index.dtype:
        raise DataError(f"{shard.name}: expected one 1-D {index.dtype} tensor named {TENSOR!r}")
    if len(tokens) != shard.tokens or (len(tokens) and int(tokens.max()) >= index.vocab_size):
        raise DataError(f"{shard.name}: {len(tokens)} tokens or a token id past the vocabulary")
    return tokens


def read_shard(folder: Path, shard: Shard, index: DatasetIndex) -> np.ndarray:
    path = folder / shard.name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    return decode_shard(data, shard, index)
