"""``spes``: train, evaluate and measure locally; look at a swarm; simulate one."""

from __future__ import annotations

import json
from pathlib import Path

import click
from spes_cli.common import SpesGroup, console, setup_logging
from spes_cli.options import settings_options

from spes_p2p.errors import SpesError
from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS

JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
TRAIN_DEFAULTS = {("run", "out"): "runs/train"}


@click.group(cls=SpesGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spes-p2p")
def spes() -> None:
    """Volunteer pretraining of mixture-of-experts language models with sparse expert synchronization."""


@spes.command()
@settings_options(
    "model",
    "train",
    "data",
    "run.out",
    "run.resume",
    "run.owned_shards",
    "run.stop_after",
    exclude=("model.dense_blocks",),
    defaults=TRAIN_DEFAULTS,
)
def train(settings) -> None:
    """Train in one process: every unit (the centralized baseline), or only --owned-shards."""
    from spes_cli.render import TrainProgress

    from spes_p2p.train.run import TrainingRun

    s = settings
    with console.status(f"Preparing the {s.data.corpus} corpus and the {s.model.preset} model..."):
        run = TrainingRun(
            s.model, s.train, s.data, Path(s.run.out), owned_shards=s.run.shard_list(), resume=s.run.resume
        )
    console.print(
        f"[bold]{s.model.preset}[/]: {run.model.num_params() / 1e6:.2f}M parameters, "
        f"training {', '.join(run.trainer.units)} with {s.train.optimizer}; "
        f"{len(run.data.train_ids) / 1e6:.2f}M training tokens"
    )
    with TrainProgress(console, total=s.train.total_steps, start=run.trainer.step) as progress:
        try:
            final = run.run(stop_after=s.run.stop_after, on_log=progress.update)
        except KeyboardInterrupt:
            console.print(
                f"[yellow]interrupted at step {run.trainer.step}[/]: checkpoint saved; "
                f"continue with the same command plus --resume"
            )
            raise
    progress.summary(final, Path(s.run.out))


@spes.command(name="eval")
@click.option(
    "--checkpoint",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="A checkpoint folder, or a run folder (its newest checkpoint).",
)
@click.option("--corpus", help="Evaluate on this corpus's validation split instead of the run's.")
@click.option(
    "--batches", type=click.IntRange(min=1), help="Number of validation batches (default: the run's)."
)
@JSON
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
@settings_options(
    "model", "peer", "train.optimizer", "train.frozen_experts", "train.batch_size", "train.seq_len"
)
@JSON
def memory(settings, as_json) -> None:
    """Allocated bytes of a peer training --capacity expert shards (and --active-blocks of the dense part),
    next to a peer that trains everything."""
    from spes_cli.render import memory_table

    from spes_p2p.train.memory import compare

    s = settings
    with console.status(f"Measuring {s.model.preset} with {s.train.optimizer}..."):
        report = compare(s.model, s.peer.capacity, s.peer.active_blocks, s.train)
    if as_json:
        click.echo(json.dumps(report))
    else:
        console.print(memory_table(report))


@spes.command()
@settings_options("swarm.run_id", "swarm.initial_peers", "run.log_level", default_file=True)
@JSON
def status(settings, as_json) -> None:
    """Show a swarm: its peers, and the holders of every unit (joins the DHT as a client)."""
    from spes_cli.render import status_tables

    from spes_p2p.peer import read_swarm

    setup_logging(settings.run.log_level)
    with console.status("Reading the swarm..."):
        summary = read_swarm(settings)
    if as_json:
        click.echo(json.dumps(summary))
        return
    if not summary["config_hashes"]:
        console.print(f"[yellow]no peer of swarm {settings.swarm.run_id!r} found[/] (check --run-id)")
    for table in status_tables(summary):
        console.print(table)


@spes.command()
@settings_options(
    "sim",
    "swarm",
    "model",
    "method",
    "sync",
    "merge",
    "train",
    "data",
    "peer",
    "run.out",
    "run.rounds",
    exclude=("swarm.initial_peers", "train.log_every", "train.keep_checkpoints"),
    defaults=LOCAL_SWARM_DEFAULTS,
)
def simulate(settings) -> None:
    """A local swarm on this machine, with crashes, late joins and network faults."""
    from spes_cli.render import SimLive, print_simulation

    from spes_p2p.sim import run

    s = settings
    out = Path(s.run.out)
    console.print(
        f"simulating {s.sim.peers} peers ({s.sim.backend}), {s.model.shards} shards, "
        f"{s.run.rounds} rounds of {s.method.steps_per_round} steps; output in {out}"
    )
    with SimLive(console, s.run.rounds) as live:
        summary = run(s, on_tick=live.update)
    print_simulation(console, summary, out)
    if summary["failures"]:
        raise SpesError(
            f"{len(summary['failures'])} peer(s) failed: see {out / 'summary.json'} and their logs"
        )
