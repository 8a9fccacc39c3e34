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
from tests.helpers.postgres import BACKENDS, Cluster, Storages, start_cluster
from tests.helpers.server import Server
from tests.helpers.settings import settings_for


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "both_backends: run each test that uses the `backend` fixture (or `storage`, `node`, "
        "`client`) on SQLite and on PostgreSQL",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`both_backends` tests run once per backend (ids `sqlite`, `postgresql`)."""
    marked = metafunc.definition.get_closest_marker("both_backends") is not None
    if marked and "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BACKENDS, indirect=True)


@pytest.fixture(autouse=True)
def close_streams() -> Iterator[None]:
    """Close every feed `Stream` a test opened, also when it failed half-way."""
    yield
    close_open_streams()


# -- storage ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """A throw-away PostgreSQL cluster for the session (tests/helpers/postgres.py); the tests
    that need it skip, saying why, where it cannot be had."""
    cluster, why = start_cluster()
    if cluster is None:
        pytest.skip(why)
    yield cluster
    cluster.stop()


@pytest.fixture
def own_cluster() -> Iterator[Cluster]:
    """A PostgreSQL cluster of this test's own, to stop, freeze and start again."""
    cluster, why = start_cluster()
    if cluster is None:
        pytest.skip(why)
    yield cluster
    cluster.stop()


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The store backend of this test: `sqlite`, or each of `BACKENDS` in a `both_backends`
    module."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def storages(backend: str, request: pytest.FixtureRequest) -> Storages:
    """Fresh `storage` settings of this test's backend, as many as it asks for."""
    return Storages(request.getfixturevalue("postgres") if backend == "postgresql" else None)


@pytest.fixture
def storage(storages: Storages) -> Iterator[str]:
    """The `storage` setting of this test's node: `sqlite`, or a fresh PostgreSQL database."""
    with storages() as setting:
        yield setting


# -- nodes --------------------------------------------------------------------------------------


@pytest.fixture
async def node(tmp_path: Path, storage: str, request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    """A started node on a fresh data directory (no HTTP server), its stores on `storage`;
    settings overridden by an indirect parameter
    (`@pytest.mark.parametrize("node", [{...}], indirect=True)`)."""
    n = Node(settings_for(tmp_path / "data", storage=storage, **getattr(request, "param", {})))
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
def server(tmp_path: Path, storage: str) -> Iterator[Server]:
    """A running real server on a fresh data directory, its stores on `storage`; stopped
    (SIGTERM) afterwards."""
    srv = Server(tmp_path / "data", env={"METANODE_STORAGE": storage}).start()
    yield srv
    srv.stop()
    srv.print_log()
