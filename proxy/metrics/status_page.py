"""The status page an operator watches: `/status` on the `--metrics` listener (its bounds
and its port), one self-contained HTML page (no external asset), which reads
`/status.json` every STATUS_REFRESH seconds and draws it.

`/status.json` is the control call `status` (`proxy.control.app.server_status`: the same
objects, no second source of truth). With a control token it needs the token
(`Authorization: Bearer`, as the control calls); the page asks for it once and keeps it
in the tab's session storage (a `#token=...` in the address is taken, then removed from
it, never sent to the server). Without a control token the page is open, and shows no
session ID: what a rebalance moved is counted, per worker it went to, and a
checkpoint's blockers naming a session are counted too. No page ever shows a token, a
key or a secret (the status holds none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gym_proxy.coordinator.contract.answers import ServerStatus

__all__ = ["PAGE", "STATUS_REFRESH", "status_json"]

STATUS_REFRESH = 2.0  # seconds between the page's reads


def status_json(status: Callable[[], ServerStatus], show_sessions: bool) -> bytes:
    """`status` as the page reads it; without `show_sessions`, no session ID in it."""
    said: dict[str, Any] = status().as_json()
    said["refresh_s"] = STATUS_REFRESH
    said["sessions_shown"] = show_sessions
    if not show_sessions:
        _hide_sessions(said)
    return orjson.dumps(said)


def _hide_sessions(said: dict[str, Any]) -> None:
    rebalance = said.get("rebalance") or {}
    for event in rebalance.get("recent", []):
        to: dict[str, int] = {}
        for owner in event["moved"].values():
            to[owner] = to.get(owner, 0) + 1
        event["moved"] = {f"{n} session{'s' * (n != 1)}": owner for owner, n in to.items()}
        event["not_moved"] = (
            {f"{len(event['not_moved'])} not moved": ""} if event["not_moved"] else {}
        )
        event["kept"] = {f"{len(event['kept'])} kept": ""} if event["kept"] else {}
    report = said.get("report") or {}
    blockers = report.get("blockers", [])
    sessions = [b for b in blockers if b.startswith("session:")]
    if sessions:
        others = [b for b in blockers if not b.startswith("session:")]
        report["blockers"] = [*others, f"{len(sessions)} sessions with a request running"]
    said["session_aliases"] = None


PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gym-proxy status</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fafbfc}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff;min-width:40em}
th,td{border:1px solid #d0d7de;padding:.25em .6em;text-align:right}
th{background:#f0f3f6}td.l,th.l{text-align:left}
.hot{background:#ffe1d6}.stalled{background:#ffc4c4}.draining{background:#fff3c4}
.muted{color:#6e7781}#err{color:#b3261e}
</style></head><body>
<h1>gym-proxy <span id="instance"></span></h1>
<div class="muted" id="summary">loading...</div><div id="err"></div>
<form id="login" hidden>A control token is needed:
<input id="token" type="password" autocomplete="off"> <button>show</button></form>
<h2>Workers</h2>
<table id="workers"><thead><tr><th>slot</th><th class="l">owner</th><th class="l">node</th>
<th class="l">state</th><th>sessions</th><th>in flight</th><th>busy avg</th><th>loop delay s</th>
<th>memory MiB</th><th>served</th><th>restarts</th></tr></thead><tbody></tbody></table>
<h2>Operations</h2><div id="operations"></div>
<h2>Rebalances</h2>
<table id="rebalances"><thead><tr><th class="l">when</th><th>slot</th><th class="l">why</th>
<th class="l">moved (to worker)</th><th class="l">not moved / kept</th></tr></thead>
<tbody></tbody></table>
<h2>Autoscaling</h2><div id="autoscale"></div>
<h2>Checkpoint</h2><div id="checkpoint"></div>
<script>
"use strict";
const key = "gym-proxy-status-token";
const hash = new URLSearchParams(location.hash.slice(1));
if (hash.get("token")) {
  sessionStorage.setItem(key, hash.get("token"));
  history.replaceState(null, "", location.pathname);
}
const text = (v) => (v === null || v === undefined ? "" : String(v));
function cell(row, value, cls) {
  const td = row.insertCell(); td.textContent = text(value); if (cls) td.className = cls;
}
function when(unix) { return new Date(unix * 1000).toLocaleTimeString(); }
function done(d) {
  return d ? d.checkpoint_id + " at " + when(d.at) + " (" + d.records + " records)" : "none";
}
function pairs(map) {
  return Object.entries(map || {}).map(([k, v]) => (v ? k + " \\u2192 " + v : k)).join(", ");
}
function draw(s) {
  document.getElementById("instance").textContent = s.instance + " (" + text(s.kind) + ")";
  const stalled = new Set((s.rebalance && s.rebalance.stalled_slots) || []);
  document.getElementById("summary").textContent =
    s.workers.length + " of " + s.expected_workers + " workers, " + s.routed_sessions +
    " sessions routed, phase " + s.phase + (s.rebalance && s.rebalance.acting ?
    ", rebalancing" : "") + ". Read " + new Date().toLocaleTimeString() +
    ", every " + s.refresh_s + " s.";
  const body = document.querySelector("#workers tbody"); body.replaceChildren();
  for (const w of s.workers) {
    const row = body.insertRow();
    const load = w.load || {};
    row.className = load.stalled || stalled.has(w.slot) ? "stalled" :
      (w.state === "draining" ? "draining" : "");
    row.dataset.slot = w.slot;
    cell(row, w.slot); cell(row, w.owner, "l"); cell(row, w.node, "l");
    cell(row, load.stalled ? w.state + ", stalled" : w.state, "l");
    cell(row, w.sessions); cell(row, w.in_flight); cell(row, load.busy_average);
    cell(row, load.loop_delay_s);
    cell(row, w.memory_bytes ? (w.memory_bytes / 1048576).toFixed(0) : "");
    cell(row, w.requests_served); cell(row, w.restarts);
  }
  const ops = s.operations || {};
  const op = (o) => o ? o.operation + " (" + o.reason + "): " + o.step +
    (o.detail ? ", " + o.detail : "") + "; " + o.moved + " sessions moved" +
    (o.complete === undefined ? "" : (o.complete ? ", complete" : ", incomplete")) : "none";
  document.getElementById("operations").textContent =
    "running: " + op(ops.running) + ". Last: " + op(ops.last) + ".";
  const rb = document.querySelector("#rebalances tbody"); rb.replaceChildren();
  for (const e of ((s.rebalance && s.rebalance.recent) || []).slice().reverse()) {
    const row = rb.insertRow();
    cell(row, when(e.at), "l"); cell(row, e.slot); cell(row, e.reason + ": " + e.why, "l");
    cell(row, pairs(e.moved), "l"); cell(row, pairs(Object.assign({}, e.not_moved, e.kept)), "l");
  }
  const a = s.autoscale;
  document.getElementById("autoscale").textContent = !a ? "off (no --max-workers)" :
    "between " + a.least + " and " + a.most + " workers; last decision: " + (!a.last ?
    "none yet" : when(a.last.at) + ", " + a.last.workers_from + " \\u2192 " +
    a.last.workers_to + " workers (" + a.last.why + "): " + a.last.outcome) + ".";
  const r = s.report || {};
  document.getElementById("checkpoint").textContent = "phase " + s.phase +
    (s.checkpoint_id ? ", checkpoint " + s.checkpoint_id : "") +
    (r.blockers && r.blockers.length ? "; blocked by " + r.blockers.join(", ") : "") +
    "; " + s.retired_rollouts + " rollouts retired, " + s.restored_pending.length +
    " restored episodes awaiting their replacement. Last commit: " + done(s.last_commit) +
    ". Last restore: " + done(s.last_restore) + ".";
}
async function read() {
  const token = sessionStorage.getItem(key);
  const headers = token ? {"Authorization": "Bearer " + token} : {};
  try {
    const response = await fetch("status.json", {headers: headers, cache: "no-store"});
    if (response.status === 401) {
      document.getElementById("login").hidden = false;
      document.getElementById("err").textContent = "";
      return 2;
    }
    const s = await response.json();
    if (!response.ok) throw new Error(s.error ? s.error.detail : response.status);
    document.getElementById("login").hidden = true;
    document.getElementById("err").textContent = "";
    draw(s);
    return s.refresh_s;
  } catch (e) {
    document.getElementById("err").textContent = "cannot read the status: " + e.message;
    return 2;
  }
}
document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(key, document.getElementById("token").value);
  read();
});
async function loop() { const wait = await read(); setTimeout(loop, wait * 1000); }
loop();
</script></body></html>
"""
