// psymesh dashboard: live regions over server-sent events, and invite countdowns.
// Served from the daemon under a CSP that allows only this file: no inline code, no eval.
// The HTML a region receives was rendered (and escaped) by the daemon's templates.
"use strict";
(function () {
  function tick() {
    document.querySelectorAll(".countdown[data-expires]").forEach(function (el) {
      var left = Math.max(0, Math.round(Number(el.dataset.expires) - Date.now() / 1000));
      el.textContent = left > 0 ? Math.floor(left / 60) + " min " + (left % 60) + " s" : "expired";
    });
  }
  function live() {
    var region = document.getElementById("live");
    if (!region || !region.dataset.view || !region.innerHTML.trim() || !window.EventSource) return;
    var url = "/events?view=" + encodeURIComponent(region.dataset.view);
    var source = new EventSource(url);
    source.addEventListener("region", function (ev) {
      region.innerHTML = ev.data;
      region.dataset.updated = String(Date.now());
      tick();
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    tick();
    setInterval(tick, 1000);
    live();
  });
})();
