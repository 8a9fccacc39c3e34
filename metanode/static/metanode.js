// The little JavaScript of metanode's pages: Edit buttons, the Live feed, plugin progress.
"use strict";

function csrf() {
  const main = document.getElementById("main");
  return main ? main.dataset.csrf || "" : "";
}

// Edit: show the row's form (its input is labelled with the key) and focus it.
document.addEventListener("click", (event) => {
  const button = event.target.closest("button.edit");
  if (!button) return;
  const form = document.getElementById(button.getAttribute("aria-controls"));
  const open = form.hidden;
  form.hidden = !open;
  button.setAttribute("aria-expanded", String(open));
  if (open) form.querySelector("input[name=value]").focus();
});

// Live: the change feed through EventSource (it resumes with Last-Event-ID by itself), each
// change with its record's title, looked up once per record through the API (the session
// cookie authorises it).
const titles = new Map();

async function titleOf(rid) {
  if (!titles.has(rid)) {
    titles.set(rid, fetch(`/api/metadata/${rid}`, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : null))
      .then((doc) => {
        const m = (doc && doc.metadata) || {};
        return m.title || (m.filePath || "").split("/").pop() || rid;
      })
      .catch(() => rid));
  }
  return titles.get(rid);
}

function startLive() {
  const list = document.getElementById("events");
  const status = document.getElementById("live-status");
  if (!list) return;
  const source = new EventSource("/api/events");
  source.onopen = () => { status.textContent = "connected"; };
  source.onerror = () => { status.textContent = "reconnecting…"; };
  const show = async (event) => {
    const data = JSON.parse(event.data);
    if (data.key === "title" && data.value) titles.set(data.rid, Promise.resolve(data.value));
    if (data.key.startsWith("cids/")) return;
    const item = document.createElement("li");
    const link = document.createElement("a");
    link.href = `/records/${data.rid}`;
    link.textContent = await titleOf(data.rid);
    item.append(link, ` ${event.type} ${data.key}`);
    if (data.value !== undefined) item.append(` = ${data.value}`);
    list.prepend(item);
    while (list.children.length > 200) list.lastChild.remove();
  };
  source.addEventListener("set", show);
  source.addEventListener("del", show);
  source.addEventListener("gap", () => { status.textContent = "caught up from a snapshot"; });
}

// Plugins: refresh the counts and progress bars every two seconds while runs are pending.
function startPlugins() {
  const table = document.getElementById("plugins");
  if (!table) return;
  const tick = async () => {
    const r = await fetch("/api/plugins", { credentials: "same-origin" });
    if (!r.ok) return;
    for (const p of (await r.json()).plugins) {
      const row = table.querySelector(`tr[data-plugin="${CSS.escape(p.name)}"]`);
      if (!row) continue;
      const { pending, done, failed } = p.runs;
      row.querySelector(".pending").textContent = pending;
      row.querySelector(".done").textContent = done;
      row.querySelector(".failed").textContent = failed;
      const bar = row.querySelector("progress");
      bar.max = pending + done + failed || 1;
      bar.value = done + failed || (pending ? 0 : 1);
    }
  };
  setInterval(tick, 2000);
}

document.addEventListener("DOMContentLoaded", () => { startLive(); startPlugins(); });
