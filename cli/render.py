"""Rich rendering for the commands: progress bars, tables and summaries."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


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


def memory_table(report: dict) -> Table:
    table = Table(
        title=f"{report['preset']}: {report['optimizer']}, {report['shards']} shards, "
        f"owning {', '.join(report['owned_units'])}"
    )
    table.add_column("")
    table.add_column("this peer", justify="right")
    table.add_column("trains everything", justify="right")
    full = report["full"]
    for key, label in (("total_params", "parameters"), ("trainable_params", "trainable parameters")):
        table.add_row(label, f"{report[key] / 1e6:,.2f}M", f"{full[key] / 1e6:,.2f}M")
    for key in ("weights_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"):
        table.add_row(
            key.replace("_bytes", "").replace("grads", "gradients"),
            _mib(report[key]),
            _mib(full[key]),
            style="bold" if key == "total_bytes" else None,
        )
    table.caption = (
        f"this peer uses {report['ratio_vs_full']:.2f}x the memory of a peer that trains everything"
    )
    return table


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
