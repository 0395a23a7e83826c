// A job's page. The server renders its whole content (fragments/job_panel.html); this script
// swaps in a fresh render when the event stream says the job changed, and every few seconds
// for its training progress (steps change without an event), and posts the commands of its
// buttons. Text from the API goes in through textContent only.
(function () {
  "use strict";

  var body = document.body;
  var API = body.dataset.apiBase;
  var PROCESS = body.dataset.processId;
  var ours = new Set((body.dataset.processIds || "").split(" ").filter(Boolean));
  var panel = document.getElementById("job-panel");
  var dialog = document.getElementById("target-dialog");
  var dialogBody = document.getElementById("dialog-body");
  var notices = document.getElementById("notices");
  var live = document.getElementById("live");
  var PROGRESS_EVERY_MS = 5000;

  var page = window.flexiumPage;
  var tick = page.tick;
  var fragment = page.fragment, fetchFragment = page.fetchFragment;

  // One notice per command (key): its outcome replaces the notice that it was sent.
  var shown = new Map();
  function notify(text, kind, key) {
    var el = key !== undefined ? shown.get(key) : null;
    if (!el || !document.contains(el)) {
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
      if (key !== undefined) { shown.set(key, el); }
    }
    el.className = "notice notice-" + kind;
    el.setAttribute("role", kind === "error" ? "alert" : "status");
    el.querySelector(".notice-text").textContent = text;
    if (kind === "ok") { setTimeout(function () { el.remove(); }, 12000); }
  }

  // --- the panel -----------------------------------------------------------------------------

  var refreshing = null, again = false;
  async function refresh() {
    if (refreshing) { again = true; return refreshing; }
    refreshing = (async function () {
      try {
        var html = await fetchFragment("/ui/jobs/" + encodeURIComponent(PROCESS) + "/panel");
        if (html === null) { window.location.reload(); return; }   // gone: the page says so
        var focused = document.activeElement;
        var action = focused && panel.contains(focused) && focused.dataset ? focused.dataset.action : null;
        var details = new Set();
        panel.querySelectorAll("details[open][data-keep]").forEach(function (d) { details.add(d.dataset.keep); });
        panel.replaceChildren(fragment(html));
        panel.querySelectorAll("details[data-keep]").forEach(function (d) { if (details.has(d.dataset.keep)) { d.open = true; } });
        if (action) {
          var button = panel.querySelector('[data-action="' + action + '"]');
          if (button && !button.disabled) { button.focus(); }
        }
        tick();
      } catch (err) {
        if (err && err.message !== "signed out") { console.warn("flexium job page:", err); }
      } finally {
        refreshing = null;
        if (again) { again = false; refresh(); }
      }
    })();
    return refreshing;
  }

  // --- commands ------------------------------------------------------------------------------

  async function api(method, path, payload) {
    var headers = {"Accept": "application/json", "X-Flexium-Request": "1"};
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
    if (!r.ok) { throw new Error((data && data.message) || "HTTP " + r.status); }
    return data;
  }

  async function send(kind, processId, extra) {
    var payload = Object.assign({kind: kind, process_id: processId}, extra || {});
    var command = await api("POST", "/commands", payload);
    notify(kind + " sent (command " + command.id + ")…", "progress", command.id);
    refresh();
    return command;
  }

  async function openForm(url, opener) {
    var html = await fetchFragment(url);
    if (html === null) { notify("this job is gone", "error"); return; }
    dialogBody.replaceChildren(fragment(html));
    dialog.opener = opener;
    dialog.showModal();
    var first = dialogBody.querySelector("input[name=target]:checked, select, button[type=submit]");
    if (first) { first.focus(); }
  }

  panel.addEventListener("click", async function (ev) {
    var button = ev.target.closest("button[data-action]");
    if (!button || button.disabled) { return; }
    var action = button.dataset.action, processId = button.dataset.processId;
    try {
      if (action === "migrate" || action === "resume") {
        await openForm("/ui/processes/" + encodeURIComponent(processId) + "/targets?kind=" + action, button);
      } else if (action === "pause") {
        button.disabled = true;
        await send("pause", processId);
      } else if (action === "job-pause" || action === "job-resume") {
        button.disabled = true;
        await send(action.slice(4), processId);
      } else if (action === "job-migrate") {
        await openForm("/ui/jobs/" + encodeURIComponent(button.dataset.jobKey) + "/migrate", button);
      } else if (action === "forget") {
        button.disabled = true;
        await api("DELETE", "/processes/" + encodeURIComponent(processId));
        window.location.assign("/");
      }
    } catch (err) {
      button.disabled = false;
      notify(action + " refused: " + err.message, "error");
    }
  });

  dialog.addEventListener("submit", async function (ev) {
    ev.preventDefault();
    var form = ev.target;
    var error = form.querySelector(".form-error");
    var submit = form.querySelector("button[type=submit]");
    error.hidden = true;
    submit.disabled = true;
    try {
      var extra = {};
      if (form.dataset.jobKey) {
        extra.ranks = {};
        form.querySelectorAll("select[data-rank]").forEach(function (s) { extra.ranks[s.dataset.rank] = s.value; });
      } else {
        var choice = form.querySelector("input[name=target]:checked");
        if (choice && choice.value) { extra.target = choice.value; }
      }
      await send(form.dataset.kind, form.dataset.processId, extra);
      dialog.close();
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    } finally {
      submit.disabled = false;
    }
  });

  dialog.addEventListener("click", function (ev) {
    if (ev.target.closest("[data-swap]")) {
      var selects = dialogBody.querySelectorAll("select[data-rank]");
      if (selects.length === 2) {
        var first = selects[0].dataset.current;
        selects[0].value = selects[1].dataset.current;
        selects[1].value = first;
      }
      return;
    }
    if (ev.target === dialog || ev.target.closest("[data-close]")) { dialog.close(); }
  });

  dialog.addEventListener("close", function () { dialogBody.replaceChildren(); });

  // --- live events ---------------------------------------------------------------------------

  function setLive(on, text) {
    live.className = "live " + (on ? "live-on" : "live-off");
    live.textContent = text;
  }

  function concerns(processId) { return ours.has(processId); }

  function connect() {
    var source = new EventSource(API + "/events");
    source.addEventListener("hello", function () { setLive(true, "live"); refresh(); });
    source.addEventListener("process", function (ev) {
      var p = JSON.parse(ev.data).process || {};
      if (concerns(p.process_id)) { refresh(); }
    });
    source.addEventListener("command", function (ev) {
      var c = JSON.parse(ev.data).command || {};
      if (!concerns(c.process_id)) { return; }
      if (c.state === "succeeded") { notify(c.kind + " succeeded (command " + c.id + ")", "ok", c.id); }
      else if (c.state === "failed" || c.state === "expired") {
        notify(c.kind + " " + c.state + " (command " + c.id + ")" + (c.error ? ": " + c.error : ""), "error", c.id);
      }
      refresh();
    });
    source.addEventListener("resync", refresh);
    source.addEventListener("error", function () {
      setLive(false, "reconnecting…");
      if (source.readyState === EventSource.CLOSED) { setTimeout(connect, 3000); }
    });
  }

  tick();
  setInterval(tick, 1000);
  setInterval(function () { if (!document.hidden) { refresh(); } }, PROGRESS_EVERY_MS);
  connect();
})();
