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
      if (!isNaN(t)) { el.textContent = t.toLocaleString(); el.title = el.getAttribute("datetime"); }
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
