"""The settings of an in-process test node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metanode import config


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
