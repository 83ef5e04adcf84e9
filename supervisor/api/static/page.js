// jobsup status page: brings the server-rendered fragment (#live) up to date every 2 s
// without reloading, changing only the nodes that differ (so a selection in what did not
// change, an ended job's id or error, survives the refresh), and shows ISO times as
// local times. No dependencies.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const live = document.getElementById("live");

  function localTimes(root) {
    for (const el of root.querySelectorAll("time.at")) {
      const t = new Date(el.getAttribute("datetime"));
      if (isNaN(t)) continue;
      el.textContent = el.classList.contains("short")
        ? t.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" })
        : t.toLocaleString();
      el.title = el.getAttribute("datetime");
    }
  }

  // Makes `into`'s children equal to `from`'s, touching only what differs: a text that
  // changed is set, an element of another tag or id is replaced, attributes are synced.
  function morph(into, from) {
    const have = Array.from(into.childNodes), want = Array.from(from.childNodes);
    want.forEach((node, i) => {
      const old = have[i];
      if (!old) { into.appendChild(document.importNode(node, true)); return; }
      if (old.nodeType !== node.nodeType || old.nodeName !== node.nodeName
          || (old.id || "") !== (node.id || "")) {
        into.replaceChild(document.importNode(node, true), old);
        return;
      }
      if (old.nodeType !== Node.ELEMENT_NODE) {
        if (old.nodeValue !== node.nodeValue) old.nodeValue = node.nodeValue;
        return;
      }
      for (const attr of Array.from(old.attributes)) {
        if (!node.hasAttribute(attr.name)) old.removeAttribute(attr.name);
      }
      for (const attr of Array.from(node.attributes)) {
        if (old.getAttribute(attr.name) !== attr.value) old.setAttribute(attr.name, attr.value);
      }
      morph(old, node);
    });
    for (let i = have.length - 1; i >= want.length; i--) into.removeChild(have[i]);
  }

  async function refresh() {
    if (!live) return;
    const query = live.dataset.query;
    const url = live.dataset.fragment + (query ? "?" + query : "");
    try {
      const answer = await fetch(url, { headers: { Accept: "text/html" }, cache: "no-store" });
      if (answer.status === 401) { window.location.reload(); return; }  // the session ended
      if (!answer.ok) { document.body.classList.add("stale"); return; }
      const fresh = document.createElement("template");
      fresh.innerHTML = await answer.text();
      localTimes(fresh.content);  // before the comparison: unchanged times stay untouched
      morph(live, fresh.content);
      document.body.classList.remove("stale");
      live.dispatchEvent(new CustomEvent("jobsup:refreshed"));
    } catch (err) {
      document.body.classList.add("stale");  // the daemon is unreachable: keep the last view
    }
  }

  // shows another view of the table (filters, order, page) without a reload
  function navigate(query) {
    live.dataset.query = query;
    history.replaceState(null, "", "/" + (query ? "?" + query : ""));
    refresh();
  }

  const filters = document.getElementById("filters");
  if (filters && live) {
    const apply = (event) => {
      if (event) event.preventDefault();
      const shown = new URLSearchParams(live.dataset.query);
      const query = new URLSearchParams();
      for (const key of ["sort", "dir"]) if (shown.get(key)) query.set(key, shown.get(key));
      for (const [key, value] of new FormData(filters)) if (value) query.set(key, value);
      navigate(query.toString());
    };
    filters.addEventListener("submit", apply);
    filters.querySelector("select").addEventListener("change", apply);
  }

  // Stop, Restart and "restart all failed": the API's routes, with the page's session
  const result = document.getElementById("action-result");
  async function act(button) {
    const action = button.dataset.action;
    const path = action === "restart-failed" ? "/api/v1/jobs:restart?state=failed"
      : "/api/v1/jobs/" + encodeURIComponent(button.dataset.job) + "/" + action;
    button.disabled = true;
    let said;
    try {
      const answer = await fetch(path, { method: "POST" });
      const body = await answer.json().catch(() => ({}));
      said = !answer.ok ? (body.error || action + " failed: " + answer.status)
        : action === "restart-failed" ? body.length + " failed job(s) restarted"
        : action === "stop" ? "stop requested: " + button.dataset.job
        : "restarted: " + button.dataset.job;
    } catch (err) {
      said = action + " failed: the daemon did not answer";
    }
    if (result) result.textContent = said;
    button.disabled = false;
    refresh();
  }

  document.addEventListener("click", (event) => {
    const link = event.target.closest("#live a.sort, #live a.pager");
    if (link && live) { event.preventDefault(); navigate(link.search.slice(1)); return; }
    const button = event.target.closest("button[data-action]");
    if (button && !button.disabled) act(button);
  });

  localTimes(document);
  window.jobsup = { refresh: refresh, refreshes: 0 };
  if (live) {
    live.addEventListener("jobsup:refreshed", () => { window.jobsup.refreshes += 1; });
    setInterval(refresh, REFRESH_MS);
  }
})();
