// The dashboard's live part. The server renders every row, card and list (routes/pages.py);
// this script swaps in fresh server-rendered fragments when the event stream says something
// changed, filters rows in place, and posts commands to the API. It never builds markup from
// data: text that came from the API goes in through textContent only.
(function () {
  "use strict";

  var body = document.body;
  var API = body.dataset.apiBase;
  var CSRF_HEADER = "X-Flexium-Request";
  var rows = document.getElementById("process-rows");
  var hosts = document.getElementById("hosts");
  var commands = document.getElementById("commands");
  var dialog = document.getElementById("target-dialog");
  var dialogBody = document.getElementById("dialog-body");
  var notices = document.getElementById("notices");
  var live = document.getElementById("live");
  var filterQ = document.getElementById("filter-q");
  var filterDevice = document.getElementById("filter-device");
  var filterStatus = document.getElementById("filter-status");

  var page = window.flexiumPage;
  var fmtDuration = page.fmtDuration, tick = page.tick;
  var fragment = page.fragment, fetchFragment = page.fetchFragment;

  // Coalesces bursts of events per key (one job's command sends several in a second) and keeps
  // fetches for one key in order, so an older answer never overwrites a newer one.
  var jobs = new Map();
  function schedule(key, fn) {
    var job = jobs.get(key);
    if (job) {
      if (job.started) { job.again = true; }
      return;
    }
    job = {started: false, again: false};
    jobs.set(key, job);
    setTimeout(async function () {
      job.started = true;
      try {
        await fn();
      } catch (err) {
        if (err && err.message !== "signed out") { console.warn("flexium dashboard:", err); }
      } finally {
        jobs.delete(key);
        if (job.again) { schedule(key, fn); }
      }
    }, 80);
  }

  function rowOf(processId) { return document.getElementById("proc-" + processId); }

  // A re-rendered row keeps the keyboard focus on the same button.
  function focusedAction() {
    var el = document.activeElement;
    return el && el.dataset && el.dataset.action && rows.contains(el)
      ? {id: el.dataset.processId, action: el.dataset.action} : null;
  }

  function restoreFocus(was) {
    if (!was || (document.activeElement && document.activeElement !== document.body)) { return; }
    // A job's buttons are on its own row: look for the button itself, not the process's row.
    var button = rows.querySelector('[data-action="' + was.action + '"][data-process-id="' + CSS.escape(was.id) + '"]');
    if (button && !button.disabled) { button.focus(); }
  }

  // Rows and GPU sections to re-render, gathered over a few events and fetched together.
  var stale = {rows: new Set(), allRows: false, hosts: new Set(), allHosts: false};
  var BATCH = 100;

  function queryOf(name, values) {
    return values.map(function (v) { return name + "=" + encodeURIComponent(v); }).join("&");
  }

  // A rank's row sits under its job's row, which sums up every rank: a change to a rank
  // re-renders the whole table (jobs are few; the order and the job row stay right).
  function rowChanged(processId, inJob) {
    var row = rowOf(processId);
    if (inJob || (row && row.dataset.jobKey)) { stale.allRows = true; }
    stale.rows.add(processId);
    schedule("rows", flushRows);
  }

  function hostChanged(name) {
    stale.hosts.add(name);
    schedule("hosts", flushHosts);
  }

  async function flushRows() {
    var ids = Array.from(stale.rows);
    var all = stale.allRows || ids.length > BATCH;
    stale.rows.clear();
    stale.allRows = false;
    if (!all && !ids.length) { return; }
    var html;
    try {
      html = await fetchFragment(all ? "/ui/processes" : "/ui/processes?" + queryOf("id", ids));
    } catch (err) {                            // try these again with the next change
      ids.forEach(function (id) { stale.rows.add(id); });
      stale.allRows = stale.allRows || all;
      throw err;
    }
    var got = fragment(html || "");
    if (!all && got.querySelector("tr[data-job-key]")) {  // a rank we did not know: its job's rows too
      ids.forEach(function (id) { stale.rows.add(id); });
      stale.allRows = true;
      schedule("rows", flushRows);
      return;
    }
    var fresh = new Map();
    got.querySelectorAll("tr.proc").forEach(function (row) {
      fresh.set(row.dataset.processId, row);
    });
    var focus = focusedAction();
    if (all) {
      rows.replaceChildren.apply(rows, Array.from(got.querySelectorAll("tr.proc, tr.job")));
    } else {
      ids.forEach(function (id) {
        var old = rowOf(id), row = fresh.get(id);
        if (row && old) { old.replaceWith(row); }
        else if (row) { rows.appendChild(row); }
        else if (old) { old.remove(); }
      });
    }
    restoreFocus(focus);
    applyFilters();
    tick();
  }

  function hostSection(name) {
    var all = hosts.querySelectorAll(".host");
    for (var i = 0; i < all.length; i++) {
      if (all[i].dataset.host === name) { return all[i]; }
    }
    return null;
  }

  // A host folded or unfolded by hand stays so until it goes silent or comes back.
  function keepFolding(old, fresh) {
    if (old.dataset.stale === fresh.dataset.stale) { fresh.open = old.open; }
  }

  async function flushHosts() {
    var names = Array.from(stale.hosts);
    var all = stale.allHosts || names.length > BATCH;
    stale.hosts.clear();
    stale.allHosts = false;
    if (!all && !names.length) { return; }
    var html;
    try {
      html = await fetchFragment(all ? "/ui/devices" : "/ui/devices?" + queryOf("host", names));
    } catch (err) {
      names.forEach(function (name) { stale.hosts.add(name); });
      stale.allHosts = stale.allHosts || all;
      throw err;
    }
    var fresh = fragment(html || "");
    fresh.querySelectorAll(".host").forEach(function (section) {
      var old = hostSection(section.dataset.host);
      if (old) { keepFolding(old, section); }
    });
    if (all) {
      hosts.replaceChildren(fresh);
    } else {
      var got = new Map();
      fresh.querySelectorAll(".host").forEach(function (section) { got.set(section.dataset.host, section); });
      names.forEach(function (name) {
        var old = hostSection(name), section = got.get(name);
        if (section && old) { old.replaceWith(section); }
        else if (section) { hosts.appendChild(section); }
        else if (old) { old.remove(); }
      });
    }
    hostsChanged();
  }

  async function refreshCommands() {
    var html = await fetchFragment("/ui/commands");
    commands.replaceChildren(fragment(html || ""));
    document.getElementById("no-commands").hidden = commands.children.length > 0;
    tick();
  }

  // The totals count what every event may change: re-read after the rows, cards or commands.
  async function refreshTotals() {
    var html = await fetchFragment("/ui/totals");
    var fresh = html ? fragment(html).querySelector("#totals") : null;
    var old = document.getElementById("totals");
    if (fresh && old) { old.replaceWith(fresh); }
  }

  function refreshAll() {
    stale.allRows = true;
    stale.allHosts = true;
    schedule("rows", flushRows);
    schedule("hosts", flushHosts);
    schedule("commands", refreshCommands);
    schedule("totals", refreshTotals);
  }

  // The device filter lists the GPUs the cards show.
  function hostsChanged() {
    document.getElementById("no-gpus").hidden = hosts.querySelector("article.gpu") !== null;
    var current = filterDevice.value;
    var keep = Array.prototype.slice.call(filterDevice.options, 0, 2);
    var options = keep.slice();
    hosts.querySelectorAll("article.gpu").forEach(function (card) {
      options.push(new Option(card.dataset.label, card.dataset.uuid));
    });
    if (current && !options.some(function (o) { return o.value === current; })) {
      options.push(new Option(current, current));
    }
    filterDevice.replaceChildren.apply(filterDevice, options);
    filterDevice.value = current;
    tick();
  }

  // --- filters -------------------------------------------------------------------------------

  function applyFilters() {
    var words = filterQ.value.toLowerCase().split(/\s+/).filter(Boolean);
    var device = filterDevice.value;
    var status = filterStatus.value;
    var total = 0, shown = 0;
    rows.querySelectorAll("tr.proc").forEach(function (row) {
      total++;
      var gpu = row.dataset.gpu || "";
      var text = row.dataset.search || "";
      var ok = (!status || row.dataset.state === status)
        && (!device || (device === "none" ? gpu === "" : gpu === device))
        && words.every(function (w) { return text.indexOf(w) >= 0; });
      row.hidden = !ok;
      if (ok) { shown++; }
    });
    rows.querySelectorAll("tr.job").forEach(function (jobRow) {
      var key = jobRow.dataset.jobKey;
      jobRow.hidden = !Array.prototype.some.call(rows.querySelectorAll("tr.rank"), function (r) {
        return r.dataset.jobKey === key && !r.hidden;
      });
    });
    var count = document.getElementById("shown-count");
    count.textContent = total === 0 ? "" : shown === total
      ? total + (total === 1 ? " process" : " processes") : shown + " of " + total + " shown";
    document.getElementById("no-processes").hidden = total > 0;
    document.getElementById("no-match").hidden = !(total > 0 && shown === 0);
  }

  function filtersToUrl() {
    var params = new URLSearchParams(window.location.search);
    [["q", filterQ.value.trim()], ["device", filterDevice.value], ["status", filterStatus.value]]
      .forEach(function (kv) { if (kv[1]) { params.set(kv[0], kv[1]); } else { params.delete(kv[0]); } });
    var query = params.toString();
    history.replaceState(null, "", window.location.pathname + (query ? "?" + query : ""));
  }

  function filtersFromUrl() {
    var params = new URLSearchParams(window.location.search);
    filterQ.value = params.get("q") || "";
    var device = params.get("device") || "";
    if (device && !Array.prototype.some.call(filterDevice.options, function (o) { return o.value === device; })) {
      filterDevice.appendChild(new Option(device, device));
    }
    filterDevice.value = device;
    filterStatus.value = params.get("status") || "";
  }

  // --- notices -------------------------------------------------------------------------------

  var tracked = new Map();   // command id -> notice element, for commands sent from this page

  function notify(text, kind, commandId) {
    var el = commandId !== undefined ? tracked.get(commandId) : null;
    if (!el) {
      el = document.createElement("div");
      var span = document.createElement("span");
      span.className = "notice-text";
      var close = document.createElement("button");
      close.type = "button";
      close.className = "notice-close";
      close.setAttribute("aria-label", "Dismiss");
      close.textContent = "×";
      close.addEventListener("click", function () { el.remove(); });
      el.append(span, close);
      notices.prepend(el);
      if (commandId !== undefined) { el.dataset.commandId = commandId; tracked.set(commandId, el); }
    }
    el.className = "notice notice-" + kind;
    el.setAttribute("role", kind === "error" ? "alert" : "status");
    el.querySelector(".notice-text").textContent = text;
    clearTimeout(el.dismissTimer);
    if (kind === "ok") {
      el.dismissTimer = setTimeout(function () { el.remove(); tracked.delete(commandId); }, 12000);
    }
    return el;
  }

  // A job operation sent from this page: one notice for every rank's command.
  var trackedOps = new Map();   // operation id -> {kind, key, ranks: Map rank -> command}

  function operationNotice(c) {
    var op = trackedOps.get(c.job.operation_id);
    if (!op) { return; }
    op.ranks.set(c.job.rank, c);
    var parts = [], failed = [], active = false, succeeded = 0;
    Array.from(op.ranks.keys()).sort(function (a, b) { return a - b; }).forEach(function (rank) {
      var command = op.ranks.get(rank);
      parts.push("rank " + rank + " " + command.state);
      if (command.state === "succeeded") { succeeded++; }
      else if (command.state === "failed" || command.state === "expired") {
        failed.push("rank " + rank + ": " + (command.error || command.state));
      } else { active = true; }
    });
    var what = op.kind + " job " + op.key + " (operation " + c.job.operation_id + "): ";
    var key = "op-" + c.job.operation_id;
    if (!active && succeeded === c.job.world_size) {
      notify(what + "succeeded on every rank", "ok", key);
    } else if (!active && op.ranks.size === c.job.world_size) {
      notify(what + "failed: " + failed.join("; "), "error", key);
    } else {
      notify(what + parts.join(", ") + "…", "progress", key);
    }
  }

  // A command names its GPU by UUID only; the index shown is the one its GPU card shows.
  function gpuText(c) {
    if (!c.target_uuid) { return ""; }
    var card = document.querySelector('article.gpu[data-uuid="' + CSS.escape(c.target_uuid) + '"]');
    var index = card ? card.dataset.index : "";
    return index ? " → GPU " + index : " → " + c.target_uuid;
  }

  function commandNotice(c) {
    if (!tracked.has(c.id)) { return; }
    var what = c.kind + " " + c.process_id + gpuText(c) + " (command " + c.id + "): ";
    var seconds = c.result && typeof c.result.seconds === "number" ? c.result.seconds
      : (c.finished_at && c.started_at ? c.finished_at - c.started_at : null);
    if (c.state === "succeeded") {
      var path = c.result && c.result.path ? " (" + c.result.path + " path)" : "";
      notify(what + "succeeded" + (seconds !== null ? " in " + fmtDuration(seconds, true) : "") + path, "ok", c.id);
    } else if (c.state === "failed" || c.state === "expired") {
      notify(what + c.state + (c.error ? ": " + c.error : ""), "error", c.id);
    } else {
      var phase = {queued: "queued", delivered: "delivered, waiting for a safe point", running: "running"}[c.state];
      notify(what + (phase || c.state) + "…", "progress", c.id);
    }
  }

  // --- commands ------------------------------------------------------------------------------

  async function api(method, path, payload) {
    var headers = {"Accept": "application/json"};
    headers[CSRF_HEADER] = "1";
    var init = {method: method, credentials: "same-origin", headers: headers};
    if (payload !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(payload);
    }
    var r;
    try {
      r = await fetch(API + path, init);
    } catch (err) {
      throw new Error("the server did not answer (" + err.message + ")");
    }
    var data = null;
    try { data = await r.json(); } catch (err) { data = null; }
    if (r.status === 401) { window.location.assign("/login"); }
    if (!r.ok) {
      throw new Error((data && data.message) || "HTTP " + r.status);
    }
    return data;
  }

  async function sendCommand(kind, processId, target) {
    var payload = {kind: kind, process_id: processId};
    if (target) { payload.target = target; }
    var command = await api("POST", "/commands", payload);
    tracked.set(command.id, null);
    commandNotice(command);
    rowChanged(processId);
    return command;
  }

  // A pause, resume or migrate of a whole job: sent to one rank, the server gives every rank its share.
  async function sendJobCommand(kind, processId, key, ranks) {
    var payload = {kind: kind, process_id: processId};
    if (ranks) { payload.ranks = ranks; }
    var command = await api("POST", "/commands", payload);
    if (command.job) {
      trackedOps.set(command.job.operation_id, {kind: kind, key: key, ranks: new Map()});
      operationNotice(command);
    }
    rowChanged(processId, true);
    return command;
  }

  async function openJobMigrate(key, opener) {
    var html = await fetchFragment("/ui/jobs/" + encodeURIComponent(key) + "/migrate");
    if (html === null) {
      notify("job " + key + " is gone", "error");
      return;
    }
    dialogBody.replaceChildren(fragment(html));
    dialog.opener = opener;
    dialog.showModal();
    var first = dialogBody.querySelector("select");
    if (first) { first.focus(); }
  }

  function jobRanks(form) {
    var ranks = {};
    form.querySelectorAll("select[data-rank]").forEach(function (select) { ranks[select.dataset.rank] = select.value; });
    return ranks;
  }

  async function openTargets(kind, processId, opener) {
    var html = await fetchFragment("/ui/processes/" + encodeURIComponent(processId) + "/targets?kind=" + kind);
    if (html === null) {
      notify("process " + processId + " is gone", "error");
      return;
    }
    dialogBody.replaceChildren(fragment(html));
    dialog.opener = opener;
    dialog.showModal();
    var first = dialogBody.querySelector("input[name=target]:checked") || dialogBody.querySelector("button[type=submit]");
    if (first) { first.focus(); }
  }

  dialog.addEventListener("submit", async function (ev) {
    ev.preventDefault();
    var form = ev.target;
    var error = form.querySelector(".form-error");
    var submit = form.querySelector("button[type=submit]");
    var choice = form.querySelector("input[name=target]:checked");
    error.hidden = true;
    submit.disabled = true;
    try {
      if (form.dataset.jobKey) {
        await sendJobCommand(form.dataset.kind, form.dataset.processId, form.dataset.jobKey, jobRanks(form));
      } else {
        await sendCommand(form.dataset.kind, form.dataset.processId, choice ? choice.value : "");
      }
      dialog.close();
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
      notify(form.dataset.kind + " " + form.dataset.processId + " refused: " + err.message, "error");
    } finally {
      submit.disabled = false;
    }
  });

  dialog.addEventListener("click", function (ev) {
    if (ev.target.closest("[data-swap]")) {            // two ranks: each takes the other's GPU
      var selects = dialogBody.querySelectorAll("select[data-rank]");
      if (selects.length === 2) {
        var first = selects[0].dataset.current, second = selects[1].dataset.current;
        selects[0].value = second;
        selects[1].value = first;
      }
      return;
    }
    if (ev.target === dialog || ev.target.closest("[data-close]")) { dialog.close(); }
  });

  dialog.addEventListener("close", function () {
    var opener = dialog.opener;
    dialogBody.replaceChildren();
    if (!opener) { return; }
    if (document.contains(opener)) {
      opener.focus();
    } else {                                   // its row was re-rendered meanwhile
      restoreFocus({id: opener.dataset.processId, action: opener.dataset.action});
    }
  });

  rows.addEventListener("click", async function (ev) {
    var button = ev.target.closest("button[data-action]");
    if (!button || button.disabled) { return; }
    var action = button.dataset.action;
    var processId = button.dataset.processId;
    try {
      if (action === "migrate" || action === "resume") {
        await openTargets(action, processId, button);
      } else if (action === "pause") {
        button.disabled = true;
        await sendCommand("pause", processId, null);
      } else if (action === "job-pause" || action === "job-resume") {
        button.disabled = true;
        await sendJobCommand(action.slice(4), processId, button.dataset.jobKey, null);
      } else if (action === "job-migrate") {
        await openJobMigrate(button.dataset.jobKey, button);
      } else if (action === "forget") {
        button.disabled = true;
        await api("DELETE", "/processes/" + encodeURIComponent(processId));
        var row = rowOf(processId);
        if (row) { row.remove(); applyFilters(); }
      }
    } catch (err) {
      button.disabled = false;
      notify(action + " " + processId + " refused: " + err.message, "error");
    }
  });

  // --- live events ---------------------------------------------------------------------------

  var source = null;
  var hellos = 0;

  function setLive(on, text) {
    live.className = "live " + (on ? "live-on" : "live-off");
    live.textContent = text;
  }

  function onProcess(ev) {
    var data = JSON.parse(ev.data);
    var p = data.process || {};
    var id = p.process_id;
    if (!id) { return; }
    var row = rowOf(id);
    var host = p.host || (row ? row.dataset.host : null);
    if (data.action === "removed") {
      if (row && row.dataset.jobKey) { rowChanged(id, true); }
      else if (row) { row.remove(); applyFilters(); }
    } else {
      rowChanged(id, Boolean(p.job && p.job.world_size > 1));
    }
    if (host) { hostChanged(host); }
    schedule("totals", refreshTotals);
  }

  function onCommand(ev) {
    var c = JSON.parse(ev.data).command;
    if (!c) { return; }
    commandNotice(c);
    if (c.job) { operationNotice(c); }
    rowChanged(c.process_id, Boolean(c.job));
    schedule("commands", refreshCommands);
    schedule("totals", refreshTotals);
  }

  function onDevices(ev) {
    var host = JSON.parse(ev.data).host;
    if (host) { hostChanged(host); }
    schedule("totals", refreshTotals);
  }

  function connect() {
    source = new EventSource(API + "/events");
    source.addEventListener("hello", function (ev) {
      setLive(true, "live");
      var data = JSON.parse(ev.data);
      // Reconnected (maybe to a restarted server), or events came between render and subscribe.
      if (hellos > 0 || String(data.last_event_id) !== body.dataset.eventId) { refreshAll(); }
      hellos++;
    });
    source.addEventListener("process", onProcess);
    source.addEventListener("command", onCommand);
    source.addEventListener("devices", onDevices);
    source.addEventListener("resync", refreshAll);
    source.addEventListener("error", function () {
      setLive(false, "reconnecting…");
      if (source.readyState === EventSource.CLOSED) {
        // A refused stream is not retried by the browser: find out why, then try again.
        source = null;
        fetchFragment("/ui/commands").catch(function () { return null; });
        setTimeout(function () { if (!source) { connect(); } }, 3000);
      }
    });
  }

  // --- start ---------------------------------------------------------------------------------

  filtersFromUrl();
  [filterQ, filterDevice, filterStatus].forEach(function (el) {
    ["input", "change"].forEach(function (type) {
      el.addEventListener(type, function () { applyFilters(); filtersToUrl(); });
    });
  });
  document.getElementById("filters").addEventListener("submit", function (ev) { ev.preventDefault(); });
  document.getElementById("filters").addEventListener("reset", function () {
    setTimeout(function () { applyFilters(); filtersToUrl(); }, 0);
  });
  applyFilters();
  tick();
  setInterval(tick, 1000);
  // Time alone changes things no event announces (a host going silent): a slow full refresh.
  setInterval(refreshAll, 60000);
  connect();
})();
