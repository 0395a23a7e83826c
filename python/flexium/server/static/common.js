// What the dashboard's pages share (dashboard.js, job.js): the server's clock, the time formats
// (the same as pages.py), and fetching a server-rendered fragment. Loaded before either.
(function () {
  "use strict";

  var skew = parseFloat(document.body.dataset.serverTime) - Date.now() / 1000;

  function serverNow() { return Date.now() / 1000 + skew; }

  // --- times (the same formats as pages.py) --------------------------------------------------

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

  window.flexiumPage = {
    serverNow: serverNow,
    fmtDuration: fmtDuration,
    fmtAgo: fmtAgo,
    tick: tick,
    fragment: fragment,
    fetchFragment: fetchFragment,
  };
})();
