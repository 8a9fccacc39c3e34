"""WebDAV over the watch roots at `/webdav/` (docs/compat.md "WebDAV"), for the MetaMesh
consumers that read bytes that way (meta-fuse's driver, meta-sort's midhash over a Range read).

A real WebDAV server, WsgiDAV, mounted in the Starlette app through a2wsgi (its WSGI runs on
a2wsgi's thread pool, off the event loop). What is ours is the layout and its guards:

* **the layout** (`Roots`): every watch root is a top-level collection, so
  `/webdav/<name>/<path below the root>`, named when it came by its folder's basename, a name
  already held (two roots called `media`, or `plugin`, reserved for plugin outputs) with `-2`,
  `-3`…, and keeping that name while it stays watched, across restarts
  (`watchroots.Names`): letting one `media` go never renames another. The compat routes give
  `filePath` and the file events' `path` in this same layout (`Roots.relative`), so a
  record's `filePath` appended to `webdavUrl` is its file. It is the roots' as they are at
  each request (`LiveRoots`): a folder added on the page is served at once, one let go is
  gone at once;
* **read-only**: every root is served by a read-only provider, so PUT, DELETE, MKCOL, MOVE,
  COPY, PROPPATCH are answered 403 by WsgiDAV;
* **only the library**: what the watcher ignores in a root (a dot-name such as `.ssh/` or
  `.DS_Store`, a download in progress, `*.part`, `watch_ignore`) is neither listed nor served
  (404), as no record names it (`Roots.rules`); the plugin outputs' folder serves whatever a
  client wrote there;
* **no way out of a root**: unless `watch_follow_symlinks` is on (then links are followed
  anywhere, as the watcher follows them), a path whose real path leaves its root, or whose
  last component is a symbolic link, is 403 and links are left out of listings (WsgiDAV's own
  checks); and the bytes are read from a descriptor opened with `O_NOFOLLOW` and checked again
  below the root, so a link swapped in after the check cannot lead out either;
* **paths** (`refusal`): one not UTF-8 once percent-decoded, with a control character (but a
  tab) or a `.`/`..` segment is a 400 envelope before WsgiDAV sees it (its own answer was a
  500 page), one longer than a file system takes a 414, and so are writes of the outputs'
  folder itself (405, 403: WsgiDAV failed an assertion);
* **plugin outputs** (`webdav_plugin_writes`, off by default): `/webdav/plugin/` is then a
  writable folder, `webdav_plugin_dir` (default `<data_dir>/plugin`), which may not overlap a
  watch root: writes never reach the media. A file is written whole (`WholeFile`), and while
  its body comes nothing moves, deletes or replaces it or its folders (`Uploads`: 423).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import threading
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import unquote_to_bytes, urlsplit, urlunsplit

from a2wsgi import WSGIMiddleware
from a2wsgi.wsgi_typing import Environ, StartResponse, WSGIApp
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from wsgidav.dav_error import (
    HTTP_CONFLICT,
    HTTP_FORBIDDEN,
    DAVError,
    PRECONDITION_CODE_PropfindFiniteDepth,
)
from wsgidav.dav_provider import DAVCollection, DAVNonCollection, DAVProvider
from wsgidav.error_printer import ErrorPrinter
from wsgidav.fs_dav_provider import FileResource, FilesystemProvider, FolderResource
from wsgidav.mw.base_mw import BaseMiddleware
from wsgidav.request_resolver import RequestResolver
from wsgidav.request_server import RequestServer
from wsgidav.wsgidav_app import WsgiDAVApp

from metanode.bodies import read_body
from metanode.config import WEBDAV_PLUGIN, Settings, below_root
from metanode.errors import (
    OUT_OF_FILES,
    Forbidden,
    InvalidRequest,
    MetanodeError,
    MethodNotAllowed,
    PathTooLong,
    RequestError,
    RequestTimeout,
    TooLarge,
    UnavailableError,
    UploadInProgress,
    out_of_files,
    shown,
)
from metanode.ignores import Rules
from metanode.ranges import Unserved, byte_ranges

MOUNT = "/webdav"  # where the app serves it (a compat route: docs/compat.md)
PLUGIN = WEBDAV_PLUGIN  # the top-level collection of plugin outputs; never a root's name
# a2wsgi threads: WebDAV requests served at once. A GET holds one for as long as it streams
# (a player, a transcode reading the whole film): with 8, eight such reads held every HEAD of
# meta-sort and every read of meta-fuse's driver waiting. Idle threads cost only their stack.
WORKERS = 64
# what a WebDAV client may ask of `/webdav` itself before it is sent on to `/webdav/`
METHODS = ["GET", "HEAD", "OPTIONS", "PROPFIND", "PROPPATCH", "MKCOL", "PUT", "DELETE"]
METHODS += ["COPY", "MOVE", "LOCK", "UNLOCK", "POST"]
# What every file this node serves carries (WebDAV and `/file/{cid}`), and the raw values a
# property holds (`GET /meta/{hash}/{key}`): a browser shows the answer as a sandboxed document
# (no script, form or plugin of it runs, nor of a frame it holds) and never takes it for another
# type than it says. A file of a watched folder is not the node's page: an HTML page or an SVG
# drawing that came with a download (or a plugin output, or a file a `mimeType` claim calls
# `text/html`) ran as a page of the node's own origin, where its script read the signed-in web
# page's CSRF token and used the session (docs/compat.md, "Files are no pages"). The document
# keeps its origin (`allow-same-origin`: one of no origin could not load its own bytes, so a
# film opened in the browser did not play); nothing in it runs anyway. Programs (players,
# meta-sort, meta-fuse) ignore both headers.
INERT = {
    "Content-Security-Policy": "sandbox allow-same-origin",
    "X-Content-Type-Options": "nosniff",
}
INERT_RAW = [(name.lower().encode(), value.encode()) for name, value in INERT.items()]
DEFAULT_RULES = Rules()  # the watcher's own ignores: dot-names, `*.part`, `*.tmp`…


@dataclass(frozen=True)
class Roots:
    """The WebDAV layout of the watch roots: (collection name, real path) in settings order.

    Paths as MetaMesh consumers see them come from here: `relative` gives a local path as the
    path below `/webdav/` that serves it, which is what the compat routes call `filePath`.
    """

    collections: tuple[tuple[str, str], ...]
    plugin: str | None = None  # the plugin outputs' folder (real path), served at `plugin/`
    rules: Rules = DEFAULT_RULES  # what the watcher ignores in a root is not served either

    @classmethod
    def served(cls, settings: Settings, roots: Sequence[tuple[str, str]]) -> Roots:
        """The layout of a node watching `roots` (name, root) now: those, and the plugin
        outputs' folder at `plugin/` when WebDAV writes are on (its files are watched too:
        `Settings.watched`)."""
        outputs = settings.plugin_outputs if settings.webdav_plugin_writes else None
        return cls.of(roots, outputs, Rules(settings.watch_ignore))

    @classmethod
    def of(
        cls,
        roots: Sequence[tuple[str, str]],
        plugin: os.PathLike[str] | None = None,
        rules: Rules = DEFAULT_RULES,
    ) -> Roots:
        """Each root (name, root: `watchroots.named`) at its real path."""
        collections = tuple((name, os.path.realpath(root)) for name, root in roots)
        outputs = os.path.realpath(plugin) if plugin is not None else None
        return cls(collections, outputs, rules)

    def local(self, path: str) -> tuple[str, str] | None:
        """(the root's real path, the local path) that `<name>/<path below the root>` names:
        `relative` the other way (`plugin/…` too when the outputs' folder is served); None for
        no such collection, no path below it, a `.`/`..` segment, or a path of a root that
        the watcher ignores (`rules`: a dot-name, `*.part`, `watch_ignore`…)."""
        name, _, below = path.strip("/").partition("/")
        reals = dict(self.collections) | ({PLUGIN: self.plugin} if self.plugin else {})
        root = reals.get(name)
        if root is None or not below or {".", "..", ""} & set(below.split("/")):
            return None
        local = os.path.join(root, below)
        if root != self.plugin and self.rules.ignored(root, local):
            return None
        return root, local

    def relative(self, path: str) -> str:
        """`<name>/<path below the root>` of the deepest root holding `path`; a path outside
        every root (from `metanode scan` of another folder) just loses its leading `/` (no
        WebDAV path serves it)."""
        best: tuple[str, str] | None = None  # (name, prefix), the longest prefix first found
        outputs = ((PLUGIN, self.plugin),) if self.plugin is not None else ()
        for name, real in (*self.collections, *outputs):
            prefix = real.rstrip("/") + "/"
            if path.startswith(prefix) and (best is None or len(prefix) > len(best[1])):
                best = (name, prefix)
        if best is None:
            return path.lstrip("/")
        return f"{best[0]}/{path[len(best[1]) :]}"


class LiveRoots:
    """The layout of the watch roots as they are at each request, so a folder added on the page
    (`POST /api/watch-roots`) is served at once and one let go is gone at once, in WebDAV and
    in the compat routes' `filePath` alike: `current` gives the roots now, each with its name
    (`Node.named_roots`), and the layout is made again only when they changed (a `realpath`
    per root, not per request). Called from the event loop and from WsgiDAV's threads: the
    cache is one tuple, swapped whole, so a thread never sees one root list's layout under
    another's key."""

    def __init__(
        self, settings: Settings, current: Callable[[], Sequence[tuple[str, str]]]
    ) -> None:
        self.settings = settings
        self.current = current
        self._made: tuple[tuple[tuple[str, str], ...], Roots] | None = None

    def __call__(self) -> Roots:
        roots = tuple(self.current())
        made = self._made
        if made is None or made[0] != roots:
            made = (roots, Roots.served(self.settings, roots))
            self._made = made
        return made[1]


class CheckedFile(FileResource):  # type: ignore[misc]
    """A file of a root whose bytes are read from a descriptor opened without following a last
    symbolic link and checked to lie below the root, unless links are followed: what WsgiDAV
    checked by path cannot be swapped for a link between its check and the read."""

    def __init__(self, path: str, environ: dict[str, Any], file_path: str, root: str) -> None:
        super().__init__(path, environ, file_path)
        self.root = root

    def get_content(self) -> IO[bytes]:
        if self.provider.fs_opts["follow_symlinks"]:
            return open(self._file_path, "rb")  # WsgiDAV closes it
        fd = os.open(self._file_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
            if not real.startswith(self.root.rstrip("/") + "/"):
                raise DAVError(HTTP_FORBIDDEN, "the file is no longer below its root")
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")


# The name of a PUT's body while it comes (`WholeFile`): hidden, and 16 random hex digits
UPLOADING = re.compile(r"\.[0-9a-f]{16}\.part")


def uploading(name: str) -> bool:
    """Whether `name` is that of a body still being uploaded (`UPLOADING`): no file yet, so
    neither listed nor served nor written by a client (a PUT of it is refused: `refusal`)."""
    return UPLOADING.fullmatch(name) is not None


class WholeFile(FileResource):  # type: ignore[misc]
    """A plugin output written whole or not at all: a PUT's body goes into a hidden `.part`
    file beside it (a name the watcher leaves out, and `Outputs` too), renamed over the file
    once the body came whole; a body refused (`Upload`) or failed leaves the file as it was.
    WsgiDAV wrote into the file itself: an upload cut short left the start of its body as the
    file, in place of the old one, which the watcher could fingerprint half-written. While the
    body comes, the file is among the provider's `Uploads`: no MOVE, COPY or DELETE touches
    it or its folders (`Uploads.busy`)."""

    part = ""

    def begin_write(self, *, content_type: str | None = None) -> IO[bytes]:
        folder = os.path.dirname(self._file_path)
        uploads: Uploads = self.provider.uploads
        with uploads.guard:
            if not os.path.isdir(folder):  # moved or deleted since WsgiDAV found it
                raise DAVError(HTTP_CONFLICT, "the folder of the PUT is gone")
            self.part = os.path.join(folder, f".{secrets.token_hex(8)}.part")  # `UPLOADING`
            uploads.coming.add(self._below())  # `end_write` takes it out, whatever happens
            return open(self.part, "xb")  # WsgiDAV closes it

    def end_write(self, *, with_errors: bool) -> None:
        upload = UPLOAD.get()
        uploads: Uploads = self.provider.uploads
        with uploads.guard:
            uploads.coming.discard(self._below())
            if with_errors or (upload is not None and upload.refused is not None):
                with contextlib.suppress(OSError):
                    os.unlink(self.part)
            else:
                os.replace(self.part, self._file_path)  # a link there is replaced, not followed

    def _below(self) -> str:
        """The file's path below the outputs' folder, as `Uploads` holds it."""
        outputs: str = self.provider.root_folder_path
        return os.path.relpath(self._file_path, outputs)


class NewFile(WholeFile):
    """A plugin output a PUT makes: on the disk only once its body came whole (`WholeFile`).
    WsgiDAV made it empty before the body came, so PROPFIND listed it, 0 bytes, for as long as
    the upload took, and a refused body had to remove it again."""

    def __init__(self, path: str, environ: dict[str, Any], file_path: str) -> None:
        DAVNonCollection.__init__(self, path, environ)  # `FileResource`'s would stat the file
        self._file_path = file_path
        self.name = os.path.basename(file_path)


class OutputsFolder(FolderResource):  # type: ignore[misc]
    """A folder of the plugin outputs, listing no body still being uploaded (`uploading`):
    PROPFIND showed each `.part` beside the file it was to become, and a client that read it
    got half an upload. A file a PUT makes is a `NewFile`."""

    def get_member_names(self) -> list[str]:
        return [name for name in super().get_member_names() if not uploading(name)]

    def create_empty_resource(self, name: str) -> NewFile:
        path = f"{self.path.rstrip('/')}/{name}"
        return NewFile(path, self.environ, self.provider._loc_to_file_path(path, self.environ))


class Uploads:
    """The plugin outputs whose bodies are coming (`WholeFile`), by their paths below the
    outputs' folder, and the lock that orders the start and end of an upload with a MOVE, COPY
    or DELETE (`guarded`). A MOVE of the folder an upload went into took its `.part` along
    (201), and the upload's end then found no `.part` to rename: the PUT was a 500 and the
    `.part` stayed, hidden, for good; a DELETE of it, the same 500. One process serves all of
    WebDAV (a reader worker hands it to the owner), so a set in memory sees every upload."""

    def __init__(self) -> None:
        self.coming: set[str] = set()
        self.guard = threading.Lock()

    def busy(self, method: str, below: str | None, destination: str | None) -> str | None:
        """The upload a `method` of `below` (the path below the outputs' folder; None: not
        there) onto `destination` (likewise) would move, delete or replace, if any: one at
        or below the source of a MOVE or DELETE, or the destination of a MOVE or COPY (the
        COPY of a folder holding one copies what is there, without it). Asked under `guard`."""
        touched = [destination] + ([below] if method in ("MOVE", "DELETE") else [])
        for path in (path.strip("/") for path in touched if path is not None):
            for coming in sorted(self.coming):
                if not path or coming == path or coming.startswith(path + "/"):
                    return coming
        return None


class Outputs(FilesystemProvider):  # type: ignore[misc]
    """The plugin outputs' folder: WsgiDAV's own, its files written whole (`WholeFile`), its
    uploads in progress neither listed (`OutputsFolder`) nor served (404), nor moved, copied
    over or deleted (`Uploads`)."""

    def __init__(self, root: str) -> None:
        super().__init__(root, readonly=False, fs_opts={"follow_symlinks": False})
        self.uploads = Uploads()

    def get_resource_inst(self, path: str, environ: dict[str, Any]) -> Any:
        if uploading(path.rstrip("/").rpartition("/")[2]):
            return None
        found = super().get_resource_inst(path, environ)
        if type(found) is FileResource:
            return WholeFile(path, environ, found._file_path)
        if type(found) is FolderResource:
            return OutputsFolder(path, environ, found._file_path)
        return found


def servable(name: str) -> bool:
    """Whether a file name can be given to a WebDAV client: valid UTF-8 (one that is not, which
    the watcher ignores too, failed its whole folder's listing with a 500) and no control
    character but a tab (a name with a line feed was listed, but its address never routed;
    most others may not stand in a listing's XML). A tab is XML and routes: the watcher
    fingerprints such a file and the file events and its record's `filePath` name it, so the
    MetaMesh consumers read it here by that name (a title pasted from a web page carries one).
    Spaces of every kind, joiners and marks are names like any other."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(unicodedata.category(char) == "Cc" and char != "\t" for char in name)


class Folder(FolderResource):  # type: ignore[misc]
    """A folder of a root, listing only the names that can be served (`servable`) and that
    the watcher does not ignore (`Roots.rules`)."""

    def __init__(
        self, path: str, environ: dict[str, Any], file_path: str, root: str, rules: Rules
    ) -> None:
        super().__init__(path, environ, file_path)
        self.root, self.rules = root, rules

    def get_member_names(self) -> list[str]:
        folder = self._file_path.rstrip("/")
        return [
            name
            for name in super().get_member_names()
            if servable(name) and not self.rules.ignored(self.root, f"{folder}/{name}")
        ]


class Top(DAVCollection):  # type: ignore[misc]
    """`/webdav/` itself: a read-only collection of the roots' collections (and `plugin`)."""

    def __init__(self, environ: dict[str, Any], names: list[str]) -> None:
        super().__init__("/", environ)
        self.names = names

    def get_member_names(self) -> list[str]:
        return self.names

    def get_member(self, name: str) -> Any:
        return self.provider.get_resource_inst(f"/{name}", self.environ)


class Layout(DAVProvider):  # type: ignore[misc]
    """The read-only provider of `/webdav/`: `Top`, then each root's files through a read-only
    `FilesystemProvider` of that root (its path checks), named by the roots as they are at
    this request (`layout`: a folder added or let go on the page shows at once)."""

    def __init__(
        self, layout: Callable[[], Roots], follow_symlinks: bool, plugin_dir: str | None
    ) -> None:
        super().__init__()
        self.readonly = True
        self.fs_opts = {"follow_symlinks": follow_symlinks}
        self.layout = layout
        self.roots: dict[str, FilesystemProvider] = {}  # by the root's real path
        self.plugin_dir = plugin_dir

    def is_readonly(self) -> bool:
        return True

    def _root(self, real: str) -> FilesystemProvider | None:
        """The provider of the root at `real`, made once the folder exists (the watcher makes
        it); by path, not name, since a name may pass to another root when one is let go."""
        if real not in self.roots and os.path.isdir(real):
            self.roots[real] = FilesystemProvider(real, readonly=True, fs_opts=self.fs_opts)
        return self.roots.get(real)

    def get_resource_inst(self, path: str, environ: dict[str, Any]) -> Any:
        """The resource at `path` (below `/webdav`), None if there is none (404)."""
        roots = self.layout()
        name, _, below = path.strip("/").partition("/")
        if not name:  # a root that is no folder now (a disk not mounted) is not listed: each
            # member listed must be a resource, or WsgiDAV answers PROPFIND with a 500
            names = [name for name, root in roots.collections if os.path.isdir(root)]
            return Top(environ, names + ([PLUGIN] if self.plugin_dir else []))
        if name == PLUGIN and self.plugin_dir:  # listed here, served by its own provider
            return FolderResource(path, environ, self.plugin_dir)
        root = dict(roots.collections).get(name)
        fs = None if root is None else self._root(root)
        if root is None or fs is None:
            return None
        file_path = fs._loc_to_file_path(f"/{below}", environ)  # 403 outside the root
        if below and roots.rules.ignored(root, file_path.rstrip("/")):
            return None  # a dot-file, a download in progress: no file of the library
        if not os.path.lexists(file_path):
            return None
        if not self.fs_opts["follow_symlinks"] and os.path.islink(file_path):
            raise DAVError(HTTP_FORBIDDEN, "symbolic links are not followed")
        if os.path.isdir(file_path):
            return Folder(path, environ, file_path, root, roots.rules)
        if not os.path.isfile(file_path):
            return None  # a dangling link, a socket…
        return CheckedFile(path, environ, file_path, fs.root_folder_path_real)


class Allowed(BaseMiddleware):  # type: ignore[misc]
    """WsgiDAV's 405 with the `Allow` RFC 9110 §15.5.6 requires of it, which it never sends: the
    one its OPTIONS answers for the same path (`OPTIONS, HEAD, GET, PROPFIND` for a file of a
    root; what the resource allows in `plugin/`)."""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            if status.startswith("405") and all(name.lower() != "allow" for name, _ in headers):
                headers = [*headers, ("Allow", self.allowed(environ))]
            return start_response(status, headers, exc_info)

        return self.next_app(environ, start)

    @staticmethod
    def allowed(environ: dict[str, Any]) -> str:
        """What WsgiDAV's OPTIONS of this request's path answers as `Allow`."""
        provider = environ["wsgidav.provider"]
        found: dict[str, str] = {}

        def kept(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            found.update((name.lower(), value) for name, value in headers)

        if provider is not None:
            with contextlib.suppress(DAVError):  # no such path, nor its folder: OPTIONS alone
                RequestServer(provider).do_OPTIONS({**environ, "REQUEST_METHOD": "OPTIONS"}, kept)
        return found.get("allow", "OPTIONS")


class OutOfFilesAnswered(BaseMiddleware):  # type: ignore[misc]
    """A file or folder that cannot be opened for want of a descriptor (EMFILE, ENFILE: every
    one held by connections) answered 503 `too_many_open_files` in the envelope, with its
    `Retry-After`, as `/file/{cid}` answers: WsgiDAV's `ErrorPrinter` made it a 500 page, which
    a client takes for a broken server, not one to ask again. Only before the answer's first
    bytes: WsgiDAV states a GET's head before it opens the file, and `ErrorPrinter` sends a head
    only with the first bytes, so a head stated again here replaces it."""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        answer: Iterable[bytes] = ()
        sent = False
        try:
            answer = self.next_app(environ, start_response)
            for chunk in answer:
                sent = True
                yield chunk
        except OSError as exc:
            if sent or exc.errno not in OUT_OF_FILES:
                raise
            where = exc.filename or wsgi_text(environ["PATH_INFO"])
            yield from enveloped(out_of_files(exc, where), start_response, [])
        finally:
            close = getattr(answer, "close", None)
            if close is not None:
                close()


class FiniteDepth(BaseMiddleware):  # type: ignore[misc]
    """A PROPFIND of a folder with `Depth: infinity`, or with no `Depth` (which RFC 4918 reads
    as infinity), is 403 with the `DAV:propfind-finite-depth` precondition, as RFC 4918 §9.1
    lets a server answer: WsgiDAV built the whole tree's answer in memory, so one listing of a
    50,000-file root took 19 s and ≈ 50 MB, eight at once 2 GB of the node's memory (64 at
    once, one per WebDAV thread, would have it killed). A file's infinity is its own entry,
    answered as before; a folder is listed a level at a time (`Depth: 1`)."""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        depth = environ.get("HTTP_DEPTH", "infinity").strip().lower()
        if (
            environ["REQUEST_METHOD"] == "PROPFIND"
            and depth == "infinity"
            and self._folder(environ)
        ):
            raise DAVError(
                HTTP_FORBIDDEN,
                context_info="PROPFIND of a folder lists one level at a time (Depth: 1)",
                err_condition=PRECONDITION_CODE_PropfindFiniteDepth,
            )
        return self.next_app(environ, start_response)

    @staticmethod
    def _folder(environ: dict[str, Any]) -> bool:
        provider = environ["wsgidav.provider"]
        if provider is None:
            return False
        try:
            res = provider.get_resource_inst(environ["PATH_INFO"], environ)
        except DAVError:
            return False  # refused anyway (a link out of its root), as WsgiDAV says
        return res is not None and bool(res.is_collection)


class Ranges(BaseMiddleware):  # type: ignore[misc]
    """A GET's `Range` as the native `/file/{cid}` reads it (`ranges.byte_ranges`), given to
    WsgiDAV in the one form its own parser reads right. Its parser took `bytes=5-2` for the
    last bytes, `bytes=-0` for none (`Content-Range: bytes 22-21/22`), `items=0-5` and
    `bytes=1-2-3` for byte ranges, all 206. RFC 9110: a header that is not a byte range, or two
    ranges (WsgiDAV served the last one as if it were all), is ignored (200, the whole file);
    one that no byte satisfies is 416 with `Content-Range: bytes */<size>`. WsgiDAV still
    answers, so `If-Range` is weighed first, as before."""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        wanted = environ.get("HTTP_RANGE")
        size = self._size(environ) if wanted is not None else None
        if wanted is not None and size is not None:
            chosen = byte_ranges(wanted, size) if "," not in wanted else Unserved.MALFORMED
            if chosen is Unserved.UNSATISFIABLE:
                environ["HTTP_RANGE"] = f"bytes={size}-"  # WsgiDAV's 416, `bytes */<size>`
            elif isinstance(chosen, list) and len(chosen) == 1:
                environ["HTTP_RANGE"] = f"bytes={chosen[0][0]}-{chosen[0][1] - 1}"
            else:
                del environ["HTTP_RANGE"]
        return self.next_app(environ, start_response)

    @staticmethod
    def _size(environ: dict[str, Any]) -> int | None:
        """The size of the file a GET or HEAD reads; None for anything else (WsgiDAV answers
        a folder, a missing path or a refusal as it would have)."""
        provider = environ["wsgidav.provider"]
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD") or provider is None:
            return None
        try:
            res = provider.get_resource_inst(environ["PATH_INFO"], environ)
        except DAVError:
            return None
        if res is None or res.is_collection:
            return None
        size: int | None = res.get_content_length()
        return size


def make_parents(outputs: Path, wsgi_path: str) -> None:
    """The folders a PUT of `wsgi_path` (below `plugin/`, as WSGI spells a path: UTF-8 bytes
    read as Latin-1) goes into, made if missing, as meta-core's nginx did
    (`create_full_put_path`): MetaMesh's plugins PUT `plugin/<id>/<file>` with no MKCOL first,
    and got 409 for their first poster. Never outside `outputs`: a folder whose real path
    leaves it (a link) is left to WsgiDAV, which refuses the PUT. One folder at a time, not
    `mkdir(parents=True)` (a recursion: 2,000 levels raised RecursionError), stopping at the
    first that cannot be made (a file of that name: WsgiDAV then answers 409)."""
    try:
        below = wsgi_path.encode("latin-1").decode("utf-8").strip("/")
    except UnicodeError:
        return
    parent = (outputs / below).parent
    inside = os.path.realpath(parent) + "/"
    if not below or not inside.startswith(os.path.realpath(outputs) + "/"):
        return
    folder = outputs
    for name in parent.relative_to(outputs).parts:
        folder = folder / name
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                return
        except OSError:
            return


def plugin_dir(settings: Settings) -> Path | None:
    """Where plugin outputs are written, made if missing; None when plugin writes are off."""
    if not settings.webdav_plugin_writes:
        return None
    settings.plugin_outputs.mkdir(parents=True, exist_ok=True)
    return settings.plugin_outputs


def dav(mount: str, provider: DAVProvider) -> WSGIApp:
    """A WsgiDAV app serving `provider` at `mount`: no authentication of its own (the perimeter
    decides, as for every compat route), no directory browser (GET of a folder is 403: list it
    with PROPFIND), a folder listed a level at a time (`FiniteDepth`), locks in memory (clients
    that write lock first), no dead properties, Range headers read as `/file/{cid}` reads them
    (`Ranges`), an `Allow` on every 405 (`Allowed`)."""
    app: WSGIApp = WsgiDAVApp(
        {
            "mount_path": mount,
            "provider_mapping": {"/": provider},
            "middleware_stack": [
                Allowed,
                ErrorPrinter,
                OutOfFilesAnswered,
                FiniteDepth,
                Ranges,
                RequestResolver,
            ],
            "lock_storage": True,
            "property_manager": None,
            "verbose": 0,
            "logging": {"enable": False},
            "suppress_version_info": True,
            "http_authenticator": {"domain_controller": None},
            "simple_dc": {"user_mapping": {"*": True}},
            "dir_browser": {"enable": False},
        }
    )
    return app


def undated(start_response: StartResponse) -> StartResponse:
    """`start_response` without WsgiDAV's `Date` header: uvicorn dates every answer, and `Date`
    is a singleton field (RFC 9110 §5.3), so two of them made an invalid answer."""

    def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        kept = [(name, value) for name, value in headers if name.lower() != "date"]
        return start_response(status, kept, exc_info)

    return cast(StartResponse, start)


def server(settings: Settings, layout: Callable[[], Roots]) -> ASGIApp:
    """The WebDAV server of a node's settings and its roots' layout now, as an ASGI app.

    Two WsgiDAV apps behind one WSGI dispatcher: the read-only layout, and the plugin outputs'
    writable folder at `plugin/` when enabled. Not two shares of one app: WsgiDAV then picks the
    provider of a MOVE's or COPY's destination before removing the mount path, so every move
    inside `plugin/` would be refused (502).
    """
    outputs = plugin_dir(settings)
    # WsgiDAV's hrefs start with its mount path, and a MOVE's or COPY's `Destination` must:
    # under `root_path`, the prefix is in both (`App` puts it in a `Destination` that lacks it)
    mount = settings.root_path + MOUNT
    # `plugin/` is listed by the layout, but served by its own writable provider below
    readonly = dav(
        mount, Layout(layout, settings.watch_follow_symlinks, str(outputs) if outputs else None)
    )
    writable = provider = None
    if outputs is not None:
        provider = Outputs(str(outputs))
        writable = dav(f"{mount}/{PLUGIN}", provider)

    def dispatch(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        dated = undated(start_response)
        if writable is not None and (path == f"/{PLUGIN}" or path.startswith(f"/{PLUGIN}/")):
            environ["SCRIPT_NAME"] += f"/{PLUGIN}"
            environ["PATH_INFO"] = path[len(PLUGIN) + 1 :]
            method = environ["REQUEST_METHOD"]
            if method == "PUT" and outputs is not None:
                make_parents(outputs, environ["PATH_INFO"])
                return checked_put(writable, environ, dated)
            if method in ("MOVE", "COPY", "DELETE") and provider is not None:
                return guarded(writable, provider.uploads, f"{mount}/{PLUGIN}", environ, dated)
            return writable(environ, dated)
        return readonly(environ, dated)

    return cast(ASGIApp, WSGIMiddleware(dispatch, workers=WORKERS))


class App:
    """The WebDAV server as the ASGI app mounted at `MOUNT`, built on its first request: by
    then the node has started, so the plugin outputs' folder is made after the data directory
    (and made private with it). `layout` gives the roots' layout at each request
    (`LiveRoots`)."""

    def __init__(self, settings: Settings, layout: Callable[[], Roots]) -> None:
        self.settings = settings
        self.layout = layout
        self.served: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def inert(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *INERT_RAW]
            await send(message)

        root = self.settings.root_path
        refused = refusal(scope, self.settings.webdav_plugin_writes, root)
        headers = {"Allow": READS} if isinstance(refused, MethodNotAllowed) else {}
        if refused is None and scope["method"] == "PUT":
            limit = self.settings.webdav_put_max_bytes
            refused = declared_too_large(scope, limit)
            headers = {"Connection": "close"} if refused else {}
            upload = Upload(receive, limit, self.settings.body_timeout_s)
            UPLOAD.set(upload)  # seen by `checked_put`, on a2wsgi's thread (a copied context)
            receive = upload
        elif refused is None:
            try:
                body = await read_body(Request(scope, receive), BODY, self.settings.body_timeout_s)
            except RequestError as exc:  # too long, too slow, or the client left
                refused, headers = exc, {"Connection": "close"}  # the rest is not worth reading
            else:
                receive = replayed(body, receive)
        if refused is not None:
            answer = JSONResponse(refused.envelope(), refused.status, headers=headers)
            await answer(scope, receive, inert)
            return
        if root and scope["method"] in ("COPY", "MOVE"):
            scope["headers"] = [
                (name, rooted(value, root) if name == b"destination" else value)
                for name, value in scope["headers"]
            ]
        if self.served is None:
            self.served = server(self.settings, self.layout)
        await self.served(scope, receive, inert)


def declared_too_large(scope: Scope, limit: int) -> TooLarge | None:
    """413 for a PUT whose `Content-Length` is over `limit`, before a byte of it is written."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return put_too_large(limit, f"{int(value):,} bytes")
    return None


def put_too_large(limit: int, size: str) -> TooLarge:
    return TooLarge(
        f"a PUT's body is at most {limit:,} bytes (webdav_put_max_bytes); this is {size}"
    )


# What WsgiDAV reads once an `Upload` is refused: the end of the body, so its thread is free
END: Message = {"type": "http.request", "body": b"", "more_body": False}


class Upload:
    """A PUT's body as WsgiDAV reads it (streamed into the file, never held whole): at most
    `limit` bytes (`webdav_put_max_bytes`), each part within `idle_s` of the one before
    (`body_timeout_s`: a poster over a slow link may take longer in all, but not stand still).
    WsgiDAV wrote any body to the disk, however long, and kept what a client that left, or
    stalled, had sent as the whole file (1,000 bytes of a declared 1,000,000: a file the
    watcher fingerprinted). Past either limit, or when the client leaves, WsgiDAV is told the
    body ended (its thread freed at once) and `refused` says why: nothing of it is kept
    (`WholeFile`), and `checked_put` answers the refusal."""

    def __init__(self, receive: Receive, limit: int, idle_s: float) -> None:
        self.receive = receive
        self.limit = limit
        self.idle_s = idle_s
        self.count = 0
        self.refused: RequestError | None = None

    async def __call__(self) -> Message:
        if self.refused is not None:
            return END
        try:
            async with asyncio.timeout(self.idle_s):
                message = await self.receive()
        except TimeoutError:
            self.refused = RequestTimeout(
                f"the PUT's body stood still for {self.idle_s:g} s ({self.count:,} bytes came)"
            )
            return END
        if message["type"] == "http.disconnect":
            self.refused = RequestError(
                f"the client left before its body ended ({self.count:,} bytes came)"
            )
            return END
        self.count += len(message.get("body", b""))
        if self.count > self.limit:
            self.refused = put_too_large(self.limit, "more")
            return END
        return message


UPLOAD: ContextVar[Upload | None] = ContextVar("metanode_webdav_upload", default=None)


def checked_put(app: WSGIApp, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
    """WsgiDAV's PUT (below `plugin/`), its answer held until it is done (a few bytes): if its
    body was refused (`Upload`), nothing of it was kept (`WholeFile`, `NewFile`), and the
    answer is the refusal in the envelope, the connection closed (the rest is not worth
    reading)."""
    status, headers, answer = held(app, environ)
    upload = UPLOAD.get()
    if upload is None or upload.refused is None:
        start_response(status, headers)
        return [answer]
    return enveloped(upload.refused, start_response, [("Connection", "close")])


def guarded(
    app: WSGIApp, uploads: Uploads, mount: str, environ: Environ, start_response: StartResponse
) -> Iterable[bytes]:
    """WsgiDAV's MOVE, COPY or DELETE below `plugin/` (whose mount path is `mount`), done
    whole under the uploads' lock, unless it would move, delete or replace a file whose
    body is still coming (`Uploads.busy`): then 423 `upload_in_progress` in the envelope,
    nothing done, as a resource locked is answered (RFC 4918 §11.3); the client asks again
    once the PUT is answered."""
    below = wsgi_text(environ["PATH_INFO"])
    destination, url = None, cast(dict[str, str], environ).get("HTTP_DESTINATION")
    if url is not None:  # UTF-8 and a URL: `refusal`
        destination = below_root(unquote_to_bytes(urlsplit(url).path).decode("utf-8"), mount)
    method = environ["REQUEST_METHOD"]
    with uploads.guard:
        coming = uploads.busy(method, below, destination)
        done = held(app, environ) if coming is None else None
    if done is None:
        name = f"/webdav/{PLUGIN}/{coming}"
        refused = UploadInProgress(
            f"{name} is still being uploaded: {method} again once its PUT is answered"
        )
        return enveloped(refused, start_response, [])
    start_response(done[0], done[1])
    return [done[2]]


def wsgi_text(path: str) -> str | None:
    """A WSGI path (UTF-8 bytes read as Latin-1) as text; None if it is not UTF-8."""
    try:
        return path.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return None


def held(app: WSGIApp, environ: Environ) -> tuple[str, list[tuple[str, str]], bytes]:
    """The WSGI app's answer to `environ`, done and held whole (a few bytes: a write's)."""
    said: list[tuple[str, list[tuple[str, str]]]] = []

    def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        said.append((status, headers))
        return lambda data: None

    answer = b"".join(app(environ, keep))
    return (*said[-1], answer)


def enveloped(
    refused: MetanodeError, start_response: StartResponse, headers: list[tuple[str, str]]
) -> Iterable[bytes]:
    """`refused` answered from the WSGI side, in the envelope; a 503 says when to retry."""
    body = json.dumps(refused.envelope(), separators=(",", ":")).encode("ascii")
    status = f"{refused.status} {HTTPStatus(refused.status).phrase}"
    if isinstance(refused, UnavailableError):
        headers = [*headers, ("Retry-After", str(refused.retry_after))]
    length = ("Content-Length", str(len(body)))
    start_response(status, [("Content-Type", "application/json"), length, *headers])
    return [body]


def replayed(body: bytes, receive: Receive) -> Receive:
    """`receive` with the request's body, already read whole, given first: WsgiDAV reads it
    from there; then the client's own messages (its leaving)."""
    given = False

    async def again() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again


def rooted(destination: bytes, root: str) -> bytes:
    """A `Destination` URL with its path under `root` (`root_path`), as WsgiDAV's mount path
    is: a client on the node's own port may name it without (the node answers both ways)."""
    parts = urlsplit(destination)
    below = unrooted(parts.path, root).encode("latin-1")
    return urlunsplit(parts._replace(path=root.encode("latin-1") + below))


def unrooted(path: bytes, root: str) -> str:
    """A percent-encoded path without the `root_path` prefix `root`, if it has it."""
    text = path.decode("latin-1")
    below = below_root(text, root) if root else None
    return text if below is None else below


def refusal(scope: Scope, writes: bool, root: str = "") -> MetanodeError | None:
    """Why the request's path, or a COPY's or MOVE's `Destination`, cannot name a file here, or
    why the outputs' folder itself is not written (with `writes`: WsgiDAV's writes of its own
    root failed an assertion, a 500); None when they can. Checked on the bytes the client sent
    (`raw_path`): uvicorn's `path` has already made an invalid UTF-8 sequence U+FFFD, a name a
    PUT then created. A `Destination` is checked without the `root_path` prefix `root` (the
    request's own path has lost it already: `api.unroot`). A write naming an upload's body in
    progress (`uploading`) is refused: it is no file, and hidden."""
    raw = scope.get("raw_path") or scope["path"].encode()
    targets = [raw]
    if scope["method"] in ("COPY", "MOVE"):  # the only methods that read it
        for name, value in scope["headers"]:
            if name == b"destination":
                try:
                    targets.append(unrooted(urlsplit(value).path, root).encode("latin-1"))
                except ValueError:  # `http://[::1/x`: it named nothing, a 500 on every method
                    return InvalidRequest(f"Destination {shown(value.decode('latin-1'))} is no URL")
    for target in targets:
        refused = path_refusal(target, writes)
        if refused is not None:
            return refused
    if not writes:
        return None
    if scope["method"] in ("COPY", "MOVE") and any(map(outputs_root, targets)):
        return INTO_ITSELF
    if scope["method"] in READS.split(", "):
        return None
    if outputs_root(raw):
        return OUTPUTS_ROOT
    if any(map(names_upload, targets)):
        return UPLOAD_NAME
    return None


def path_refusal(raw: bytes, writes: bool) -> MetanodeError | None:
    """Why the percent-encoded path `raw` names no file WebDAV may serve or write: not UTF-8
    once decoded (a lone surrogate neither), a control character (NUL failed the open with a
    500 and its exception's text; the others are never listed: `servable`), a `.`/`..`
    segment (WsgiDAV's 400 lost its body), longer than a file system takes (its OSError was a
    500), or, with `writes`, below `plugin/` deeper or longer than `WRITE_LEVELS` and
    `WRITE_BYTES` (a folder a PUT makes is then never too long for the file system)."""
    try:
        path = unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return NOT_UTF8
    if not servable(path):
        return CONTROL
    names = path.split("/")
    if {".", ".."} & set(names):
        return DOT_SEGMENT
    if len(path.encode()) > PATH_MAX or max(len(name.encode()) for name in names) > NAME_MAX:
        return TOO_LONG
    below = path.removeprefix(f"{MOUNT}/{PLUGIN}/")
    too_deep = below.count("/") >= WRITE_LEVELS or len(below.encode()) > WRITE_BYTES
    if writes and below != path and too_deep:
        return TOO_DEEP
    return None


def names_upload(raw: bytes) -> bool:
    """Whether a name of the percent-encoded path `raw` (UTF-8: `path_refusal`) is that of an
    upload's body in progress (`uploading`): a folder so named would be hidden too."""
    return any(map(uploading, unquote_to_bytes(raw).decode("utf-8").split("/")))


def outputs_root(raw: bytes) -> bool:
    """Whether the path `raw` is the plugin outputs' folder itself (`/webdav/plugin`, with or
    without its slash)."""
    return unquote_to_bytes(raw).rstrip(b"/") == f"{MOUNT}/{PLUGIN}".encode()


# Linux's NAME_MAX and PATH_MAX: a longer name or path names no file (ENAMETOOLONG)
NAME_MAX, PATH_MAX = 255, 4096
# what a plugin output's path below `plugin/` may be (`<id>/<file>`, `fanart/ab/cd/<file>`):
# with the outputs' folder in front it stays under PATH_MAX
WRITE_LEVELS, WRITE_BYTES = 32, 1024
# The most of a request body but a PUT's: the XML of a PROPFIND, LOCK or PROPPATCH (a few
# hundred bytes from every client seen). Read whole, within `body_timeout_s`, before WsgiDAV
# sees the request (`App`): WsgiDAV read any body it was told of into memory on one of its
# threads, with no deadline (an 800 MB PROPFIND body grew the node by 800 MB, kept; 64 bodies
# that never came held every WebDAV thread for good).
BODY = 64 * 1024
READS = "OPTIONS, HEAD, GET, PROPFIND"  # what the outputs' folder itself (and a root) answers
DOT_SEGMENT = InvalidRequest("a WebDAV path has no '.' or '..' segment")
NOT_UTF8 = InvalidRequest("a WebDAV path is UTF-8 once percent-decoded")
CONTROL = InvalidRequest("a WebDAV path has no control character")
TOO_LONG = PathTooLong(
    f"a WebDAV path is at most {PATH_MAX:,} bytes, each name at most {NAME_MAX} bytes"
)
TOO_DEEP = PathTooLong(
    f"a path below /webdav/{PLUGIN}/ is at most {WRITE_BYTES:,} bytes in {WRITE_LEVELS} levels"
)
OUTPUTS_ROOT = MethodNotAllowed(f"/webdav/{PLUGIN}/ itself is not written: its members are")
UPLOAD_NAME = Forbidden(
    "a name of the form .<16 hex digits>.part is a body still being uploaded here: write another"
)
INTO_ITSELF = Forbidden(
    f"/webdav/{PLUGIN}/ itself is neither copied nor moved (into itself) nor replaced"
)
