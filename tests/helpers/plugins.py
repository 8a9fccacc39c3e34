"""A test plugin that records its calls (`Probe`), for the plugin host's tests in-process and
for the PostgreSQL ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register

Action = Callable[[LocalFile, RecordLookup, Register], None]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Probe(Plugin):
    """A test plugin: records every call, then does `action`."""

    def __init__(self, action: Action) -> None:
        self.action = action
        self.calls: list[LocalFile] = []
        self.called_at_ms: list[int] = []
        self.arguments: list[str] = []  # repr of everything process() was given

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        self.calls.append(file)
        self.called_at_ms.append(now_ms())
        self.arguments.append(repr((file, record, register)))
        self.action(file, record, register)


def probe(
    name: str, action: Action, version: str = "1", weight: int = 1, may_link: bool = False
) -> Probe:
    """A `Probe` under its own class, since name, version, weight and may_link are class-level."""
    cls = type(
        f"Probe_{name}_{version}",
        (Probe,),
        {"name": name, "version": version, "weight": weight, "may_link": may_link},
    )
    instance: Probe = cls(action)
    return instance


def claim(key: str, value: str) -> Action:
    def action(file: LocalFile, record: RecordLookup, register: Register) -> None:
        register(file.cid, key, value)

    return action


def install_plugin(site: Path, package: str, plugin_name: str, process: str = "pass") -> None:
    """An installed distribution in `site` (a dist-info folder and its module, as pip leaves
    them) whose entry point is a plugin named `plugin_name`; `process`: the body of its
    `process(self, file, record, register)`."""
    module = f"{package}_plugin"
    body = "".join(f"        {line}\n" for line in process.splitlines())
    (site / f"{module}.py").write_text(
        "import os\nfrom metanode.plugins import Plugin\n"
        f"class P(Plugin):\n    name = {plugin_name!r}\n    version = '1'\n"
        f"    def process(self, file, record, register):\n{body}"
    )
    info = site / f"{package}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[metanode.plugins]\n{package} = {module}:P\n")
