"""The hand-off of `POST /api/claims` from a reader worker to the owner (handoff.py), on a
real Unix socket: frames carry every JSON value unchanged, every error crosses as its own
class, and an owner that is gone, stops or dies mid-request gives a 503 (never a false OK).
The same path under `serve --workers 2` is in test_workers.py and test_group_commit.py."""

from __future__ import annotations

import asyncio
import inspect
import logging
import marshal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metanode import errors, handoff
from metanode.errors import InvalidBatch, MetanodeError, UnavailableError
from tests.helpers.wait import until

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


@given(st.lists(st.lists(JSON, max_size=8), min_size=1, max_size=3))
def test_frames_carry_json_values_unchanged_back_to_back(batches: list[list[Any]]) -> None:
    async def read_all() -> list[Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(handoff.frame(batch) for batch in batches))
        reader.feed_eof()
        out = [await handoff.read_frame(reader) for _ in batches]
        with pytest.raises(asyncio.IncompleteReadError):
            await handoff.read_frame(reader)
        return out

    assert asyncio.run(read_all()) == batches


def every_error() -> list[MetanodeError]:
    """One instance of every error class of the tree, with an extra field."""
    out: list[MetanodeError] = []
    for kind in vars(errors).values():
        if not (inspect.isclass(kind) and issubclass(kind, MetanodeError)):
            continue
        if kind is InvalidBatch:
            items = [{"index": 0, "error": "unknown_signer", "message": "not registered"}]
            out += [InvalidBatch(items), InvalidBatch(items, status=403, total=7)]
        else:
            out.append(kind(f"a {kind.__name__}", survivor="x"))
    return out


@pytest.mark.parametrize("exc", every_error(), ids=lambda e: f"{type(e).__name__}-{e.status}")
def test_every_error_crosses_as_its_own_class(exc: MetanodeError) -> None:
    again = errors.rebuilt(marshal.loads(marshal.dumps(errors.portable(exc))))
    assert type(again) is type(exc)
    assert (again.status, again.envelope()) == (exc.status, exc.envelope())
    if isinstance(exc, InvalidBatch):
        assert isinstance(again, InvalidBatch)
        assert (again.items, again.total) == (exc.items, exc.total)
    if isinstance(exc, UnavailableError):
        assert isinstance(again, UnavailableError) and again.retry_after == exc.retry_after


def test_an_error_class_this_build_lacks_is_an_internal_error() -> None:
    again = errors.rebuilt(("NoSuchError", 418, "teapot", {}, 0))
    assert (type(again), again.status) == (errors.InternalError, 500)
    assert "NoSuchError: teapot" in again.message


class Owner:
    """The owner's end on a real socket, answering with what `answer` says (or raises)."""

    def __init__(self, path: Path) -> None:
        self.seen: list[list[Any]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.server = handoff.Server(path, self.ingest)

    async def ingest(self, items: list[Any]) -> tuple[int, dict[str, Any]]:
        self.seen.append(items)
        await self.release.wait()
        if items == ["policy"]:
            raise InvalidBatch([{"index": 0, "error": "blocked_signer", "message": "m"}], 403)
        if items == ["bug"]:
            raise ZeroDivisionError("a bug")
        return 200, {"accepted": len(items), "results": [{"status": "accepted"}] * len(items)}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "handoff.sock"


async def test_answers_and_refusals_cross_on_one_reused_connection(path: Path) -> None:
    owner = Owner(path)
    await owner.server.start()
    assert path.stat().st_mode & 0o777 == 0o600
    client = handoff.Client(path)
    try:
        items = [{"uid": "u", "value": None, "ts": 1, "nested": [1.5, {"x": True}]}]
        assert await client.ingest(items) == (
            200,
            {"accepted": 1, "results": [{"status": "accepted"}]},
        )
        with pytest.raises(InvalidBatch) as refused:
            await client.ingest(["policy"])
        assert refused.value.status == 403 and refused.value.items[0]["error"] == "blocked_signer"
        with pytest.raises(errors.InternalError):
            await client.ingest(["bug"])
        assert (await client.ingest([1, 2]))[0] == 200  # the connection survived all three
        assert owner.seen == [items, ["policy"], ["bug"], [1, 2]]
        assert len(client._idle) == 1 and len(owner.server._connections) == 1
    finally:
        client.close()
        await owner.server.stop()
    assert not path.exists()


async def test_stopping_beside_an_idle_connection_logs_no_error(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C on `make serve` after one claim handed over logged an asyncio ERROR with a
    traceback: the idle connection's task, cancelled by `stop`, was asked for its exception by
    Python 3.11's stream callback."""
    owner = Owner(path)
    await owner.server.start()
    client = handoff.Client(path)
    try:
        assert (await client.ingest([1]))[0] == 200  # its connection stays open, idle
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            await owner.server.stop()
            for _ in range(3):  # the stream's done-callbacks run
                await asyncio.sleep(0)
        assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    finally:
        client.close()


async def test_no_owner_is_a_503_that_says_nothing_was_written(path: Path) -> None:
    with pytest.raises(UnavailableError, match="nothing was written"):
        await handoff.Client(path).ingest([1])


async def test_an_owner_that_dies_mid_request_is_a_503_never_an_ok(path: Path) -> None:
    """The owner's end of the connection closes while a request waits for its commit."""
    owner = Owner(path)
    owner.release.clear()
    await owner.server.start()
    client = handoff.Client(path)
    pending = asyncio.create_task(client.ingest([1]))
    await until(lambda: bool(owner.seen), "the owner to take the request")
    for task in list(owner.server._connections):
        task.cancel()  # what a SIGKILL does to its side: the socket closes unanswered
    with pytest.raises(UnavailableError, match="may or may not be stored"):
        await pending
    assert client._idle == []  # a broken connection is not pooled
    owner.release.set()
    assert (await client.ingest([2]))[0] == 200  # a new connection
    client.close()
    await owner.server.stop()


async def test_stopping_finishes_the_request_being_answered_then_refuses(path: Path) -> None:
    owner = Owner(path)
    await owner.server.start()
    client, idle = handoff.Client(path), handoff.Client(path)
    assert (await idle.ingest([0]))[0] == 200  # a connection left idle in its pool
    owner.release.clear()
    pending = asyncio.create_task(client.ingest([1]))
    await until(lambda: len(owner.seen) == 2, "the owner to take the second request")
    stopping = asyncio.create_task(owner.server.stop())
    server = owner.server
    await until(lambda: server._connections == server._busy, "stop to end the idle connection")
    assert not pending.done() and not stopping.done()  # stop waits for the commit
    owner.release.set()
    assert (await pending)[0] == 200
    await stopping
    for each in (client, idle):  # the idle connection was ended; the socket is gone
        with pytest.raises(UnavailableError):
            await each.ingest([3])
