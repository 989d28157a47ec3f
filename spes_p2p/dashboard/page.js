// The dashboard's page: every few seconds it fetches /api/dashboard and redraws. Text from the swarm
// (peer ids, units) goes in as text, never as markup; the charts are SVG the server drew and escaped.
"use strict";

const REFRESH_MS = 3000;

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fill(id, rows, draw) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const item of rows) draw(body.insertRow(), item);
}

function short(peer) {
  return peer.length > 14 ? `${peer.slice(0, 6)}…${peer.slice(-6)}` : peer;
}

function number(x, digits = 0) {
  return x === null || x === undefined ? "-" : x.toLocaleString("en", { maximumFractionDigits: digits });
}

function bytes(n) {
  const units = [[1 << 30, "GiB"], [1 << 20, "MiB"], [1 << 10, "KiB"]];
  for (const [size, name] of units) if (n >= size) return `${(n / size).toFixed(1)} ${name}`;
  return `${n} B`;
}

function drawUnits(status) {
  const target = status.target_replication;
  const units = Object.entries(status.units).sort();
  fill("units", units, (row, [unit, holders]) => {
    const uncovered = status.uncovered.includes(unit);
    const under = status.under_replicated.includes(unit);
    row.className = uncovered ? "uncovered" : under ? "under" : "";
    cell(row, unit);
    cell(row, holders.length, "num");
    cell(row, unit.startsWith("experts/") ? target : "-", "num");
    cell(row, uncovered ? "uncovered" : under ? "under-replicated" : "ok");
    cell(row, holders.map(short).join(", ") || "-").title = holders.join("\n");
  });
}

function drawPeers(status) {
  fill("peers", status.peers, (row, p) => {
    if (p.banned_by.length) row.className = "bad";
    cell(row, short(p.peer_id)).title = p.peer_id;
    cell(row, p.units.join(", ") || "-");
    cell(row, p.round, "num");
    cell(row, number(p.tokens_per_s), "num");
    cell(row, number(p.loss, 3), "num");
    cell(row, number(p.val_loss, 3), "num");
    cell(row, bytes(p.bytes_sent), "num");
    cell(row, bytes(p.bytes_received), "num");
    cell(row, p.rejected, "num");
    cell(row, `${p.dht_ops} / ${bytes(p.dht_bytes)}`, "num").title = "DHT reads and writes of its last round, and their bytes";
    cell(row, number(p.score, 2), "num");
    cell(row, p.client_mode ? "client (no)" : p.reachable);
    cell(row, `${number(p.seen_seconds_ago)} s ago`, "num");
    cell(row, p.banned_by.length ? p.banned_by.map(short).join(", ") : "-");
  });
}

function drawEvents(events) {
  fill("events", events, (row, e) => {
    cell(row, new Date(e.at * 1000).toISOString().slice(11, 19));
    cell(row, e.round, "num");
    cell(row, short(e.who)).title = e.who;
    cell(row, e.text);
  });
}

function draw(data) {
  const state = document.getElementById("state");
  const status = data.status;
  const history = data.history;
  state.className = data.error ? "state error" : "state";
  state.textContent = data.error
    ? `cannot read the swarm: ${data.error}`
    : `updated ${new Date(data.updated * 1000).toISOString().slice(11, 19)} UTC; watched for ` +
      `${number(history.watched_seconds / 60, 1)} min`;
  if (status) {
    document.getElementById("run-id").textContent = status.run_id;
    document.getElementById("peer-count").textContent = status.peers.length;
    document.getElementById("uncovered-count").textContent = status.uncovered.length;
    document.getElementById("under-count").textContent = status.under_replicated.length;
    document.getElementById("data-epoch").textContent = status.data.epoch;
    document.getElementById("shards-done").textContent = `${status.data.done} / ${status.data.shards}`;
    drawUnits(status);
    drawPeers(status);
  }
  document.getElementById("round").textContent = history.round;
  document.getElementById("rounds-per-hour").textContent = number(history.rounds_per_hour, 1);
  document.getElementById("tokens-per-hour").textContent = number(history.tokens_per_hour);
  if (data.charts) {
    document.getElementById("loss-chart").innerHTML = data.charts.loss;
    document.getElementById("traffic-chart").innerHTML = data.charts.traffic;
  }
  drawEvents(history.events);
}

async function refresh() {
  try {
    const response = await fetch("/api/dashboard", { cache: "no-store" });
    draw(await response.json());
  } catch (error) {
    const state = document.getElementById("state");
    state.className = "state error";
    state.textContent = `the dashboard's server does not answer (${error})`;
  }
  setTimeout(refresh, REFRESH_MS);
}

refresh();
