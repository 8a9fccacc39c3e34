// The little JavaScript of metanode's pages: Edit buttons, the Live feed, plugin progress.
"use strict";

// The path the node is served under behind a proxy (the `root_path` setting, on <html> as
// `data-root`; empty at the root of a host): every URL the scripts make starts with it.
const ROOT = document.documentElement.dataset.root || "";

// A status region (role=status, aria-live=polite) is read aloud at each change of its content,
// the very same words written again included: Plugins wrote "The node does not answer;
// retrying…" every two seconds while the node was down, Live "reconnecting…" at each attempt, a
// screen reader repeating them until it came back. Only words that differ are written.
function say(region, ...words) {
  const text = words.map((w) => (typeof w === "string" ? w : w.textContent)).join("");
  if (region.textContent !== text) region.replaceChildren(...words);
}

function csrf() {
  const main = document.getElementById("main");
  return main ? main.dataset.csrf || "" : "";
}

// Edit: show the row's form (its input is labelled with the key) and focus it; Escape in the
// form closes it again, back to its Edit button.
function toggleEdit(button, open) {
  const form = document.getElementById(button.getAttribute("aria-controls"));
  form.hidden = !open;
  button.setAttribute("aria-expanded", String(open));
  if (open) form.querySelector("[name=value]").focus();
  else button.focus();
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button.edit");
  if (button) toggleEdit(button, button.getAttribute("aria-expanded") !== "true");
});

document.addEventListener("keydown", (event) => {
  const form = event.key === "Escape" && event.target.closest("form[id^=edit-]");
  if (form) toggleEdit(document.querySelector(`button[aria-controls="${form.id}"]`), false);
});

// Live: the change feed through EventSource (it resumes with Last-Event-ID by itself). Each
// change is listed at once, in the feed's order, its record named as the library names it
// (`/records/<rid>/label`, asked once per record and again when a change may rename it:
// `data-label-keys`); every row of a record takes its newest name, so one record never goes
// by several names down the list.

// The session is gone (signed out elsewhere, or its hours are up; a restart of the node keeps
// it): say so where the page shows its state, with the way back. Reloading shows the
// sign-in form, which goes on to this very page.
function signedOut(status) {
  const again = document.createElement("a");
  again.href = location.pathname + location.search;
  again.textContent = "Sign in again";
  say(status, "Signed out (here or in another tab, or the session ended). ", again);
}

const NEWS_MS = 5000;
// how much of the newest change is read aloud: a value may be an nfo's plot of paragraphs
const NEWS_CHARS = 120;
// how long Live waits before following again after the node refused its feed for a while (503)
const LIVE_RETRY_MS = 5000;

// How many names Live asks at once: of the six connections a browser opens to a host, one is
// the feed's, and one stays free for a tap on a link. It asked one for every record that came
// by, all at once: over a slow phone link (400 ms there and back, 400 kbit/s) a burst of 1,000
// new records queued 1,000 asks, 800 for rows already dropped (the page keeps 200), the oldest
// first, and the rows shown had their names after 85 s.
const LABEL_ASKS = 4;

// A name or value as the page shows it (ui.legible, the same set of characters): in a <bdi>,
// so a right-to-left text or an override inside it never reorders the rest of the row, with
// each character that changes how it reads without being seen (a control character, a
// bidirectional embedding, override or isolate) shown as its code point.
const HIDDEN = /[\u0000-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/g;

function legible(text) {
  const bdi = document.createElement("bdi");
  let from = 0;
  for (const match of text.matchAll(HIDDEN)) {
    const mark = document.createElement("span");
    mark.className = "hidden-char";
    mark.textContent = `U+${match[0].charCodeAt(0).toString(16).toUpperCase().padStart(4, "0")}`;
    bdi.append(text.slice(from, match.index), mark);
    from = match.index + 1;
  }
  bdi.append(text.slice(from));
  return bdi;
}

function startLive() {
  const list = document.getElementById("events");
  const status = document.getElementById("live-status");
  if (!list) return;
  const renaming = new Set(list.dataset.labelKeys.split(" "));
  const known = new Map(); // rid → its label, once asked
  const asking = new Set(); // the rids whose names are being asked
  let source = null;
  let lastId = ""; // the newest event's id: a new EventSource goes on from it
  const gone = () => { source.close(); signedOut(status); };
  // A screen reader hears how many changes came, and the newest, once every NEWS_MS at most,
  // not every row: a season of episodes queued minutes of speech.
  const news = document.getElementById("live-news");
  let unread = 0;
  let newsTimer = null;
  const told = () => {
    const row = list.firstElementChild ? list.firstElementChild.textContent : "";
    const newest = row.length > NEWS_CHARS ? `${row.slice(0, NEWS_CHARS)}…` : row;
    news.textContent = unread === 1
      ? `1 new change: ${newest}`
      : `${unread} new changes, the newest: ${newest}`;
    unread = 0;
    newsTimer = null;
  };
  const tell = () => {
    unread += 1;
    if (newsTimer === null) newsTimer = setTimeout(told, NEWS_MS);
  };
  const links = (rid) => list.querySelectorAll(`a[data-rid="${CSS.escape(rid)}"]`);
  const rename = (rid, label) => {
    known.set(rid, label);
    for (const link of links(rid)) link.replaceChildren(legible(label));
  };
  // A row whose record's name is unknown, or may have changed, has its link marked `stale`;
  // the names asked are those of the newest such rows still on the page, LABEL_ASKS at once.
  const pump = () => {
    for (const link of list.querySelectorAll("a[data-stale]")) {
      if (asking.size >= LABEL_ASKS) return;
      if (!asking.has(link.dataset.rid)) ask(link.dataset.rid);
    }
  };
  const ask = async (rid) => {
    asking.add(rid);
    for (const link of links(rid)) delete link.dataset.stale;
    try {
      const r = await fetch(`${ROOT}/records/${encodeURIComponent(rid)}/label`, { credentials: "same-origin" });
      if (r.status === 401) return gone();
      if (r.ok) rename(rid, (await r.json()).label);
    } catch { /* the node does not answer: the row keeps the name it has */ }
    asking.delete(rid);
    pump(); // a rename that came meanwhile marked its rows again
  };
  // EventSource retries by itself while the node does not answer; it gives up (CLOSED) when the
  // node answers anything but 200. That is a gone session (401) or a node that cannot take the
  // feed now (503 `too_busy` past `max_connections`, `cache_not_ready` while it starts): the
  // page said "Signed out" to both and stopped following. The page itself, asked without its
  // body, tells which; for a 503 a new EventSource goes on from the last id after a while.
  const closed = async () => {
    try {
      const r = await fetch(`${ROOT}/live`, { method: "HEAD", credentials: "same-origin" });
      if (r.status === 401) return signedOut(status);
    } catch { /* the node does not answer: try again all the same */ }
    say(status, "reconnecting…");
    setTimeout(connect, LIVE_RETRY_MS);
  };
  // Only what the list shows: the node leaves out the `cids/…` links (`?exclude=`), which the
  // page received and dropped: 60 of the 302 events (26 % of the bytes) of 20 new files with
  // the built-in plugins, one of the two of a claim on a new CID.
  const connect = () => {
    const query = new URLSearchParams({ exclude: "cids/" });
    if (lastId) query.set("since", lastId);
    source = new EventSource(`${ROOT}/api/events?${query}`);
    source.onopen = () => say(status, "connected");
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) closed();
      else say(status, "reconnecting…");
    };
    source.addEventListener("set", show);
    source.addEventListener("del", show);
    source.addEventListener("gap", (event) => {
      lastId = event.lastEventId || lastId;
      say(status, "caught up from a snapshot");
    });
  };
  // 200 rows: the newest, and the one holding the keyboard's focus whatever its age (removed
  // under it, the focus fell to the page and a keyboard reader lost their place)
  const trim = (rows) => {
    for (let row = rows.lastElementChild; rows.children.length > 200 && row;) {
      const older = row.previousElementSibling;
      if (!row.contains(document.activeElement)) row.remove();
      row = older;
    }
  };
  const show = (event) => {
    lastId = event.lastEventId || lastId;
    const data = JSON.parse(event.data);
    const item = document.createElement("li");
    const link = document.createElement("a");
    link.href = `${ROOT}/records/${data.rid}`;
    link.dataset.rid = data.rid;
    link.append(legible(known.get(data.rid) || data.rid));
    item.append(link, ` ${event.type} `, legible(data.key));
    if (data.value !== undefined) item.append(" = ", legible(data.value));
    list.prepend(item);
    // a first name already asked is the new row's too; a rename asks again, after an ask
    // under way (whose answer may be the old name)
    if (renaming.has(data.key)) for (const other of links(data.rid)) other.dataset.stale = "";
    else if (!known.has(data.rid) && !asking.has(data.rid)) link.dataset.stale = "";
    trim(list);
    tell();
    pump();
  };
  connect();
}

// Plugins: refresh the counts and progress bars two seconds after each answer (not every two
// seconds: on a large library an answer takes a while, and the asks piled up); say when the
// node does not answer, and stop once the session is gone.
function startPlugins() {
  const table = document.getElementById("plugins");
  const status = document.getElementById("plugins-status");
  if (!table) return;
  const show = (plugins) => {
    for (const p of plugins) {
      const row = table.querySelector(`tr[data-plugin="${CSS.escape(p.name)}"]`);
      if (!row) continue;
      const { pending, done, skipped, failed } = p.runs;
      row.querySelector(".pending").textContent = pending;
      row.querySelector(".done").textContent = done;
      row.querySelector(".skipped").textContent = skipped;
      row.querySelector(".failed").textContent = failed;
      const bar = row.querySelector("progress");
      bar.max = pending + done + skipped + failed || 1;
      bar.value = done + skipped + failed || (pending ? 0 : 1);
      // the files it works on now: a slow plugin's pending count alone did not say
      row.querySelector(".running").replaceChildren(...p.running.flatMap((r, i) => {
        const name = document.createElement("code");
        name.textContent = r.path || r.cid;
        return i ? [", ", name] : [name];
      }));
    }
  };
  const tick = async () => {
    try {
      const r = await fetch(`${ROOT}/api/plugins`, { credentials: "same-origin" });
      if (r.status === 401) return signedOut(status);
      if (r.ok) {
        say(status, "");
        show((await r.json()).plugins);
      }
    } catch {
      say(status, "The node does not answer; retrying…");
    }
    setTimeout(tick, 2000);
  };
  setTimeout(tick, 2000);
}

// After a form: focus what the page says about it (in the edited row, or at the top), so the
// keyboard and a screen reader go on from there rather than from the top of the page; a form
// shown again with what was typed (a refused edit, a refused folder: `data-typed`) gets the
// focus in its field instead.
function focusSaid() {
  const typed = document.querySelector("form[id^=edit-]:not([hidden]) [name=value], [data-typed]");
  const said = document.querySelector("[data-focus]");
  if (said) said.focus();
  if (typed) typed.focus();
}

document.addEventListener("DOMContentLoaded", () => { startLive(); startPlugins(); });
// after the load, not at DOMContentLoaded: going to the address's #fragment, Chromium clears the
// focus once the document is parsed
window.addEventListener("load", () => setTimeout(focusSaid));
