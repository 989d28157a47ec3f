"""``spes``: train, evaluate and measure locally."""

from __future__ import annotations

import json
from pathlib import Path

import click
from spes_cli.common import SpesGroup, console, dense_block_options, parse_shard_list, swarm_options

from spes_p2p.settings import CODECS

PRESET_NAMES = (
    "tiny",
    "small",
    "1b",
    "2b",
    "7b",
)  # mirrored from spes_p2p.model.config; a test keeps them equal


@click.group(cls=SpesGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spes-p2p")
def spes() -> None:
    """Volunteer pretraining of mixture-of-experts language models with sparse expert synchronization."""


@spes.command()
@click.option("--preset", default="tiny", show_default=True, help=f"Model preset: {', '.join(PRESET_NAMES)}.")
@click.option(
    "--shards", default=4, show_default=True, help="Number of expert shards the experts split into."
)
@click.option(
    "--owned-shards",
    callback=parse_shard_list,
    metavar="LIST",
    help="Train only these expert shards (plus the dense part), e.g. '1' or '0,2'. Default: everything.",
)
@click.option(
    "--max-steps", default=300, show_default=True, help="Length of the schedule in optimizer steps."
)
@click.option(
    "--stop-after", type=int, help="Stop (with a checkpoint) after this many steps of this invocation."
)
@click.option("--out", type=click.Path(path_type=Path), help="Run folder. Default: runs/train-<preset>.")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --out.")
@click.option(
    "--corpus",
    default="stdlib",
    show_default=True,
    help="'stdlib', a text/.jsonl file or folder, or hf:NAME[:SPLIT].",
)
@click.option("--max-corpus-mb", type=float, help="Read at most this many MB of the corpus.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), help="A tokenizer.json to use.")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Tokenizer and token cache folder.")
@click.option(
    "--optimizer", type=click.Choice(["adamw8bit", "adamw"]), default="adamw8bit", show_default=True
)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--warmup-steps", default=50, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--log-every", default=10, show_default=True)
@click.option("--eval-every", default=100, show_default=True)
@click.option("--checkpoint-every", default=100, show_default=True)
@click.option("--seed", default=0, show_default=True)
def train(
    preset,
    shards,
    owned_shards,
    max_steps,
    stop_after,
    out,
    resume,
    corpus,
    max_corpus_mb,
    tokenizer,
    cache_dir,
    optimizer,
    lr,
    warmup_steps,
    batch_size,
    seq_len,
    log_every,
    eval_every,
    checkpoint_every,
    seed,
) -> None:
    """Train in one process: every unit (the centralized baseline), or only --owned-shards."""
    from spes_cli.render import TrainProgress

    from spes_p2p.train.data import DataConfig
    from spes_p2p.train.run import RunConfig, TrainingRun
    from spes_p2p.train.trainer import TrainConfig

    cfg = RunConfig(
        preset=preset,
        n_shards=shards,
        owned_shards=owned_shards,
        train=TrainConfig(
            optimizer=optimizer,
            lr=lr,
            warmup_steps=warmup_steps,
            max_steps=max_steps,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            log_every=log_every,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
        ),
        data=DataConfig(
            corpus=corpus,
            max_bytes=int(max_corpus_mb * 1e6) if max_corpus_mb else None,
            tokenizer=tokenizer,
            cache_dir=cache_dir,
            seed=seed,
        ),
    )
    out = out or Path("runs") / f"train-{preset}"
    with console.status(f"Preparing the {corpus} corpus and the {preset} model..."):
        run = TrainingRun(cfg, out, resume=resume)
    console.print(
        f"[bold]{preset}[/]: {run.model.num_params() / 1e6:.2f}M parameters, "
        f"training {', '.join(run.trainer.units)} with {optimizer}; "
        f"{len(run.data.train_ids) / 1e6:.2f}M training tokens"
    )
    with TrainProgress(console, total=max_steps, start=run.trainer.step) as progress:
        try:
            final = run.run(stop_after=stop_after, on_log=progress.update)
        except KeyboardInterrupt:
            console.print(
                f"[yellow]interrupted at step {run.trainer.step}[/]: checkpoint saved; "
                f"continue with the same command plus --resume"
            )
            raise
    progress.summary(final, out)


@spes.command(name="eval")
@click.option(
    "--checkpoint",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="A checkpoint folder, or a run folder (its newest checkpoint).",
)
@click.option("--corpus", help="Evaluate on this corpus's validation split instead of the run's.")
@click.option("--batches", type=int, help="Number of validation batches (default: the run's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_(checkpoint, corpus, batches, as_json) -> None:
    """Validation loss and perplexity of a checkpoint."""
    from spes_p2p.train.run import evaluate_checkpoint

    with console.status("Evaluating..."):
        result = evaluate_checkpoint(checkpoint, corpus=corpus, eval_batches=batches)
    if as_json:
        click.echo(json.dumps(result))
    else:
        console.print(
            f"{result['checkpoint']} (step {result['step']}, {result['tokens']:,} tokens): "
            f"val_loss [bold]{result['val_loss']:.4f}[/], perplexity [bold]{result['perplexity']:.2f}[/] "
            f"over {result['val_tokens']:,} tokens"
        )


@spes.command()
@click.option(
    "--preset", default="small", show_default=True, help=f"Model preset: {', '.join(PRESET_NAMES)}."
)
@click.option("--shards", default=4, show_default=True)
@click.option(
    "--owned-shards",
    callback=parse_shard_list,
    default="0",
    show_default=True,
    metavar="LIST",
    help="Expert shards the peer trains (it also trains --active-blocks of the dense part).",
)
@click.option(
    "--optimizer", type=click.Choice(["adamw8bit", "adamw"]), default="adamw8bit", show_default=True
)
@dense_block_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def memory(
    preset, shards, owned_shards, optimizer, dense_blocks, active_blocks, frozen_experts, as_json
) -> None:
    """Allocated bytes of a peer owning --owned-shards, next to a peer that trains everything."""
    from spes_cli.render import memory_table

    from spes_p2p.train import memory as mem

    with console.status(f"Measuring {preset} with {optimizer}..."):
        report = mem.compare(
            preset,
            shards,
            list(owned_shards),
            optimizer,
            dense_blocks=dense_blocks or 1,
            active_blocks=active_blocks or 1,
            frozen_experts=frozen_experts or "full",
        )
    if as_json:
        click.echo(json.dumps(report))
    else:
        console.print(memory_table(report))


@spes.command()
@swarm_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(config, peers, run_id, log_level, as_json) -> None:
    """Show a swarm: its peers, and the holders of every unit (joins the DHT as a client)."""
    from spes_cli.common import setup_logging
    from spes_cli.render import status_tables

    from spes_p2p.peer import open_transport, swarm_summary
    from spes_p2p.settings import load_settings

    setup_logging(log_level)
    settings = load_settings(config).override(swarm__run_id=run_id, swarm__initial_peers=tuple(peers) or None)
    with console.status("Reading the swarm..."):
        transport = open_transport(settings, new_swarm=False, client=True)
        try:
            summary = swarm_summary(transport, settings.swarm.run_id)
        finally:
            transport.shutdown()
    if as_json:
        click.echo(json.dumps(summary))
        return
    if not summary["config_hashes"]:
        console.print(f"[yellow]no peer of swarm {settings.swarm.run_id!r} found[/] (check --run-id)")
    for table in status_tables(summary):
        console.print(table)


@spes.command()
@click.option("--peers", "n_peers", default=4, show_default=True, help="Peers at the start.")
@click.option("--shards", default=2, show_default=True)
@click.option("--preset", default="tiny", show_default=True)
@click.option("--experts", default=0, help="Experts per MoE layer (default: the preset's; tiny has 8).")
@click.option("--rounds", default=6, show_default=True)
@click.option("--steps-per-round", default=20, show_default=True)
@click.option(
    "--backend",
    type=click.Choice(["hivemind", "memory"]),
    default="hivemind",
    show_default=True,
    help="hivemind: real spes-join processes on 127.0.0.1; memory: every peer in this process.",
)
@click.option(
    "--kill",
    "kills",
    multiple=True,
    metavar="I@ROUND",
    help="SIGKILL peer I (or 'sole': a peer that alone holds a shard) when the swarm reaches ROUND.",
)
@click.option(
    "--join", "joins", multiple=True, metavar="K@ROUND", help="K newcomers when the swarm reaches ROUND."
)
@click.option("--drop", default=0.0, help="Memory backend: probability that a request is lost.")
@click.option("--delay", "delay_ms", default=0.0, help="Memory backend: milliseconds added to every request.")
@click.option("--corrupt", default=0.0, help="Memory backend: probability that an answer has a byte flipped.")
@click.option(
    "--partition",
    "partitions",
    multiple=True,
    metavar="G/G@START[-END]",
    help="Memory backend: e.g. 0,1/2,3@2-3 splits the swarm in rounds 2 to 3.",
)
@click.option("--codec", type=click.Choice(CODECS), default="int8", show_default=True)
@click.option(
    "--method",
    type=click.Choice(["spes", "diloco"]),
    default="spes",
    show_default=True,
    help="diloco: the baseline where every peer trains and averages the full model (Nesterov outer step).",
)
@dense_block_options
@click.option("--rotate-every", default=2, show_default=True, help="Rounds between dense-block rotations.")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--seq-len", default=128, show_default=True)
@click.option("--max-corpus-mb", default=4.0, show_default=True)
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/sim"), show_default=True
)
def simulate(
    experts,
    n_peers,
    shards,
    preset,
    rounds,
    steps_per_round,
    backend,
    kills,
    joins,
    drop,
    delay_ms,
    corrupt,
    partitions,
    codec,
    method,
    dense_blocks,
    active_blocks,
    rotate_every,
    frozen_experts,
    batch_size,
    seq_len,
    max_corpus_mb,
    out,
) -> None:
    """A local swarm on this machine, with crashes, late joins and network faults."""
    from spes_cli.render import SimLive, print_simulation

    from spes_p2p.sim import SimConfig, parse_event, parse_partition, run

    cfg = SimConfig(
        peers=n_peers,
        shards=shards,
        preset=preset,
        experts=experts,
        rounds=rounds,
        steps_per_round=steps_per_round,
        backend=backend,
        kills=tuple(parse_event(k, "--kill") for k in kills),
        joins=tuple(parse_event(j, "--join") for j in joins),
        drop=drop,
        delay_ms=delay_ms,
        corrupt=corrupt,
        partitions=tuple(parse_partition(p) for p in partitions),
        codec=codec,
        method=method,
        dense_blocks=dense_blocks or 1,
        active_blocks=active_blocks or 1,
        rotate_every=rotate_every,
        frozen_experts=frozen_experts or "full",
        batch_size=batch_size,
        seq_len=seq_len,
        max_corpus_mb=max_corpus_mb,
        out=out,
    )
    console.print(
        f"simulating {n_peers} peers ({backend}), {shards} shards, {rounds} rounds of {steps_per_round} "
        f"steps; output in {out}"
    )
    with SimLive(console, rounds) as live:
        summary = run(cfg, on_tick=live.update)
    print_simulation(console, summary, out)
