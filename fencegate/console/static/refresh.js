// Read pages reload themselves every data-refresh seconds, but never while the operator is
// typing into a form or has changed one: a refresh must not wipe a half-written answer.
(function () {
  "use strict";
  var seconds = Number(document.body.getAttribute("data-refresh") || 0);
  if (!seconds) {
    return;
  }
  var edited = false;
  document.addEventListener("input", function () { edited = true; }, true);
  setInterval(function () {
    var active = document.activeElement;
    var typing = active && active.form && active.tagName !== "BUTTON";
    if (!edited && !typing && !document.hidden) {
      window.location.reload();
    }
  }, seconds * 1000);
})();
