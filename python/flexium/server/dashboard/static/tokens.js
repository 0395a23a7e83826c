// The tokens page, as an admin has it: the issue form (POST /tokens), whose new token's secret is
// shown once with the lines that connect a shell to this server, and a Revoke button on each active
// token, confirmed in a dialog the server renders (/ui/tokens/{id}/revoke: the tokens revoked with
// it, the processes left unheard). After either, the table is fetched again (/ui/tokens). The API
// calls, the notices and the dialog are common.js's; text goes in through textContent only.
(function () {
  "use strict";

  var page = window.flexiumPage;
  var api = page.api, notify = page.notify;
  var table = document.getElementById("tokens");
  var form = document.getElementById("issue-form");
  var issued = document.getElementById("issued");

  async function refreshTable() {
    var html = await page.fetchFragment("/ui/tokens");
    if (html !== null) { table.replaceChildren(page.fragment(html)); }
  }

  function refreshTableOrSay() {
    return refreshTable().catch(function (err) { notify("the table could not be read again: " + err.message, "error"); });
  }

  // An exact time as the server writes it (formatters.fmt_utc).
  function utc(ts) {
    return new Date(ts * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }

  // --- issuing -------------------------------------------------------------------------------

  // The life asked for, in seconds: null for "never" (the server then gives it this session's
  // token's end, if that has one). What the server refuses (0, more than its bounds, longer than
  // this session's token) it says why; only a blank count is caught here, which would read as
  // "never".
  function lifeSeconds() {
    if (form.querySelector("input[name=life]:checked").value === "never") { return null; }
    var count = form.querySelector("input[name=life-count]");
    if (count.value.trim() === "") {
      count.focus();
      throw new Error("give the number of " + form.querySelector("select[name=life-unit]").selectedOptions[0].text +
        " it may live, or choose never expires");
    }
    return parseFloat(count.value) * parseInt(form.querySelector("select[name=life-unit]").value, 10);
  }

  function showIssued(t) {
    issued.querySelectorAll('[data-issued="token"]').forEach(function (el) { el.textContent = t.token; });
    issued.querySelector('[data-issued="id"]').textContent = t.id;
    issued.querySelector('[data-issued="summary"]').textContent = (t.name ? t.name + ": " : "") + t.role + " token, " +
      (t.expires_at === null ? "valid until revoked" : "expires " + utc(t.expires_at));
    issued.hidden = false;
    issued.querySelector("[data-copy]").focus();
  }

  // The secret leaves the page: it is in no other place the page can show it from.
  function forgetIssued() {
    issued.querySelectorAll("[data-issued]").forEach(function (el) { el.textContent = ""; });
    issued.hidden = true;
  }

  async function issue() {
    var body = {name: form.querySelector("input[name=name]").value.trim(), role: form.querySelector("select[name=role]").value};
    var life = lifeSeconds();
    if (life !== null) { body.expires_in_s = life; }
    var t = await api("POST", "/tokens", body);
    forgetIssued();
    showIssued(t);
    form.querySelector("input[name=name]").value = "";
    notify("issued token " + t.id + (t.name ? " (" + t.name + ")" : "") + ", role " + t.role, "ok", "token-" + t.id);
    await refreshTableOrSay();
    var row = document.getElementById("token-" + t.id);
    if (row) { row.classList.add("token-new"); }
  }

  form.addEventListener("submit", async function (ev) {
    ev.preventDefault();
    var error = form.querySelector(".form-error");
    var submit = form.querySelector("button[type=submit]");
    error.hidden = true;
    submit.disabled = true;
    try {
      await issue();
    } catch (err) {
      error.textContent = "issuing refused: " + err.message;
      error.hidden = false;
    } finally {
      submit.disabled = false;
    }
  });

  // A count typed is a life chosen.
  form.querySelector("input[name=life-count]").addEventListener("input", function () {
    form.querySelector('input[name=life][value="limited"]').checked = true;
  });

  document.getElementById("issued-done").addEventListener("click", function () {
    forgetIssued();
    form.querySelector("input[name=name]").focus();
  });

  // The clipboard API is only in a secure context (https, or this machine): elsewhere the text is
  // selected and copied the old way, or left selected for the person to copy.
  async function copy(button) {
    var source = document.getElementById(button.dataset.copy);
    try {
      await navigator.clipboard.writeText(source.textContent);
    } catch (err) {
      var range = document.createRange();
      range.selectNodeContents(source);
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      if (!document.execCommand("copy")) {
        notify("this browser would not copy it: it is selected, copy it with the keyboard", "error");
        return;
      }
    }
    button.textContent = "Copied";
    setTimeout(function () { button.textContent = "Copy"; }, 2000);
  }

  issued.addEventListener("click", function (ev) {
    var button = ev.target.closest("button[data-copy]");
    if (button) { copy(button); }
  });

  // --- revoking ------------------------------------------------------------------------------

  function revokedText(r) {
    var text = "revoked token " + r.id + (r.name ? " (" + r.name + ")" : "");
    if (r.cascade.length) { text += ", and the tokens it minted: " + r.cascade.join(", "); }
    if (r.processes.length) {
      text += "; the processes they registered train on, but the server no longer hears or commands them: " +
        r.processes.join(", ");
    }
    return text;
  }

  var dialog = page.formDialog(document.getElementById("revoke-dialog"), document.getElementById("revoke-dialog-body"), {
    send: async function (confirmed) {
      var r = await api("DELETE", "/tokens/" + encodeURIComponent(confirmed.dataset.tokenId));
      notify(revokedText(r), "ok", "token-" + r.id);
      await refreshTableOrSay();   // where this session's token was revoked, fetchFragment sends it to the login page
    },
    // Its button is gone with the redrawn row: the focus goes to the table's heading.
    refocus: function () { document.getElementById("tokens-title").focus(); },
  });

  table.addEventListener("click", async function (ev) {
    var button = ev.target.closest('button[data-action="revoke-token"]');
    if (!button || button.disabled) { return; }
    var id = button.dataset.tokenId;
    button.disabled = true;
    try {
      var html = await page.fetchFragment("/ui/tokens/" + encodeURIComponent(id) + "/revoke");
      if (html === null) {
        notify("token " + id + " is no longer active", "error");
        await refreshTable();
        return;
      }
      dialog.open(html, button);
      // Cancel first: Enter on an opened confirmation should not revoke.
      document.querySelector("#revoke-dialog [data-close]").focus();
    } catch (err) {
      notify("revoke token " + id + ": " + err.message, "error");
    } finally {
      button.disabled = false;
    }
  });
})();
