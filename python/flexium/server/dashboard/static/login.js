// A login link carries a one-time login code after '#', which browsers never send to the
// server (so no code lands in access logs or proxies): post it from here. Opening the link on
// an open login page only changes the hash, hence the hashchange listener.
(function () {
  "use strict";
  function fromHash() {
    var m = /[#&]code=([^&]+)/.exec(window.location.hash);
    if (!m) { return; }
    history.replaceState(null, "", window.location.pathname);
    document.getElementById("code").value = decodeURIComponent(m[1]);
    document.getElementById("token").value = "";
    document.getElementById("login-form").submit();
  }
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
