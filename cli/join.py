"""``spes-join``: join a swarm (or start one), claim the expert shards it needs most, and train them."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import click
from spes_cli.common import SpesCommand, console, dense_block_options, err_console, swarm_options

from spes_p2p.settings import CODECS


@click.command(cls=SpesCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--new-swarm", is_flag=True, help="Start the first peer of a new swarm (dial nobody).")
@click.option(
    "--addr-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write this peer's dialable multiaddrs here, one per line, once it is up.",
)
@swarm_options
@click.option("--preset", help="Model preset (must match the swarm).")
@click.option("--shards", type=int, help="Number of expert shards (must match the swarm).")
@click.option("--experts", type=int, help="Experts per MoE layer, overriding the preset's (must match).")
@click.option("--capacity", type=int, help="Expert shards this peer trains at once.")
@dense_block_options
@click.option("--replication", type=int, help="Target number of holders per expert shard.")
@click.option("--identity", help="Private key file (created if missing); keeps the peer id across restarts.")
@click.option(
    "--listen", multiple=True, metavar="MULTIADDR", help="Where to accept connections (repeatable)."
)
@click.option(
    "--announce", multiple=True, metavar="MULTIADDR", help="Public address to advertise (repeatable)."
)
@click.option("--client-mode", is_flag=True, default=None, help="Dial out only; hold no shard.")
@click.option("--use-relay", is_flag=True, default=None, help="Use relays to get through NAT.")
@click.option("--heartbeat", type=float, help="Seconds between record refreshes.")
@click.option("--record-ttl", type=float, help="Seconds before a silent peer's records vanish.")
@click.option("--steps-per-round", type=int, help="H: local steps between synchronizations (must match).")
@click.option("--codec", type=click.Choice(CODECS), help="How updates travel.")
@click.option("--overlap/--no-overlap", default=None, help="Sync round k while round k+1 trains.")
@click.option(
    "--method",
    type=click.Choice(["spes", "diloco"]),
    help="diloco: the baseline where every peer trains and averages the full model (must match).",
)
@click.option("--merge/--no-merge", default=None, help="Expert-merging warm-up.")
@click.option("--corpus", help="This peer's data: stdlib, a text/.jsonl file or folder, or hf:NAME.")
@click.option("--max-corpus-mb", type=float, help="Read at most this many MB of the corpus.")
@click.option("--batch-size", type=int)
@click.option("--seq-len", type=int)
@click.option("--lr", type=float)
@click.option("--max-rounds", type=int, help="Stop after this many rounds (default: run until Ctrl-C).")
@click.option("--until-round", type=int, help="Stop once the swarm's round reaches this one.")
@click.option("--resume", is_flag=True, help="Restart from the newest checkpoint in --out (same peer id).")
@click.option(
    "--min-peers",
    type=int,
    default=1,
    show_default=True,
    help="Wait (up to --wait-seconds) for this many peers before training.",
)
@click.option("--wait-seconds", type=float, default=300.0, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Run folder: metrics.jsonl, checkpoints, and on exit model.safetensors and state.json.",
)
@click.version_option(package_name="spes-p2p")
def spes_join(
    new_swarm,
    addr_file,
    config,
    peers,
    run_id,
    log_level,
    preset,
    shards,
    experts,
    capacity,
    dense_blocks,
    active_blocks,
    frozen_experts,
    replication,
    identity,
    listen,
    announce,
    client_mode,
    use_relay,
    heartbeat,
    record_ttl,
    steps_per_round,
    codec,
    overlap,
    method,
    merge,
    corpus,
    max_corpus_mb,
    batch_size,
    seq_len,
    lr,
    max_rounds,
    min_peers,
    wait_seconds,
    out,
    until_round,
    resume,
) -> None:
    """Join a swarm (or start one), claim the expert shard it needs most, and train it with the shard's other
    holders until --max-rounds or Ctrl-C."""
    from spes_cli.common import setup_logging
    from spes_cli.render import SwarmLive, print_joined

    from spes_p2p.peer import Peer, open_transport
    from spes_p2p.settings import load_settings

    setup_logging(log_level)
    settings = load_settings(config).override(
        swarm__run_id=run_id,
        swarm__initial_peers=tuple(peers) or None,
        model__preset=preset,
        model__shards=shards,
        model__experts=experts,
        peer__capacity=capacity,
        model__dense_blocks=dense_blocks,
        peer__active_blocks=active_blocks,
        train__frozen_experts=frozen_experts,
        swarm__target_replication=replication,
        network__identity=identity,
        network__listen=tuple(listen) or None,
        network__announce=tuple(announce) or None,
        network__client_mode=client_mode,
        network__use_relay=use_relay,
        swarm__heartbeat_seconds=heartbeat,
        swarm__record_ttl_seconds=record_ttl,
        method__steps_per_round=steps_per_round,
        method__codec=codec,
        method__overlap=overlap,
        method__mode=method,
        method__merge=merge,
        data__corpus=corpus,
        data__max_corpus_mb=max_corpus_mb,
        train__batch_size=batch_size,
        train__seq_len=seq_len,
        train__lr=lr,
    )
    stop = _stop_on_signals()
    with console.status("Starting the peer and joining the swarm..."):
        transport = open_transport(settings, new_swarm=new_swarm)
    peer = None
    try:
        with console.status("Preparing the model and the data..."):
            peer = Peer(settings, transport, out_dir=out)
        status = peer.join(resume=resume)
        if peer.resumed_from:
            console.print(
                f"resumed from {peer.resumed_from}; now at the swarm's round {peer.round}", highlight=False
            )
        if addr_file:
            _write_lines(addr_file, status.addresses)
        print_joined(console, settings, status, peer.reachability(), new_swarm)
        if min_peers > 1:
            with console.status(f"Waiting for {min_peers} peers..."):
                peer.wait_for_peers(min_peers, wait_seconds, stop)
        with SwarmLive(console, settings) as live:
            live.update(peer.status())
            peer.run(stop, on_update=live.update, max_rounds=max_rounds, until_round=until_round)
        if not stop.is_set():
            with console.status("Serving the last round until the others have it..."):
                peer.drain(settings.swarm.sync_deadline_max)
    finally:
        with console.status("Releasing claims and leaving..."):
            if peer is not None:
                peer.close()
            else:
                transport.shutdown()
    where = f"; outputs in {out}" if out else ""
    console.print(f"[green]left the swarm[/] after round {peer.round}{where}")


def _stop_on_signals() -> threading.Event:
    """SIGINT and SIGTERM ask for a clean stop; a second one stops at once."""
    stop = threading.Event()

    def handle(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        err_console.print(f"[yellow]{signal.Signals(signum).name}: leaving the swarm...[/]")
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop


def _write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
    logging.getLogger(__name__).info("wrote %d address(es) to %s", len(lines), path)
