"""``spes data``: prepare a corpus into a dataset of token shards that a swarm can pin and share."""

from __future__ import annotations

from pathlib import Path

import click
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from spes_cli.common import console

from spes_p2p.data.recipe import Recipe

DEFAULTS = Recipe(source="")


@click.group()
def data() -> None:
    """Datasets: a corpus tokenized into shards with an index."""


@data.command(name="prepare")
@click.argument("source")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="The dataset's folder."
)
@click.option(
    "--tokenizer", default="", help="A tokenizer.json to encode with; default: train one on SOURCE."
)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=257, max=1 << 24),
    default=DEFAULTS.vocab_size,
    show_default=True,
    help="The tokenizer trained: its vocabulary (the model's vocab_size must be at least this).",
)
@click.option(
    "--shard-tokens",
    type=click.IntRange(min=1024, max=1 << 28),
    default=DEFAULTS.shard_tokens,
    show_default=True,
    help="Tokens per shard (the last of each split may hold fewer).",
)
@click.option(
    "--val-percent",
    type=click.FloatRange(0, 50, min_open=True, max_open=True),
    default=DEFAULTS.val_percent,
    show_default=True,
    help="Documents held out for validation, in percent (chosen by a hash of their names).",
)
@click.option(
    "--tokenizer-sample-mb",
    type=click.FloatRange(0, min_open=True),
    default=DEFAULTS.tokenizer_sample_mb,
    show_default=True,
    help="Training text the tokenizer is trained on (the first documents).",
)
@click.option(
    "--max-corpus-mb",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Read the source up to the first document that reaches this many MB of text; 0: all of it.",
)
def prepare_(
    source, out, tokenizer, vocab_size, shard_tokens, val_percent, tokenizer_sample_mb, max_corpus_mb
) -> None:
    """Tokenize SOURCE (a text/.md/.py/.jsonl/.parquet file or folder, stdlib, or hf:NAME[:SPLIT]) into
    fixed-size token shards in OUT, with an index; a re-run of an interrupted preparation resumes it."""
    from spes_p2p.data.prepare import prepare

    limit = int(max_corpus_mb * 1e6) or None
    recipe = Recipe(source, tokenizer, vocab_size, shard_tokens, val_percent, tokenizer_sample_mb, limit)
    columns = [
        TextColumn("[bold]prepare"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[shards]}"),
    ]
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("prepare", total=None, shards="")
        index = prepare(
            recipe,
            out,
            lambda p: bar.update(
                task,
                completed=p.bytes_read,
                total=p.bytes_total,
                shards=f"{p.documents:,} documents, {p.shards} shards",
            ),
        )
    console.print(
        f"{out}: {index.tokens('train'):,} training tokens in {len(index.train)} shards, "
        f"{index.tokens('val'):,} validation tokens in {len(index.val)}, from {index.documents:,} documents\n"
        f"dataset {index.digest}"
    )
