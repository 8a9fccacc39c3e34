"""The web page: the library, each record's provenance, fixing a value, the live feed, files,
plugins, signers, health and the API docs, served by the node itself (docs/ui.md).

Server-rendered Jinja2 templates (`metanode/templates/`) with a little plain JavaScript
(`metanode/static/`): no build step, nothing fetched from the internet (a home box may be
offline; Swagger UI comes from the `swagger-ui-bundle` package). An edge like `api.py`: it calls
`Node` methods only.

Sign-in trades the API token for a session: a random id kept in this process (so signing out,
or a restart, ends it for every copy of the cookie), sent as a cookie signed with the data
directory's `session-secret` and expiring after `ui_session_hours`, HttpOnly and
SameSite=Strict. The token itself never reaches the browser's storage. Every state-changing
request made with the cookie must carry the session's CSRF token (a form field, or the
`X-CSRF-Token` header for the page's own JSON calls) and, if the browser says where it comes
from, an `Origin` of this very host.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import importlib.resources
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import time
import unicodedata
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import jinja2
import markupsafe
import swagger_ui_bundle
from itsdangerous import BadSignature, Signer
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from metanode import cid as cids
from metanode import datadir, labels, merge
from metanode.bodies import read_body
from metanode.claims import LINK_PREFIX, LOCAL_KEYS, Claim
from metanode.errors import (
    CsrfRefused,
    InvalidBatch,
    InvalidRequest,
    Merged,
    MetanodeError,
    TooLarge,
    TooManyAttempts,
    UnknownCid,
    shown,
)
from metanode.node import Node

# The page routes, as `api.FAMILIES` lists them (a prefix ends in "/"; "/" is the start page).
PAGES = (
    "/",
    "/signin",
    "/signout",
    "/records/",
    "/live",
    "/files",
    "/files/",
    "/plugins",
    "/plugins/",
    "/signers",
    "/signers/",
    "/status",
    "/docs",
    "/docs/",
    "/static/",
)
# The addresses only forms post to; a GET of one (typed, or from the history) goes to its page.
FORM_ONLY = (
    "/signin",
    "/signout",
    "/records/{id}/edit",
    "/signers/{uid}/block",
    "/signers/{uid}/unblock",
    "/plugins/{name}/retry",
    "/files/watch-roots",
    "/files/watch-roots/remove",
)
UNSAVED = "Not saved: you had been signed out. What you typed is back in its form: save it again."
COOKIE = "metanode_session"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
log = logging.getLogger(__name__)
FIRST = asyncio.FIRST_COMPLETED
PAGE = 50  # records a library page lists
# the library's Files filter (`?files=`): every record, those with a file on this box, or those
# whose files are all gone (kept: claims are never deleted; they crowded the list)
HELD: dict[str, bool | None] = {"": None, "here": True, "gone": False}
FILES_PAGE = 200  # files the Files page lists at once
FOLDERS_PAGE = 500  # folders in a folder the Files page lists at once
FORM_EXTRA_BYTES = 4096  # a form's fields beside its value (`Pages.form`)
FORM_TYPE = "application/x-www-form-urlencoded"
ADD_FOLDER = "add-folder"  # the Files page's Add folder form: where its refusals are said


# -- sessions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flash:
    """What the next page says once (`after_form`): kept in the session, never in the URL,
    where anyone could word a message for the page to show. `at` is the id of the element it
    is about (a record's row, its Add form), where the page shows it and goes to; None: the
    top of the page."""

    kind: str  # "notice" or "error"
    text: str
    at: str | None = None


@dataclass(frozen=True)
class Draft:
    """What a person typed in a form the node did not take (a value too long, a rejected key,
    a session that had ended): the record page shows it again in that form, open, so nothing
    typed is lost. `adding`: the Add form, else the key's Edit form."""

    key: str
    value: str
    adding: bool


@dataclass
class Session:
    """One signed-in browser: its id, its CSRF token, when it ends (monotonic seconds), and
    `ended`, set when it is ended before that (sign-out), which ends its open streams."""

    sid: str
    csrf: str
    expires: float
    flash: Flash | None = None
    draft: Draft | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


MOST_SESSIONS = 1_000  # live sign-ins at once (≈ 1 KB each): a household has a few browsers


@dataclass
class Sessions:
    """The live sessions of this process. A cookie is honoured only while its id is listed
    here, so ending a session (sign-out) stops every copy of its cookie at once.

    They are kept in `Settings.sessions_path` too (`keep`, at each sign-in and sign-out) and
    read back at start (`restore`): held in memory only, every restart of `serve` (an upgrade,
    a reboot of the box) signed every browser out, and whoever was at the page had to find
    the API token again."""

    node: Node
    live: dict[str, Session] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time  # the file's ends: the monotonic clock restarts
    _writing: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ttl_s(self) -> float:
        return self.node.settings.ui_session_hours * 3600

    def _signer(self) -> Signer:
        # the secret is made at start (`Node.start`), after this object was built
        return Signer(self.node.session_secret, salt="metanode-ui-session")

    def create(self) -> tuple[str, Session]:
        """A new session and its cookie value (the signed id); expired sessions are dropped,
        and past `MOST_SESSIONS` the oldest are ended. Every sign-in never signed out (a
        browser closed, a script signing in again and again) stayed for `ui_session_hours`,
        which has no upper bound: sign-ins at any pace grew this map without end."""
        now = self.clock()
        for sid in [sid for sid, s in self.live.items() if s.expires <= now]:
            del self.live[sid]
        while len(self.live) >= MOST_SESSIONS:  # kept in the order made: the oldest first
            self.end(next(iter(self.live.values())))
        session = Session(secrets.token_urlsafe(24), secrets.token_urlsafe(24), now + self.ttl_s)
        self.live[session.sid] = session
        return self._signer().sign(session.sid).decode("ascii"), session

    def find(self, cookie: str | None) -> Session | None:
        """The live session a cookie value names, or None (unsigned, expired or ended).

        The cookie signs the id only: its age is the session's (`expires`, on the monotonic
        clock). A signed wall-clock time in it, checked against `ui_session_hours`, refused
        every cookie as signed "in the future" once the clock stepped back (an NTP
        correction), and every one after a step forward of those hours: every browser signed
        out, while the session itself had hours to go."""
        if not cookie or not self.node.session_secret:
            return None
        try:
            sid = self._signer().unsign(cookie).decode("ascii")
        except (BadSignature, UnicodeDecodeError):
            return None
        session = self.live.get(sid)
        if session is None or session.expires <= self.clock():
            return None
        return session

    def of_scope(self, scope: Scope) -> Session | None:
        """The session of a request's cookie header."""
        header = dict(scope["headers"]).get(b"cookie", b"").decode("latin-1")
        cookie = SimpleCookie()
        try:
            cookie.load(header)
        except Exception:  # a malformed cookie header is no session, never an error
            return None
        morsel = cookie.get(COOKIE)
        return self.find(morsel.value if morsel else None)

    def end(self, session: Session) -> None:
        self.live.pop(session.sid, None)
        session.ended.set()

    def _of_token(self) -> str:
        """Which API token the kept sessions were given for (an HMAC of it under the session
        secret: the file names no token). Sessions kept under another token are not taken
        back: replacing a token others have seen (operations.md) must sign every browser out."""
        key = self.node.session_secret.encode()
        return hmac.new(key, self.node.token.encode(), hashlib.sha256).hexdigest()

    def _kept(self) -> str:
        """The file's text: each live session's id, CSRF token and end (wall-clock seconds),
        in the order made; nothing else (a flash or a draft waits in memory only)."""
        now, wall = self.clock(), self.wall()
        live = [
            {"sid": s.sid, "csrf": s.csrf, "until": wall + s.expires - now}
            for s in self.live.values()
            if s.expires > now
        ]
        return json.dumps({"token": self._of_token(), "sessions": live}) + "\n"

    async def keep(self) -> None:
        """Write the live sessions whole (`datadir.write_whole`, on a thread: an fsync on a
        slow card must not hold every request). One write at a time, each of the sessions as
        they are when it starts, so the last one written is the newest. A disk that refuses
        is its typed `StorageError`."""
        async with self._writing:
            text = self._kept()
            await asyncio.to_thread(datadir.write_whole, self.node.settings.sessions_path, text)

    async def keep_ended(self) -> None:
        """`keep` after a sign-out, which must end the session for good. Should the disk refuse
        the write (full), the kept list is removed instead: a restart then signs every browser
        out rather than bring the ended session back. Only if that fails too is it refused."""
        try:
            await self.keep()
        except MetanodeError as exc:
            try:
                self.node.settings.sessions_path.unlink(missing_ok=True)
            except OSError:
                raise exc from None
            log.warning("%s; the kept sessions are removed instead", exc.message)

    def restore(self) -> None:
        """The sessions kept by the last run, those still to run (at most `MOST_SESSIONS`, the
        newest), taken back at start. A file that cannot be read or is damaged never stops the
        start: it is logged in one line and every browser signs in again."""
        path = self.node.settings.sessions_path
        try:
            sessions = self._parsed(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.warning("%s is damaged or unreadable (%s): every browser signs in again", path, exc)
            return
        self.live = {s.sid: s for s in sessions[-MOST_SESSIONS:]}

    def _parsed(self, text: str) -> list[Session]:
        """The sessions of the file's `text` that are still to run; its end is never later
        than `ui_session_hours` from now (a wall clock stepped back, a setting lowered). Raises
        `ValueError`, `KeyError` or `TypeError` for a text that is not such a file."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("sessions"), list):
            raise ValueError("not a list of sessions")
        sessions = [self._entry(kept) for kept in data["sessions"]]
        if data.get("token") != self._of_token():
            log.info("the web page's sessions were of another API token: none taken back")
            return []
        return [s for s in sessions if s.expires > self.clock()]

    def _entry(self, kept: Any) -> Session:
        """One session of the file (as JSON parsed it: anything), its end moved to the
        monotonic clock."""
        sid, csrf, until = kept["sid"], kept["csrf"], kept["until"]
        if not (sid and csrf and isinstance(sid, str) and isinstance(csrf, str)):
            raise ValueError("a session without its id or CSRF token")
        if isinstance(until, bool) or not isinstance(until, int | float):
            raise ValueError("a session without its end")
        left = min(until - self.wall(), self.ttl_s)
        return Session(sid, csrf, self.clock() + left)

    def while_signed_in(
        self, stream: AsyncGenerator[bytes, None], scope: Scope
    ) -> AsyncGenerator[bytes, None]:
        """`stream` (the change feed) for a request the session cookie authorises: ended when
        the session ends or expires, so a Live page left open stops receiving changes at
        sign-out as every other request of its cookie does (it read on, its cookie refused
        for all else). A request with a token is not bounded by any session."""
        if b"authorization" in dict(scope["headers"]):
            return stream
        session = self.of_scope(scope)
        return stream if session is None else self._bounded(stream, session)

    async def _bounded(
        self, stream: AsyncGenerator[bytes, None], session: Session
    ) -> AsyncGenerator[bytes, None]:
        ended = asyncio.ensure_future(session.ended.wait())
        step: asyncio.Future[bytes] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                left = session.expires - self.clock()
                await asyncio.wait({step, ended}, timeout=max(0.0, left), return_when=FIRST)
                if not step.done():  # the session ended or expired
                    return
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    return
                yield chunk
        finally:  # here too when the client leaves: the pending step cancelled before closing
            ended.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await stream.aclose()


@dataclass
class Strikes:
    """One client's wrong tokens at sign-in: how many in a row, when the last was, and when it
    may try again (monotonic seconds)."""

    failures: int = 0
    last: float = 0.0
    until: float = 0.0


@dataclass
class SignInThrottle:
    """How fast a client may guess the token at sign-in: `free` wrong ones in a row, then it
    waits `first_s` before its next try, twice that after the next wrong one, four times, … up
    to `most_s` (a try while it waits is refused, not counted); a right one, or `most_s`
    without a try once its wait is over, starts its count again. Without it a client on the LAN
    tried tokens as fast as the node answered (a token an operator chose short is then found).

    Kept in this process: the sign-in is always the owner's under `serve --workers N` (a
    reader hands every POST but `/api/claims` over, with the client's address), so every
    worker's clients count here. A client is its address (`client_key`); at most
    `MOST_CLIENTS` are remembered, the longest quiet forgotten first."""

    free: int
    first_s: float
    most_s: float
    clock: Callable[[], float] = time.monotonic
    clients: dict[str, Strikes] = field(default_factory=dict)

    def wait_s(self, client: str) -> float:
        """Seconds `client` must still wait before its next try (0: it may try now)."""
        strikes = self.clients.get(client)
        return 0.0 if strikes is None else max(0.0, strikes.until - self.clock())

    def failed(self, client: str) -> None:
        """A wrong token from `client`: counted, and its wait set once past `free`."""
        now = self.clock()
        strikes = self.clients.pop(client, None)
        if strikes is None or now - max(strikes.last, strikes.until) > self.most_s:
            strikes = Strikes()  # quiet that long: forgiven
        strikes.failures += 1
        strikes.last = now
        over = strikes.failures - self.free
        if over >= 0:
            strikes.until = now + min(self.most_s, self.first_s * 2.0 ** min(over, 64))
        self.clients[client] = strikes  # last in the dict: the most recent
        while len(self.clients) > MOST_CLIENTS:
            del self.clients[next(iter(self.clients))]

    def succeeded(self, client: str) -> None:
        self.clients.pop(client, None)


MOST_CLIENTS = 10_000  # ≈ 1 MB of `Strikes`


def client_key(scope: Scope) -> str:
    """Who a sign-in comes from: its address (after a trusted proxy's `X-Forwarded-For`), an
    IPv6 one by its /64, which one machine is given whole (it could try from 2^64 addresses)."""
    client = scope.get("client")
    if not client:  # a Unix socket
        return ""
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return str(client[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else address)


def same_origin(scope: Scope) -> bool:
    """Whether the request's `Origin` (if the browser sent one) is this host: a page of
    another site may make a browser send a form here, never with this host's origin."""
    headers: dict[bytes, bytes] = dict(scope["headers"])
    origin = headers.get(b"origin")
    if origin is None:
        return True
    host = headers.get(b"host", b"").decode("latin-1")
    try:
        return urlsplit(origin.decode("latin-1")).netloc == host
    except ValueError:  # `Origin: http://[`: no origin this host has
        return False


def foreign_origin(scope: Scope) -> str:
    """Why the request's `Origin` is not this host, in words ('' when it is): both are named,
    since behind a reverse proxy that rewrites `Host` (nginx's `$host` drops the port, and
    without `proxy_set_header Host` the node's own address is sent) even this node's own
    page is refused, and only the two side by side tell a person why."""
    if same_origin(scope):
        return ""
    headers: dict[bytes, bytes] = dict(scope["headers"])
    origin = headers.get(b"origin", b"").decode("latin-1")
    host = headers.get(b"host", b"").decode("latin-1")
    return (
        f"this form came from {origin}, but reached the node addressed to {host!r} (behind a "
        "reverse proxy, the proxy must pass the browser's Host header on: docs/operations.md)"
    )


def local_path(then: str) -> str:
    """`then` if it is a path of this node (`/…`, not `//host` nor `/\\host`, which browsers
    take for another site), else the library: where signing in may go on to."""
    if not then.startswith("/") or then.startswith(("//", "/\\")) or not then.isprintable():
        return "/"
    return "/" if urlsplit(then).path in ("/signin", "/signout") else then


def cookie_attributes(request: Request) -> dict[str, Any]:
    """The session cookie's attributes, the same when it is set and when it is deleted (a
    deletion of other attributes is another cookie to the browser): HttpOnly, SameSite=Strict,
    its `Path` the node's (`root_path`), and `Secure` when the page was reached over HTTPS
    (through a proxy in `trusted_proxies` whose `X-Forwarded-Proto` says so), so that a browser
    never sends it over plain HTTP, where anyone on the way reads it (an `http://` link to the
    same host, a proxy that also listens on port 80 to redirect)."""
    return {
        "path": root_of(request) or "/",
        "httponly": True,
        "samesite": "strict",
        "secure": request.url.scheme == "https",
    }


def csrf_ok(session: Session, given: str | None, scope: Scope) -> bool:
    """The check of every state-changing request made with the session cookie."""
    return (
        given is not None
        and hmac.compare_digest(given.encode(), session.csrf.encode())
        and same_origin(scope)
    )


def cookie_allows(sessions: Sessions, scope: Scope) -> bool:
    """Whether the session cookie authorises this API request (`api.Perimeter`): reads with
    the cookie alone, writes only with the session's CSRF token in `X-CSRF-Token`."""
    session = sessions.of_scope(scope)
    if session is None:
        return False
    if scope["method"] in SAFE_METHODS:
        return True
    given = dict(scope["headers"]).get(CSRF_HEADER.encode())
    return csrf_ok(session, None if given is None else given.decode("latin-1"), scope)


# -- provenance ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Voice:
    """A signer as the page names it."""

    name: str
    weight: int
    uid: str


@dataclass(frozen=True)
class Value:
    """One value of a key and the signers whose counting vote it is."""

    value: str
    voices: list[Voice]

    @property
    def weight(self) -> int:
        return sum(v.weight for v in self.voices)


@dataclass(frozen=True)
class Field:
    """A key of a record: its merged value, the values that compete, and whether it is a
    fact of the disk or the group (not signed, not editable)."""

    key: str
    value: str | None
    winner: Value | None
    competing: list[Value]
    computed: bool
    owner_votes: bool  # the owner has a live vote on it (Revert)

    @property
    def anchor(self) -> str:
        """The id of its row (`anchor_of`)."""
        return anchor_of(self.key)


def anchor_of(key: str) -> str:
    """The id of `key`'s row on a record page, and the fragment an edit of it goes back to: a
    key may hold spaces, which an id may not (percent-encoded, as a fragment is)."""
    return "field-" + quote(key, safe="/:@")


def multiline(value: str | None) -> bool:
    """Whether `value` is edited in a text area rather than a one-line input (which would
    drop its line breaks on Save)."""
    return value is not None and ("\n" in value or len(value) > 80)


def provenance(
    record: Mapping[str, str],
    votes: Sequence[Claim],
    signers: Sequence[Mapping[str, Any]],
    owner_uid: str,
) -> list[Field]:
    """Every key of a record with who said what (`merge.counted_votes`, the merge's own rules
    1 and 2), the winning value first; link keys left out (the CIDs are listed apart)."""
    by_uid = {s["uid"]: s for s in signers}
    weights = {
        uid: merge.Signer(s["weight"], s["status"] == "blocked") for uid, s in by_uid.items()
    }
    by_key: dict[str, list[Claim]] = {}
    for vote in votes:
        if not vote.is_link:
            by_key.setdefault(vote.key, []).append(vote)
    fields = []
    for key in sorted(set(record) | set(by_key)):
        if key.startswith(LINK_PREFIX):
            continue
        values: dict[str, list[Voice]] = {}
        for uid, vote in sorted(merge.counted_votes(by_key.get(key, []), weights).items()):
            signer = by_uid.get(uid, {"name": "", "weight": merge.DEFAULT_WEIGHT})
            assert vote.value is not None
            values.setdefault(vote.value, []).append(Voice(signer["name"], signer["weight"], uid))
        ranked = [Value(value, voices) for value, voices in values.items()]
        winner = next((v for v in ranked if v.value == record.get(key)), None)
        fields.append(
            Field(
                key,
                record.get(key),
                winner,
                sorted((v for v in ranked if v is not winner), key=lambda v: -v.weight),
                key in LOCAL_KEYS,
                any(v.uid == owner_uid and v.value is not None for v in by_key.get(key, [])),
            )
        )
    return fields


# -- pages --------------------------------------------------------------------------------------

TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("metanode", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
TEMPLATES.globals["multiline"] = multiline
WORD_PARTS = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=/)")  # audio|Stream|Codec, subtitles/|en


def word_breaks(key: str) -> markupsafe.Markup:
    """`key`, escaped, with a line-break opportunity (`<wbr>`) between its words: a camelCase
    key broke anywhere in its narrow column (`audioStreamCode` / `c`), now between words."""
    return markupsafe.Markup("<wbr>").join(WORD_PARTS.split(key))


TEMPLATES.filters["word_breaks"] = word_breaks
# Characters that change how a text reads without being seen (docs/ui.md, "Names as they
# are"): control characters, and the explicit bidirectional formatting characters (embeddings,
# overrides, isolates; RIGHT-TO-LEFT OVERRIDE turns `invoice\u202egpj.exe` into what reads
# `invoiceexe.jpg`). A value keeps its line ends and tabs (`LINES`). metanode.js's `HIDDEN`
# is the same set.
HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
LINES = "\t\n\r"


def hidden_char(char: str) -> markupsafe.Markup:
    """A hidden character made visible: its code point, named in its title when it has a
    name (the controls have none)."""
    code = f"U+{ord(char):04X}"
    name = unicodedata.name(char, "control character")
    return markupsafe.Markup('<span class="hidden-char" title="{}">{}</span>').format(name, code)


def legible(text: object, lines: bool = False) -> markupsafe.Markup:
    """`text` (a name, path, title or value) as the page shows it: escaped, isolated in a
    `<bdi>` (its direction its own, so a right-to-left name or an override inside it never
    reorders what is around it: a file's size beside its name), and every `HIDDEN` character
    shown as its code point; with `lines`, line ends and tabs are kept (a value shown in a
    `pre-wrap` cell)."""
    value = str(text)

    def visible(match: re.Match[str]) -> str:
        char = match.group()
        return char if lines and char in LINES else hidden_char(char)

    marked = HIDDEN.sub(visible, str(markupsafe.escape(value)))
    return markupsafe.Markup("<bdi>{}</bdi>").format(markupsafe.Markup(marked))


def plain(text: object) -> str:
    """`text` where no markup may go (the page's `<title>`): every `HIDDEN` character as its
    code point in brackets."""
    return HIDDEN.sub(lambda match: f"[U+{ord(match.group()):04X}]", str(text))


TEMPLATES.filters["legible"] = legible
TEMPLATES.filters["plain"] = plain
NAV = (
    ("/", "Library"),
    ("/live", "Live"),
    ("/files", "Files"),
    ("/plugins", "Plugins"),
    ("/signers", "Signers"),
    ("/status", "Health"),
    ("/docs", "API docs"),
)


# What every page carries. Its scripts, styles, pictures and requests are the node's own files
# (nothing inline: an injected `<script>` or `onerror=` would not run, should a value ever
# reach a page unescaped; `data:` for the icon and Swagger UI's pictures), and no other page may
# frame it: a page of another port of the same host (a site to the browser, so the
# SameSite=Strict cookie goes along) framed the signed-in Signers page, its Block buttons under
# whatever it drew over them (clickjacking); `X-Frame-Options` says the same to older browsers.
PAGE_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": PAGE_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


def crumbs(folder: str, roots: Sequence[str]) -> list[tuple[str, str]]:
    """The Files page's way back up from `folder`: (name, path) of its watched root and of each
    folder between, `folder` last; none for a folder under no root."""
    root = next((r for r in roots if f"{folder}/".startswith(f"{r.rstrip('/')}/")), None)
    if root is None:
        return []
    trail = [(root, root)]
    for name in filter(None, folder[len(root) :].split("/")):
        trail.append((name, f"{trail[-1][1].rstrip('/')}/{name}"))
    return trail


def root_of(request: Request) -> str:
    """The `root_path` setting (`/metanode`, or empty): what every URL a page writes starts
    with. The routes are at `/` (`api.unroot`); only what the browser is sent carries it: the
    templates' links, forms and assets (`root`), the scripts' URLs (`data-root`), redirects
    (`to`) and the session cookie's `Path`."""
    root: str = request.app.state.root_path
    return root


def to(request: Request, path: str) -> RedirectResponse:
    """On to the node's own `path` (`/records/…`: a route's), under `root_path` (303)."""
    return RedirectResponse(root_of(request) + path, status_code=303)


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A page: the template with the navigation, the session's CSRF token, the path (the
    route's, without `root_path`: `root`, which every URL in it starts with), and what the last
    form left to say (`flash`) and to show again (`draft`), once."""
    session: Session | None = request.scope.get("metanode.session")
    flash = draft = None
    if session is not None:  # said once: on the page that follows what left it
        flash, session.flash = session.flash, None
        draft, session.draft = session.draft, None
    html = TEMPLATES.get_template(template).render(
        nav=NAV,
        root=root_of(request),
        path=request.url.path,
        session=session,
        csrf=session.csrf if session else "",
        flash=flash,
        draft=draft,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=PAGE_HEADERS)


def _unsettable(key: str) -> str:
    """Why the page does not set `key`."""
    if not key:
        return "A key needs a name."
    if key in LOCAL_KEYS:
        return f"{key!r} cannot be set here: it comes from the disk."
    return f"{key!r} cannot be set here: links between CIDs are signed votes, not fields."


def _why(exc: MetanodeError) -> str:
    """A refusal in words: a rejected batch's own reasons (a blocked owner, say), not only
    that it was rejected."""
    if isinstance(exc, InvalidBatch):
        return " ".join(f"{item['message']}." for item in exc.items)
    return f"{exc.message}."


def asked(request: Request) -> str:
    """The path and query a request asked for: where signing in goes on to."""
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")


def wants_page(request: Request) -> bool:
    """Whether a browser asks to see this as a page (a GET that accepts HTML, outside the
    API), so a mistyped address is a page saying so rather than the API's JSON envelope."""
    accepts = request.headers.get("accept", "")
    return (
        request.method in SAFE_METHODS
        and "text/html" in accepts
        and not request.url.path.startswith("/api/")
    )


def after_form(
    request: Request, page: str, flash: Flash, draft: Draft | None = None
) -> RedirectResponse:
    """On to `page` (at `flash.at`), which says `flash` once: what a form did, or why it was
    refused, where it was sent from, with what was typed in it if it was not taken (`draft`)."""
    session: Session = request.scope["metanode.session"]
    session.flash, session.draft = flash, draft
    return to(request, page + (f"#{flash.at}" if flash.at else ""))


def back_of(path: str) -> str:
    """The page a form posted to `path` was sent from: a record's for its edits, Signers'
    for a block, else the library."""
    if path.startswith("/records/"):
        return path.rsplit("/", 1)[0]
    page = "/" + path.strip("/").split("/")[0]
    return page if page in ("/signers", "/plugins", "/files") else "/"


def draft_of(form: Mapping[str, str]) -> Draft | None:
    """The edit a record's form carried, if it was one (a Save or an Add: `adding` when the
    form said so), to show it again."""
    if form.get("action") != "save" or "key" not in form:
        return None
    return Draft(form["key"], normal_value(form.get("value", "")), form.get("form") == "add")


def replaced(said: str, before: str) -> str:
    """What Add says when the record had the key already: the value it replaced (Edit shows
    the value it replaces; Add did not, and replaced it without a word)."""
    return f"{said.removesuffix('.')}, in place of “{cut(before)}”."


def outweighed(key: str, shown: str | None) -> str:
    """What a Save says when the record still shows another value: signers of more weight
    than the owner say it (it said "Saved", and the value stayed as it was)."""
    still = "no value" if shown is None else f"“{cut(shown)}”"
    return f"Saved {key}, but the record still shows {still}: its signers outweigh the owner."


def cut(value: str) -> str:
    """A value as a message quotes it: 60 characters at most."""
    return value if len(value) <= 60 else value[:59] + "…"


def normal_value(value: str) -> str:
    """A value as a form sent it, with line breaks as `\n`: a browser sends a text area's as
    CRLF (HTML's form encoding), which would make an unchanged text a new one."""
    return value.replace("\r\n", "\n")


def sign_in_page(
    request: Request,
    then: str,
    status: int = 200,
    error: str = "",
    lost: Draft | bool = False,
    refused: MetanodeError | None = None,
) -> HTMLResponse:
    """The sign-in form, which goes on to `then`; `error`: why the last token was refused
    (`refused`: the typed error, whose slug the message carries in `data-error`).
    `lost`: a form was sent after its session ended, so the page says it was not saved, and
    carries what was typed in it (a `Draft`) to show it again once signed in."""
    request.scope["metanode.session"] = None
    carried = lost if isinstance(lost, Draft) else None
    slug = refused.slug if refused else ""
    context = {"then": then, "error": error, "lost": bool(lost), "carried": carried, "slug": slug}
    return render(request, "signin.html", status, **context)


def throttled(request: Request, then: str, wait: float, draft: Draft | None) -> HTMLResponse:
    """The sign-in form again, 429 `too_many_attempts`: the client tried too many wrong tokens
    (`SignInThrottle`) and waits `wait` seconds, which `Retry-After` says (whole seconds, up)."""
    seconds = math.ceil(wait)
    refused = TooManyAttempts(
        f"Too many wrong tokens from this address: try again in {seconds} s.", seconds
    )
    page = sign_in_page(request, then, refused.status, refused.message, draft or False, refused)
    page.headers["Retry-After"] = str(refused.retry_after)
    return page


def error_page(request: Request, exc: MetanodeError) -> HTMLResponse:
    """A typed error as a page saying what went wrong (never a stack trace)."""
    return render(request, "error.html", exc.status, error=exc)


Handler = Callable[[Request], Awaitable[Response]]


class Assets(StaticFiles):
    """The style sheets and scripts of the pages (`/static/`, `/docs/assets/`), with Starlette's
    `ETag` and `Last-Modified` (a 304 to `If-None-Match`) and a `Cache-Control` by the URL's
    version (`asset`): one naming the file's current content (`?v=`) is kept a year unasked
    (`immutable`), since another content has another URL; any other is revalidated
    (`no-cache`).

    `names`: the files served, and no other (404). Swagger UI's package holds its demo pages
    too (`index.html`, `oauth2-redirect.html`): served at `/docs/assets/` to anyone, without
    the page policy, one ran Swagger UI as a page of the node's origin, which fetched a
    document from petstore.swagger.io and sent it to validator.swagger.io."""

    def __init__(self, directory: str, names: frozenset[str] | None = None) -> None:
        super().__init__(directory=directory)
        self.names = names

    async def get_response(self, path: str, scope: Scope) -> Response:
        if self.names is not None and path not in self.names:
            raise HTTPException(status_code=404)
        response = await super().get_response(path, scope)
        asked = QueryParams(scope["query_string"]).get("v")
        current = response.status_code in (200, 304) and asked == file_version(
            os.path.join(str(self.directory), path)
        )
        response.headers["Cache-Control"] = KEPT if current else "no-cache"
        return response


KEPT = "public, max-age=31536000, immutable"  # a year: RFC 9111's "never expires"
# where the pages' assets are, by their URL's folder (`routes`)
ASSET_FOLDERS = {
    "static": str(importlib.resources.files("metanode") / "static"),
    "docs/assets": swagger_ui_bundle.swagger_ui_path,
}


@functools.cache
def file_version(path: str) -> str:
    """A file's version: 48 bits of the SHA-256 of its content, read once a process (the
    package's files do not change under a running node; every worker and every restart of the
    same install computes the same)."""
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()[:12]


def asset(url: str) -> str:
    """An asset's URL as a page names it (`static/metanode.css`), with its version
    (`?v=<file_version>`), so a browser keeps it until the node serves another content."""
    folder, _, name = url.rpartition("/")
    return f"{url}?v={file_version(os.path.join(ASSET_FOLDERS[folder], name))}"


TEMPLATES.globals["asset"] = asset


# what `docs.html` takes from the swagger-ui-bundle package
SWAGGER_ASSETS = frozenset({"swagger-ui.css", "swagger-ui-bundle.js"})


class Pages:
    """The page routes of one node; each page needs a session, else it shows the sign-in."""

    def __init__(self, node: Node, sessions: Sessions) -> None:
        self.node = node
        self.sessions = sessions
        settings = node.settings
        self.throttle = SignInThrottle(
            settings.signin_free_attempts, settings.signin_backoff_s, settings.signin_max_backoff_s
        )

    def page(self, handler: Handler) -> Handler:
        """`handler` behind the session: no session → the sign-in form (401); a typed error →
        its page; a state-changing request without the CSRF token → 403."""

        async def guarded(request: Request) -> Response:
            session = self.sessions.of_scope(request.scope)
            request.scope["metanode.session"] = session
            if session is None:
                return await self.signed_out(request)
            try:
                if request.method not in SAFE_METHODS:
                    if not same_origin(request.scope):  # before the form can say anything
                        raise CsrfRefused("a page of another site sent this form")
                    try:
                        form = await self.form(request)
                    except MetanodeError as exc:  # too long a value, say: said where it was
                        back = Flash("error", f"Not saved: {self._form_refused(exc)}")
                        return after_form(request, back_of(request.url.path), back)
                    if not csrf_ok(session, form.get("csrf"), request.scope):
                        raise CsrfRefused("the form lacks this session's CSRF token; reload it")
                    request.scope["metanode.form"] = form
                return await handler(request)
            except MetanodeError as exc:
                return error_page(request, exc)

        return guarded

    async def form(self, request: Request) -> dict[str, str]:
        """The posted form (URL-encoded: what a page's forms send), size-limited and read
        with the API's deadline; the first value of each field. The limit holds a value of
        `max_value_bytes` however it is encoded (a byte is at most 6 characters: a text
        area's line break is sent as `%0D%0A`), so the node's own check words the refusal of
        a longer one."""
        if request.headers.get("content-type", "").split(";")[0].strip() != FORM_TYPE:
            raise InvalidRequest(f"a form must be sent as {FORM_TYPE}")
        limit = 6 * self.node.settings.max_value_bytes + FORM_EXTRA_BYTES
        body = await read_body(request, limit, self.node.settings.body_timeout_s)
        try:
            fields = parse_qs(body.decode("utf-8"), max_num_fields=16, errors="strict")
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidRequest("the form is not valid UTF-8 URL-encoded fields") from exc
        return {name: values[0] for name, values in fields.items()}

    def _form_refused(self, exc: MetanodeError) -> str:
        """Why a form could not be read, in a person's words: a body over the form's limit
        can only be a value far over `max_value_bytes` (the bytes of the URL-encoded body
        are no measure a person knows)."""
        if isinstance(exc, TooLarge):
            most = self.node.settings.max_value_bytes
            return f"that is far more than a value may hold ({most:,} bytes of UTF-8)."
        return _why(exc)

    # -- sign-in ---------------------------------------------------------------------------------

    async def signed_out(self, request: Request) -> Response:
        """The sign-in form (401) for a page asked for without a session: it goes on to that
        page, or, for a form sent after the session ended, back to where it was sent from.
        Only a form this very site's page sent (its `Origin` is this host: a browser names it
        on every POST) is said to be lost and carried (`Draft`): a form another site makes a
        browser post also comes without the session (the cookie is SameSite=Strict), and its
        value must not wait in the record's form for the owner to save."""
        back = back_of(request.url.path)
        if request.method in SAFE_METHODS:
            return sign_in_page(request, asked(request), 401)
        if request.url.path == "/signout" or b"origin" not in dict(request.scope["headers"]):
            return sign_in_page(request, back, 401)
        if not same_origin(request.scope):
            return sign_in_page(request, "/", 401)
        try:
            draft = draft_of(await self.form(request))
        except MetanodeError:
            draft = None
        return sign_in_page(request, back, 401, lost=draft or True)

    async def sign_in(self, request: Request) -> Response:
        """POST /signin: the API token for a session cookie; a wrong token is an inline error."""
        request.scope["metanode.session"] = None
        foreign = foreign_origin(request.scope)
        if foreign:
            return sign_in_page(request, "/", 403, f"sign in from this node's own page: {foreign}")
        try:
            form = await self.form(request)
        except MetanodeError as exc:
            return sign_in_page(request, "/", exc.status, exc.message)
        then = local_path(form.get("then", ""))
        draft = draft_of({k[6:]: v for k, v in form.items() if k.startswith("draft-")})
        client = client_key(request.scope)
        wait = self.throttle.wait_s(client)
        if wait > 0:
            return throttled(request, then, wait, draft)
        given = form.get("token", "").strip()
        if not given or not hmac.compare_digest(given.encode(), self.node.token.encode()):
            self.throttle.failed(client)
            wrong = "That is not this node's API token."
            return sign_in_page(request, then, 401, wrong, draft or False)
        self.throttle.succeeded(client)
        value, session = self.sessions.create()
        await self._keep_signed_in()
        request.scope["metanode.session"] = session
        if draft is not None and then.startswith("/records/"):
            at = "add" if draft.adding else anchor_of(draft.key)
            response = after_form(request, then, Flash("error", UNSAVED, at), draft)
        else:
            response = to(request, then)
        response.set_cookie(
            COOKIE, value, max_age=int(self.sessions.ttl_s), **cookie_attributes(request)
        )
        return response

    async def _keep_signed_in(self) -> None:
        """Keep the sessions after a sign-in; a disk that refuses does not refuse it (the
        session lives in memory, until the next restart), it is logged."""
        try:
            await self.sessions.keep()
        except MetanodeError as exc:
            log.warning("the new session lasts until the node restarts: %s", exc.message)

    async def sign_out(self, request: Request) -> Response:
        """POST /signout: the session ends here, for every copy of its cookie."""
        session: Session = request.scope["metanode.session"]
        self.sessions.end(session)
        await self.sessions.keep_ended()  # refused: its error page, so no one thinks it ended
        response = to(request, "/")
        response.delete_cookie(COOKIE, **cookie_attributes(request))
        return response

    # -- the library -----------------------------------------------------------------------------

    async def library(self, request: Request) -> Response:
        q = request.query_params
        text, kind = q.get("q", ""), q.get("type", "")
        after = q.get("after") or None
        before = None if after else q.get("before") or None
        where = q.get("files", "") if q.get("files", "") in HELD else ""
        sidecars = q.get("sidecars") == "1"
        found = self.node.library(
            text, kind, HELD[where], PAGE, before=before, after=after, sidecars=sidecars
        )
        filters = {"q": text, "type": kind, "files": where, "sidecars": "1" if sidecars else ""}
        return render(
            request,
            "library.html",
            rows=found.rows,
            text=text,
            kind=kind,
            where=where,
            sidecars=sidecars,
            filters=urlencode({name: value for name, value in filters.items() if value}),
            types=self.node.library_types(),
            older=found.older,
            newer=found.newer,
            # a Newer page that reached the top is the first page again: no Newest link
            paged=before is not None or found.newer is not None,
        )

    # -- one record ------------------------------------------------------------------------------

    def _rid_of(self, text: str) -> str:
        """The active rid a rid or any CID names; 404 `unknown_cid`/`unknown_rid`, `merged`
        for a merged-away rid (the page then goes to the survivor)."""
        try:
            return self.node.active_rid(text)
        except MetanodeError as exc:
            if isinstance(exc, Merged):
                raise
            try:
                return self.node.resolve_cid(text)[1]
            except MetanodeError:
                raise UnknownCid(f"no record is named or holds {shown(text)}") from exc

    async def record(self, request: Request) -> Response:
        text = request.path_params["id"]
        try:
            rid = self._rid_of(text)
        except Merged as exc:
            return to(request, f"/records/{exc.extra['survivor']}")
        document = self.node.metadata(rid)
        record = document["metadata"]
        fields = provenance(record, self.node.votes(rid), self.node.signers(), self.node.owner.uid)
        return render(
            request,
            "record.html",
            rid=rid,
            doc=document,
            title=labels.label(record, rid),
            fields=fields,
            placed=[f.anchor for f in fields] + ["add"],  # where a flash is said in place
        )

    async def edit(self, request: Request) -> Response:
        """POST /records/{rid}/edit: the owner's word on one key (`save`; nothing when the
        record already says that), or its tombstone on every CID the owner voted through
        (`revert`), then the record page again, at the key's row (or the Add form, with what
        was typed, when the node refused it)."""
        form: dict[str, str] = request.scope["metanode.form"]
        rid = self._rid_of(request.path_params["id"])
        action = form.get("action", "")
        if action not in ("save", "revert"):
            raise InvalidRequest("the action must be save or revert")
        draft = draft_of(form)
        key = form.get("key", "").strip()
        record = f"/records/{rid}"
        at = "add" if draft is not None and draft.adding else anchor_of(key)
        if not key or key.startswith(LINK_PREFIX) or key in LOCAL_KEYS:
            return after_form(request, record, Flash("error", _unsettable(key), at), draft)
        value = None if draft is None else draft.value
        before = self.node.metadata(rid)["metadata"].get(key)
        if value is not None and before == value:
            unchanged = f"Nothing to save: {key} already has that value."
            return after_form(request, record, Flash("notice", unchanged, anchor_of(key)))
        replacing = before if draft is not None and draft.adding else None
        try:
            said = await self._say(rid, key, value, replacing)
        except MetanodeError as exc:
            refused = Flash("error", f"{key!r} was not changed: {_why(exc)}", at)
            return after_form(request, record, refused, draft)
        return after_form(request, record, Flash("notice", said, anchor_of(key)))

    async def _say(
        self, rid: str, key: str, value: str | None, replacing: str | None = None
    ) -> str:
        """The owner's word on `key` (`value`), or its tombstone on every CID the owner voted
        through (None); what the page then says: once applied, a value that heavier signers
        outweigh (`outweighed`), or the one an Add `replacing` replaced (`replaced`)."""
        owner = await self.node.owner.register()
        if value is None:
            voted = {c.cid for c in self.node.live_claims(rid, [key], owner)}
            if not voted:  # a second tab's Revert: it said it withdrew what was not there
                return f"Nothing to revert: the owner has no word on {key}."
            await self.node.owner_says([(cid, key, None) for cid in sorted(voted)])
            return f"Reverted {key}: the owner's word on it is withdrawn."
        canonical = cids.by_rank(self.node.group_cids(rid))[0]
        answer = await self.node.owner_says([(canonical, key, value)])
        shown = self.node.metadata(rid)["metadata"].get(key)
        if answer.status == 200 and shown != value:  # applied (a 202 shows it later)
            return outweighed(key, shown)
        said = f"Saved {key}." if value else f"Saved {key} as an empty value."
        return said if replacing is None else replaced(said, replacing)

    # -- the other pages ---------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return render(request, "live.html", label_keys=labels.LABEL_KEYS)

    async def label(self, request: Request) -> Response:
        """GET /records/{id}/label: what the page calls the record now (`labels.label`), for
        the Live feed to name its changes as the library and the record page name it; a
        merged-away rid's survivor's."""
        try:
            rid = self._rid_of(request.path_params["id"])
        except Merged as exc:
            rid = exc.extra["survivor"]
        record = self.node.metadata(rid)["metadata"]
        return JSONResponse({"rid": rid, "label": labels.label(record, rid)})

    async def files(self, request: Request) -> Response:
        q = request.query_params
        prefix, after = q.get("prefix", ""), q.get("after") or None
        roots = self.node.watched() if self.node.settings.watch_enabled else ()
        watch = await self.node.watch_roots()
        stop = q.get("stop", "")  # a folder whose Stop watching asks to be confirmed
        folder = prefix.rstrip("/") or prefix  # "/" stays itself
        below, more_folders = (
            await self.node.subfolders(folder, q.get("folders_after", ""), FOLDERS_PAGE)
            if folder
            else ([], False)
        )
        page = self.node.files(prefix, after, FILES_PAGE)
        folders: dict[str, list[dict[str, Any]]] = {}
        for file in page["files"]:
            folders.setdefault(file["path"].rsplit("/", 1)[0], []).append(file)
        # a folder the page begins or ends inside: its count is this page's, not the folder's
        split = {path.rsplit("/", 1)[0] for path in (after, page["next"]) if path}
        return render(
            request,
            "files.html",
            roots=roots,
            crumbs=crumbs(folder, roots),
            below=[(name, f"{folder.rstrip('/')}/{name}") for name in below],
            more_folders=more_folders,
            folders=folders,
            split=split,
            prefix=prefix,
            paged=after is not None,
            next=page["next"],
            duplicates=self.node.duplicates(PAGE),
            gone=self.node.library("", "", False, PAGE).rows,
            not_utf8=self.node.not_utf8(),
            watch=watch,
            stopping=stop if stop in {r["path"] for r in watch["roots"]} else "",
            rescan_s=self.node.settings.watch_rescan_s,
            placed=[ADD_FOLDER],
        )

    async def add_watch_root(self, request: Request) -> Response:
        """POST /files/watch-roots: the owner's Add folder, through `Node.add_watch_root` as
        the API's; a refusal is said at the field, with what was typed in it again."""
        text = request.scope["metanode.form"].get("path", "").strip()
        try:
            if not text:
                raise InvalidRequest("type the path of a folder")
            await self.node.add_watch_root(text)
        except MetanodeError as exc:
            refused = Flash("error", f"Not added: {_why(exc)}", ADD_FOLDER)
            return after_form(request, "/files", refused, Draft("path", text, True))
        return after_form(request, "/files", Flash("notice", f"Watching {text} as well."))

    async def remove_watch_root(self, request: Request) -> Response:
        """POST /files/watch-roots/remove: the confirmed Stop watching of one folder."""
        text = request.scope["metanode.form"].get("path", "")
        try:
            await self.node.remove_watch_root(text)
        except MetanodeError as exc:
            return after_form(request, "/files", Flash("error", f"Not changed: {_why(exc)}"))
        said = f"No longer watching {text}: its files keep their records."
        return after_form(request, "/files", Flash("notice", said))

    async def plugins(self, request: Request) -> Response:
        return render(request, "plugins.html", **await self.node.plugins())

    async def retry_plugin(self, request: Request) -> Response:
        """POST /plugins/{name}/retry: its failed and skipped runs queued again, then the
        Plugins page."""
        name = request.path_params["name"]
        try:
            retried = await self.node.retry_plugin(name)
        except MetanodeError as exc:
            return after_form(request, "/plugins", Flash("error", f"Not retried: {_why(exc)}"))
        failed, skipped = retried["failed"], retried["skipped"]
        said = [f"{failed} failed"] if failed or not skipped else []
        said += [f"{skipped} skipped"] if skipped else []
        runs = "run" if failed + skipped == 1 else "runs"
        return after_form(
            request,
            "/plugins",
            Flash("notice", f"Retrying {' and '.join(said)} {runs} of {name}."),
        )

    async def signers(self, request: Request) -> Response:
        return render(
            request, "signers.html", signers=self.node.signers(), owner=self.node.owner.uid
        )

    def set_signer(self, status: str) -> Handler:
        """POST /signers/{uid}/block (`blocked`) or /unblock (`active`)."""

        async def handler(request: Request) -> Response:
            try:
                row = await self.node.set_signer_status(request.path_params["uid"], status)
            except MetanodeError as exc:
                return after_form(request, "/signers", Flash("error", f"Not changed: {_why(exc)}"))
            name = row.get("name") or row["uid"]
            if status == "blocked":
                said = f"Blocked {name}: its votes no longer count (Unblock gives them back)."
            else:
                said = f"Unblocked {name}: its votes count again."
            return after_form(request, "/signers", Flash("notice", said))

        return handler

    async def health(self, request: Request) -> Response:
        return render(request, "health.html", health=self.node.health())

    async def docs(self, request: Request) -> Response:
        return render(request, "docs.html")

    # -- the routes ------------------------------------------------------------------------------

    async def root(self, request: Request) -> Response:
        """`/`: the library once signed in, else the sign-in form."""
        if self.sessions.of_scope(request.scope) is None:
            return sign_in_page(request, asked(request))
        return await self.page(self.library)(request)

    async def back(self, request: Request) -> Response:
        """A GET of an address only forms post to (typed again, or from the history): on to
        the page the form is on, never a bare 405."""
        return to(request, back_of(request.url.path))

    def routes(self) -> list[BaseRoute]:
        page = self.page
        return [
            Route("/", self.root),
            Route("/signin", self.sign_in, methods=["POST"]),
            Route("/signout", page(self.sign_out), methods=["POST"]),
            *(Route(path, self.back, methods=["GET"]) for path in FORM_ONLY),
            Route("/records/{id}", page(self.record)),
            Route("/records/{id}/edit", page(self.edit), methods=["POST"]),
            Route("/records/{id}/label", page(self.label)),
            Route("/live", page(self.live)),
            Route("/files", page(self.files)),
            Route("/files/watch-roots", page(self.add_watch_root), methods=["POST"]),
            Route("/files/watch-roots/remove", page(self.remove_watch_root), methods=["POST"]),
            Route("/plugins", page(self.plugins)),
            Route("/plugins/{name}/retry", page(self.retry_plugin), methods=["POST"]),
            Route("/signers", page(self.signers)),
            Route("/signers/{uid}/block", page(self.set_signer("blocked")), methods=["POST"]),
            Route("/signers/{uid}/unblock", page(self.set_signer("active")), methods=["POST"]),
            Route("/status", page(self.health)),
            Route("/docs", self.docs),
            Mount("/static", Assets(ASSET_FOLDERS["static"]), name="static"),
            Mount("/docs/assets", Assets(ASSET_FOLDERS["docs/assets"], SWAGGER_ASSETS)),
        ]


def routes(node: Node, sessions: Sessions) -> list[BaseRoute]:
    """The page routes (`api.create_app` adds them beside the API's)."""
    return Pages(node, sessions).routes()
