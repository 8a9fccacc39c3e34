"""The shared fixtures; what they are built from lives in tests/helpers (test modules import it
from there, never from here or from one another)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from metanode.api import create_app
from metanode.node import Node
from tests.helpers.feed import close_open_streams
from tests.helpers.server import Server
from tests.helpers.settings import settings_for


@pytest.fixture(autouse=True)
def close_streams() -> Iterator[None]:
    """Close every feed `Stream` a test opened, also when it failed half-way."""
    yield
    close_open_streams()


# -- nodes --------------------------------------------------------------------------------------


@pytest.fixture
async def node(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    """A started node on a fresh data directory (no HTTP server); settings overridden by an
    indirect parameter (`@pytest.mark.parametrize("node", [{...}], indirect=True)`)."""
    n = Node(settings_for(tmp_path / "data", **getattr(request, "param", {})))
    await n.start()
    await n.applier.wait_for(0, 10)
    yield n
    await n.stop()


@pytest.fixture
async def client(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client speaking to the node's ASGI app in-process, with the API token set."""
    transport = httpx.ASGITransport(app=create_app(node))
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://node",
        headers={"Authorization": f"Bearer {node.token}"},
    ) as c:
        yield c


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A running real server on a fresh data directory; stopped (SIGTERM) afterwards."""
    srv = Server(tmp_path / "data").start()
    yield srv
    srv.stop()
    srv.print_log()
