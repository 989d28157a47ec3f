"""Rich rendering for the commands: progress bars, tables and summaries."""

from __future__ import annotations

import functools
from pathlib import Path

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from spes_p2p.peer.life import Frontend


class TrainProgress:
    """A progress bar showing the latest loss and throughput."""

    def __init__(self, console: Console, total: int, start: int) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, loss="-", val="-", tps="-")

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, record: dict) -> None:
        fields = {"loss": f"{record['loss']:.3f}", "tps": f"{record['tokens_per_s']:,.0f}"}
        if "val_loss" in record:
            fields["val"] = f"{record['val_loss']:.3f}"
        self.progress.update(self.task, completed=record["step"], **fields)

    def summary(self, final: dict, out: Path) -> None:
        if not final:
            self.console.print(f"nothing to do: the run in {out} is already at its last step")
            return
        val = f", val_loss {final['val_loss']:.4f}" if "val_loss" in final else ""
        self.console.print(
            f"[green]done[/] at step {final['step']}: loss {final['loss']:.4f}{val}, "
            f"{final['tokens_per_s']:,.0f} tokens/s. Metrics: {out / 'metrics.jsonl'}, "
            f"checkpoints: {out / 'checkpoints'}"
        )


def print_memory(console: Console, report: dict) -> None:
    """``spes memory``: after one step, the pre-flight line, and the running measurement when made."""
    console.print(memory_table(report))
    pre = report["preflight"]
    console.print(
        pre["problem"]
        or f"pre-flight on {pre['device']}: needs about {_mib(pre['needs_bytes'])} (weights as held, "
        f"gradients, optimizer state, plus 25%) of {_mib(pre['free_bytes'])} free: fits",
        highlight=False,
    )
    if "running" in report:
        console.print(running_table(report["running"]))


def memory_table(report: dict) -> Table:
    table = Table(
        title=f"{report['preset']}: {report['optimizer']}, {report['shards']} shards, "
        f"owning {', '.join(report['owned_units'])}; after one step"
    )
    table.add_column("")
    for column in ("this peer", "DiLoCo peer", "centralized"):
        table.add_column(column, justify="right")
    rows = (report, report["diloco"], report["full"])
    for key, label in (("total_params", "parameters"), ("trainable_params", "trainable parameters")):
        table.add_row(label, *(f"{r[key] / 1e6:,.2f}M" for r in rows))
    for key in ("weights_bytes", "grads_bytes", "optimizer_bytes", "outer_bytes", "total_bytes"):
        label = key.replace("_bytes", "").replace("grads", "gradients").replace("outer", "outer state")
        table.add_row(label, *(_mib(r[key]) for r in rows), style="bold" if key == "total_bytes" else None)
    table.caption = (
        f"this peer: {report['ratio_vs_diloco']:.2f}x a DiLoCo peer, {report['ratio_vs_full']:.2f}x a "
        "centralized trainer"
    )
    return table


def running_table(running: dict) -> Table:
    diloco = running["diloco"]
    table = Table(
        title=f"while training: {running['peers']} peers, {running['rounds']} rounds of "
        f"{running['steps_per_round']} steps; the median peer's steady-state peak"
    )
    table.add_column("")
    table.add_column("this peer", justify="right")
    table.add_column("DiLoCo peer", justify="right")
    for kind, held in running["memory_bytes"].items():
        table.add_row(kind, _mib(held), _mib(diloco["memory_bytes"][kind]))
    table.add_row("peak", _mib(running["peak_bytes"]), _mib(diloco["peak_bytes"]), style="bold")
    table.caption = (
        f"this peer: {running['ratio_vs_diloco']:.2f}x a DiLoCo peer; the process (every peer) peaked at "
        f"{_mib(running['rss_bytes'])} RSS"
    )
    return table


def count(n: int) -> str:
    """A parameter count: 1.17B, 15.2M, 612k."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


# ------------------------------------------------------------------------------------------------- swarm


class JoinView(Frontend):
    """spes-join on a terminal: a spinner per phase, what to share once joined, then the live swarm table."""

    def __init__(self, console: Console, settings) -> None:
        self.console, self.settings = console, settings
        self.live: SwarmLive | None = None

    def __enter__(self) -> JoinView:
        return self

    def __exit__(self, *exc) -> None:
        self._stop_live()

    def phase(self, text: str):
        self._stop_live()
        return self.console.status(text)

    def joined(self, status, reachability, resumed) -> None:
        say = functools.partial(
            self.console.print, soft_wrap=True, highlight=False
        )  # addresses stay copyable
        if resumed:
            say(f"resumed from {resumed}; now at the swarm's round {status.round}")
        say(
            f"peer [bold]{status.peer_id}[/] in swarm [bold]{self.settings.swarm.run_id}[/], "
            f"holding [bold]{', '.join(status.units) or 'nothing'}[/]"
        )
        dialed = {True: "[green]dialed back[/]", False: "[red]not dialed back[/]", None: "not checked"}
        for addr in status.addresses:
            say(f"  dial me at {addr}  ({dialed[reachability.addresses.get(addr)]})")
        color = {"yes": "green", "no": "red"}.get(reachability.reachable, "yellow")
        say(f"[{color}]{reachability.message}[/]")
        invite = self.settings.run.invite
        if self.settings.run.new_swarm:
            where = f"with the invite in {invite} (spes-join --config {invite}), or " if invite else ""
            say(f"New swarm started. Others join {where}with spes-join --peers ADDR (an address above).")

    def update(self, status) -> None:
        if self.live is None:
            self.live = SwarmLive(self.console, self.settings).__enter__()
        self.live.update(status)

    def serving(self, url: str) -> None:
        self.console.print(f"the swarm's page: [bold]{url}[/]", highlight=False)

    def left(self, status) -> None:
        self._stop_live()
        where = f"; outputs in {self.settings.run.out}" if self.settings.run.out else ""
        self.console.print(f"[green]left the swarm[/] after round {status.round}{where}")

    def _stop_live(self) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None


class LiveView:
    """A live table on a terminal; one line per change otherwise (logs, tests). Subclasses say what."""

    def __init__(self, console: Console) -> None:
        from rich.live import Live

        self.console = console
        self.live = Live(console=console, auto_refresh=False) if console.is_terminal else None
        self.last_line = ""

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, item) -> None:
        if self.live:
            self.live.update(self.table(item), refresh=True)
            return
        line = self.line(item)
        if line != self.last_line:
            self.console.print(line, highlight=False, soft_wrap=True)
            self.last_line = line

    def table(self, item) -> Table:
        raise NotImplementedError

    def line(self, item) -> str:
        raise NotImplementedError


class SwarmLive(LiveView):
    """A peer's view of its swarm: units, holders, round, loss, traffic."""

    def __init__(self, console: Console, settings) -> None:
        super().__init__(console)
        self.settings = settings

    def table(self, status) -> Table:
        return swarm_table(self.settings.swarm.run_id, status)

    def line(self, status) -> str:
        coverage = " ".join(f"{u}={len(h)}" for u, h in status.view.holders.items())
        held = ", ".join(status.units)
        line = f"round {status.round}: holding {held}; {len(status.view.peers)} peers; coverage {coverage}"
        line += f"; reachable {status.reachable}"
        if status.loss is not None:
            line += (
                f"; loss {status.loss:.3f}, {status.tokens_per_s:,.0f} tok/s, "
                f"sent {_mib(status.bytes_sent)}, received {_mib(status.bytes_received)}"
            )
        if "data" in status.last:
            line += f"; {_data_line(status.last['data'])}"
        if "memory_peak_bytes" in status.last:
            line += f"; memory {_mib(status.last['memory_peak_bytes'])}"
        if status.banned:
            line += f"; banned {', '.join(status.banned)}"
        return line


def _data_line(data: dict) -> str:
    """Where this peer is in the swarm's dataset."""
    return (
        f"data epoch {data['epoch']}, shard {data['shard']} at window {data['window']}, "
        f"{data['shards_done']} shards done here"
    )


def _memory_line(row: dict) -> str:
    """The round's peak by kind, largest first, and the process's resident memory."""
    kinds = sorted(((b, k) for k, b in row["memory_bytes"].items() if b), reverse=True)
    line = ", ".join(f"{k} {_mib(b)}" for b, k in kinds) + f"; process RSS {_mib(row['rss_bytes'])}"
    if "device_peak_bytes" in row:
        line += f"; GPU peak {_mib(row['device_peak_bytes'])}"
    return line


def swarm_table(run_id: str, status) -> Table:
    table = Table(title=f"swarm {run_id}", caption=f"this peer: {status.peer_id}; Ctrl-C leaves the swarm")
    table.add_column("unit")
    table.add_column("holders", justify="right")
    table.add_column("peers")
    for unit, holders in status.view.holders.items():
        mine = " (this peer)" if unit in status.units else ""
        style = "bold red" if not holders else ("green" if mine else None)
        table.add_row(
            unit + mine,
            str(len(holders)),
            " ".join(sorted(h[-8:] for h in holders)) or "UNCOVERED",
            style=style,
        )
    table.add_section()
    table.add_row(
        "peers seen", str(len(status.view.peers)), f"this peer reachable from the swarm: {status.reachable}"
    )
    loss = "-" if status.loss is None else f"{status.loss:.3f}"
    table.add_row("round", str(status.round), f"loss {loss}, {status.tokens_per_s:,.0f} tok/s")
    table.add_row("traffic", "", f"sent {_mib(status.bytes_sent)}, received {_mib(status.bytes_received)}")
    if "data" in status.last:
        table.add_row("data", str(status.last["data"]["epoch"]), _data_line(status.last["data"]))
    if "memory_peak_bytes" in status.last:
        table.add_row("memory", _mib(status.last["memory_peak_bytes"]), _memory_line(status.last))
    if status.banned:
        table.add_row("banned", str(len(status.banned)), " ".join(p[-8:] for p in status.banned), style="red")
    return table


def status_tables(summary: dict) -> list[Table]:
    d = summary["data"]
    peers = Table(
        title=f"swarm {summary['run_id']}: {len(summary['peers'])} peers, round {summary['round']}",
        caption=(
            f"manifest {summary['manifest'][:16]}, protocol {summary['protocol']}; "
            f"dataset {d['dataset'][:16]}: epoch {d['epoch']}, {d['done']} of {d['shards']} shards done, "
            f"{d['training']} training, {d['stalled']} stalled; {d['tokens']:,} tokens trained by live peers"
        ),
    )
    peers.add_column("peer", overflow="fold")
    columns = ("units", "round", "tokens/s", "loss", "val loss", "sent / received", "DHT / round")
    columns = (*columns, "reachable", "version")
    for col in (*columns, "seen", "score", "banned by"):
        peers.add_column(col)
    for p in summary["peers"]:
        loss, val = ("-" if x is None else f"{x:.3f}" for x in (p["loss"], p["val_loss"]))
        seen = f"{p['seen_seconds_ago']:.0f}s ago"
        reach = "client" if p["client_mode"] else p["reachable"]
        tokens = f"{p['tokens_per_s']:,.0f}"
        banned_by = str(len(p["banned_by"])) if p["banned_by"] else ""
        peers.add_row(
            p["peer_id"],
            ", ".join(p["units"]),
            str(p["round"]),
            tokens,
            loss,
            val,
            f"{_mib(p['bytes_sent'])} / {_mib(p['bytes_received'])}",
            f"{p['dht_ops']} ops, {p['dht_bytes'] / 1024:.0f} KiB",
            reach,
            p["version"],
            seen,
            "-" if p["score"] is None else f"{p['score']:.2f}",
            banned_by,
            style="red" if banned_by else None,
        )
    units = Table(title=f"units (target: {summary['target_replication']} holders per expert shard)")
    units.add_column("unit")
    units.add_column("holders")
    units.add_column("")
    for unit, holders in summary["units"].items():
        flag = "UNCOVERED" if not holders else "below target" if unit in summary["under_replicated"] else ""
        style = "bold red" if not holders else "yellow" if flag else None
        units.add_row(unit, ", ".join(h[-12:] for h in holders), flag, style=style)
    return [peers, units]


class StatusLive(LiveView):
    """spes status --watch: the status tables, refreshed."""

    def table(self, summary: dict):
        return Group(*status_tables(summary))

    def line(self, summary: dict) -> str:
        cover = " ".join(f"{u}={len(h)}" for u, h in summary["units"].items())
        d = summary["data"]
        data = f"epoch {d['epoch']}, {d['done']}/{d['shards']} shards done"
        return f"round {summary['round']}: {len(summary['peers'])} peers; coverage {cover}; {data}"


# -------------------------------------------------------------------------------------------- simulation


class SimLive(LiveView):
    """A simulation's peers, their rounds, and its events."""

    def __init__(self, console: Console, rounds: int) -> None:
        super().__init__(console)
        self.rounds = rounds

    def table(self, tick: dict) -> Table:
        table = Table(title=f"simulation: {tick['elapsed']:.0f}s", caption=_events_line(tick["events"]))
        table.add_column("peer")
        table.add_column("round", justify="right")
        for name, round_ in sorted(tick["rounds"].items()):
            table.add_row(name, f"{round_}/{self.rounds}")
        for name in tick["killed"]:
            table.add_row(name, "killed", style="red")
        return table

    def line(self, tick: dict) -> str:
        return "rounds " + " ".join(f"{n}:{r}" for n, r in sorted(tick["rounds"].items()))


def _events_line(events: list[dict]) -> str:
    return (
        "; ".join(f"{e['type']} {e.get('peer', '')} @ round {e.get('round', '')}" for e in events)
        or "no events"
    )


def print_simulation(console: Console, summary: dict, out: Path) -> None:
    initial, final = summary["initial_loss"], summary["final_loss"]
    loss = (
        f"loss {initial:.3f} -> {final:.3f}"
        if initial is not None and final is not None
        else f"no loss (compute {summary['config']['compute']})"
    )
    console.print(
        f"[green]done[/] in {summary['seconds']:.0f}s: {summary['rounds_completed']} rounds, {loss}, "
        f"uncovered unit-rounds {summary['uncovered_unit_rounds']}, "
        f"rejected payloads {summary['rejected_payloads']}",
        highlight=False,
    )
    dht = summary["dht"]
    busiest = next(iter(dht["served_bytes_per_round"].items()), None)
    what = "key" if dht["served_counted_at"] == "store" else "kind of key (as its readers counted it)"
    console.print(
        f"DHT per peer and round (median): {dht['ops_per_peer_round']:.0f} reads and writes, "
        f"{dht['bytes_per_peer_round'] / 1024:.1f} KiB"
        + (f"; busiest {what} {busiest[0]}: {busiest[1] / 1024:.1f} KiB served a round" if busiest else ""),
        highlight=False,
    )
    apart = summary.get("holders_apart", {})
    if apart:
        units = ", ".join(f"{u} (by up to {d:.2g})" for u, d in apart.items())
        console.print(f"[yellow]holders do not end bit-identical: {units}[/]", highlight=False)
    for failure in summary["failures"]:
        console.print(f"[red]{failure}[/]")
    console.print(f"summary: {out / 'summary.json'}\nplot:    {out / 'loss.png'}", highlight=False)
