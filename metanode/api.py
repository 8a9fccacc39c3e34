"""The HTTP API: `create_app(node)` builds the Starlette app (SPEC §4).

Handlers are thin: parse the request, call the node, render JSON. Every error is a
`MetanodeError` rendered by one handler into the envelope; unknown routes and methods get the
same envelope, so a client never has to parse anything else.
"""

from __future__ import annotations

import enum
import hmac
import importlib.resources
import ipaddress
import itertools
import json
import logging
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers, QueryParams
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metanode import client, compat, logs, merge, peers, sse, ui
from metanode.bodies import ascii_number, read_json, refuse_unknown
from metanode.claims import utf8_size
from metanode.config import below_root
from metanode.errors import (
    Forbidden,
    InternalError,
    InvalidRequest,
    MetanodeError,
    MethodNotAllowed,
    NotFoundError,
    PeerTokenScope,
    RequestTimeout,
    Unauthorized,
    UnavailableError,
    shown,
)
from metanode.etags import PRIVATE_NO_CACHE, revalidated, revalidated_json
from metanode.metrics import CONTENT_TYPE
from metanode.node import Node

MAX_PATH_BYTES = 4096  # Linux's PATH_MAX: the longest folder a watch-roots request names

log = logging.getLogger(__name__)
access = logging.getLogger("metanode.access")
# Request ids: a random per-process prefix and a counter, unique without a uuid per request
# (the prefix drawn once: in the generator's expression it cost a getrandom call a request).
_REQUEST_PREFIX = secrets.token_hex(4)
_request_ids = (f"{_REQUEST_PREFIX}{n:08x}" for n in itertools.count())
MAX_PAGE = 1000
SIGNER_MEMBERS = ("uid", "name", "weight", "may_link")  # schemas/signer-request.schema.json
PEER_MEMBERS = ("url", "token", "weight", "name")  # schemas/peer-request.schema.json
RECONCILE_BYTES = 4 * 1024 * 1024  # at most 16,384 ranges (≈ 200 bytes each)


class ErrorResponse(JSONResponse):
    """The error envelope, ASCII-escaped: a message may quote the caller's input, lone
    surrogates included, and must still render."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: MetanodeError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """`exc` in the envelope; a 503 says when to retry, a 401 which scheme it wants (RFC 9110
    §11.6.1), and a 408 closes the connection (the rest of a slow body is not worth waiting
    for)."""
    extra = dict(headers or {})
    if isinstance(exc, Unauthorized):
        extra["WWW-Authenticate"] = 'Bearer realm="metanode"'
    if isinstance(exc, UnavailableError):
        extra["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, RequestTimeout):
        extra["Connection"] = "close"
    return ErrorResponse(exc.envelope(), status_code=exc.status, headers=extra)


class Access(enum.Enum):
    """Who may use a route family (SPEC §4, docs/api.md "Perimeter")."""

    PUBLIC = "public"  # anyone
    TRUSTED = "trusted"  # the token, or a client address in `trusted_networks`
    TOKEN = "token"  # the token (or the web page's session cookie, ui.py)
    PAGE = "page"  # the web page: it asks for its session itself (a sign-in form, not a 401)
    PEER = "peer"  # the token, or a peer token (docs/peers.md)


# The route families, by exact path or by prefix (ending in "/", but "/" itself is only the
# start page); the first match decides, and a path matching none needs the token. The MetaMesh
# routes (docs/compat.md) are TRUSTED: their consumers send no token and relied on the box's
# network, as they did with meta-core. The web page's (docs/ui.md) are PAGE.
FAMILIES: tuple[tuple[str, Access], ...] = (
    ("/api/meta/", Access.PUBLIC),
    ("/health", Access.PUBLIC),
    ("/openapi.json", Access.PUBLIC),
    ("/api/claims/log", Access.PEER),
    ("/api/claims/reconcile", Access.PEER),
    ("/meta", Access.TRUSTED),
    ("/meta/", Access.TRUSTED),
    ("/api/events/meta", Access.TRUSTED),
    ("/api/events/files", Access.TRUSTED),
    ("/api/file/", Access.TRUSTED),
    ("/file/", Access.TRUSTED),
    ("/urls", Access.TRUSTED),
    ("/api/services", Access.TRUSTED),
    ("/services", Access.TRUSTED),
    ("/webdav", Access.TRUSTED),
    ("/webdav/", Access.TRUSTED),
    *((page, Access.PAGE) for page in ui.PAGES),
    # meta-core's routes this node does not serve (docs/compat.md): a consumer that sends no
    # token is told 404 there, as the table says, not 401 (which reads as "send a token")
    *((path, Access.TRUSTED) for path in compat.NOT_SERVED),
)


def _is_prefix(family: str) -> bool:
    return family != "/" and family.endswith("/")


# `FAMILIES` indexed: the exact paths by name and the prefixes in order, each with its place in
# the table, so a request's path is one dict lookup and a few `startswith` (read family by
# family, a path in none, as `POST /api/claims` is, cost 6 µs a request; now 1.8).
_EXACT = {f: (place, a) for place, (f, a) in reversed(list(enumerate(FAMILIES)))}
_PREFIXES = tuple((f, place, a) for place, (f, a) in enumerate(FAMILIES) if _is_prefix(f))


def access_of(path: str) -> Access:
    """The access rule of `path`'s route family: the first family in `FAMILIES` that `path`
    is, or starts with if the family is a prefix; a path in none needs the token."""
    exact = _EXACT.get(path)
    for family, place, access in _PREFIXES:
        if exact is not None and exact[0] < place:
            break
        if path.startswith(family):
            return access
    return Access.TOKEN if exact is None else exact[1]


def client_address(scope: Scope) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The client's IP address (after uvicorn applied a trusted proxy's `X-Forwarded-For`), an
    IPv4-mapped IPv6 one as IPv4; None when there is none (a Unix socket, a test transport)."""
    client = scope.get("client")
    try:
        address = ipaddress.ip_address(client[0]) if client else None
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


# Names no public DNS gives out: reserved (RFC 6761, 6762, 8375; ICANN's `.internal`), or the
# private ones RFC 6762 appendix G lists as in use, and two home routers' own.
LOCAL_SUFFIXES: tuple[str, ...] = (".localhost", ".local", ".home.arpa", ".internal", ".lan")
LOCAL_SUFFIXES += (".home", ".intranet", ".private", ".corp", ".localdomain", ".fritz.box")


def host_name(host: str) -> str | None:
    """The name a `Host` header gives (lower case, no port, without the one trailing dot of a
    fully qualified spelling: `localhost.` and `nas.fritz.box.` name what `localhost` and
    `nas.fritz.box` do, and a browser sends the dot as typed), None if it does not parse."""
    try:
        name = urllib.parse.urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return None
    return name[:-1] if name.endswith(".") and name != "." else name


def local_host(host: str, also: Collection[str] = ()) -> bool:
    """Whether a `Host` header names this box as no public DNS name can: an IP address,
    `localhost`, a name of one label (a Docker service, a LAN host), one under a private
    suffix (`LOCAL_SUFFIXES`), or one of `also` (the `trusted_hosts` setting)."""
    name = host_name(host)
    if name is None:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return (
            name in also or name == "localhost" or "." not in name or name.endswith(LOCAL_SUFFIXES)
        )


def not_vouched(scope: Scope, headers: Mapping[bytes, bytes], also: Collection[str]) -> str | None:
    """Why the network a request comes from does not vouch for it (None: it does), though its
    address is trusted: a browser there carries in whatever any page asks (docs/compat.md,
    "Browsers"):

    * a `Host` that is a public name (`local_host`): a page whose DNS name was pointed at this
      box after it loaded (DNS rebinding) is "same-origin" to the browser, and over plain
      HTTP the browser says nothing else of it;
    * a write (not GET or HEAD) from another site: its `Origin` is not this host
      (`ui.same_origin`), or `Sec-Fetch-Site` says so. A form or `fetch` of any page the
      person opens can send a simple POST without asking first.

    Reads from another site's page need no rule here: the MetaMesh routes send no CORS
    header (`Edge`), so the page cannot read the answer."""
    host = headers.get(b"host", b"").decode("latin-1")
    if not local_host(host, also):
        return (
            f"the Host {shown(host)} is a public name, which a browser's page may have pointed "
            "at this box (add it to trusted_hosts if it is this box's)"
        )
    if scope["method"] not in ui.SAFE_METHODS and (
        not ui.same_origin(scope) or headers.get(b"sec-fetch-site") in (b"cross-site", b"same-site")
    ):
        return "a browser sent this write for a page of another site"
    return None


# What a browser loads to run or to style a page (`Sec-Fetch-Dest`): no file of the media is
# that. A classic `<script>` needs no CORS, so another site's page ran a `.js` of the watched
# folders through a trusted address's browser and read what it held; and on this origin it is
# a script the page policy's `'self'` lets run. Programs send no such header.
NOT_A_SUBRESOURCE = frozenset(
    {b"script", b"style", b"worker", b"sharedworker", b"serviceworker", b"audioworklet"}
    | {b"paintworklet", b"xslt"}
)
NOT_RUN = Forbidden(
    "the MetaMesh routes serve files and records, never a script, style sheet or worker of a page"
)


class Perimeter:
    """The one place that decides who may use a route: `FAMILIES` (SPEC §4, docs/api.md)."""

    def __init__(self, node: Node, sessions: ui.Sessions) -> None:
        self.node = node
        self.sessions = sessions
        self.trusted = node.settings.trusted
        self.hosts = frozenset(
            name.lower().removesuffix(".") for name in node.settings.trusted_hosts
        )

    def _network_refusal(self, scope: Scope, headers: Mapping[bytes, bytes]) -> Unauthorized | None:
        """None if the client's network vouches for this request (the MetaMesh routes' rule),
        else the 401 it gets without the token: the generic one for an address outside
        `trusted_networks`, one saying why for a trusted address (`not_vouched`)."""
        address = client_address(scope)
        if address is None or not any(address in network for network in self.trusted):
            return UNAUTHORIZED
        why = not_vouched(scope, headers, self.hosts)
        return None if why is None else Unauthorized(f"{why}; {UNAUTHORIZED.message}")

    def refusal(
        self, scope: Scope, headers: Mapping[bytes, bytes], access: Access | None = None
    ) -> MetanodeError | None:
        """Why this request may not use its route (`access`: its family, if known), or None."""
        access = access_of(scope["path"]) if access is None else access
        if access in (Access.PUBLIC, Access.PAGE):
            return None
        unauthorized = UNAUTHORIZED
        if access is Access.TRUSTED:
            if headers.get(b"sec-fetch-dest") in NOT_A_SUBRESOURCE:
                return NOT_RUN
            network = self._network_refusal(scope, headers)
            if network is None:
                return None
            unauthorized = network
        given = headers.get(b"authorization")
        if given is None:
            return None if ui.cookie_allows(self.sessions, scope) else unauthorized
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not token:  # a scheme is case-insensitive (RFC 9110)
            return unauthorized
        if hmac.compare_digest(token, self.node.token.encode()):
            return None
        if self.node.peer_token_name(token.decode("latin-1")) is None:
            return unauthorized
        if access is Access.PEER:
            return None
        return PeerTokenScope(
            "a peer token may read the claim log, reconcile and read /api/meta/* only; this "
            "route needs the API token"
        )


UNAUTHORIZED = Unauthorized(
    "this route needs `Authorization: Bearer <token>` (the token is in the data directory's "
    "api-token file), or the web page's session cookie (with its `X-CSRF-Token` for a write)"
)


# What a page of another site may read of a public answer beyond the CORS-safelisted headers
# (`Cache-Control`, `Content-Type`…): without this list a browser hides the rest, so a consumer
# could not keep a record's `ETag` to revalidate it, see the `Retry-After` of a 503
# (`cache_not_ready`) or quote the `X-Request-ID` a 500's message names.
EXPOSED = ("ETag", "Retry-After", "X-Request-ID")
EXPOSED_LIST = ", ".join(EXPOSED)


class Cors(CORSMiddleware):
    """Starlette's CORS, its refused preflight in the envelope instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code == 200:
            return answer
        asked = request_headers["access-control-request-method"]
        headers = request_headers.get("access-control-request-headers", "")
        refusal = InvalidRequest(
            f"cross-origin request refused ({bytes(answer.body).decode()}): another site's page "
            f"may only GET this route, with no headers but the simple ones (asked: {shown(asked)}"
            + (f", headers {shown(headers)})" if headers else ")")
        )
        kept = {k: v for k, v in answer.headers.items() if k.startswith("access-control-")}
        return error_response(refusal, kept)


def not_utf8(scope: Scope) -> InvalidRequest | None:
    """`InvalidRequest` if the request's path or query is not UTF-8 once its %-escapes are
    decoded, for every route at once. uvicorn and Starlette decode them with
    `errors="replace"`, so `PUT /meta/{hash}/rv%FFkey` stored the key `rv\ufffdkey` (and a
    lookup of `%FF` looked up U+FFFD). Costs one substring test a request; the bytes are decoded
    again only when the path holds U+FFFD or the query a `%` or a byte beyond ASCII."""
    if "\ufffd" in scope["path"]:
        raw = scope.get("raw_path") or scope["path"].encode("utf-8")
        if not _utf8(urllib.parse.unquote_to_bytes(raw.partition(b"?")[0])):
            return InvalidRequest("the path is not UTF-8 once its %-escapes are decoded")
    query: bytes = scope.get("query_string", b"")
    escaped = query and (b"%" in query or not query.isascii())
    if escaped and not _utf8(urllib.parse.unquote_to_bytes(query)):
        return InvalidRequest("the query is not UTF-8 once its %-escapes are decoded")
    return None


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def unroot(scope: Scope, root: str) -> None:
    """The request's path without the `root_path` prefix, if it has it: the node answers under
    the prefix as well as without it (a proxy that passes the path on whole, the page's own
    links followed on the node's port, a WebDAV client given prefixed hrefs on the internal
    address). Only when the bytes sent start with it too: `root` is of unreserved characters,
    the same percent-encoded or not (config.ROOT_NAME)."""
    below = below_root(scope["path"], root)
    if below is None:
        return
    raw: bytes | None = scope.get("raw_path")
    if raw is not None:
        raw_below = below_root(raw.decode("latin-1"), root)
        if raw_below is None:  # a prefix spelt with %-escapes: not this node's spelling
            return
        scope["raw_path"] = raw_below.encode("latin-1")
    scope["path"] = below


# What no cache may keep: the answers of the routes that need the token (or the session), which
# a browser's cache would keep on disk past sign-out, and a shared one hand to whoever asks
# (a cookie does not keep a response out of a proxy's cache). A route may say otherwise
# (`Cache-Control: no-cache` on the change feed).
PRIVATE = frozenset({Access.TOKEN, Access.PEER})
NO_STORE = (b"cache-control", b"no-store")


class Edge:
    """The node's one middleware layer, pure ASGI (each layer is another call and another
    `send` wrapper per request; four of them cost a measurable share of a read, benchmarks.md):

    * a request id for every log line of the request (`X-Request-ID`, echoed back), one access
      log line, and the latency histogram by route template;
    * the `root_path` prefix taken off a path that starts with it (`unroot`): the routes are at
      `/` whether a proxy strips the prefix or not;
    * `Cache-Control: no-store` on the answers of the token routes (`PRIVATE`) that set none;
    * CORS (`*`, GET) for the public routes' requests that carry an `Origin`: those go
      through Starlette's `CORSMiddleware` (preflights included, a refused one in the envelope:
      `Cors`); the others skip it. Not the
      MetaMesh routes: trusted by the network, they would let any page a person opens in a
      browser on that network read the library (`not_vouched` keeps its writes out);
    * the perimeter (`Perimeter`): a route family's access rule, 401 (or a peer token's 403)
      in the envelope;
    * a path or query that is not UTF-8 once decoded: 400 `invalid_request` (`not_utf8`);
    * the catch-all: whatever a handler let escape that is not a `MetanodeError` is logged with
      its traceback and answered 500 `internal_error` in the envelope, the connection kept.
      Not Starlette's `Exception` handler: that one re-raises after answering, and uvicorn then
      closes the connection, resetting the client's next request on it. If the answer had
      already begun (a stream), nothing can be answered any more: the error goes on up;
    * `direct` routes (`Direct`: `POST /api/claims`, the busiest write, and `GET
      /api/meta/{cid}`, the busiest read): called here, past Starlette's exception
      middleware, router and endpoint wrappers (≈ 25 µs of the event loop's ≈ 150 a one-claim
      request, benchmarks.md "Session 13"; ≈ 15 % of a read's, "Session 25"); a
      `MetanodeError` they raise is answered here by `error_response`, the app's one error
      handler's function.
    """

    def __init__(
        self, app: ASGIApp, node: Node, sessions: ui.Sessions, direct: Sequence[Route] = ()
    ) -> None:
        self.app = app
        self.direct = Direct(direct)
        self.node = node
        self.perimeter = Perimeter(node, sessions)
        self.cors = Cors(
            self._guarded,
            allow_origins=["*"],
            allow_methods=["GET"],
            allow_headers=["If-None-Match"],
            expose_headers=EXPOSED,
        )
        self.histogram = node.metrics.request_seconds
        self.timers: dict[tuple[str, str, int], Any] = {}  # labelled histogram children
        self.root = node.settings.root_path

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app behind the perimeter."""
        refusal = self.perimeter.refusal(scope, dict(scope["headers"]))
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await self._refused(scope, refusal)(scope, receive, send)

    def _refused(self, scope: Scope, refusal: MetanodeError) -> ASGIApp:
        """The answer to a refused request: the envelope, but the sign-in page (401) for a
        browser that asks for a page (a mistyped address, /metrics) without a session: signed
        in, it goes on there, and finds what is there or the 404 page. The peer routes say which
        box refused (`peers.SELF_HEADER`), as their answers do: `peers add` of this box's own
        address with a token it does not take was kept, and polled itself for ever."""
        access = access_of(scope["path"])
        if isinstance(refusal, Unauthorized) and access is Access.TOKEN:
            request = Request(scope)
            if ui.wants_page(request):
                return ui.sign_in_page(request, ui.asked(request), refusal.status)
        if access is Access.PEER:
            return error_response(refusal, {peers.SELF_HEADER: self.node.instance})
        return error_response(refusal)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.root:
            unroot(scope, self.root)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if 0 < len(given) <= 64 and given.isprintable() else next(_request_ids)
        token = logs.request_id.set(rid)
        started = time.perf_counter()
        status = 0  # none sent yet
        origin = b"origin" in headers
        family = access_of(scope["path"])
        # A public answer carries `Access-Control-Allow-Origin` only when asked with an
        # `Origin` (`Cors` says `Vary: Origin` then): without one it says so too, or a shared
        # cache could give a browser's page the answer without the header, which it refuses.
        added = [(b"x-request-id", rid.encode("latin-1"))]
        if family is Access.PUBLIC and not origin:
            added.append((b"vary", b"Origin"))
        private = family in PRIVATE

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), *added]
                if private and not any(n == b"cache-control" for n, _ in message["headers"]):
                    message["headers"].append(NO_STORE)
            await send(message)

        try:
            if (garbled := not_utf8(scope)) is not None:
                await error_response(garbled)(scope, receive, observed)
            elif origin and family is Access.PUBLIC:
                await self.cors(scope, receive, observed)
            elif (refusal := self.perimeter.refusal(scope, headers, family)) is None:
                app = self.direct.app(scope) or self.app
                await app(scope, receive, observed)
            else:
                await self._refused(scope, refusal)(scope, receive, observed)
        except Exception:
            if status:
                raise
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            await self._internal(origin)(scope, receive, observed)
        finally:
            self._observe(scope, status or 500, time.perf_counter() - started)
            logs.request_id.reset(token)

    @staticmethod
    def _internal(origin: bool) -> Response:
        """The 500 envelope (with the CORS headers a cross-origin caller needs to read it and
        the request id its message names)."""
        return error_response(
            InternalError(
                f"unexpected error; it is logged under request id {logs.request_id.get()}"
            ),
            (
                {"Access-Control-Allow-Origin": "*", "Access-Control-Expose-Headers": EXPOSED_LIST}
                if origin
                else None
            ),
        )

    def _observe(self, scope: Scope, status: int, elapsed: float) -> None:
        """The latency histogram (its labelled child looked up once per route, method and
        status) and, if configured, the access line."""
        route = getattr(scope.get("route"), "path", "unmatched")
        labels = (route, scope["method"], status)
        timer = self.timers.get(labels)
        if timer is None:
            timer = self.timers[labels] = self.histogram.labels(route, scope["method"], str(status))
        timer.observe(elapsed)
        if self.node.settings.log_access:
            access.info(
                "%s %s %d %.1f ms",
                scope["method"],
                scope["path"],
                status,
                elapsed * 1000,
                extra={
                    "fields": {
                        "method": scope["method"],
                        "path": scope["path"],
                        "status": status,
                        "ms": round(elapsed * 1000, 1),
                    }
                },
            )


class Direct:
    """The routes `Edge` calls itself, past Starlette's exception middleware, router and
    endpoint wrappers: the busiest ones, each a plain ASGI app. A route's path is either exact
    (`/api/claims`: one dict lookup) or ends in one parameter (`/api/meta/{cid}`: a prefix test,
    then the route's own `matches`, so the parameter and the methods are the router's). The
    scope names the route (for the latency histogram), and a `MetanodeError` is answered in the
    envelope, by `error_response`, the app's one error handler's function."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self._exact: dict[tuple[str, str], ASGIApp] = {}
        self._prefixed: list[tuple[str, Route, ASGIApp]] = []
        for route in routes:
            app = _direct(route)
            prefix, brace, _ = route.path.partition("{")
            if brace:
                self._prefixed.append((prefix, route, app))
            else:
                self._exact.update({(method, route.path): app for method in route.methods or ()})

    def app(self, scope: Scope) -> ASGIApp | None:
        """The app of the direct route `scope` asks for, its path parameters set; else None."""
        exact = self._exact.get((scope["method"], scope["path"]))
        if exact is not None:
            return exact
        path = scope["path"]
        for prefix, route, app in self._prefixed:
            if path.startswith(prefix):
                match, child = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child)
                    return app
        return None


def _direct(route: Route) -> ASGIApp:
    """`route`'s app as `Edge` calls it: the scope names the route, a `MetanodeError` is
    answered in the envelope."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = route
        try:
            await route.app(scope, receive, send)
        except MetanodeError as exc:
            await error_response(exc)(scope, receive, send)

    return app


class GetMeta:
    """`GET /api/meta/{cid}`, a plain ASGI app, so that `Edge` may call it directly: the
    stored rendering (`cache.render_documents`), or with `?as=<uid>` the record as that
    signer sees it; either with its `ETag`, and a 304 for a copy that is current
    (`revalidated`)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cid = scope["path_params"]["cid"]
        query = scope["query_string"]
        viewer = QueryParams(query).get("as") if query else None
        if viewer is None:
            answer = revalidated(self.node.meta_bytes(cid), scope["headers"])
        else:
            answer = revalidated_json(self.node.meta(cid, viewer), scope["headers"])
        await answer(scope, receive, send)


class PostClaims:
    """`POST /api/claims`, a plain ASGI app, so that `Edge` may call it directly."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.node.settings
        request = Request(scope, receive)
        try:
            body = await read_json(request, settings.max_batch_bytes, settings.body_timeout_s)
        except MetanodeError as exc:  # a refused batch too (`Metrics.refused`)
            self.node.metrics.refused(exc)
            raise
        answer = await self.node.ingest(body)
        await JSONResponse(answer.body, status_code=answer.status)(scope, receive, send)


def openapi_document(root: str = "") -> bytes:
    """The OpenAPI document shipped inside the package (a byte copy of schemas/openapi.json,
    kept in step by tools/openapi_sync.py), so an installed node serves it too; under a
    `root_path`, its one server is that path (`/`, its own, would send the API docs' "Try it
    out" to the root of the proxy's host)."""
    shipped = importlib.resources.files("metanode").joinpath("openapi.json").read_bytes()
    if not root:
        return shipped
    document = json.loads(shipped)
    for server in document["servers"]:
        server["url"] = root + server["url"].rstrip("/")  # `/` → `/metanode`
    return json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")


def _flag(query: QueryParams, name: str) -> bool:
    """A yes/no query parameter: `1`/`true`, `0`/`false`, or absent (no); anything else is
    refused (`?snapshot=yes` was read as no, silently)."""
    value = query.get(name, "0")
    if value not in ("0", "1", "true", "false"):
        raise InvalidRequest(f"{name} must be 1, true, 0 or false")
    return value in ("1", "true")


def _limit(request: Request, default: int = 100) -> int:
    value = ascii_number(request.query_params.get("limit", str(default)))
    if value is None or not 1 <= value <= MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_PAGE}")
    return value


def _signer_body(body: Any) -> tuple[str, str | None, int | None, bool | None]:
    """(uid, name, weight, may_link) from a POST /api/signers body, or a clear error; what is
    left out is None (a known signer keeps its own, a new one gets the defaults)."""
    if not isinstance(body, dict) or not isinstance(body.get("uid"), str):
        raise InvalidRequest('the body must be {"uid": "z6Mk…", "name", "weight", "may_link"}')
    refuse_unknown(body, SIGNER_MEMBERS)
    name, may_link = body.get("name"), body.get("may_link")
    if "name" in body and (not isinstance(name, str) or utf8_size(name) is None):
        raise InvalidRequest("name must be a string of valid Unicode")
    weight = _weight(body) if "weight" in body else None
    if "may_link" in body and not isinstance(may_link, bool):
        raise InvalidRequest("may_link must be true or false")
    return body["uid"], name, weight, may_link


def _weight(body: dict[str, Any], default: int = 0) -> int:
    weight = body.get("weight", default)
    if (
        not isinstance(weight, int)
        or isinstance(weight, bool)
        or not 0 <= weight <= merge.MAX_WEIGHT
    ):
        raise InvalidRequest(f"weight must be an integer from 0 to {merge.MAX_WEIGHT}")
    return weight


def _peer_body(body: Any) -> tuple[str, str, int, str]:
    """(url, token, weight, name) from a POST /api/peers body, or a clear error; the name
    defaults to the URL's host and port."""
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise InvalidRequest('the body must be {"url": "http://…", "token", "weight", "name"}')
    refuse_unknown(body, PEER_MEMBERS)
    url, token = client.node_address(body["url"]), body.get("token")
    if not isinstance(token, str) or not token.isascii() or not token.isprintable() or not token:
        raise InvalidRequest("token must be the peer's token (printable ASCII)")
    name = body.get("name") or urllib.parse.urlsplit(url).netloc
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= 64
        or not name.isprintable()
        or "/" in name
    ):
        raise InvalidRequest("name must be 1 to 64 printable characters, without '/'")
    return url, token, _weight(body), name


def watch_root_text(text: Any, where: str) -> str:
    """The folder a watch-roots request names (`{"path"}` of a POST, `?path=` of a DELETE):
    a path of 1 to 4,096 bytes of UTF-8 with no control character, else `invalid_request`."""
    if (
        not isinstance(text, str)
        or not text
        or (size := utf8_size(text)) is None
        or size > MAX_PATH_BYTES
        or not text.isprintable()
    ):
        raise InvalidRequest(
            f"{where} must be a folder's path: 1 to {MAX_PATH_BYTES} bytes of UTF-8, "
            "no control characters"
        )
    return text


def create_app(node: Node) -> Starlette:
    """The ASGI app of one node; starting it starts the node, stopping it stops the node."""
    sessions = ui.Sessions(node)

    async def on_metanode_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, MetanodeError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:  # Starlette names the route's methods in `Allow`
            allow = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))
            return error_response(
                MethodNotAllowed(f"{request.method} is not allowed here; allowed: {allow}"),
                {"Allow": allow},
            )
        missing = NotFoundError(f"no route {request.url.path}")
        if ui.wants_page(request):  # signed in, the page keeps its navigation and Sign out
            request.scope["metanode.session"] = sessions.of_scope(request.scope)
            return ui.error_page(request, missing)
        return error_response(missing)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await node.start()
        if not node.follower:  # a reader worker hands every sign-in and cookie to the owner
            sessions.restore()
        await compat.start(node)
        try:
            yield
        finally:
            await node.stop()

    post_claims = Route("/api/claims", PostClaims(node), methods=["POST"])
    get_meta = Route("/api/meta/{cid}", GetMeta(node), methods=["GET"])
    routes = [
        get_meta,
        post_claims,
        *_record_routes(node, sessions),
        *_peer_routes(node),
        *_signer_routes(node),
        *_node_routes(node),
        _watch_roots_route(node),
        *compat.routes(node),  # the MetaMesh routes (docs/compat.md)
        *ui.routes(node, sessions),  # the web page (docs/ui.md)
    ]
    middleware = [Middleware(Edge, node=node, sessions=sessions, direct=[post_claims, get_meta])]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={MetanodeError: on_metanode_error, HTTPException: on_http_error},
        lifespan=lifespan,
    )
    # `/api/claims/` is an unknown route (404 in the envelope), not a 307 to a `Location` made
    # from the request's own `Host` header, which a client or a proxy cache may follow anywhere.
    app.router.redirect_slashes = False
    app.state.root_path = node.settings.root_path  # what every URL the pages write starts with
    return app


def _record_routes(node: Node, sessions: ui.Sessions) -> list[Route]:
    """The reads of records, claims and files, and the change feed (`/api/events`). The
    busiest read and write (`GetMeta`, `PostClaims`) are `create_app`'s own: `Edge` calls them
    past the router."""

    async def meta_claims(request: Request) -> Response:
        q = request.query_params
        cid = request.path_params["cid"]
        claims = node.meta_claims(cid, q.get("key"), q.get("uid"))
        return revalidated_json(claims, request.scope["headers"])

    async def metadata(request: Request) -> Response:
        document = node.metadata(request.path_params["rid"])
        return revalidated_json(document, request.scope["headers"], PRIVATE_NO_CACHE)

    async def metadata_claims(request: Request) -> Response:
        q = request.query_params
        claims = node.metadata_claims(request.path_params["rid"], q.get("key"), q.get("uid"))
        return revalidated_json(claims, request.scope["headers"], PRIVATE_NO_CACHE)

    async def hash_ids(request: Request) -> Response:
        return JSONResponse(node.hash_ids(request.query_params.get("after"), _limit(request)))

    async def events(request: Request) -> Response:
        q = request.query_params
        cursor = request.headers.get("last-event-id") or q.get("since")
        where = sse.Filter.of(q.getlist("rid"), q.getlist("prefix"), q.getlist("exclude"))
        stream = node.subscribe(cursor, _flag(q, "snapshot"), where)
        return compat.event_stream(
            node, sessions.while_signed_in(stream, request.scope), request.scope
        )

    async def files(request: Request) -> Response:
        q = request.query_params
        if _flag(q, "missing"):
            if "prefix" in q:  # the records listed have no path to filter on
                raise InvalidRequest("prefix filters paths; missing=1 lists records without one")
            return JSONResponse(await node.missing_files(q.get("after"), _limit(request)))
        return JSONResponse(node.files(q.get("prefix", ""), q.get("after"), _limit(request)))

    return [
        Route("/api/meta/{cid}/claims", meta_claims),
        Route("/api/metadata/{rid}", metadata),
        Route("/api/metadata/{rid}/claims", metadata_claims),
        Route("/api/hash-ids", hash_ids),
        Route("/api/events", events),
        Route("/api/files", files),
    ]


def _peer_routes(node: Node) -> list[Route]:
    """The claim log and reconciliation peers read (docs/peers.md), and the peers this box
    follows."""

    async def claims_log(request: Request) -> Response:
        q = request.query_params
        page = node.claims_log(q.get("after"), _limit(request), q.get("signer"))
        return JSONResponse(page, headers={peers.SELF_HEADER: node.instance})

    async def reconcile(request: Request) -> Response:
        body = await read_json(request, RECONCILE_BYTES, node.settings.body_timeout_s)
        answer = await node.reconcile_answer(body)
        return JSONResponse(answer, headers={peers.SELF_HEADER: node.instance})

    async def list_peers(request: Request) -> Response:
        if request.method == "POST":
            body = await read_json(request, 64 * 1024, node.settings.body_timeout_s)
            return JSONResponse(await node.add_peer(*_peer_body(body)))
        return JSONResponse({"peers": node.list_peers()})

    async def remove_peer(request: Request) -> Response:
        await node.remove_peer(request.path_params["name"])
        return JSONResponse({"removed": request.path_params["name"]})

    async def sync_peer(request: Request) -> Response:
        return JSONResponse(await node.sync_peer(request.path_params["name"]))

    return [
        Route("/api/claims/log", claims_log),
        Route("/api/claims/reconcile", reconcile, methods=["POST"]),
        Route("/api/peers", list_peers, methods=["GET", "POST"]),
        Route("/api/peers/{name}", remove_peer, methods=["DELETE"]),
        Route("/api/peers/{name}/sync", sync_peer, methods=["POST"]),
    ]


def _signer_routes(node: Node) -> list[Route]:
    """The signer registry: list, add or change, block, unblock."""

    async def signers(request: Request) -> Response:
        if request.method == "POST":
            body = await read_json(request, 64 * 1024, node.settings.body_timeout_s)
            return JSONResponse(await node.add_signer(*_signer_body(body)))
        return JSONResponse({"signers": node.signers()})

    async def block(request: Request) -> Response:
        return JSONResponse(await node.set_signer_status(request.path_params["uid"], "blocked"))

    async def unblock(request: Request) -> Response:
        return JSONResponse(await node.set_signer_status(request.path_params["uid"], "active"))

    return [
        Route("/api/signers", signers, methods=["GET", "POST"]),
        Route("/api/signers/{uid}/block", block, methods=["POST"]),
        Route("/api/signers/{uid}/unblock", unblock, methods=["POST"]),
    ]


def _watch_roots_route(node: Node) -> Route:
    """The watched folders: listed, one added, one no longer watched (docs/api.md, "Watched
    folders"); the Files page changes them through the same `Node` methods."""

    async def watch_roots(request: Request) -> Response:
        if request.method == "POST":
            body = await read_json(request, 64 * 1024, node.settings.body_timeout_s)
            if not isinstance(body, dict):
                raise InvalidRequest('the body must be {"path": "/srv/media"}')
            refuse_unknown(body, ("path",))
            text = watch_root_text(body.get("path"), "path")
            return JSONResponse(await node.add_watch_root(text))
        if request.method == "DELETE":
            text = watch_root_text(request.query_params.get("path"), "?path=")
            return JSONResponse(await node.remove_watch_root(text))
        return JSONResponse(await node.watch_roots())

    return Route("/api/watch-roots", watch_roots, methods=["GET", "POST", "DELETE"])


def _node_routes(node: Node) -> list[Route]:
    """The node's own state: plugins, health, metrics and the OpenAPI document."""
    spec = openapi_document(node.settings.root_path)

    async def list_plugins(request: Request) -> Response:
        return JSONResponse(await node.plugins())

    async def retry_plugin(request: Request) -> Response:
        return JSONResponse(await node.retry_plugin(request.path_params["name"]))

    async def health(request: Request) -> Response:
        return JSONResponse(node.health())

    async def rebuild_cache(request: Request) -> Response:
        return JSONResponse(await node.rebuild_cache(), status_code=202)

    async def metrics(request: Request) -> Response:
        return Response(await node.metrics_text(), media_type=CONTENT_TYPE)

    async def openapi(request: Request) -> Response:
        return revalidated(spec, request.scope["headers"])  # 217 KB the API docs page loads

    return [
        Route("/api/plugins", list_plugins),
        Route("/api/plugins/{name}/retry", retry_plugin, methods=["POST"]),
        Route("/api/cache/rebuild", rebuild_cache, methods=["POST"]),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/openapi.json", openapi),
    ]
