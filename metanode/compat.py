"""MetaMesh compatibility: meta-core's routes on top of metanode (docs/compat.md).

meta-sort, meta-fuse, meta-stremio and the MetaMesh plugins talk to meta-core through the `/meta`
family, two SSE streams (`/api/events/meta`, `/api/events/files`), the content routes
(`/api/file/{cid}/info`, `/file/{cid}`) and `/urls`. This module serves those shapes from the
ordinary machinery, adding no state of its own but the legacy writer's key and the cache's
`file_feed` table:

* reads come from the cache (the merged records, `local_file`, `feed` and `file_feed`) and the
  truth, always through `Node`'s typed methods: this module holds no connection and no SQL;
* writes cannot be signed by their senders, so the node signs them with its own "legacy writer"
  key and ingests them through `Node.ingest_wire`, exactly as `POST /api/claims` would: they are
  votes that merge with every other signer's, not overwrites;
* the streams resume from `<epoch>-<seq>` cursors by `GET /api/events`' rule and from its
  shared readers (`feed.Hub`), framed their own way; a cursor they cannot resume from gets a
  `gap` event and then the full current state.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import mimetypes
import os
import socket
import stat
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import Receive, Scope, Send

from metanode import cid as cids
from metanode import claims, feed, merge, ranges, signer, sse, webdav
from metanode import rid as rids
from metanode.bodies import declares_json, parse_json, read_body, refuse_unknown
from metanode.config import Settings
from metanode.errors import (
    OUT_OF_FILES,
    CacheNotReady,
    DeprecatedField,
    InvalidCid,
    InvalidJson,
    InvalidRequest,
    InvalidRid,
    InvalidValue,
    MetanodeError,
    NotFoundError,
    TooLarge,
    UnknownCid,
    out_of_files,
    shown,
)
from metanode.etags import revalidated, revalidated_json
from metanode.ignores import UNKNOWN_CTIME, ctime_of, mtime_of
from metanode.metrics import STALL_WATCH
from metanode.node import Node
from metanode.webdav import LiveRoots, Roots

MAX_PROPERTY_BODY = 1024 * 1024  # meta-core reads a property body into a 1 MiB buffer
# meta-core's routes not served here (docs/compat.md's "not served" rows), by path or prefix
NOT_SERVED = (
    "/leader",
    "/role",
    "/neighbors",
    "/api/neighbors",
    "/api/mounts",
    "/api/events/subscribe",
    "/api/scan/trigger",
    "/api/kv/",
    "/data/",
)


class RangeNotSatisfiable(MetanodeError):
    status = 416
    slug = "range_not_satisfiable"


def is_deprecated(field: str) -> bool:
    """meta-core's removed per-algorithm CID fields: `cid_*`, `midhash256`, `canonical_cid`."""
    return field.startswith("cid_") or field in ("midhash256", "canonical_cid")


# -- MetaMesh's names for metanode's keys ------------------------------------------------------

# The ids MetaMesh names otherwise than metanode's plugins do: MetaMesh's name (meta-interface's
# `JellyfinMetaData`; meta-stremio finds the file of a Stremio `tt…` id by `imdbid`, and shows
# the IMDb link from it) -> the key the nfo plugin signs (plugins.md). The views of this page
# give a record's value under MetaMesh's name as well, unless the record holds one of its own
# there (a MetaMesh plugin's, written through meta-sort), which wins.
METAMESH_NAMES = {"imdbid": "imdb", "tmdbid": "tmdb"}
_METAMESH_NAME_OF = {ours: theirs for theirs, ours in METAMESH_NAMES.items()}


def metamesh_view(record: dict[str, str]) -> dict[str, str]:
    """A merged record as the MetaMesh routes show it: each key of `METAMESH_NAMES` that has no
    value of its own takes the value of metanode's key for it."""
    named = {
        theirs: record[ours]
        for theirs, ours in METAMESH_NAMES.items()
        if record.get(ours) and not record.get(theirs)
    }
    return {**record, **named} if named else record


def metamesh_value(node: Node, rid: str, key: str) -> str | None:
    """One property as `metamesh_view` shows it: its own value, else metanode's key's for it."""
    stored = node.record_value(rid, key)
    if not stored and key in METAMESH_NAMES:
        return node.record_value(rid, METAMESH_NAMES[key])
    return stored


def metamesh_ops(op: str) -> tuple[str, ...]:
    """The events under MetaMesh's name that an event on metanode's key (`imdb`) comes with: a
    `set` is a `set` of `imdbid`; a `del` is a `del` of it and then a `set`, since the record
    may hold an `imdbid` of its own that shows again (a consumer re-reads on `set`, and takes
    the 404 of a record without one for nothing to read)."""
    return ("set",) if op == "set" else ("del", "set")


# -- naming a record: a rid, or any CID in any spelling -----------------------------------------


def _as_rid(text: str) -> str | None:
    try:
        return rids.parse(text)
    except InvalidRid:
        return None


def record_rid(node: Node, text: str) -> str:
    """The active rid that `{hash}` names: a rid (404 `unknown_rid` / `merged`) or any known CID
    (404 `unknown_cid`, also for what is neither: MetaMesh clients read only a 404 as missing,
    and meta-core answered 404 for any key it did not hold)."""
    node.require_ready()
    rid = _as_rid(text)
    if rid is not None:
        return node.active_rid(rid)
    try:
        return node.resolve_cid(text)[1]
    except InvalidCid as exc:
        raise UnknownCid(f"no record is named {shown(text)}: {exc.message}") from None


# -- the legacy writer --------------------------------------------------------------------------


# What a MetaMesh writer sends but the node derives itself, from the watcher's local files and the
# group's members: never a claim, so a PATCH carrying them (meta-sort's, or a read-modify-write
# of `GET /meta/{hash}`) writes the rest and names these in `ignored`. `__fields__` is meta-core's
# own field index.
BOX_LOCAL_FIELDS = frozenset(
    {*claims.LOCAL_KEYS, "sizeByte", "paths", "cids", "hashId", "__fields__"}
)


def is_box_local(field: str) -> bool:
    return field in BOX_LOCAL_FIELDS or field.startswith("paths/")


def link_spelling(field: str) -> str:
    """`cids/<cid>` with the member in canonical spelling (any accepted spelling is read), so a
    MetaMesh writer's base58 or upper-case member links instead of failing the whole write."""
    if not field.startswith(claims.LINK_PREFIX):
        return field
    member = field[len(claims.LINK_PREFIX) :]
    try:
        return claims.LINK_PREFIX + cids.normalise(member)
    except InvalidCid:
        return field  # check_key names the member's fault


@dataclass(frozen=True)
class Fields:
    """A legacy write's fields sorted out: what becomes claims, and what the node ignores."""

    claims: dict[str, str]
    ignored: list[str]

    @classmethod
    def of(cls, fields: dict[str, str], node: Node) -> Fields:
        """Check every field first (nothing is written if one fails): a deprecated per-algorithm
        CID shape is refused, box-local fields are set aside, the rest must be valid claims."""
        for field in fields:
            if is_deprecated(field):
                raise DeprecatedField(
                    f"field {field!r} is a removed per-algorithm CID shape; write the bare-CID "
                    'key-set instead: "cids/<cid>": "true"',
                    field=field,
                )
        kept = {link_spelling(k): v for k, v in fields.items() if not is_box_local(k)}
        for field, value in kept.items():
            claims.check_key(field)
            claims.check_value(value, node.limits)
        return cls(kept, sorted(k for k in fields if is_box_local(k)))


@dataclass(frozen=True)
class Written:
    status: int  # 200, or 202 when the cache did not apply the claims in time
    rid: str  # the record the CID is in afterwards (a `cids/` field may have merged it)
    updated: int  # claims written (votes and retractions)
    ignored: tuple[str, ...] = ()  # box-local fields the node derives itself


class LegacyWriter:
    """Signs `/meta` writes with the node's own legacy-writer key (`Node.legacy`), one request
    at a time: a later write always wins over an earlier one of this signer, whichever CID of
    the group each named. Each write holds the signer's lock over what it reads (the target,
    the signer's live votes, a set's current value) and what it signs."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.signer = node.legacy

    def _target(self, text: str) -> tuple[str, str | None]:
        """(the CID a claim about `{hash}` names, the rid of its group or None if it has none).

        A rid names its group's canonical CID; a CID names itself in canonical spelling, or its
        alias spelling when only that one is grouped already (so the write joins that record).
        """
        rid = _as_rid(text)
        if rid is not None:
            rid = self.node.active_rid(rid)
            canonical = cids.canonical_cid(self.node.group_cids(rid))
            assert canonical is not None  # an active rid always holds a CID
            return canonical, rid
        return self.node.grouped_spelling(text)

    def _existing(self, text: str) -> tuple[str, str]:
        """(target CID, rid) of a record that must exist: deleting or adding to nothing is 404."""
        cid, rid = self._target(text)
        if rid is None:
            raise UnknownCid(f"no record holds {cid}")
        return cid, rid

    async def _ingest(self, cid: str, drafts: list[signer.Draft], ignored: list[str]) -> Written:
        answer = await self.signer.sign_and_ingest(drafts)
        after = self.node.group_of(cid)
        assert after is not None  # the claims were stored, so their CID is grouped
        return Written(answer.status, self.node.survivor(after), len(drafts), tuple(ignored))

    def _echoes(self, rid: str, fields: dict[str, str]) -> set[str]:
        """The fields a write only repeats: the value the record already shows. meta-sort's
        `/meta` proxy, through which every MetaMesh plugin writes, reads the whole record and
        PATCHes it all back for each key it sets (UnifiedAPIServer.ts `PUT /meta/:hash/*`);
        signed, each echo would be this signer's vote for what another signer said, which then
        outlived that signer's retraction or block. So too where this signer voted another
        value before (most keys a MetaMesh plugin parsed): a person's fix, echoed, became the
        legacy writer's vote and outlived the person's Revert. meta-core stored an unchanged
        value as no change, so it is none here."""
        record = metamesh_view(self.node.record_rows(rid))  # as the writer read it
        return {k for k, v in fields.items() if v and record.get(k) == v}

    async def write(self, text: str, fields: dict[str, str]) -> Written:
        """Sign `fields` as claims about the CID `{hash}` names and ingest them.

        "" is a retraction: a tombstone on that CID and on every other CID of the group where
        this signer still has a live vote on the key. A field the record already shows is not
        signed (`_echoes`).
        """
        sorted_out = Fields.of(fields, self.node)
        async with self.signer.lock:
            await self.signer.register()
            cid, rid = self._target(text)
            if rid is None and not any(sorted_out.claims.values()):  # no value, nothing to undo
                raise UnknownCid(f"no record holds {cid}")
            echoes = self._echoes(rid, sorted_out.claims) if rid is not None else set()
            written = [(k, v) for k, v in sorted_out.claims.items() if k not in echoes]
            if not written:
                assert rid is not None
                return Written(200, self.node.survivor(rid), 0, tuple(sorted_out.ignored))
            drafts: list[signer.Draft] = [(cid, k, v or None) for k, v in written]
            retracted = [field for field, value in written if not value]
            if rid is not None and retracted:
                drafts += [
                    (c.cid, c.key, None)
                    for c in self.node.live_claims(rid, retracted, self.signer.uid)
                    if c.cid != cid
                ]
            done = await self._ingest(cid, drafts, sorted_out.ignored)
        return Written(done.status, done.rid, len(written), done.ignored)

    async def retract_all(self, text: str) -> Written:
        """`DELETE /meta/{hash}`: tombstone every live vote of this signer on the record (its
        values and its links; a retracted link splits nothing). Other signers' claims stay:
        claims are never deleted, so the record keeps what the watcher and plugins say."""
        async with self.signer.lock:
            await self.signer.register()
            cid, rid = self._existing(text)
            live = self.node.live_claims(rid, None, self.signer.uid)
            if not live:
                return Written(200, self.node.survivor(rid), 0)
            return await self._ingest(cid, [(c.cid, c.key, None) for c in live], [])

    async def add_to_set(self, text: str, key: str, value: str) -> tuple[Written, bool]:
        """`POST /meta/{hash}/_add/{key}`: meta-core's pipe-delimited set. The merged value is
        split on `|`; a member already there adds nothing (`added` false), else this signer
        votes the set with the member appended."""
        claims.check_key(key)
        async with self.signer.lock:
            await self.signer.register()
            cid, rid = self._existing(text)
            current = self.node.record_value(rid, key) or ""
            members = current.split("|") if current else []
            if value in members:
                return Written(200, self.node.survivor(rid), 0), False
            joined = "|".join([*members, value])
            claims.check_value(joined, self.node.limits)
            return await self._ingest(cid, [(cid, key, joined)], []), True


Endpoint = Callable[[Request], Awaitable[Response]]


def to_webdav_root(root: str) -> Endpoint:
    """`/webdav` is the collection `/webdav/`: a 307 there (under `root_path` `root`), by a
    relative `Location` (the router's own slash redirects are off: they named the request's
    `Host`, whatever it said)."""

    async def redirect(request: Request) -> Response:
        return RedirectResponse(f"{root}{webdav.MOUNT}/", status_code=307)

    return redirect


async def start(node: Node) -> None:
    """At server start (after `node.start()`): re-register the legacy writer if it has signed
    before, so a changed `legacy_writer_weight` re-merges its votes at once. A node that never
    had a legacy write gets its key and signer row on the first one.

    Reads the MIME types' table (`/etc/mime.types`) now, not at the first `/file/{cid}` or
    WebDAV GET: it opens files, and one asked while every descriptor was held answered 500."""
    mimetypes.init()
    if node.legacy.path.exists():
        await node.legacy.register()


# -- request bodies -----------------------------------------------------------------------------


def patch_fields(body: bytes, max_fields: int) -> dict[str, str]:
    """A PATCH body: one JSON object of string → string (meta-core's `map[string]string`)."""
    parsed = parse_json(body)
    if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
        raise InvalidRequest('the body must be a JSON object of strings: {"key": "value", …}')
    if len(parsed) > max_fields:
        raise TooLarge(f"{len(parsed)} fields; at most {max_fields} per write")
    return parsed


def property_value(body: bytes, declared_json: bool) -> str:
    """A PUT property body: `{"value": "…"}` (null counts as ""), else the raw body as text.

    A body declared JSON (`Content-Type: application/json`) is read as JSON and nothing else:
    a member named twice or NaN is `invalid_json` (not a value `{"value":"a","value":"b"}`
    to store), and it must be that object. An undeclared body that parses as an object with a
    `value` is read the same way (an extra member refused, not dropped); any other undeclared
    body is the value as text, as meta-core stored it. The body is required (the OpenAPI
    document says so): an empty one is refused rather than read as a retraction, which
    `{"value": ""}` states explicitly."""
    if not body:
        raise InvalidRequest(
            'the body is required: {"value": "…"} or the value as text ({"value": ""} retracts)'
        )
    if declared_json:
        parsed = parse_json(body)
    else:
        try:
            parsed = parse_json(body)
        except InvalidJson:
            parsed = None  # not JSON: the raw body is the value
    if isinstance(parsed, dict) and "value" in parsed:
        refuse_unknown(parsed, ("value",))
        if parsed["value"] is not None and not isinstance(parsed["value"], str):
            raise InvalidRequest('"value" is a string (or null, which retracts like "")')
        return parsed["value"] or ""
    if declared_json:
        raise InvalidRequest('a JSON body is {"value": "…"} (the value as text: not JSON)')
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidValue('the body is neither {"value": …} nor UTF-8 text') from None


# -- local files --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalCopy:
    """A local file holding the content, opened and checked to still be the file that was hashed.

    Whoever takes one closes `fd` (`OpenedFile` does, however its response ends).
    """

    path: str
    fd: int
    stat: os.stat_result
    content_type: str


def open_hashed(
    file: merge.LocalFile, roots: Sequence[str], follow_symlinks: bool
) -> tuple[int, os.stat_result] | None:
    """The file at `file.path`, opened, if it still is the very file the watcher hashed; else None.
    `OutOfFiles` (503 `too_many_open_files`) when no descriptor is free to open it.

    A path can be swapped after hashing for a link to any file the node may read, even one of the
    same size and mtime. So, unless the owner chose to follow links: the last component must not
    be a symbolic link (`O_NOFOLLOW`) and the opened file's real path must lie below a watch root
    (a linked folder cannot lead out). Always: the opened file has the inode, size and mtime it
    was hashed with (a row with no inode recorded is not served until it is hashed again), and
    its ctime, where the row has one: a file rewritten in place with its size and mtime put
    back is not served as the content it held until the watcher has hashed it again.
    Checked on the open descriptor, which is then what is served: nothing can be swapped between
    the check and the read.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(file.path, flags)
    except OSError as exc:
        if exc.errno in OUT_OF_FILES:  # not "no copy here": a 404 a client takes for missing
            raise out_of_files(exc, file.path) from None
        return None
    try:
        info = os.fstat(fd)
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        return None
    same = (
        stat.S_ISREG(info.st_mode)
        and file.ino != 0
        and (info.st_ino, info.st_size, mtime_of(info)) == (file.ino, file.size, file.mtime_ns)
        and file.ctime_ns in (UNKNOWN_CTIME, ctime_of(info))
    )
    inside = follow_symlinks or any(real.startswith(root.rstrip("/") + "/") for root in roots)
    if same and inside:
        return fd, info
    os.close(fd)
    return None


async def local_copy(node: Node, text: str) -> LocalCopy | None:
    """The first local path (by path) still holding the content this CID names, opened."""
    node.require_ready()
    files, mime = node.local_copies(node.resolve_cid(text)[1])
    roots = [os.path.realpath(root) for root in node.watched()]
    for file in files:
        opened = await asyncio.to_thread(
            open_hashed, file, roots, node.settings.watch_follow_symlinks
        )
        if opened is not None:
            guessed = mimetypes.guess_type(file.path)[0]
            return LocalCopy(file.path, *opened, mime or guessed or "application/octet-stream")
    return None


class OpenedFile(FileResponse):
    """A `FileResponse` of an already opened and checked file, read through that descriptor
    itself (`_open_file`); the descriptor is closed however the response ends. The path given
    to Starlette is never opened: it opened `/proc/self/fd/N`, a second descriptor of the same
    file, after the head was sent, so a node out of descriptors then cut a 200 short."""

    def __init__(self, copy: LocalCopy) -> None:
        super().__init__(
            f"/proc/self/fd/{copy.fd}",
            stat_result=copy.stat,
            media_type=copy.content_type,
            headers=webdav.INERT,  # whatever the file is, no page of this origin
        )
        self.fd = copy.fd

    @contextlib.asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        """The checked descriptor as Starlette's file: read from where it stands (0: opened
        for this response; a range seeks first), closed by `__call__`, not here. Starlette
        reads a file through this since 1.x; an older one opens the path, as before
        (`test_http_edge.py::test_a_file_served_holds_one_descriptor_of_it` says which)."""
        with os.fdopen(self.fd, "rb", closefd=False) as file:
            yield anyio.wrap_file(file)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            os.close(self.fd)


def range_refused(response: FileResponse, request: Request, size: int) -> Response | None:
    """A 416 envelope for a Range that FileResponse would refuse with its own plain-text 400 or
    416 (a malformed or unsatisfiable range, as Go's `http.ServeContent` refuses both), using
    FileResponse's own parser (`ranges`) so the two never disagree; None when it will serve the
    request."""
    wanted, if_range = request.headers.get("range"), request.headers.get("if-range")
    if wanted is None or if_range not in (
        None,
        response.headers.get("last-modified"),
        response.headers.get("etag"),
    ):
        return None  # no range, or If-Range says the client's copy is stale: the whole file
    if isinstance(ranges.byte_ranges(wanted, size), ranges.Unserved):
        refused = RangeNotSatisfiable(f"range {wanted!r} cannot be served from {size} bytes")
        return JSONResponse(
            refused.envelope(),
            status_code=refused.status,
            headers={"Content-Range": f"bytes */{size}"},
        )
    return None


# -- the two SSE streams ------------------------------------------------------------------------

# The reasons of the one resume rule (`sse.resume_gap`, `feed.Hub.after`) as MetaMesh consumers
# know them (docs/compat.md): the rule is /api/events', only a name differs.
GAP_REASONS = {
    sse.UNKNOWN_EPOCH: "unknown_epoch",
    sse.FUTURE: "future",
    sse.TOO_OLD: "retention",
    sse.STATE_CHANGED: "state_changed",
}
R = TypeVar("R", bound=feed.Sequenced)


def _meta_data(rid: str, key: str, at: int) -> dict[str, str]:
    return {"key": f"file:{rid}/{key}", "ts": str(at)}


def meta_frame(epoch: int, row: feed.FeedRow) -> bytes:
    """A feed row as meta-core's keyspace event: `set`/`del`, the key and when, no value. A row
    on a key MetaMesh names otherwise (`imdb`) comes after the events under MetaMesh's name
    (`metamesh_ops`), which carry no id: the row's own event is the one a cursor names."""
    frame = sse.event(
        row.op, _meta_data(row.rid, row.key, row.at), sse.event_id(epoch, row.seq)
    ).encode()
    theirs = _METAMESH_NAME_OF.get(row.key)
    if theirs is None:
        return frame
    named = _meta_data(row.rid, theirs, row.at)
    return b"".join(sse.event(op, named).encode() for op in metamesh_ops(row.op)) + frame


@dataclass(frozen=True)
class FileFrames:
    """The files stream's framing of `file_feed` rows, every value a string as meta-core's
    Redis-backed stream sends them. A value (equal for equal roots), so every subscriber of a
    node shares one set of frames per page."""

    roots: Roots

    def __call__(self, epoch: int, row: feed.FileFeedRow) -> bytes:
        data = self.data(row.path, row.midhash, row.size, row.at, row.old_path)
        return sse.event(row.op, data, sse.event_id(epoch, row.seq)).encode()

    def data(
        self, path: str, midhash: str, size: int, at: int, old_path: str | None = None
    ) -> dict[str, str]:
        data = {"midhash256": midhash}
        if old_path is not None:
            data["oldPath"] = self.roots.relative(old_path)
        data.update(path=self.roots.relative(path), size=str(size), timestamp=str(at))
        return data  # keys in sorted order, as meta-core's Go maps marshal them


class _Follow(feed.Framing[R]):
    """One client of a MetaMesh stream over an event table, served from the table's shared hub
    (`feed.Hub`, the same one as `/api/events` for the meta stream), framed its own way: a
    `feed.Framing` that `feed.Subscription` runs by the one resume rule (replay after a
    retained cursor; otherwise one `gap` and the full current state, with ids inside that
    state, so a client cut off in it resumes there; then the live tail, with `: keep-alive`
    after silences). The MetaMesh streams end neither a replay nor a full state with a frame
    of their own (no `synced`): the state's last event carries the state's seq, which resumes
    with the events after it. Chunks of whole frames: a page of events per chunk.
    """

    gap_names = GAP_REASONS
    # Whether a client that sends no cursor gets the full state first (else the live tail only)
    whole_without_cursor = False

    def __init__(self, node: Node, cursor: sse.Cursor | None) -> None:
        self.node = node
        self.cursor = cursor
        self.feed = self._feed()

    # the stream's specifics
    def _feed(self) -> feed.Feed[R]:
        raise NotImplementedError

    def _form(self) -> feed.Form[R]:
        raise NotImplementedError

    def _state(self, rows: list[Any], now: int) -> list[feed.Event]:
        """The full state's events of one page of the snapshot's rows."""
        raise NotImplementedError

    def _state_start(self, now: int) -> list[feed.Event]:
        return []

    def live(self, got: feed.Slice[R]) -> bytes:
        return got.chunk(self._form())

    async def full_state(self) -> feed.Snapshot:
        now = self.node.clock()
        return await self.feed.full_state(
            lambda rows: self._state(rows, now), self._state_start(now)
        )

    def stream(self) -> AsyncGenerator[bytes, None]:
        subscription = feed.Subscription(self.feed, self, self.cursor, self.whole_without_cursor)
        return self.node.counted(subscription)


class MetaFollow(_Follow[feed.FeedRow]):
    """`GET /api/events/meta`: the record feed as meta-core's keyspace events,
    `set`/`del` with `{"key": "file:<rid>/<field>", "ts": "<ms>"}` and no value."""

    def _feed(self) -> feed.Feed[feed.FeedRow]:
        return self.node.meta_feed()

    def _form(self) -> feed.Form[feed.FeedRow]:
        return meta_frame

    def _state(self, rows: list[Any], now: int) -> list[feed.Event]:
        """A `set` for every key, and for a key MetaMesh names otherwise (`imdb`) a `set` of its
        name (`imdbid`) before it, as the live tail sends them."""
        events: list[feed.Event] = []
        for rid, key, _ in rows:
            if (theirs := _METAMESH_NAME_OF.get(key)) is not None:
                events.append(("set", _meta_data(rid, theirs, now)))
            events.append(("set", _meta_data(rid, key, now)))
        return events


class FilesFollow(_Follow[feed.FileFeedRow]):
    """`GET /api/events/files`: `add`/`change`/`delete`/`rename` from `file_feed`; the full
    state is `reset` and then an `add` for every local file.

    A client with no cursor gets the full state first, with no gap: meta-sort asks so at its
    first start (no cursor file yet) and runs its plugins on what the stream says. meta-core's
    watcher kept its state in memory and sent `reset` and an `add` for every file at each of
    its starts, so a stack started together fed meta-sort the library; metanode's watcher keeps
    its state, and live only, a first meta-sort got nothing of a library already known."""

    whole_without_cursor = True

    def __init__(self, node: Node, cursor: sse.Cursor | None) -> None:
        # the paths in the roots' layout at each chunk: a folder added on the page while a
        # client follows is named in its events at once (`webdav.LiveRoots`)
        self.layout = LiveRoots(node.settings, node.named_roots)
        super().__init__(node, cursor)

    def _feed(self) -> feed.Feed[feed.FileFeedRow]:
        return self.node.files_feed()

    def _form(self) -> FileFrames:
        return FileFrames(self.layout())

    def _state_start(self, now: int) -> list[feed.Event]:
        return [("reset", {"path": "", "timestamp": str(now)})]

    def _state(self, rows: list[Any], now: int) -> list[feed.Event]:
        frames = self._form()
        return [("add", frames.data(path, midhash, size, now)) for path, midhash, size in rows]


def internal_url(settings: Settings) -> str:
    """The node's URL for a client beside it: by the host name when it listens on every
    address (in Docker, the container's name, which its siblings resolve, as meta-core's
    `webdavUrlInternal` did), else by the address it listens on. Without `root_path`: past the
    proxy, the routes are at `/` (the node answers under the prefix too)."""
    if settings.host in ("0.0.0.0", "::", ""):
        return f"http://{socket.gethostname()}:{settings.port}"
    return settings.client_url


def served_file(roots: Roots, settings: Settings, path: str) -> str:
    """The real path of the file `path` (`<collection>/<below>`, as `filePath` and the file
    events name it) names, inside its root unless `watch_follow_symlinks` (the watcher's and
    WebDAV's rule); `NotFoundError` for no such file, `InvalidRequest` for a folder or for a
    path no file can have: a NUL, or a lone surrogate (JSON's `"\\ud800"`), which the file
    system calls (`realpath`) raise on as ValueError or UnicodeEncodeError, not OSError."""
    if "\0" in path:
        raise InvalidRequest(f"{shown(path)} holds a NUL character, which no file name holds")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{shown(path)} holds a lone surrogate, which is not text") from None
    found = roots.local(path)
    if found is None:
        raise NotFoundError(
            f"no file at {shown(path)}: a path starts with a watch root's name, and names no "
            "file the watcher ignores (a dot-name, `*.part`, `watch_ignore`…)"
        )
    root, local = found
    real = os.path.realpath(local)
    if not settings.watch_follow_symlinks and not real.startswith(root.rstrip("/") + "/"):
        raise NotFoundError(f"no file at {shown(path)} (a link out of its root is not followed)")
    if os.path.isdir(real):
        raise InvalidRequest(f"{shown(path)} is a folder, not a file")
    if not os.path.isfile(real):
        raise NotFoundError(f"no file at {shown(path)}")
    return real


HASH_CHUNK = 1 << 20
# `POST /file/cid`s hashing at once; the others wait their turn on the event loop. Each reads
# its whole file on a thread of the default pool (min(32, cores + 4) threads), which the
# watcher's hashing, `/file/{cid}`'s open, the applier's lock polls and the plugins page share:
# eight asked at once for one 20 GB file held all six threads of a 2-core box, and
# `/api/file/{cid}/info` waited 133 s.
HASHING = 2


def sha256_cid(path: str) -> tuple[str, int]:
    """(the sha2-256 CIDv1 of the file's bytes, raw codec, as meta-core gave it; its size)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return cids.encode(cids.RAW, cids.SHA2_256, digest.digest()), size


LEADER_FILE = Path("locks", "kv-leader.info")  # in the MetaMesh volume, as meta-core wrote it


def announce(settings: Settings) -> None:
    """Make `<metamesh_volume>/locks/kv-leader.info` name this node (`internal_url`, a line,
    as meta-core's leader election wrote it): the consumers that predate UDP discovery read it
    to find the core, then ask its `/urls`. Written whole (renamed into place), and only when
    it says something else: every consumer watches the folder and takes any event on the file
    for a new core (meta-stremio drops its connection and cache, meta-fuse opens a second
    meta stream beside the first), so a restart at the same URL leaves it untouched. Never
    removed, as meta-core's leader never removed it (its election script's cleanup trap did
    not outlive `exec supervisord`): a consumer that sees it go disconnects, and meta-stremio
    gives up after five minutes and does not notice it come back (a rename, which it does not
    handle); one that reads it while the node is down just retries `/urls`."""
    if not settings.metamesh_volume:
        return
    path = Path(settings.metamesh_volume) / LEADER_FILE
    text = internal_url(settings) + "\n"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path.read_text(encoding="utf-8") == text:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}")
    part.write_text(text, encoding="utf-8")
    os.replace(part, path)


SERVICES = "services"  # in the MetaMesh volume: each service's `<name>-<host>.json`
STALE_S = 60  # a registration whose heartbeat is older is listed `stale`, as meta-core did
MAX_REGISTRATION = 64 * 1024  # bytes of one registration file read


def registered(settings: Settings, now: datetime.datetime) -> list[dict[str, Any]]:
    """The services the MetaMesh consumers register in `<metamesh_volume>/services/` (meta-sort,
    meta-fuse and meta-stremio write `<name>-<host>.json` and beat its `lastHeartbeat`), by
    name, as meta-core listed them: one whose heartbeat is older than `STALE_S` is `stale`;
    a file that is no JSON object with a `name` is left out. None without a volume."""
    if not settings.metamesh_volume:
        return []
    folder = Path(settings.metamesh_volume) / SERVICES
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            with path.open("rb") as registration:
                info = json.loads(registration.read(MAX_REGISTRATION))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and isinstance(info.get("name"), str):
            found.append({**info, "status": _status(info, now)})
    return found


def _status(info: dict[str, Any], now: datetime.datetime) -> Any:
    """A registration's own status, or `stale` when its heartbeat is older than `STALE_S`."""
    try:
        beat = datetime.datetime.fromisoformat(str(info.get("lastHeartbeat")))
    except ValueError:
        return info.get("status")
    if beat.tzinfo is None:
        beat = beat.replace(tzinfo=datetime.UTC)
    return "stale" if (now - beat).total_seconds() > STALE_S else info.get("status")


def internal_host(settings: Settings) -> str:
    """`/urls`' `hostname`: the host (and port, unless 80) of `internal_url`. meta-fuse builds
    its WebDAV root as `http://<hostname>/webdav` (meta-core's nginx answered on port 80), so
    a bare host name sent it to a port nothing listens on."""
    return urlsplit(internal_url(settings)).netloc.removesuffix(":80")


# -- routes -------------------------------------------------------------------------------------


def routes(node: Node) -> list[BaseRoute]:
    """The MetaMesh routes of one node (the token, or a trusted network: docs/compat.md)."""
    # the roots' layout as it is at each request: a folder added or let go on the page is
    # served, and named in `filePath`, at once (docs/watcher.md, "Choosing the folders")
    layout = LiveRoots(node.settings, node.named_roots)
    root = node.settings.root_path  # what the URLs this node gives start with
    return [
        *_record_routes(node, layout),
        *_stream_routes(node),
        *_file_routes(node, layout),
        *_directory_routes(node),
        Route(webdav.MOUNT, to_webdav_root(root), methods=webdav.METHODS),
        Mount(webdav.MOUNT, app=webdav.App(node.settings, layout)),  # outside the OpenAPI doc
    ]


def mounted(settings: Settings, roots: Roots, path: str) -> str:
    """A record's `filePath` as the consumers hold it: their files folder, then the WebDAV
    path (the file events' `path`). meta-sort writes `/files/<event path>` and takes any
    other stored value for a second file of the same midhash (a collision: the file left
    out of its view); meta-fuse and meta-stremio strip the folder again to reach WebDAV."""
    return f"{settings.metamesh_files_path.rstrip('/')}/{roots.relative(path)}"


def _record_routes(node: Node, layout: LiveRoots) -> list[BaseRoute]:
    """`/meta…`: a record's values as MetaMesh reads them, and its writes as the legacy
    writer's claims (`LegacyWriter`)."""
    writer = LegacyWriter(node)

    async def list_meta(request: Request) -> Response:
        node.require_ready()
        found = await node.list_rids()
        # 2.9 MB at 100,000 records: encoded and tagged on a thread too (23 ms)
        listed = {"hashIds": found, "count": len(found)}
        return await asyncio.to_thread(revalidated_json, listed, request.scope["headers"])

    async def meta_record(request: Request) -> Response:
        text = request.path_params["hash"]
        if request.method == "PATCH":
            body = await read_body(
                request, node.settings.max_batch_bytes, node.settings.body_timeout_s
            )
            fields = patch_fields(body, node.settings.max_batch_claims)
            done = await writer.write(text, fields)
            return JSONResponse(
                {
                    "success": True,
                    "hashId": done.rid,
                    "updated": done.updated,
                    "ignored": list(done.ignored),
                },
                status_code=done.status,
            )
        if request.method == "DELETE":
            done = await writer.retract_all(text)
            return JSONResponse(
                {"success": True, "hashId": done.rid, "deleted": done.updated},
                status_code=done.status,
            )
        rid = record_rid(node, text)
        record = node.record_rows(rid)
        if not record:
            raise CacheNotReady(f"{rid} is not in the cache yet; retry shortly")
        if "filePath" in record:
            path = mounted(node.settings, layout(), record["filePath"])
            record = {**record, "filePath": path}
        view = metamesh_view(record)
        document = {"hashId": rid, "metadata": dict(sorted(view.items()))}
        return revalidated_json(document, request.scope["headers"])

    async def meta_property(request: Request) -> Response:
        text, key = request.path_params["hash"], request.path_params["key"]
        if not key:
            raise InvalidRequest("a key is required: /meta/{hash}/{key}")
        if request.method in ("PUT", "DELETE"):  # a DELETE is the signer's retraction: ""
            value = ""
            if request.method == "PUT":
                limit, timeout = MAX_PROPERTY_BODY, node.settings.body_timeout_s
                raw = await read_body(request, limit, timeout)
                value = property_value(raw, declares_json(request))
            done = await writer.write(text, {key: value})
            body = {"success": True, "hashId": done.rid, "property": key}
            if done.ignored:  # a key the node derives itself (filePath…): nothing was written
                body["ignored"] = list(done.ignored)
            return JSONResponse(body, status_code=done.status)
        rid = record_rid(node, text)
        stored = metamesh_value(node, rid, key)
        if not stored:  # missing, or "" (meta-core reads an empty value as missing)
            raise NotFoundError(f"{rid} has no value for {key!r}")
        value = mounted(node.settings, layout(), stored) if key == "filePath" else stored
        # a value, never a page (`INERT`)
        return revalidated(value.encode(), request.scope["headers"], "text/plain", webdav.INERT_RAW)

    async def add_to_set(request: Request) -> Response:
        text, key = request.path_params["hash"], request.path_params["key"]
        if not key:
            raise InvalidRequest("a key is required: /meta/{hash}/_add/{key}")
        body = await read_body(request, MAX_PROPERTY_BODY, node.settings.body_timeout_s)
        value = property_value(body, declares_json(request)) if body else ""
        if not value:
            raise InvalidRequest('a value is required: {"value": "…"} or the value as text')
        done, added = await writer.add_to_set(text, key, value)
        return JSONResponse(
            {"success": True, "hashId": done.rid, "property": key, "added": added},
            status_code=done.status,
        )

    return [
        Route("/meta", list_meta),
        Route("/meta/{hash}", meta_record, methods=["GET", "PATCH", "DELETE"]),
        Route("/meta/{hash}/_add/{key:path}", add_to_set, methods=["POST"]),
        Route("/meta/{hash}/{key:path}", meta_property, methods=["GET", "PUT", "DELETE"]),
    ]


def event_stream(node: Node, stream: AsyncIterator[bytes], scope: Scope) -> EventSourceResponse:
    """A change feed's answer, for every stream: its chunks as they come (no ping of
    sse-starlette's: the subscription sends its own keep-alive), the server asked to watch
    it for a client that stopped reading (`metrics.STALL_WATCH`, `feed_stall_s`; absent
    where the server is not metanode's, an in-process test's)."""
    watch = scope.get("extensions", {}).get(STALL_WATCH)
    if watch is not None:
        watch(node.metrics.feed_stalls)
    return EventSourceResponse(stream, ping=0, sep=sse.SEP, headers={"Cache-Control": "no-cache"})


def _stream_routes(node: Node) -> list[BaseRoute]:
    """The meta and files change streams, framed MetaMesh's way (`MetaFollow`, `FilesFollow`)."""

    def follow(request: Request, kind: type[_Follow[Any]]) -> Response:
        node.require_ready()
        cursor = sse.parse_cursor(
            request.headers.get("last-event-id") or request.query_params.get("since")
        )
        return event_stream(node, kind(node, cursor).stream(), request.scope)

    async def events_meta(request: Request) -> Response:
        return follow(request, MetaFollow)

    async def events_files(request: Request) -> Response:
        return follow(request, FilesFollow)

    return [
        Route("/api/events/meta", events_meta),
        Route("/api/events/files", events_files),
    ]


def _file_routes(node: Node, layout: LiveRoots) -> list[BaseRoute]:
    """A CID's local file: whether it is here, its bytes, and a path's sha2-256 CID."""
    hashing = asyncio.Semaphore(HASHING)  # `POST /file/cid`'s whole-file reads
    files_path = node.settings.metamesh_files_path.rstrip("/")

    async def file_info(request: Request) -> Response:
        try:
            copy = await local_copy(node, request.path_params["cid"])
        except CacheNotReady:
            raise
        except MetanodeError:
            copy = None  # unknown, or not a CID at all: still 200, with exists false
        if copy is None:
            return JSONResponse({"exists": False})
        os.close(copy.fd)
        return JSONResponse(
            {
                "exists": True,
                "contentType": copy.content_type,
                "size": copy.stat.st_size,
                "filePath": layout().relative(copy.path),
            }
        )

    async def file_bytes(request: Request) -> Response:
        text = request.path_params["cid"]
        copy = await local_copy(node, text)
        if copy is None:
            raise UnknownCid(f"no local file holds {text}")
        response = OpenedFile(copy)
        refused = range_refused(response, request, copy.stat.st_size)
        if refused is not None:
            os.close(copy.fd)
        return refused or response

    async def file_cid(request: Request) -> Response:
        """`POST /file/cid` `{"path"}`: the sha2-256 CID (raw codec, base32: `bafkrei…`) of
        the file at `path` below the consumers' files folder, with its size, as meta-core
        computed it for the MetaMesh plugins (jellyfin-nfo's poster, subtitle's sibling file)
        that need a file's CID in the same call. Read whole, on a thread, at most `HASHING`
        at once."""
        body = parse_json(await read_body(request, MAX_PROPERTY_BODY, node.settings.body_timeout_s))
        if isinstance(body, dict):
            refuse_unknown(body, ("path",))
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise InvalidRequest('the body is {"path": "<path below the files folder>"}')
        local = served_file(layout(), node.settings, path.removeprefix(files_path + "/"))
        try:
            async with hashing:
                cid, size = await asyncio.to_thread(sha256_cid, local)
        except OSError as exc:
            raise NotFoundError(f"cannot read {shown(path)}: {exc.strerror}") from None
        return JSONResponse({"cid": cid, "path": path, "size": size})

    return [
        Route("/api/file/{cid}/info", file_info),
        Route("/file/cid", file_cid, methods=["POST"]),
        Route("/file/{cid}", file_bytes),
    ]


def _directory_routes(node: Node) -> list[BaseRoute]:
    """Where this node answers (`/urls`) and the services registered beside it."""
    root = node.settings.root_path  # what the URLs this node gives start with

    async def urls(request: Request) -> Response:
        """Where this node answers. `webdavUrl`: the WebDAV root by the URL this request
        reached (what a client on the box's network uses); `webdavUrlInternal`: by the node's
        own name and port (what another container or process beside it uses). Each under
        `root_path`: the WebDAV listings' hrefs carry it, and a client takes a listing's
        members by their hrefs below its root's."""
        base = str(request.base_url).rstrip("/") + root
        return JSONResponse(
            {
                "hostname": internal_host(node.settings),
                "baseUrl": base,
                "apiUrl": base,
                "redisUrl": "",
                "webdavUrl": base + webdav.MOUNT,
                "webdavUrlInternal": internal_url(node.settings) + root + webdav.MOUNT,
            }
        )

    async def services(request: Request) -> Response:
        """meta-core's service registry (`{"services": [ServiceInfo], "count"}`, and the asked
        `current`), which meta-sort's and meta-fuse's navigation read (meta-stremio's at
        `/services?current=…`): this node, then the services registered in the MetaMesh
        volume (`registered`), read on a thread. This node's URLs are under `root_path`."""
        base = str(request.base_url).rstrip("/") + root
        now = datetime.datetime.now(datetime.UTC)
        others = await asyncio.to_thread(registered, node.settings, now)
        this = {
            "name": "metanode",
            "hostname": socket.gethostname(),
            "baseUrl": base,
            "apiUrl": base,
            "healthUrl": f"{base}/health",
            "status": "running",
            "lastHeartbeat": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        listed = [this, *others]
        current = request.query_params.get("current")
        asked = {"current": current} if current else {}
        return JSONResponse({"services": listed, "count": len(listed), **asked})

    return [
        Route("/urls", urls),
        Route("/api/services", services),
        Route("/services", services),  # meta-core's older path: meta-stremio's navigation
    ]
