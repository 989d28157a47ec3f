"""A simulation's results, read back from its peers' run folders: summary.json and loss.png."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from safetensors.torch import load_file

from spes_p2p.model import UnitLayout
from spes_p2p.model.units import layout_of
from spes_p2p.settings import Settings


def read_rows(folder: Path) -> list[dict]:
    """A peer's metrics rows; a line cut short by a kill is ignored."""
    path = Path(folder) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def summarize(
    settings: Settings,
    peers_dir: Path,
    events: list[dict],
    names: list[str],
    killed: set[str],
    seconds: float,
    failures: list[str],
    leftovers: list[str] = (),
    served: dict[str, int] | None = None,
) -> dict:
    """The simulation's summary, from its peers' run folders; also written to OUT/summary.json.
    ``leftovers``: what of the run still ran after it (processes, threads): a failure. ``served``: the
    bytes each DHT key's reads returned, where the store counted them (``Fleet.served``)."""
    rows = {name: read_rows(peers_dir / name) for name in names}
    completed = 1 + max((r["round"] for rs in rows.values() for r in rs), default=-1)
    summary = {
        "peers": [_peer(n, rows[n], peers_dir, killed, events) for n in names],
        "rounds_completed": completed,
        **_losses(rows, completed),
        **_coverage(settings, rows, completed, peers_dir, killed),
        "newcomers": newcomers(rows, events, {n: _startup(peers_dir / n) for n in names}),
        "churn": churn(rows, events),
        "data": data_split(rows),
        "leftovers": list(leftovers),
        "bytes": {
            n: {"sent": sum(r["bytes_sent"] for r in rs), "received": sum(r["bytes_received"] for r in rs)}
            for n, rs in rows.items()
        },
        "dht": dht_traffic(rows, completed, served),
        "rejected_payloads": sum(
            max((r.get("rejected_payloads", 0) for r in rs), default=0) for rs in rows.values()
        ),
        "byzantine": byzantine(settings, rows, killed),
        "events": events,
        "failures": failures,
        "seconds": seconds,
        "config": _config(settings),
    }
    summary["failures"] = _failures(settings, rows, failures, summary["churn"], leftovers)
    (Path(settings.run.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


DHT_FIELDS = ("reads", "entries", "read_bytes", "writes", "written_bytes")
BUSIEST_KEYS = 5


def dht_traffic(rows: dict[str, list[dict]], completed: int, served: dict[str, int] | None) -> dict:
    """The swarm's DHT traffic: the median peer-round's reads and writes and their value bytes, in all and
    by kind of key (``net.transport.key_kind``); and the bytes the busiest keys served per round, counted at
    the store where it could be (``served``), else as the bytes the readers' reads returned, by kind of key
    (a real backend's keepers of a key serve at least that: a read may ask several of them)."""
    each = [r for rs in rows.values() for r in rs if "dht" in r]
    kinds = sorted({k for r in each for k in r["dht"]})
    if served is None:
        served, counted = Counter(), "readers"
        for r in each:
            served.update({kind: c["read_bytes"] for kind, c in r["dht"].items()})
    else:
        counted = "store"
    busiest = sorted(served.items(), key=lambda kv: (-kv[1], kv[0]))[:BUSIEST_KEYS]
    return {
        "ops_per_peer_round": _median([r["dht_ops"] for r in each]),
        "bytes_per_peer_round": _median([r["dht_bytes"] for r in each]),
        "by_kind": {
            k: {f: _median([r["dht"].get(k, {}).get(f, 0) for r in each]) for f in DHT_FIELDS} for k in kinds
        },
        "served_counted_at": counted,  # "store": by key; "readers": by kind of key
        "served_bytes_per_round": {key: n / max(1, completed) for key, n in busiest},
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def data_split(rows: dict[str, list[dict]]) -> dict:
    """How the swarm went through its dataset (the windows each round trained, ``row["data"]["trained"]``):
    tokens trained, the last epoch reached, per epoch the shards trained and those of which some windows
    were trained more than once (by two peers, or again by one that continued a crashed peer's shard
    from its last recorded position)."""
    ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r in (r for rs in rows.values() for r in rs if "data" in r):
        for epoch, shard, first, end in r["data"]["trained"]:
            ranges.setdefault((epoch, shard), []).append((first, end))
    epochs: dict[int, dict] = {}
    for (epoch, _), spans in sorted(ranges.items()):
        again, covered = 0, 0  # windows read again; the end of those read so far
        for first, end in sorted(spans):
            again += max(0, min(end, covered) - first)
            covered = max(covered, end)
        count = epochs.setdefault(epoch, {"shards_trained": 0, "shards_trained_twice": 0, "windows_twice": 0})
        count["shards_trained"] += 1
        count["shards_trained_twice"] += again > 0
        count["windows_twice"] += again
    return {
        "tokens": sum(r["round_tokens"] for rs in rows.values() for r in rs),
        "epoch": max(epochs, default=0),
        "epochs": {str(e): c for e, c in sorted(epochs.items())},
    }


def _peer(name: str, rows: list[dict], peers_dir: Path, killed: set[str], events: list[dict]) -> dict:
    return {
        "name": name,
        "killed": name in killed,  # (down at the end)
        "kills": sum(e["type"] == "kill" and e["peer"] == name for e in events),
        "rounds": len(rows),
        "resynced_rounds": sum(bool(r.get("resynced")) for r in rows),  # started off the swarm's weights
        "final_round": _final_round(peers_dir / name, rows),
    }


def _config(settings: Settings) -> dict:
    return {
        "peers": settings.sim.peers,
        "shards": settings.model.shards,
        "preset": settings.model.preset,
        "rounds": settings.run.rounds,
        "steps_per_round": settings.method.steps_per_round,
        "backend": settings.swarm.backend,
        "codec": settings.sync.codec,
        "compute": settings.sim.compute,  # virtual: no model ran, there is no loss
    }


def _failures(
    settings: Settings, rows: dict[str, list[dict]], failures: list[str], churned: dict, leftovers
) -> list[str]:
    """The peers' own failures, then what the rows show went wrong: a split swarm, a restart that did not
    come back, processes left running."""
    attackers = {f"peer{i}" for i in settings.sim.byzantine_peers}  # (it may split itself off: its business)
    return [
        *failures,
        *splits({n: rs for n, rs in rows.items() if n not in attackers}),
        *(f"{r['peer']} restarted at round {r['round']} {r['problem']}" for r in churned["not_back"]),
        *([f"left running after the run: {', '.join(leftovers)}"] if leftovers else []),
    ]


def byzantine(settings: Settings, rows: dict[str, list[dict]], killed: set[str]) -> dict:
    """Per malicious peer: its attack, who banned it and whose screening left some of its updates out;
    how many refusals the honest peers counted; and the honest peers' final validation loss (the figure an
    attack must not move)."""
    attackers = {f"peer{i}": mode for i, mode in settings.sim.byzantine_peers.items()}
    if not attackers:
        return {}
    honest = {n: rs[-1] for n, rs in rows.items() if rs and n not in attackers and n not in killed}
    val = [row["val_loss"] for row in honest.values() if "val_loss" in row]

    def left_out_by(name: str) -> list[str]:
        ids = {name} | {r["peer"] for r in rows.get(name, []) if "peer" in r}
        return sorted(
            n
            for n in honest
            if any(ids & set(peers) for r in rows[n] for peers in r.get("left_out", {}).values())
        )

    return {
        "attackers": {
            name: {
                "mode": mode,
                "banned_by": sorted(n for n, row in honest.items() if name in row.get("banned", [])),
                "left_out_by": left_out_by(name),
            }
            for name, mode in attackers.items()
        },
        "honest_rejected": sum(row.get("rejected", 0) for row in honest.values()),
        "honest_final_val_loss": statistics.fmean(val) if val else None,
    }


def churn(rows: dict[str, list[dict]], events: list[dict]) -> dict:
    """Kills and restarts, and whether each restarted peer came back with its id: it wrote rows after the
    restart (its event says how many it had before), all with the one peer id of its rows before."""
    restarts = [e for e in events if e["type"] == "restart"]
    not_back = []
    for event in restarts:
        peer_rows = rows.get(event["peer"], [])
        before = {r.get("peer") for r in peer_rows[: event["rows"]]}
        after = {r.get("peer") for r in peer_rows[event["rows"] :]}
        if not after:
            problem = "did not come back (no round trained since)"
        elif len(before | after) != 1:
            problem = (
                f"came back with another peer id ({sorted(map(str, after))} after {sorted(map(str, before))})"
            )
        else:
            continue
        not_back.append({"peer": event["peer"], "round": event["round"], "problem": problem})
    return {
        "kills": sum(e["type"] == "kill" for e in events),
        "restarts": len(restarts),
        "back_with_id": len(restarts) - len(not_back),
        "not_back": not_back,
    }


def _counted_rounds(rows: list[dict]) -> list[int]:
    """The rounds in which this peer's own update counted (it is among its units' participants)."""
    return [r["round"] for r in rows if any(r.get("peer") in p for p in r["participants"].values())]


def newcomers(
    rows: dict[str, list[dict]], events: list[dict], startup: dict[str, dict] | None = None
) -> list[dict]:
    """Per newcomer: the round it was asked to join at, the first round its update counted in, and the
    seconds from its launch to each start-up milestone (``startup.json``)."""
    out = []
    for event in events:
        if event["type"] == "join":
            counted = _counted_rounds(rows.get(event["peer"], []))
            first = counted[0] if counted else None
            out.append(
                {
                    "name": event["peer"],
                    "join_round": event["round"],
                    "first_counted_round": first,
                    "rounds_late": None if first is None else first - event["round"],
                    "startup_seconds": (startup or {}).get(event["peer"], {}),
                }
            )
    return out


def _startup(folder: Path) -> dict:
    path = folder / "startup.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return {}


def splits(rows: dict[str, list[dict]]) -> list[str]:
    """Groups of peers that trained the same unit in the same round but never met in an exchange (one used
    an update of the other): a swarm split in two. Peers that share no unit, like lone holders of dense
    blocks, rightly never meet."""
    ids = {name: rs[0]["peer"] for name, rs in rows.items() if rs and "peer" in rs[0]}
    names = {peer_id: name for name, peer_id in ids.items()}
    group = {peer_id: frozenset({peer_id}) for peer_id in names}
    trainers: dict[tuple[int, str], set[str]] = {}
    for name, peer_id in ids.items():
        for row in rows[name]:
            for unit, participants in row["participants"].items():
                trainers.setdefault((row["round"], unit), set()).add(peer_id)
                met = group[peer_id].union(*(group.get(p, {p}) for p in participants)).intersection(names)
                group.update(dict.fromkeys(met, met))
    apart = {frozenset(group[p] for p in peers) for peers in trainers.values()}
    described = sorted(
        " | ".join(sorted(", ".join(sorted(names[p] for p in c)) for c in components))
        for components in apart
        if len(components) > 1
    )
    return [
        f"split: these groups of peers trained the same units but never met in an exchange: {d}"
        for d in described
    ]


def _losses(rows: dict[str, list[dict]], completed: int) -> dict:
    trained = [row for rs in rows.values() for row in rs if row["loss"] is not None]  # (virtual: none)
    by_round = {r: [row["loss"] for row in trained if row["round"] == r] for r in range(completed)}
    first, last = by_round.get(0), by_round.get(completed - 1)
    final_val = [row["val_loss"] for rs in rows.values() for row in rs[-1:] if "val_loss" in row]
    initial = statistics.fmean(first) if first else None
    final = statistics.fmean(last) if last else None
    return {
        "initial_loss": initial,
        "final_loss": final,
        "loss_fell": None if initial is None or final is None else final < initial,
        "final_val_loss": statistics.fmean(final_val) if final_val else None,  # of peers that evaluated last
        "loss_by_round": {str(r): statistics.fmean(v) for r, v in by_round.items() if v},
    }


def _coverage(
    settings: Settings, rows: dict[str, list[dict]], completed: int, peers_dir: Path, killed: set
) -> dict:
    """Who trained each unit in each round, the unit-rounds nobody trained, and whether holders agree."""
    layout = layout_of(settings.model)
    holders = {
        u: {  # string keys, as in summary.json
            str(r): sorted(
                n for n, rs in rows.items() for row in rs if row["round"] == r and u in row["units"]
            )
            for r in range(completed)
        }
        for u in layout.units
    }
    names = list(rows)
    difference = {u: _holder_difference(peers_dir, names, killed, layout, u) for u in layout.units}
    return {
        "uncovered_unit_rounds": sum(1 for u in holders for r in holders[u] if not holders[u][r]),
        "units": {u: {"holders": holders[u], "max_holder_difference": difference[u]} for u in layout.units},
        "holders_apart": {u: d for u, d in difference.items() if d},  # holders that do not end bit-identical
    }


def _final_round(folder: Path, rows: list[dict]) -> int:
    state = folder / "state.json"
    if state.exists():
        return json.loads(state.read_text())["round"]
    return rows[-1]["round"] + 1 if rows else 0


def _holder_difference(
    peers_dir: Path, names: list[str], killed: set[str], layout: UnitLayout, unit: str
) -> float | None:
    """The largest absolute difference of any tensor of ``unit`` between the survivors that hold it at the
    end (0.0: they agree bit for bit; None: fewer than two holders to compare)."""
    models = []
    for name in names:
        state_path, model_path = peers_dir / name / "state.json", peers_dir / name / "model.safetensors"
        if name in killed or not state_path.exists() or not model_path.exists():
            continue
        if unit in json.loads(state_path.read_text())["units"]:
            models.append(load_file(model_path))
    if len(models) < 2:
        return None
    keys = [k for k in models[0] if layout.unit_of(k) == unit]
    return max(float((m[k] - models[0][k]).abs().max()) for m in models[1:] for k in keys)


def plot_losses(peers_dir: Path, events: list[dict], path: Path) -> None:
    """Loss per peer (thin) and the mean (thick) over rounds; kills, restarts and joins marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    per_round: dict[int, list[float]] = {}
    for folder in sorted(Path(peers_dir).iterdir()):
        rows = [r for r in read_rows(folder) if r["loss"] is not None]
        if rows:
            ax.plot(
                [r["round"] for r in rows], [r["loss"] for r in rows], lw=0.8, alpha=0.6, label=folder.name
            )
            for r in rows:
                per_round.setdefault(r["round"], []).append(r["loss"])
    if per_round:
        xs = sorted(per_round)
        ax.plot(xs, [statistics.fmean(per_round[x]) for x in xs], color="black", lw=2.5, label="mean")
    colors = {"kill": "tab:red", "join": "tab:green", "restart": "tab:blue"}
    for event in events:
        if event["type"] in colors:
            color = colors[event["type"]]
            ax.axvline(event["round"], color=color, ls="--", lw=1)
            ax.annotate(
                f"{event['type']} {event['peer']}",
                (event["round"], 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                fontsize=7,
                color=color,
            )
    ax.set_xlabel("round")
    ax.set_ylabel("training loss")
    ax.set_title("spes simulate")
    if per_round:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
