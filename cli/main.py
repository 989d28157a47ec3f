"""``spes``: train, evaluate and measure locally; look at a swarm; simulate one."""

from __future__ import annotations

import json
from pathlib import Path

import click
from spes_cli.common import SpesGroup, console, err_console
from spes_cli.data import data
from spes_cli.options import settings_options

from spes_p2p.compat import setup_logging
from spes_p2p.errors import SpesError
from spes_p2p.sim.config import LOCAL_SWARM_DEFAULTS

JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
TRAIN_DEFAULTS = {"run.out": "runs/train"}


@click.group(cls=SpesGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spes-p2p")
def spes() -> None:
    """Volunteer pretraining of mixture-of-experts language models with sparse expert synchronization."""


spes.add_command(data)


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
        f"training {', '.join(run.trainer.units)} with {s.train.optimizer} on {run.device.type}; "
        f"{run.data.index.tokens('train') / 1e6:.2f}M training tokens"
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


CHECKPOINT = click.option(
    "--checkpoint",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="A checkpoint folder, or a run folder (of spes train or of a swarm peer: its newest model).",
)
TOKENIZER = click.option(
    "--tokenizer",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The tokenizer file, when none is saved beside the model.",
)


@spes.command(name="export")
@CHECKPOINT
@click.option("--out", required=True, type=click.Path(path_type=Path), help="A new folder for the export.")
@TOKENIZER
def export(checkpoint, out, tokenizer) -> None:
    """Write a model as a folder that transformers loads (AutoModelForCausalLM, AutoTokenizer)."""
    from spes_p2p.interop.hf_export import export_hf
    from spes_p2p.interop.saved import load_saved

    with console.status("Exporting..."):
        saved = load_saved(checkpoint, tokenizer)
        folder, architecture = export_hf(saved, out)
    console.print(
        f"{saved.path} -> [bold]{folder}[/] ({architecture}, {saved.config.n_layers} layers, "
        f"{saved.config.n_experts} experts, vocabulary {saved.config.vocab_size:,})\n"
        f"load it with: AutoModelForCausalLM.from_pretrained({str(folder)!r}) "
        "(pip install 'spes-p2p\\[hf]' for transformers)"
    )


@spes.command(name="upcycle")
@click.option(
    "--from",
    "source",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A dense transformers model folder (Llama, Qwen2 or Qwen3): config.json, safetensors and "
    "tokenizer.json.",
)
@click.option("--experts", required=True, type=click.IntRange(min=1), help="Experts per MoE layer.")
@click.option("--top-k", type=click.IntRange(min=1), default=2, show_default=True, help="Experts per token.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the routers' initial weights.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="A new folder for the MoE.")
def upcycle_(source, experts, top_k, seed, out) -> None:
    """Turn a dense model into an MoE whose experts are copies of its MLPs; a swarm starts from it with
    spes-join --new-swarm --init OUT."""
    from spes_cli.render import count

    from spes_p2p.interop.upcycle import read_dense, upcycle, write_upcycled

    with console.status("Upcycling..."):
        model, tokenizer = upcycle(read_dense(source), experts, top_k, seed)
        checkpoint = write_upcycled(model, tokenizer, source, out)
    cfg = model.cfg
    console.print(
        f"{source} -> [bold]{checkpoint}[/] ({cfg.n_layers} layers, {cfg.n_experts} experts of width "
        f"{cfg.expert_dim}, top-{cfg.top_k}; {count(model.num_params())} parameters, "
        f"{count(model.num_active_params())} active)\n"
        f"found a swarm from it: spes-join --new-swarm --init {out}"
    )


@spes.command()
@CHECKPOINT
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True, help="0: greedy."
)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True)
@click.option("--greedy", is_flag=True, help="Always the likeliest token (as --temperature 0).")
@click.option("--seed", type=int, help="Seed the sampling, for the same text again.")
@TOKENIZER
def generate(checkpoint, prompt, max_tokens, temperature, top_p, greedy, seed, tokenizer) -> None:
    """Continue a prompt with a model, streamed to the terminal."""
    from spes_p2p.interop.saved import load_saved
    from spes_p2p.interop.text import stream_text
    from spes_p2p.model.sampling import Sampling

    sampling = Sampling(max_tokens, 0.0 if greedy else temperature, top_p, seed)
    saved = load_saved(checkpoint, tokenizer)
    where = f"round {saved.round}" if saved.round is not None else f"step {saved.step}"
    err_console.print(f"[dim]{saved.path} ({where})[/]")
    click.echo(prompt, nl=False)
    for piece in stream_text(saved, prompt, sampling):
        click.echo(piece, nl=False)
    click.echo()


@spes.command()
@settings_options(
    "model",
    "peer",
    "train.device",
    "train.optimizer",
    "train.frozen_experts",
    "train.frozen_dense",
    "train.batch_size",
    "train.seq_len",
)
@JSON
@click.option(
    "--running",
    is_flag=True,
    help="Also measure peers while they train: a local swarm of this model and one of DiLoCo peers, a few "
    "rounds each (minutes; memory for every peer of both).",
)
def memory(settings, as_json, running) -> None:
    """Allocated bytes of a peer training --capacity expert shards (and --active-blocks of the dense part),
    next to a DiLoCo peer and a centralized trainer; whether it fits --device's free memory; with --running,
    the steady-state peak of peers that train."""
    from spes_cli.render import print_memory

    from spes_p2p.sim.running_memory import report

    s = settings
    with console.status(f"Measuring {s.model.preset} with {s.train.optimizer}..."):
        result = report(s, running)
    if as_json:
        click.echo(json.dumps(result))
    else:
        print_memory(console, result)


@spes.command()
@settings_options("swarm.run_id", "swarm.initial_peers", "swarm.backend", "run.log_level", default_file=True)
@JSON
@click.option(
    "--watch",
    is_flag=True,
    help="Keep the table on screen, refreshed every --every seconds (with --json: a JSON line each time).",
)
@click.option("--every", type=click.FloatRange(min=0.5), default=5.0, show_default=True)
def status(settings, as_json, watch, every) -> None:
    """Show a swarm: its peers, and the holders of every unit (joins the DHT as a client)."""
    from spes_cli.render import StatusLive, status_tables

    from spes_p2p.peer import SwarmReader
    from spes_p2p.peer.life import stop_on_signals

    setup_logging(settings.run.log_level)
    with console.status("Reading the swarm..."):
        reader = SwarmReader(settings)
    with reader:
        if watch and as_json:
            reader.watch(every, lambda summary: click.echo(json.dumps(summary)), stop_on_signals())
            return
        if watch:
            with StatusLive(console) as live:
                reader.watch(every, live.update, stop_on_signals())
            return
        summary = reader.read()
    if as_json:
        click.echo(json.dumps(summary))
        return
    for table in status_tables(summary):
        console.print(table)


@spes.command()
@settings_options("swarm.run_id", "swarm.initial_peers", "swarm.backend", "run.log_level", default_file=True)
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The invite file."
)
def invite(settings, out) -> None:
    """Write an invite to a running swarm: a peers.toml that joins it (spes-join --config FILE)."""
    from spes_p2p.peer import SwarmReader, write_invite
    from spes_p2p.peer.status import live_addresses

    setup_logging(settings.run.log_level)
    with console.status("Reading the swarm..."), SwarmReader(settings) as reader:
        summary = reader.read()
        write_invite(out, settings, reader.manifest, live_addresses(reader.transport, settings.swarm.run_id))
    console.print(
        f"invite to swarm [bold]{summary['run_id']}[/] ({len(summary['peers'])} live peers, round "
        f"{summary['round']}) written to {out}; join with: spes-join --config {out}",
        highlight=False,
    )


@spes.command()
@settings_options(
    "swarm.run_id",
    "swarm.initial_peers",
    "swarm.backend",
    "dashboard",
    "run.log_level",
    default_file=True,
    defaults={"dashboard.port": 8080},
    flags={"dashboard.port": "--port", "dashboard.host": "--host"},
)
def dashboard(settings) -> None:
    """Serve a live web page of a swarm: its peers, which units need volunteers, loss and traffic (joins the
    DHT as a client: it claims and trains nothing). --port 0 picks a free port."""
    from spes_p2p.dashboard.server import Dashboard
    from spes_p2p.peer import SwarmReader
    from spes_p2p.peer.life import stop_on_signals

    setup_logging(settings.run.log_level)
    with console.status("Joining the swarm's DHT..."):
        reader = SwarmReader(settings)
    with reader, Dashboard(reader.read, settings.dashboard.host, settings.dashboard.port) as board:
        console.print(f"the dashboard of swarm {settings.swarm.run_id!r}: {board.url} (Ctrl-C to stop)")
        stop = stop_on_signals()
        while not stop.wait(1.0):
            pass


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
@click.option(
    "--cleanup",
    is_flag=True,
    help="Remove the network namespaces (and their processes) that killed --netns runs left, then exit.",
)
def simulate(settings, cleanup: bool) -> None:
    """A local swarm on this machine, with crashes, late joins and network faults."""
    from spes_cli.render import SimLive, print_simulation

    from spes_p2p.sim import run

    if cleanup:
        from spes_p2p.sim.netns import cleanup as remove_leftovers

        removed = remove_leftovers()
        console.print(f"removed {len(removed)} namespace(s) of dead runs: {', '.join(removed) or 'none'}")
        return
    s = settings
    out = Path(s.run.out)
    console.print(
        f"simulating {s.sim.peers} peers ({s.swarm.backend}, {s.sim.compute} compute), {s.model.shards} "
        f"shards, {s.run.rounds} rounds of {s.method.steps_per_round} steps; output in {out}"
    )
    with SimLive(console, s.run.rounds) as live:
        summary = run(s, on_tick=live.update)
    print_simulation(console, summary, out)
    if summary["failures"]:
        raise SpesError(
            f"{len(summary['failures'])} peer(s) failed: see {out / 'summary.json'} and their logs"
        )
