// jobsup status page: swaps the server-rendered fragment (#live) in every 2 s without
// reloading, and shows ISO times as local times. No dependencies.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const live = document.getElementById("live");

  function localTimes(root) {
    for (const el of root.querySelectorAll("time.at")) {
      const t = new Date(el.getAttribute("datetime"));
      if (!isNaN(t)) { el.textContent = t.toLocaleString(); el.title = el.getAttribute("datetime"); }
    }
  }

  async function refresh() {
    if (!live) return;
    const query = live.dataset.query;
    const url = live.dataset.fragment + (query ? "?" + query : "");
    try {
      const answer = await fetch(url, { headers: { Accept: "text/html" }, cache: "no-store" });
      if (answer.status === 401) { window.location.reload(); return; }  // the session ended
      if (!answer.ok) { document.body.classList.add("stale"); return; }
      live.innerHTML = await answer.text();
      document.body.classList.remove("stale");
      localTimes(live);
      live.dispatchEvent(new CustomEvent("jobsup:refreshed"));
    } catch (err) {
      document.body.classList.add("stale");  // the daemon is unreachable: keep the last view
    }
  }

  const filters = document.getElementById("filters");
  if (filters && live) {
    const apply = (event) => {
      if (event) event.preventDefault();
      const query = new URLSearchParams();
      for (const [key, value] of new FormData(filters)) if (value) query.set(key, value);
      live.dataset.query = query.toString();
      history.replaceState(null, "", "/" + (live.dataset.query ? "?" + live.dataset.query : ""));
      refresh();
    };
    filters.addEventListener("submit", apply);
    filters.querySelector("select").addEventListener("change", apply);
  }

  localTimes(document);
  window.jobsup = { refresh: refresh, refreshes: 0 };
  if (live) {
    live.addEventListener("jobsup:refreshed", () => { window.jobsup.refreshes += 1; });
    setInterval(refresh, REFRESH_MS);
  }
})();
