"""Byte-level BPE tokenizers: trained on the corpus (deterministically, cached) or loaded from a file."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from spes_p2p.data.corpus import EOS, Document
from spes_p2p.errors import ConfigError, DataError


def train_tokenizer(docs: list[Document], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with one special token, EOS. Deterministic for the same documents in the same order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer, length=len(docs))
    return tok


def load_tokenizer(path: str | Path, max_vocab: int) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise DataError(f"cannot load tokenizer {path}: {exc}") from None
    if tok.get_vocab_size() > max_vocab:
        raise ConfigError(
            f"tokenizer {path} has {tok.get_vocab_size()} tokens but the model's vocab_size is {max_vocab}; "
            "pick a preset with a larger vocabulary or a smaller tokenizer"
        )
    if tok.token_to_id(EOS) is None:
        raise DataError(f"tokenizer {path} has no {EOS} token; add it as a special token")
    return tok


def tokenizer_hash(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()
