// The login link the server prints carries the token after '#', which browsers never send to
// the server (so no token lands in access logs or proxies): post it from here. Opening the
// link on an open login page only changes the hash, hence the hashchange listener.
(function () {
  "use strict";
  function fromHash() {
    var m = /[#&]token=([^&]+)/.exec(window.location.hash);
    if (!m) { return; }
    history.replaceState(null, "", window.location.pathname);
    document.getElementById("token").value = decodeURIComponent(m[1]);
    document.getElementById("login-form").submit();
  }
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
