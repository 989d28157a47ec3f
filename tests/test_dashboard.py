"""The swarm's dashboard: its history of reads (events, losses and traffic by round, rates), its charts,
and its API over HTTP, for a swarm on the memory backend (the page in a browser: test_dashboard_browser)."""

import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spes_p2p.dashboard.charts import line_chart
from spes_p2p.dashboard.history import FAR, MAX_ROUNDS, SwarmHistory
from spes_p2p.dashboard.server import Dashboard
from spes_p2p.errors import SpesError
from spes_p2p.net.memory import MemoryNetwork
from spes_p2p.peer import Peer
from spes_p2p.peer.status import SwarmReader
from spes_p2p.settings import Settings
from spes_p2p.swarm.records import Progress

pytestmark = pytest.mark.timeout(180)


def entry(peer_id, round_=0, loss=None, units=("experts/0",), **figures) -> dict:
    base = {"val_loss": None, "tokens": 0, "bytes_sent": 0, "bytes_received": 0, "rejected": 0, "banned": []}
    return {"peer_id": peer_id, "round": round_, "loss": loss, "units": list(units), **base, **figures}


def summary(*peers, uncovered=()) -> dict:
    return {
        "round": max((p["round"] for p in peers), default=0),
        "peers": list(peers),
        "uncovered": list(uncovered),
    }


def test_the_history_tells_joins_leaves_claims_rejections_bans_and_coverage():
    history = SwarmHistory()
    history.add(summary(entry("a"), entry("b")), at=0.0)
    history.add(
        summary(
            entry("a", units=("experts/1",), rejected=3, banned=["c"]),
            entry("c"),
            uncovered=("experts/0",),
        ),
        at=10.0,
    )
    history.add(summary(entry("a", units=("experts/1",), rejected=3, banned=["c"]), entry("c")), at=20.0)
    events = [(e["who"], e["kind"], e["text"]) for e in reversed(history.view()["events"])]
    assert events == [
        ("", "watch", "watching 2 live peers"),
        ("c", "join", "joined, holding experts/0"),
        ("b", "leave", "left (or its record expired)"),
        ("a", "claim", "now holds experts/1"),
        ("a", "rejected", "rejected 3 message(s) of other peers"),
        ("a", "ban", "banned c"),
        ("experts/0", "uncovered", "no live peer trains it"),
        ("experts/0", "covered", "trained again"),
    ]


def test_the_history_takes_the_median_loss_by_round_and_counts_traffic_and_rates():
    history = SwarmHistory()
    history.add(
        summary(entry("a", 1, 4.0, tokens=100, bytes_sent=10), entry("b", 1, 5.0, val_loss=4.5)), at=0.0
    )
    history.add(
        summary(
            entry("a", 2, 3.0, tokens=1100, bytes_sent=510, bytes_received=40),
            entry("b", 3, 2.0, tokens=2000, bytes_sent=300),
        ),
        at=1800.0,
    )
    history.add(summary(entry("a", 3, 2.5, tokens=50, bytes_sent=5)), at=3600.0)  # a restarted: counts from 0
    view = history.view()
    assert view["rounds"] == [1, 2, 3]
    assert view["loss"] == [4.0, 3.0, 2.0] and view["val_loss"] == [4.5, None, None]  # (the median_low)
    assert view["sent"] == [0, 500 + 150, 150] and view["received"] == [0, 40, 0]  # (b: 2 rounds, 300 B)
    assert view["rounds_per_hour"] == 2.0  # round 1 to 3 in an hour
    assert view["tokens_per_hour"] == 1000 + 2000  # (b's tokens since its first read: 2000)


def test_a_peer_that_claims_to_be_far_ahead_stretches_neither_the_charts_nor_the_pace():
    history = SwarmHistory()
    honest = [entry(p, 1, 4.0) for p in "abc"]
    history.add(summary(*honest, entry("liar", 0, bytes_sent=0)), at=0.0)
    history.add(summary(*honest, entry("liar", 10**15, 0.1, bytes_sent=10**12)), at=3600.0)
    view = history.view()
    assert view["rounds"] == [0, 1] and view["loss"] == [None, 4.0] and view["sent"] == [0, 0]
    assert view["round"] == 1 and view["rounds_per_hour"] == 0.0  # the median peer's
    history.add(summary(*honest, entry("liar", 10**15 + 1, bytes_sent=0)), at=7200.0)
    history.add(summary(*[entry(p, 10**15) for p in "abc"], entry("liar", 10**15, bytes_sent=300)), at=7201.0)
    assert len(history.view()["rounds"]) == 2 + FAR  # its jump spread over the last FAR rounds only


def test_the_history_keeps_only_the_last_rounds():
    history = SwarmHistory()
    for r in range(MAX_ROUNDS + 10):
        history.add(summary(entry("a", r, 1.0)), at=float(r))
    assert history.view()["rounds"] == list(range(10, MAX_ROUNDS + 10))


def test_a_chart_draws_each_series_and_escapes_what_peers_wrote():
    svg = line_chart("loss", {"<script>x</script>": [(0, 3.0), (1, None), (2, 2.0)], "b": [(1, 1.0)]})
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    assert "no data yet" in line_chart("loss", {"a": [(0, None)]})


@pytest.fixture(scope="module")
def joined():
    """A founder that reports 2 rounds done, and a second peer, on one memory network."""
    net = MemoryNetwork(seed=0)
    settings = Settings().override({"model.shards": 2, "method.overlap": False, "data.max_corpus_mb": 1.0})
    founder, other = Peer(settings, net.join("founder")), Peer(settings, net.join("other"))
    founder.join()
    other.join()
    founder.transport.stats.bytes_sent = 12345
    progress = Progress(tokens_per_s=100.0, loss=3.5, val_loss=3.25, tokens=8192, dht_ops=37, dht_bytes=20480)
    founder.member.report(2, progress, 0)
    founder.member.heartbeat()
    work = founder.data.take()
    founder.data.record(work, 3, done=True)  # its dataset's one training shard, read to its end
    founder.data.commit([[*work[:2], 0, 3]])  # (and its round landed: done in epoch 0)
    yield net, founder
    other.close()
    founder.close()


def get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_api_serves_the_status_the_page_and_prometheus_metrics(joined):
    net, founder = joined
    with SwarmReader(founder.settings, transport=net.join("observer")) as reader:
        with Dashboard(reader.read) as board:
            assert board.url.startswith("http://127.0.0.1:")
            board.refresh()
            status, headers, body = get(board.url + "api/status")
            assert status == 200 and "default-src 'self'" in headers["content-security-policy"]
            served, direct = json.loads(body), reader.read()
            for p in served["peers"] + direct["peers"]:
                del p["seen_seconds_ago"]
            assert served == direct  # the same JSON as `spes status --json`
            founder_entry = next(p for p in served["peers"] if p["peer_id"] == "founder")
            assert founder_entry["round"] == 2 and founder_entry["val_loss"] == 3.25
            assert founder_entry["tokens"] == 8192 and founder_entry["bytes_sent"] == 12345
            assert (founder_entry["dht_ops"], founder_entry["dht_bytes"]) == (37, 20480)

            page = json.loads(get(board.url + "api/dashboard")[2])
            assert page["error"] is None and page["history"]["loss"] == [None, 3.5]  # (round 0: other)
            assert page["charts"]["loss"].count("<circle") == 2  # one point of each loss so far

            metrics = {
                (s.name, tuple(s.labels.items())): s.value
                for family in text_string_to_metric_families(get(board.url + "metrics")[2].decode())
                for s in family.samples
            }
            assert metrics["spes_peer_round", (("peer", "founder"),)] == 2
            assert metrics["spes_swarm_peers", ()] == 2 and metrics["spes_dashboard_read_ok", ()] == 1
            sent = metrics["spes_peer_sent_bytes_total", (("peer", "founder"),)]
            assert sent == founder_entry["bytes_sent"]
            assert metrics["spes_peer_dht_ops", (("peer", "founder"),)] == 37
            assert metrics["spes_peer_dht_bytes", (("peer", "founder"),)] == 20480
            holders = {dict(k[1])["unit"]: v for k, v in metrics.items() if k[0] == "spes_unit_holders"}
            assert holders == {u: len(h) for u, h in served["units"].items()}
            data = {
                k: served["data"][k] for k in ("epoch", "shards", "done", "training", "stalled", "tokens")
            }
            assert data == {"epoch": 0, "shards": 1, "done": 1, "training": 0, "stalled": 0, "tokens": 8192}
            assert all(metrics[f"spes_data_{k}", ()] == v for k, v in data.items())

            assert b'id="peers"' in get(board.url)[2] and get(board.url + "static/page.js")[0] == 200
            assert get(board.url + "static/..%2fserver.py")[0] == 404
            request = urllib.request.Request(board.url + "api/status", data=b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError, match="405"):
                urllib.request.urlopen(request, timeout=30)


def test_the_largest_finite_figures_peers_can_write_neither_stop_the_reader_nor_break_the_page(joined):
    """Two fake peers reporting a loss of 1.7e308 used to crash the reader thread (a mean that overflowed):
    the page froze for good."""
    net, founder = joined
    with SwarmReader(founder.settings, transport=net.join("observer")) as reader:
        real = reader.read()
    huge, count = 1.7e308, 2**63 - 1
    honest = {**real["peers"][0], "loss": -huge, "val_loss": 4.0}
    fakes = [
        {**honest, "peer_id": p, "round": 10**15, "loss": huge, "val_loss": huge, "tokens": count}
        for p in ("f1", "f2")
    ]
    lied = {**real, "peers": [honest, *fakes]}
    with Dashboard(lambda: lied) as board:
        for _ in range(2):
            board.refresh()
        status, _, body = get(board.url + "api/dashboard")
        page = json.loads(body)
        assert status == 200 and page["error"] is None and set(page["history"]["loss"]) == {-huge, huge}
        assert "nan" not in page["charts"]["loss"] and "inf" not in page["charts"]["loss"]
        assert get(board.url + "metrics")[0] == 200


def test_a_swarm_that_cannot_be_read_is_shown_as_such():
    def unreadable() -> dict:
        raise RuntimeError("swarm 'x' has no live peer")

    with Dashboard(unreadable) as board:
        board.refresh()
        status, _, body = get(board.url + "api/status")
        assert status == 503 and json.loads(body) == {"error": "swarm 'x' has no live peer"}
        assert "spes_dashboard_read_ok 0.0" in get(board.url + "metrics")[2].decode()


def test_a_port_in_use_is_one_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(
            SpesError, match=f"on 127.0.0.1:{port}: Address already in use; choose another port"
        ):
            Dashboard(dict, port=port).start()
