// runpool console: the Retry and Cancel buttons, and the run page following its run live
// (Server-Sent Events from /api/runs/{id}/events). No framework, no build step.
"use strict";

const TERMINAL = ["succeeded", "failed", "cancelled"];

// The prefix the console is mounted under ("" at the root of its server).
const root = document.body.dataset.root || "";

async function act(button) {
  const run = button.dataset.run, action = button.dataset.action;
  button.disabled = true;
  try {
    // JSON content type: cross-site pages cannot send it without a preflight (see api.py).
    const response = await fetch(`${root}/api/runs/${run}/${action}`, {
      method: "POST", headers: {"Content-Type": "application/json"}, body: "{}",
    });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error || response.statusText);
    // The server's answer stays on the button: a script (or a test) can tell it was handled.
    button.dataset.answer = answer.status;
    const note = document.createElement("span");
    note.className = "badge " + answer.status;
    note.textContent = answer.status;
    if (document.getElementById("run")) {
      // The stream may have told a later status than this answer (a cancelled run's status
      // event can beat the cancel's own response, which says "running"): an answer never
      // takes a terminal status back, but a retry's, which revives the run.
      if (action === "retry" || !TERMINAL.includes(document.getElementById("status").textContent)) {
        setStatus(answer.status);
      }
      if (action === "retry") followRun();
    } else {
      button.replaceWith(note);
    }
  } catch (error) {
    button.disabled = false;
    alert(`${action} failed: ${error.message}`);
  }
}

function setStatus(status) {
  const badge = document.getElementById("status");
  badge.textContent = status;
  badge.className = "badge " + status;
  const terminal = TERMINAL.includes(status);
  document.getElementById("cancel").hidden = terminal;
  document.getElementById("retry").hidden = !["failed", "cancelled"].includes(status);
}

function text(value) {
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}

function addMessage(ev) {
  const list = document.getElementById("conversation");
  const item = document.createElement("li");
  item.className = `msg ${ev.data.role} fresh`;
  item.dataset.seq = ev.seq;
  const role = document.createElement("span");
  role.className = "role";
  role.textContent = ev.data.role;
  const body = document.createElement("pre");
  body.textContent = text(ev.data.content);
  item.append(role, body);
  list.append(item);
  document.getElementById("no-messages").hidden = true;
}

function setToolCall(ev) {
  const table = document.querySelector("#tool-calls tbody");
  let row = table.querySelector(`tr[data-call="${CSS.escape(ev.data.call_id)}"]`);
  if (!row) {
    row = document.createElement("tr");
    row.dataset.call = ev.data.call_id;
    for (let i = 0; i < 5; i++) row.append(document.createElement("td"));
    row.cells[0].className = "mono";
    row.cells[3].className = "n";
    table.append(row);
  }
  row.cells[0].textContent = ev.data.call_id;
  row.cells[1].textContent = ev.data.name;
  row.cells[2].innerHTML = "";
  const badge = document.createElement("span");
  badge.className = "badge " + ev.data.status;
  badge.textContent = ev.data.status;
  row.cells[2].append(badge);
  if (ev.data.result !== undefined) {
    const pre = document.createElement("pre");
    pre.className = "clip";
    pre.textContent = text(ev.data.result);
    row.cells[4].replaceChildren(pre);
  }
}

let stream = null;

function followRun() {
  const page = document.getElementById("run");
  const live = document.getElementById("live");
  if (stream) stream.close();
  // Follows on from what the server rendered (data-after: the seq of its last event); the
  // browser resumes a cut stream with Last-Event-ID: nothing is missed, nothing comes twice.
  stream = new EventSource(`${root}/api/runs/${page.dataset.run}/events?after=${page.dataset.after}`);
  live.textContent = "● live";
  const handle = (kind, fn) => stream.addEventListener(kind, (e) => {
    const ev = JSON.parse(e.data);
    page.dataset.after = ev.seq;
    fn(ev);
  });
  handle("message", addMessage);
  handle("tool_call", setToolCall);
  handle("progress", (ev) => { live.textContent = "● " + text(ev.data).slice(0, 120); });
  handle("status", (ev) => {
    setStatus(ev.data.status);
    if (ev.data.attempt !== undefined) document.getElementById("attempt").textContent = ev.data.attempt;
    if (TERMINAL.includes(ev.data.status)) {
      stream.close();
      live.textContent = "";
    }
  });
  stream.onerror = () => { if (stream.readyState === EventSource.CLOSED) live.textContent = ""; };
}

document.addEventListener("click", (e) => {
  const button = e.target.closest("button.act");
  if (button) act(button);
});

document.addEventListener("DOMContentLoaded", () => {
  const page = document.getElementById("run");
  if (page && page.dataset.terminal !== "true") followRun();
});
