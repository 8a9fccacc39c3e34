"""The code checks of `make lint`, run with the tests so CI enforces them too: ruff (style,
imports, bugbear rules) and its formatter, mypy in strict mode over the package, the plugins
and the tools, import-linter's contracts (the layers of docs/architecture.md) and vulture's
dead code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_is_clean() -> None:
    done = run("ruff", "check", "metanode", "plugins", "tests", "tools")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_applied() -> None:
    """The code is as `ruff format` writes it (line length 100, pyproject.toml)."""
    done = run("ruff", "format", "--check", "metanode", "plugins", "tests", "tools")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_is_clean(tmp_path: Path) -> None:
    done = run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))  # files: pyproject.toml
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout


def test_no_dead_code() -> None:
    """vulture finds no function, class, attribute or variable that nothing uses (pyproject.toml
    names the ones only a library calls)."""
    done = run("vulture")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layers_hold() -> None:
    """pyproject.toml's import-linter contracts: the layers, a pure core without I/O, SQLite only
    in the stores, the edges only through the node."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports"))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
