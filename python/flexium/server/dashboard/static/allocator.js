// The dashboard as the team's GPU allocator (dashboard.js, job.js): a paused job queued to resume
// when free, or room made for it; a wait or a placement (flexium run's job not started) cancelled;
// a job's priority set; a GPU or a whole host drained (a host once confirmed in its dialog) and
// undrained. Loaded after common.js, whose notices and API calls it uses; the notice of a refused
// resume offers "Queue it?" from here. Text from the API goes in through textContent only.
(function () {
  "use strict";

  var page = window.flexiumPage;
  var api = page.api, notify = page.notify;

  function gpuOf(uuid) { return uuid ? page.gpuName(uuid) : "any GPU it may use"; }

  // --- the resume-when-free queue ------------------------------------------------------------

  // A paused job into the queue (POST /waits, as flexium resume --when-free), or room made for it
  // by pausing jobs of lower priority (makeRoom); what the server did is told in a notice. A button
  // among the job page's actions sends the reason typed there (said once, as a command's is).
  async function queueResume(processId, makeRoom, button) {
    var field = button && button.closest("#job-actions") ? document.getElementById("job-reason") : null;
    var reason = field ? field.value.trim() : "";
    var request = {process_id: processId, make_room: Boolean(makeRoom)};
    var answer = await api("POST", "/waits", reason ? Object.assign({reason: reason}, request) : request);
    if (field) { field.value = ""; }
    var w = answer.wait;
    var paused = answer.commands.filter(function (c) { return c.kind === "pause"; })
      .map(function (c) { return c.process_id; });
    var resumed = answer.commands.some(function (c) { return c.kind === "resume"; });
    var text = resumed ? "resume " + processId + ": there is room now, resuming on " + gpuOf(w.gpu_uuid)
      : makeRoom ? "making room for " + processId + " on "
        + gpuOf(w.reservation ? w.reservation.gpu_uuid : w.gpu_uuid) + ": pausing "
        + (paused.length ? paused.join(", ") : "no job (the room is free)") + "; it resumes there once the room shows"
      : processId + " waits to resume when free: #" + w.position + " in the queue of " + w.host
        + " (wait " + w.id + ")";
    notify(text, "ok", "wait-" + w.id);
    return answer;
  }

  // What a notice of a refused resume offers: the same job queued to resume when free.
  page.offerAfterRefusedResume(function (processId) {
    return {
      label: "Queue it?",
      run: function (button) {
        queueResume(processId, false).then(function () {
          var notice = button.closest(".notice");
          if (notice) { notice.remove(); }
        }, function (err) {
          button.disabled = false;
          notify("queue " + processId + " refused: " + err.message, "error");
        });
      },
    };
  });

  // A refusal to make room says why GPU by GPU ("...: GPU 0: ...; GPU 1: ..."): a line each.
  function byGpu(message) { return message.replace(/: (?=GPU )/, ":\n").replace(/; (?=GPU )/g, "\n"); }

  async function cancelWait(waitId, processId) {
    var w = await api("DELETE", "/waits/" + encodeURIComponent(waitId));
    notify(processId + " left the queue of " + w.host + " (wait " + w.id + " cancelled)", "ok", "wait-" + w.id);
  }

  // A job flexium run waits to start (DELETE /placements/{id}): its flexium run stops waiting and
  // starts nothing (its placement event redraws the queue).
  async function cancelPlacement(button) {
    var pl = await api("DELETE", "/placements/" + encodeURIComponent(button.dataset.placementId));
    notify("placement " + pl.id + " on " + pl.host + " " + pl.state + ": its flexium run starts nothing",
      "ok", "placement-" + pl.id);
  }

  // --- drains --------------------------------------------------------------------------------

  // A GPU taken out of use (its jobs moved off, nothing placed there) until it is undrained.
  async function drainGpu(button) {
    var gpu = button.dataset.index !== "" ? "GPU " + button.dataset.index : button.dataset.uuid;
    var d = await api("POST", "/drains", {host: button.dataset.host, gpu: button.dataset.uuid});
    notify("draining " + gpu + " of " + d.host + " (drain " + d.id + "): its jobs move off", "ok", "drain-" + d.id);
  }

  // Every GPU of a host (POST /drains without a GPU), once the admin confirmed it in the dialog
  // that says what it does to each job there (from the host's heading among the GPU cards, or in
  // the process table).
  var drainDialog = null;

  async function openDrainHost(button) {
    var host = button.dataset.host;
    var html = await page.fetchFragment("/ui/drain-host?host=" + encodeURIComponent(host));
    button.disabled = false;
    if (html === null) {
      notify("host " + host + " reports no GPU now", "error");
      return;
    }
    drainDialog.open(html, button);
  }

  async function drainHost(form) {
    var d = await api("POST", "/drains", page.withReason(form, {host: form.dataset.host}));
    notify("draining every GPU of " + d.host + " (drain " + d.id + "): its jobs are paused and queued to resume when free",
      "ok", "drain-" + d.id);
  }

  async function undrain(button) {
    var d = await api("DELETE", "/drains/" + encodeURIComponent(button.dataset.drainId));
    notify("drain " + d.id + " of " + d.host + " ended: its GPUs take jobs again", "ok", "drain-" + d.id);
  }

  // --- priorities ----------------------------------------------------------------------------

  async function setPriority(form) {
    var number = form.querySelector("input[name=number]").value.trim();
    var priority = number || form.querySelector("select[name=priority]").value;
    // As text, a name or a number: the server's one reading of a priority says what it refuses.
    var p = await api("PUT", "/processes/" + encodeURIComponent(form.dataset.processId) + "/priority",
      {priority: priority});
    delete form.dataset.dirty;
    notify("priority of " + p.process_id + " set to " + priority, "ok", "priority-" + p.process_id);
  }

  // --- the buttons ---------------------------------------------------------------------------

  // button -> what it does; the refusal's notice says it in the server's words.
  var ACTIONS = {
    "queue": function (b) { return queueResume(b.dataset.processId, false, b); },
    "make-room": function (b) { return queueResume(b.dataset.processId, true, b); },
    "cancel-wait": function (b) { return cancelWait(b.dataset.waitId, b.dataset.processId); },
    "cancel-placement": cancelPlacement,
    "drain": drainGpu,
    "drain-host": openDrainHost,
    "undrain": undrain,
  };

  function refusal(action, button, err) {
    if (action === "cancel-placement") { return "cancel placement " + button.dataset.placementId + " refused: " + err.message; }
    if (action === "make-room") { return "make room for " + button.dataset.processId + " refused: " + byGpu(err.message); }
    if (action === "drain" || action === "drain-host" || action === "undrain") {
      return action + " " + (button.dataset.host || "") + " refused: " + byGpu(err.message);
    }
    return action + " " + button.dataset.processId + " refused: " + err.message;
  }

  // The allocator's buttons (data-action) and priority forms in `container`, and the Drain host
  // dialog where the page has one (the main page's host headings).
  function wireAllocator(container) {
    var dialog = document.getElementById("drain-dialog");
    if (dialog) {
      drainDialog = page.formDialog(dialog, document.getElementById("drain-dialog-body"), {
        send: drainHost,
        refusal: function (err) { return byGpu(err.message); },
      });
    }
    container.addEventListener("click", async function (ev) {
      var button = ev.target.closest("button[data-action]");
      if (!button || button.disabled || !ACTIONS[button.dataset.action]) { return; }
      var action = button.dataset.action;
      button.disabled = true;
      try {
        await ACTIONS[action](button);
      } catch (err) {
        button.disabled = false;
        notify(refusal(action, button, err), "error");
      }
    });

    container.addEventListener("submit", async function (ev) {
      var form = ev.target.closest("form.priority-form");
      if (!form) { return; }
      ev.preventDefault();
      var submit = form.querySelector("button[type=submit]");
      submit.disabled = true;
      try {
        await setPriority(form);
      } catch (err) {
        notify("priority of " + form.dataset.processId + " refused: " + err.message, "error");
      } finally {
        submit.disabled = false;
      }
    });
  }

  page.wireAllocator = wireAllocator;
})();
