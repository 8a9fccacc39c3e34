"""The test suite's own layout: test modules share code through tests/helpers only.

A test module that imports another couples the two (moving or deleting one breaks the other, and
pytest may collect an imported test twice); one that imports conftest.py reaches past the fixture
mechanism. Both are refused here, so the rule stays true as tests are added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TEST_MODULES = sorted(TESTS.glob("test_*.py"))
FORBIDDEN_STEMS = {p.stem for p in TEST_MODULES} | {"conftest"}


def imported_modules(tree: ast.Module) -> list[str]:
    """Every dotted name the module imports, at any depth (function-local imports count too);
    `from tests import x` yields `tests.x`, and relative imports are spelled from `tests`."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "tests" if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def imported_test_modules(source: str) -> list[str]:
    """The test modules (or conftest) `source` imports, as `tests.<name>` or a bare `<name>`."""
    out = []
    for name in imported_modules(ast.parse(source)):
        parts = name.split(".")
        if parts[0] == "tests" and len(parts) > 1 and parts[1] in FORBIDDEN_STEMS:
            out.append(".".join(parts[:2]))
        elif len(parts) == 1 and parts[0] in FORBIDDEN_STEMS:
            out.append(parts[0])
    return out


@pytest.mark.parametrize(
    "source",
    [
        "from tests.test_feed import Frame",
        "import tests.test_ingest",
        "import tests.test_cid as c",
        "from tests import test_feed_server",
        "from tests.conftest import Server",
        "from . import test_cid",
        "from .test_feed import Replica",
        "import test_cid",
        "def f():\n    from tests.test_ingest import register\n",
    ],
)
def test_the_check_sees_each_spelling(source: str) -> None:
    assert imported_test_modules(source), source


@pytest.mark.parametrize(
    "source",
    [
        "from tests.helpers.feed import Frame",
        "from tests.helpers import claims",
        "import tests.helpers.server",
        "from metanode import cid",
        "import pytest",
    ],
)
def test_the_check_lets_helpers_through(source: str) -> None:
    assert imported_test_modules(source) == [], source


@pytest.mark.parametrize(
    "path",
    [*TEST_MODULES, TESTS / "conftest.py", *sorted((TESTS / "helpers").glob("*.py"))],
    ids=lambda p: p.relative_to(TESTS).as_posix(),
)
def test_no_module_of_the_suite_imports_a_test_module(path: Path) -> None:
    assert imported_test_modules(path.read_text(encoding="utf-8")) == [], (
        f"{path.name} imports a test module (or conftest); move what it shares to tests/helpers"
    )


def test_the_suite_has_test_modules() -> None:
    """The glob found the suite (a wrong path would make the check above vacuous)."""
    assert len(TEST_MODULES) > 20 and TESTS / "test_layout.py" in TEST_MODULES
