// A job's page. The server renders its whole content (fragments/job_panel.html); this script
// swaps in a fresh render when the event stream says something the page shows changed: one of
// its processes (a new rank of its job too), a command for them, sent or refused, its wait in the
// queue, or the GPUs of their hosts; when their stored training progress changed, only the
// training sections. No timer re-reads it: every change it shows comes with an event, and a
// reconnected stream starts with "hello", which re-reads it too.
// Its buttons, dialog and notices are common.js's and allocator.js's, as on the dashboard.
(function () {
  "use strict";

  var body = document.body;
  var PROCESS = body.dataset.processId;
  var panel = document.getElementById("job-panel");

  var page = window.flexiumPage;
  var tick = page.tick, fragment = page.fragment, fetchFragment = page.fetchFragment;

  // What the panel shows, as its last render says (a rank may register after the page opened).
  var ours = new Set(), hosts = new Set(), jobKey = null;
  function readPanel() {
    var head = panel.querySelector(".job-head");
    ours = new Set((head.dataset.processIds || "").split(" ").filter(Boolean));
    hosts = new Set(JSON.parse(head.dataset.hosts || "[]"));
    jobKey = head.dataset.jobKey === undefined ? null : head.dataset.jobKey;
  }

  // --- the panel -----------------------------------------------------------------------------

  // The focus back on a redrawn action, without scrolling to it (the page stays where it is read).
  function focusAction(action) {
    var button = panel.querySelector('[data-action="' + action + '"]');
    if (button && !button.disabled) { button.focus({preventScroll: true}); }
  }

  // `work`, one run at a time: asked again meanwhile, it runs once more after the one under way.
  function coalesced(work) {
    var running = null, again = false;
    return function run() {
      if (running) { again = true; return running; }
      running = (async function () {
        try {
          await work();
        } catch (err) {
          if (err && err.message !== "signed out") { console.warn("flexium job page:", err); }
        } finally {
          running = null;
          if (again) { again = false; run(); }
        }
      })();
      return running;
    };
  }

  // The reason being typed beside the actions survives a render, caret and all; returns what
  // puts it back.
  function keptReason() {
    var field = document.getElementById("job-reason");
    if (!field || !field.value) { return function () {}; }
    var value = field.value, typing = document.activeElement === field;
    var start = field.selectionStart, end = field.selectionEnd;
    return function () {
      var again = document.getElementById("job-reason");
      if (!again) { return; }
      again.value = value;
      if (typing) { again.focus(); again.setSelectionRange(start, end); }
    };
  }

  var refresh = coalesced(async function () {
    var html = await fetchFragment("/ui/jobs/" + encodeURIComponent(PROCESS) + "/panel");
    if (html === null) { window.location.reload(); return; }   // gone: the page says so
    var focused = document.activeElement;
    var action = focused && panel.contains(focused) && focused.dataset ? focused.dataset.action : null;
    var details = new Set();
    panel.querySelectorAll("details[open][data-keep]").forEach(function (d) { details.add(d.dataset.keep); });
    var choosing = panel.querySelector("form.priority-form[data-dirty]");   // a priority being chosen stays chosen
    var chosen = choosing ? {priority: choosing.elements.priority.value, number: choosing.elements.number.value} : null;
    var typed = keptReason();
    panel.replaceChildren(fragment(html));
    typed();
    panel.querySelectorAll("details[data-keep]").forEach(function (d) { if (details.has(d.dataset.keep)) { d.open = true; } });
    var form = panel.querySelector("form.priority-form");
    if (chosen && form) {
      form.elements.priority.value = chosen.priority;
      form.elements.number.value = chosen.number;
      form.dataset.dirty = "1";
    }
    readPanel();
    if (action) { focusAction(action); }
    tick();
  });

  // Progress changes only the training sections: those alone are read again and swapped in.
  var refreshProgress = coalesced(async function () {
    var html = await fetchFragment("/ui/jobs/" + encodeURIComponent(PROCESS) + "/progress");
    if (html === null) { return; }   // gone: the process event that says so re-renders the page
    Array.from(fragment(html).children).forEach(function (section) {
      var shown = section.id ? document.getElementById(section.id) : null;
      if (shown && panel.contains(shown)) { shown.replaceWith(section); }
    });
    tick();
  });

  // --- commands and live events --------------------------------------------------------------

  page.wireCommands(panel, {
    sent: refresh,
    forgotten: function () { window.location.assign("/"); },
    refocus: function (opener) { focusAction(opener.dataset.action); },
  });
  page.wireAllocator(panel);

  ["input", "change"].forEach(function (type) {
    panel.addEventListener(type, function (ev) {
      var form = ev.target.closest("form.priority-form");
      if (form) { form.dataset.dirty = "1"; }
    });
  });

  function concerns(processId) { return ours.has(processId); }

  page.listen({
    hello: refresh,
    process: function (data) {
      var p = data.process || {};
      if (concerns(p.process_id) || (jobKey !== null && p.job && p.job.key === jobKey)) { refresh(); }
    },
    command: function (data) {
      var c = data.command || {};
      if (!concerns(c.process_id)) { return; }
      page.commandEvent(c, true);   // every command of this job, from this page or not
      refresh();
    },
    command_refused: function (data) {
      if (concerns((data.request || {}).process_id)) { refresh(); }   // on its timeline
    },
    drain: function (data) {
      if (hosts.has((data.drain || {}).host)) { refresh(); }   // its GPU cards
    },
    wait: function (data) {
      var w = data.wait || {};
      if (hosts.has(w.host)) { refresh(); }   // its place in its host's queue, or its own wait
    },
    progress: function (data) {
      if ((data.processes || []).some(function (p) { return concerns(p.process_id); })) { refreshProgress(); }
    },
    devices: function (data) {
      if (hosts.has(data.host)) { refresh(); }   // its GPU cards
    },
    resync: refresh,
  });

  readPanel();
  tick();
  setInterval(tick, 1000);
})();
