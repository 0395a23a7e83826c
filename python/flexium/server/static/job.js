// A job's page. The server renders its whole content (fragments/job_panel.html); this script
// swaps in a fresh render when the event stream says the job changed, and every few seconds
// for its training progress (steps change without an event). Its buttons, dialog and notices
// are common.js's, as on the dashboard.
(function () {
  "use strict";

  var body = document.body;
  var PROCESS = body.dataset.processId;
  var ours = new Set((body.dataset.processIds || "").split(" ").filter(Boolean));
  var panel = document.getElementById("job-panel");
  var PROGRESS_EVERY_MS = 5000;

  var page = window.flexiumPage;
  var tick = page.tick, fragment = page.fragment, fetchFragment = page.fetchFragment;

  // --- the panel -----------------------------------------------------------------------------

  function focusAction(action) {
    var button = panel.querySelector('[data-action="' + action + '"]');
    if (button && !button.disabled) { button.focus(); }
  }

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
        if (action) { focusAction(action); }
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

  // --- commands and live events --------------------------------------------------------------

  page.wireCommands(panel, {
    sent: refresh,
    forgotten: function () { window.location.assign("/"); },
    refocus: function (opener) { focusAction(opener.dataset.action); },
  });

  function concerns(processId) { return ours.has(processId); }

  page.listen({
    hello: refresh,
    process: function (data) {
      if (concerns((data.process || {}).process_id)) { refresh(); }
    },
    command: function (data) {
      var c = data.command || {};
      if (!concerns(c.process_id)) { return; }
      page.commandEvent(c, true);   // every command of this job, from this page or not
      refresh();
    },
    resync: refresh,
  });

  tick();
  setInterval(tick, 1000);
  setInterval(function () { if (!document.hidden) { refresh(); } }, PROGRESS_EVERY_MS);
})();
