"""The settings of an in-process test node."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metanode import cache, config, db, truth


def settings_for(data_dir: Path, **overrides: Any) -> config.Settings:
    """Settings of a test node: its data directory; watcher and plugins off unless a test turns
    them on; read-your-writes waited for up to 120 s, not 5, so that busy cores never turn an
    asserted 200 into a 202 (see `Server.base_env`)."""
    defaults = {
        "data_dir": data_dir,
        "watch_enabled": False,
        "plugins_enabled": False,
        "watch_roots": (str(data_dir.parent / "media"),),
        "apply_wait_s": 120.0,
    }
    return config.load(env={}, overrides={**defaults, **overrides})


@contextlib.contextmanager
def reading(data_dir: Path, name: str, storage: str = "sqlite") -> Iterator[db.Connection]:
    """A read-only connection to store `name` (`truth`, `cache`) of a data directory whose
    stores are on `storage`: what a test reads a server's databases through, on either
    backend."""
    kind = truth.TruthStore if name == "truth" else cache.CacheStore
    store = kind.configured(settings_for(data_dir, storage=storage))
    try:
        with store.reading() as conn:
            yield conn
    finally:
        store.close()  # and the connection `reading` keeps for the next read
