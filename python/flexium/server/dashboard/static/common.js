// What the dashboard's pages share (dashboard.js, job.js): the server's clock, the time formats
// (the same as formatters.py), fetching a server-rendered fragment, the notices, the API, the buttons
// and the dialog that send commands (and the notices that follow each one), and the event stream.
// Loaded first; allocator.js (the queue, priorities and drains) after it. Text from the API goes in through textContent only.
(function () {
  "use strict";

  var body = document.body;
  var API = body.dataset.apiBase;
  var CSRF_HEADER = "X-Flexium-Request";

  var skew = parseFloat(document.body.dataset.serverTime) - Date.now() / 1000;

  function serverNow() { return Date.now() / 1000 + skew; }

  // --- times (the same formats as formatters.py) ---------------------------------------------

  function fmtDuration(seconds, precise) {
    var s = Math.max(0, seconds);
    if (s < 10 && precise) { return s.toFixed(2) + " s"; }
    if (s < 60) { return Math.floor(s) + " s"; }
    var m = Math.floor(s / 60), sec = Math.floor(s % 60);
    if (m < 60) { return sec ? m + " min " + sec + " s" : m + " min"; }
    var h = Math.floor(m / 60); m = m % 60;
    if (h < 24) { return m ? h + " h " + m + " min" : h + " h"; }
    var d = Math.floor(h / 24); h = h % 24;
    return h ? d + " d " + h + " h" : d + " d";
  }

  function fmtAgo(ts) {
    var age = Math.max(0, serverNow() - ts);
    if (age < 2) { return "just now"; }
    if (age >= 86400) { return Math.floor(age / 86400) + " d ago"; }
    if (age >= 3600) { return Math.floor(age / 3600) + " h ago"; }
    if (age >= 60) { return Math.floor(age / 60) + " min ago"; }
    return Math.floor(age) + " s ago";
  }

  function tick() {
    document.querySelectorAll("[data-since]").forEach(function (el) {
      var since = parseFloat(el.dataset.since);
      if (!isNaN(since)) { el.textContent = fmtDuration(serverNow() - since, false); }
    });
    document.querySelectorAll("[data-ago]").forEach(function (el) {
      var ts = parseFloat(el.dataset.ago);
      if (!isNaN(ts)) { el.textContent = fmtAgo(ts); }
    });
  }

  // --- fragments -----------------------------------------------------------------------------

  function fragment(html) {
    var t = document.createElement("template");
    t.innerHTML = html;
    return t.content;
  }

  async function fetchFragment(url) {
    var r = await fetch(url, {credentials: "same-origin", headers: {"Accept": "text/html"}});
    if (r.status === 401) {
      window.location.assign("/login");
      throw new Error("signed out");
    }
    if (r.status === 404) { return null; }
    if (!r.ok) { throw new Error("HTTP " + r.status + " for " + url); }
    return r.text();
  }

  // --- notices -------------------------------------------------------------------------------

  // key -> its notice: a command's (or a job operation's) next state replaces the last one.
  var tracked = new Map();

  // offer: a button the notice holds, {label, run} (run() gets the button), e.g. "Queue it?" on a
  // refused resume.
  function notify(text, kind, key, offer) {
    var el = key !== undefined ? tracked.get(key) : null;
    if (!el || !document.contains(el)) {        // none yet, or dismissed by hand
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
      document.getElementById("notices").prepend(el);
      if (key !== undefined) { el.dataset.commandId = key; tracked.set(key, el); }
    }
    el.className = "notice notice-" + kind;
    el.setAttribute("role", kind === "error" ? "alert" : "status");
    el.querySelector(".notice-text").textContent = text;
    var shown = el.querySelector(".notice-action");
    if (shown && (!offer || shown.textContent !== offer.label)) { shown.remove(); shown = null; }
    if (offer && !shown) {
      var button = document.createElement("button");
      button.type = "button";
      button.className = "btn notice-action";
      button.textContent = offer.label;
      button.addEventListener("click", function () { button.disabled = true; offer.run(button); });
      el.insertBefore(button, el.querySelector(".notice-close"));
    }
    clearTimeout(el.dismissTimer);
    if (kind === "ok") {
      el.dismissTimer = setTimeout(function () { el.remove(); tracked.delete(key); }, 12000);
    }
    return el;
  }

  // What the notice of a refused resume offers (allocator.js: "Queue it?"), {label, run} or undefined.
  var refusedResumeOffer = function () { return undefined; };
  function resumeOffer(processId) { return refusedResumeOffer(processId); }

  // The newest state of each command seen. The answer to the POST that sent a command and the
  // command's events come in either order (a job may be done before the answer arrives): an
  // older state never replaces a newer one, and events before the answer are not lost.
  var STAGE = {queued: 0, delivered: 1, running: 2, succeeded: 3, failed: 3, expired: 3};
  var latest = new Map();   // command id -> command

  function newest(c) {
    var was = latest.get(c.id);
    if (was && STAGE[was.state] > STAGE[c.state]) { return was; }
    latest.set(c.id, c);
    return c;
  }

  // A job operation followed by this page: one notice for every rank's command.
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
      notify(what + "failed: " + failed.join("; "), "error", key,
        op.kind === "resume" ? resumeOffer(c.process_id) : undefined);
    } else {
      notify(what + parts.join(", ") + "…", "progress", key);
    }
  }

  // A command names its GPU by UUID only; the index shown is the one a GPU card or the target
  // dialog shows when the command is first seen, kept for its later notices (cards come and go as
  // the page updates).
  var gpuTexts = new Map();
  function gpuName(uuid) {
    var shown = document.querySelector('[data-uuid="' + CSS.escape(uuid) + '"][data-index]:not([data-index=""])');
    return shown ? "GPU " + shown.dataset.index : uuid;
  }
  function gpuText(c) {
    if (!gpuTexts.has(c.id)) {
      var moves = c.gpu_moves ? Object.keys(c.gpu_moves).map(function (now) {
        return gpuName(now) + " → " + gpuName(c.gpu_moves[now]);
      }).sort() : [];
      gpuTexts.set(c.id, moves.length ? " " + moves.join(", ") : c.target_uuid ? " → " + gpuName(c.target_uuid) : "");
    }
    return gpuTexts.get(c.id);
  }

  // A process on flexium's simulated host (its row or its page says so): its timings are no measurements.
  function onSimulatedGpus(processId) {
    return document.querySelector('[data-process-id="' + CSS.escape(processId) + '"][data-simulated]') !== null;
  }

  function commandNotice(c) {
    if (!tracked.has(c.id)) { return; }
    var what = c.kind + " " + c.process_id + gpuText(c) + " (command " + c.id + "): ";
    var seconds = c.result && typeof c.result.seconds === "number" ? c.result.seconds
      : (c.finished_at && c.started_at ? c.finished_at - c.started_at : null);
    if (c.state === "succeeded") {
      var path = c.result && c.result.path ? " (" + c.result.path + " path)" : "";
      var simulated = onSimulatedGpus(c.process_id) ? " on simulated GPUs" : "";
      notify(what + "succeeded" + (seconds !== null ? " in " + fmtDuration(seconds, true) : "") + simulated + path,
             "ok", c.id);
    } else if (c.state === "failed" || c.state === "expired") {
      notify(what + c.state + (c.error ? ": " + c.error : ""), "error", c.id,
        c.kind === "resume" ? resumeOffer(c.process_id) : undefined);
    } else {
      var phase = {queued: "queued", delivered: "delivered, waiting for a safe point", running: "running"}[c.state];
      notify(what + (phase || c.state) + "…", "progress", c.id);
    }
  }

  function follow(c) {
    if (c.job) {
      var id = c.job.operation_id;
      if (trackedOps.has(id)) { return; }
      var op = {kind: c.kind, key: c.job.job_key, ranks: new Map()};
      latest.forEach(function (seen) {        // its ranks' commands seen before now
        if (seen.job && seen.job.operation_id === id) { op.ranks.set(seen.job.rank, seen); }
      });
      trackedOps.set(id, op);
    } else if (!tracked.has(c.id)) {
      tracked.set(c.id, null);
    }
  }

  function show(c) {
    commandNotice(c);
    if (c.job) { operationNotice(c); }
  }

  // A command from the event stream: its notice follows it when this page sent it, or when
  // `adopt` says this page follows every command of what it shows (the job page).
  function commandEvent(c, adopt) {
    c = newest(c);
    if (adopt) { follow(c); }
    show(c);
  }

  // --- the API -------------------------------------------------------------------------------

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

  // A pause, resume or migrate of one process, or of a whole job (sent to one rank: the server
  // gives every rank its share); its notice follows it from here on.
  async function sendCommand(kind, processId, extra) {
    var command = await api("POST", "/commands", Object.assign({kind: kind, process_id: processId}, extra || {}));
    var now = newest(command);
    follow(now);
    show(now);
    return command;
  }

  // --- the buttons and the dialog that send commands -----------------------------------------

  // What the dialog's form chose: a GPU for each rank of a job, where each GPU's memory of a
  // process on several goes (those that move), or one target (none: the server picks).
  function formChoice(form) {
    if (form.dataset.jobKey) {
      var ranks = {};
      form.querySelectorAll("select[data-rank]").forEach(function (select) { ranks[select.dataset.rank] = select.value; });
      return {ranks: ranks};
    }
    if (form.dataset.gpus) {
      var gpus = {};
      form.querySelectorAll("select[data-gpu]").forEach(function (select) {
        if (select.value !== select.dataset.current) { gpus[select.dataset.gpu] = select.value; }
      });
      return {gpus: gpus};
    }
    var choice = form.querySelector("input[name=target]:checked");
    return choice && choice.value ? {target: choice.value} : {};
  }

  // `body` with the reason typed in `scope` (a dialog's form, the job page's actions), if any.
  function withReason(scope, body) {
    var input = scope ? scope.querySelector("input[name=reason]") : null;
    var reason = input ? input.value.trim() : "";
    return reason ? Object.assign({reason: reason}, body) : body;
  }

  // A <dialog> whose `body` a fetched form fills (.open(html, opener)): a submit runs
  // how.send(form) and closes it, or shows the refusal in the form's .form-error (in the words of
  // how.refusal(err), else the server's) and tells how.refused(form, err); a click on the backdrop
  // or on [data-close] closes it, unless how.click(ev) took it; closed, the focus goes back to its
  // opener, or to how.refocus(opener) where that was re-rendered meanwhile.
  function formDialog(dialog, body, how) {
    dialog.addEventListener("submit", async function (ev) {
      ev.preventDefault();
      var form = ev.target;
      var error = form.querySelector(".form-error");
      var submit = form.querySelector("button[type=submit]");
      error.hidden = true;
      submit.disabled = true;
      try {
        await how.send(form);
        dialog.close();
      } catch (err) {
        error.textContent = how.refusal ? how.refusal(err) : err.message;
        error.hidden = false;
        if (how.refused) { how.refused(form, err); }
      } finally {
        submit.disabled = false;
      }
    });
    dialog.addEventListener("click", function (ev) {
      if (how.click && how.click(ev)) { return; }
      if (ev.target === dialog || ev.target.closest("[data-close]")) { dialog.close(); }
    });
    dialog.addEventListener("close", function () {
      var opener = dialog.opener;
      body.replaceChildren();
      if (!opener) { return; }
      if (document.contains(opener)) { opener.focus(); } else if (how.refocus) { how.refocus(opener); }
    });
    return {
      open: function (html, opener) {
        body.replaceChildren(fragment(html));
        dialog.opener = opener;
        dialog.showModal();
        var first = body.querySelector("input[name=target]:checked") || body.querySelector("select")
          || body.querySelector("button[type=submit]");
        if (first) { first.focus(); }
      },
    };
  }

  // The buttons (data-action) in `container` and the page's #target-dialog. hooks.sent(command)
  // after a command went out, hooks.forgotten(processId) after a forget, hooks.refocus(opener)
  // when the dialog closes and the button that opened it was re-rendered meanwhile.
  function wireCommands(container, hooks) {
    var dialogBody = document.getElementById("dialog-body");
    var dialog = formDialog(document.getElementById("target-dialog"), dialogBody, {
      send: function (form) {
        return send(form.dataset.kind, form.dataset.processId, withReason(form, formChoice(form)));
      },
      refused: function (form, err) {
        notify(form.dataset.kind + " " + form.dataset.processId + " refused: " + err.message, "error", undefined,
          form.dataset.kind === "resume" ? resumeOffer(form.dataset.processId) : undefined);
      },
      click: function (ev) {  // two ranks or GPUs: each takes the other's GPU
        if (!ev.target.closest("[data-swap]")) { return false; }
        var selects = dialogBody.querySelectorAll("select[data-current]");
        if (selects.length === 2) {
          var first = selects[0].dataset.current, second = selects[1].dataset.current;
          selects[0].value = second;
          selects[1].value = first;
        }
        return true;
      },
      refocus: function (opener) { hooks.refocus(opener); },
    });

    async function openDialog(url, opener, what) {
      var html = await fetchFragment(url);
      if (html === null) {
        notify(what + " is gone", "error");
        return;
      }
      dialog.open(html, opener);
    }

    async function send(kind, processId, extra) {
      hooks.sent(await sendCommand(kind, processId, extra));
    }

    container.addEventListener("click", async function (ev) {
      var button = ev.target.closest("button[data-action]");
      if (!button || button.disabled) { return; }
      var action = button.dataset.action;
      var processId = button.dataset.processId;
      try {
        if (action === "migrate" || action === "resume") {
          await openDialog("/ui/processes/" + encodeURIComponent(processId) + "/targets?kind=" + action,
            button, "process " + processId);
        } else if (action === "pause" || action === "job-pause" || action === "job-resume") {
          button.disabled = true;
          var beside = button.closest("#job-actions");
          await send(action.replace("job-", ""), processId, withReason(beside, {}));
          var used = beside ? document.getElementById("job-reason") : null;   // said once, with this command
          if (used) { used.value = ""; }
        } else if (action === "job-migrate") {
          await openDialog("/ui/jobs/" + encodeURIComponent(button.dataset.jobKey) + "/migrate",
            button, "job " + button.dataset.jobKey);
        } else if (action === "forget") {
          button.disabled = true;
          await api("DELETE", "/processes/" + encodeURIComponent(processId));
          hooks.forgotten(processId);
        }
      } catch (err) {
        button.disabled = false;
        notify(action + " " + processId + " refused: " + err.message, "error", undefined,
          action === "job-resume" ? resumeOffer(processId) : undefined);
      }
    });
  }

  // --- live events ---------------------------------------------------------------------------

  function setLive(on, text) {
    var live = document.getElementById("live");
    live.className = "live " + (on ? "live-on" : "live-off");
    live.textContent = text;
  }

  // The workspace's event stream: handlers[name](data) for each event of that name.
  function listen(handlers) {
    var source = new EventSource(API + "/events");
    Object.keys(handlers).forEach(function (name) {
      source.addEventListener(name, function (ev) {
        if (name === "hello") { setLive(true, "live"); }
        handlers[name](JSON.parse(ev.data));
      });
    });
    source.addEventListener("error", function () {
      setLive(false, "reconnecting…");
      if (source.readyState === EventSource.CLOSED) {
        // A refused stream is not retried by the browser: find out why (signed out: the login
        // page), then try again.
        fetchFragment("/ui/commands").catch(function () { return null; });
        setTimeout(function () { listen(handlers); }, 3000);
      }
    });
  }

  window.flexiumPage = {
    serverNow: serverNow,
    fmtDuration: fmtDuration,
    fmtAgo: fmtAgo,
    tick: tick,
    fragment: fragment,
    fetchFragment: fetchFragment,
    notify: notify,
    offerAfterRefusedResume: function (offer) { refusedResumeOffer = offer; },
    commandEvent: commandEvent,
    api: api,
    gpuName: gpuName,
    wireCommands: wireCommands,
    formDialog: formDialog,
    withReason: withReason,
    listen: listen,
  };
})();
