// The dashboard's live part. The server renders every row, card and list (server/dashboard/);
// this script swaps in fresh server-rendered fragments when the event stream says something
// changed, filters rows in place, and posts commands to the API. It never builds markup from
// data: text that came from the API goes in through textContent only.
(function () {
  "use strict";

  var body = document.body;
  var rows = document.getElementById("process-rows");
  var hosts = document.getElementById("hosts");
  var commands = document.getElementById("commands");
  var queue = document.getElementById("queue");
  var filterQ = document.getElementById("filter-q");
  var filterDevice = document.getElementById("filter-device");
  var filterStatus = document.getElementById("filter-status");

  var page = window.flexiumPage;
  var tick = page.tick, fragment = page.fragment, fetchFragment = page.fetchFragment;

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

  // A re-rendered row keeps the keyboard focus on the same button, where it was: focus() would
  // scroll to it, and a page that jumps under a person loses the click they were making.
  function focusedAction() {
    var el = document.activeElement;
    return el && el.dataset && el.dataset.action && rows.contains(el)
      ? {id: el.dataset.processId, action: el.dataset.action} : null;
  }

  function restoreFocus(was) {
    if (!was || (document.activeElement && document.activeElement !== document.body)) { return; }
    // A job's buttons are on its own row: look for the button itself, not the process's row.
    var button = rows.querySelector('[data-action="' + was.action + '"][data-process-id="' + CSS.escape(was.id) + '"]');
    if (button && !button.disabled) { button.focus({preventScroll: true}); }
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
    // A row of a host the table does not list yet, or the last row of its host gone: the
    // headings per host are the whole table's to say.
    if (!all && ids.some(function (id) {
      var row = fresh.get(id), old = rowOf(id);
      return row && !old ? !hostRows(row.dataset.host).length : !row && old && hostRows(old.dataset.host).length === 1;
    })) {
      ids.forEach(function (id) { stale.rows.add(id); });
      stale.allRows = true;
      schedule("rows", flushRows);
      return;
    }
    var focus = focusedAction();
    if (all) {
      rows.replaceChildren.apply(rows, Array.from(got.querySelectorAll("tr.host-heading, tr.proc, tr.job")));
    } else {
      ids.forEach(function (id) {
        var old = rowOf(id), row = fresh.get(id);
        if (row && old) { old.replaceWith(row); }
        else if (row) { hostRows(row.dataset.host).pop().after(row); }   // the last of its host's rows
        else if (old) { old.remove(); }
      });
    }
    restoreFocus(focus);
    applyFilters();
    tick();
  }

  // The table has a heading per host (it lists more than one).
  function grouped() { return rows.querySelector("tr.host-heading") !== null; }

  function hostRows(host) {
    return Array.prototype.filter.call(rows.querySelectorAll("tr.proc, tr.job"), function (r) {
      return r.dataset.host === host;
    });
  }

  async function refreshQueue() {
    var html = await fetchFragment("/ui/queue");
    queue.replaceChildren(fragment(html || ""));
    document.getElementById("no-waits").hidden = queue.querySelector(".queue-host") !== null;
    marksFollowQueue();
    tick();
  }

  // A wait that moves in the queue (another left, or went first) sends no event of its own job:
  // the rows whose mark ("queued #2") the queue just read differently are rendered again.
  function marksFollowQueue() {
    var places = new Map();
    queue.querySelectorAll("li.wait").forEach(function (li) { places.set(li.dataset.waitId, li); });
    rows.querySelectorAll(".queued-tag").forEach(function (tag) {
      var li = places.get(tag.dataset.waitId), row = tag.closest("tr");
      places.delete(tag.dataset.waitId);
      if (row && (!li || li.dataset.position !== tag.dataset.position)) {
        rowChanged(row.dataset.processId, Boolean(row.dataset.jobKey));
      }
    });
    places.forEach(function (li) { rowChanged(li.dataset.processId, Boolean(li.dataset.jobKey)); });
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
    schedule("queue", refreshQueue);
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
    rows.querySelectorAll("tr.host-heading").forEach(function (heading) {
      var host = heading.dataset.host;
      heading.hidden = !Array.prototype.some.call(rows.querySelectorAll("tr.proc, tr.job"), function (r) {
        return r.dataset.host === host && !r.hidden;
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

  // --- commands and live events --------------------------------------------------------------

  page.wireCommands(document.getElementById("main"), {   // the table's buttons and the queue's
    sent: function (command) { rowChanged(command.process_id, Boolean(command.job)); },
    forgotten: function (processId) {
      var row = rowOf(processId);
      if (row) { row.remove(); applyFilters(); }
    },
    refocus: function (opener) { restoreFocus({id: opener.dataset.processId, action: opener.dataset.action}); },
  });
  page.wireAllocator(document.getElementById("main"));

  // Training progress comes with beats, not with a process event: each row's progress line is set
  // in place, worded as the row renders it (formatters.fmt_rate).
  function onProgress(data) {
    (data.processes || []).forEach(function (p) {
      var row = rowOf(p.process_id);
      var line = row && row.querySelector(".progress-line");
      if (!line || typeof p.steps !== "number") { return; }
      var text = p.steps.toLocaleString("en-US") + " steps";
      if (row.dataset.state === "RUNNING" && typeof p.steps_per_s === "number") {
        text += " · " + p.steps_per_s.toFixed(p.steps_per_s < 10 ? 2 : 0) + " steps/s";
      }
      line.textContent = text;
    });
  }

  var hellos = 0;

  function onProcess(data) {
    var p = data.process || {};
    var id = p.process_id;
    if (!id) { return; }
    var row = rowOf(id);
    var host = p.host || (row ? row.dataset.host : null);
    if (data.action === "removed") {
      var lastOfHost = row && grouped() && hostRows(row.dataset.host).length === 1;   // its heading goes too
      if (row && (row.dataset.jobKey || lastOfHost)) { rowChanged(id, true); }
      else if (row) { row.remove(); applyFilters(); }
    } else {
      rowChanged(id, Boolean(p.job && p.job.world_size > 1));
      if (p.wait_id !== null && p.wait_id !== undefined) { schedule("queue", refreshQueue); }   // its priority
    }
    if (host) { hostChanged(host); }
    schedule("totals", refreshTotals);
  }

  function onCommand(data) {
    var c = data.command;
    if (!c) { return; }
    page.commandEvent(c, false);
    rowChanged(c.process_id, Boolean(c.job));
    schedule("commands", refreshCommands);
    schedule("totals", refreshTotals);
  }

  // The queue changed: its list, and the row of the job that waits (its mark, its buttons).
  function onWait(data) {
    var w = data.wait;
    if (!w) { return; }
    schedule("queue", refreshQueue);
    rowChanged(w.process_id, Boolean(w.job_key));
  }

  // A drain began, acted or ended: its host's cards say so, and its heading in the table.
  function onDrain(data) {
    var d = data.drain;
    if (!d || !d.host) { return; }
    hostChanged(d.host);
    if (grouped()) {
      stale.allRows = true;
      schedule("rows", flushRows);
    }
  }

  // flexium run's placement was asked for, placed, taken by its job, given up or ended.
  function onPlacement(data) {
    if (data.placement) { schedule("queue", refreshQueue); }
  }

  function onDevices(data) {
    if (data.host) { hostChanged(data.host); }
    schedule("totals", refreshTotals);
  }

  function onHello(data) {
    // Reconnected (maybe to a restarted server), or events came between render and subscribe.
    if (hellos > 0 || String(data.last_event_id) !== body.dataset.eventId) { refreshAll(); }
    hellos++;
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
  page.listen({
    hello: onHello, process: onProcess, command: onCommand, wait: onWait, drain: onDrain, placement: onPlacement,
    devices: onDevices, progress: onProgress, resync: refreshAll,
  });
})();
